"""`fused.grouped_experts` on CUDA: the routed experts of a captured step as ``torch._grouped_mm`` over the picked
experts. The kernel against the loop over the picked experts (bf16), then the MoE families' graph replays with it
on equal to their capture-free steps with it on, bit for bit, and at the first step close to the default
graph's logits."""

import pytest
import torch
from fnattn.models import fused
from fnattn.models.common import StackedExperts, grouped_moe, moe_sum
from test_graph_gpu import decode_run

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


@pytest.mark.parametrize("T", [1, 8, 64])
def test_grouped_moe_on_cuda_matches_the_loop(T, record):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    E, D, inner, k = 64, 256, 128, 8
    parts = [tuple(torch.randn(*s, device="cuda", generator=g, dtype=BF16) * 0.05
                   for s in ((inner, D), (inner, D), (D, inner))) for _ in range(E)]
    stacked = StackedExperts.stack(parts)
    x = torch.randn(T, D, device="cuda", generator=g, dtype=BF16)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, device="cuda", generator=g)
    want = moe_sum(x, ids, w, E, lambda e, xs: stacked[e](xs), lambda y, v: y * v)
    got = grouped_moe(x, ids, w, stacked.gate_up, stacked.down, lambda y, v: y * v)
    rel = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    ok = bool(torch.isfinite(got).all()) and rel < 2e-2
    record({"case": f"grouped_moe T{T} E{E} k{k} bf16 vs the loop", "max_rel": rel, "ok": ok})
    assert ok, rel


@pytest.mark.parametrize("name", ["deepseek_v32", "kimi_linear", "deepseek_v4"])
def test_graph_with_grouped_experts_equals_its_capture_free_steps(name, record):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _, default, _ = decode_run(name, True)
    with fused.grouped_experts(True):
        _, graph, rows_ok = decode_run(name, True)
        _, eager, _ = decode_run(name, False)
    equal = all(torch.equal(a, b) for a, b in zip(graph, eager))
    # the first step only: later ones may pick another greedy token where two logits nearly tie
    rel = ((graph[0].float() - default[0].float()).abs().max() / default[0].float().abs().max()).item()
    ok = equal and rows_ok and rel < 5e-2
    record({"case": f"grouped experts graph == capture-free, {name}", "bitwise": equal, "finite": rows_ok,
            "max_rel_to_default_graph": rel, "ok": ok})
    assert ok, (equal, rows_ok, rel)
