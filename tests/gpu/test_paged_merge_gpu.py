"""`kernels.paged_attention.merge_in_launch` on the H200: a split paged decode whose last split of each tile
merges the splits, against the same kernel with its merge kernel, eager and replayed from a CUDA graph."""

import pytest
import torch
from fnattn.kernels.paged_attention import paged_decode

from fnattn.kernels import _counters, paged_attention

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _problem(B, ctx, Hq, Hkv, D, *, page=16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    pages = -(-(ctx + 1) // page)
    k_cache, v_cache = r(B * pages + 1, page, Hkv, D).to(BF16), r(B * pages + 1, page, Hkv, D).to(BF16)
    table = (1 + torch.arange(B * pages, device="cuda", dtype=torch.int32)).view(B, pages)
    lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
    q, k_new, v_new = r(B, Hq, D).to(BF16), r(B, Hkv, D).to(BF16), r(B, Hkv, D).to(BF16)
    return q, k_cache, v_cache, table, lens, k_new, v_new


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("B, ctx, Hq, Hkv, D", [(1, 512, 8, 2, 256), (1, 4096, 32, 8, 128), (8, 4096, 32, 8, 128),
                                                 (3, 1000, 8, 2, 256)])
@pytest.mark.parametrize("sinks", [False, True])
def test_merged_in_launch_matches_the_merge_kernel(B, ctx, Hq, Hkv, D, sinks, record):
    q, k_cache, v_cache, table, lens, k_new, v_new = _problem(B, ctx, Hq, Hkv, D)
    kw = dict(k_new=k_new, v_new=v_new, scale=D ** -0.5,
              sinks=torch.randn(Hq, device="cuda") if sinks else None)
    want = paged_decode(q, k_cache, v_cache, table, lens, **kw)
    with paged_attention.merge_in_launch(True):
        got = paged_decode(q, k_cache, v_cache, table, lens, **kw)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = paged_decode(q, k_cache, v_cache, table, lens, **kw)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    want_replayed = paged_decode(q, k_cache, v_cache, table, lens, **kw)
    errs = {"o": _rel(got[0], want[0]), "lse": _rel(got[1], want[1]), "o replayed": _rel(replayed[0], want_replayed[0]),
            "lse replayed": _rel(replayed[1], want_replayed[1])}
    zero = not _counters.tile_counters(q.device, 1).any().item()
    ok = zero and errs["o"] <= 1e-2 and errs["o replayed"] <= 1e-2 and errs["lse"] <= 1e-5 \
        and errs["lse replayed"] <= 1e-5
    record({"case": f"paged decode B{B} ctx{ctx} {Hq}q/{Hkv}kv d{D}{' sinks' if sinks else ''}: merged in launch",
            "backend": "triton", **{f"max_rel_{k.replace(' ', '_')}": v for k, v in errs.items()},
            "bitwise": torch.equal(got[0], want[0]), "counters_zero": zero, "ok": ok})
    assert ok, errs
