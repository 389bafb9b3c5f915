"""The DSA indexer's scores kernel over its tiles, and where the indexer's time goes: the scores against
``torch.topk`` over them, at DeepSeek-V3.2's decode shape (64 indexer heads of 128, top-k 2048).

    python benchmarks/indexer_sweep.py [--batch 64] [--ctx 32768] [--keys bf16|fp8] [--out indexer_sweep.json]

Each tile (`kernels.indexer.configured`: positions a dot, positions a program, warps, stages, the dot's rows) is checked
against the shipped tile's scores first (the same -inf pattern, values within 1e-3 relative), then timed with
``triton.testing.do_bench``; TB/s counts the index keys read once (``--keys fp8``: FP8 e4m3 keys with a scale
per token, `IndexerConfig.key_dtype`, 132 bytes a key). The last rows time ``torch.topk`` alone over
the shipped scores and the whole `kernels.indexer_topk`, then sgl_kernel's radix select (`kernels.radix_topk`) alone,
its set against ``torch.topk``'s, and the whole indexer with it.
"""

import argparse
import itertools
import json

import torch
from fnattn.kernels.indexer import (configured, finite_topk, indexer_scores_paged, indexer_topk, radix_reasons,
                                    radix_topk, sort_positions)

from fnattn.bench import environment


def inputs(batch: int, ctx: int, *, heads: int, dim: int, page: int, device: str = "cuda"):
    """One decode token a request, each with ``ctx`` cached keys in shuffled pages (page 0 unused)."""
    dev, g = torch.device(device), torch.Generator(device=device).manual_seed(0)
    pages_each = -(-(ctx + 1) // page)
    total = batch * pages_each + 1
    table = (torch.randperm(total - 1, device=dev, generator=g) + 1)[: batch * pages_each]
    table = table.view(batch, pages_each).to(torch.int32)
    r = lambda *s: torch.randn(*s, device=dev, generator=g).to(torch.bfloat16)  # noqa: E731
    q, w = r(batch, heads, dim), torch.randn(batch, heads, device=dev, generator=g)
    cache_k, new_k = r(total, page, dim), r(batch, dim)
    every = torch.arange(batch, device=dev)
    cache_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    cu = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    positions = torch.full((batch,), ctx, device=dev, dtype=torch.long)
    return q, w, cache_k, new_k, table, every, cache_lens, cu, positions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--keys", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from triton.testing import do_bench

    heads, dim = 64, 128
    args = inputs(a.batch, a.ctx, heads=heads, dim=dim, page=64)
    scale, scales = dim ** -0.5, {}
    keys = a.batch * (a.ctx + 1) * dim * 2
    if a.keys == "fp8":
        from fnattn.kinds.sparse_mla.config import IndexerConfig

        ix = IndexerConfig(num_heads=heads, head_dim=dim, topk=a.topk, key_dtype="fp8_e4m3")
        cache_k, new_k = args[2], args[3]
        stored, cache_scale = ix.encode_keys(cache_k.flatten(0, 1))
        new8, new_scale = ix.encode_keys(new_k)
        args = (*args[:2], stored.view(cache_k.shape), new8, *args[4:])
        scales = dict(cache_scale=cache_scale.view(*cache_k.shape[:2], 1), new_scale=new_scale)
        keys = a.batch * (a.ctx + 1) * (dim + 4)
    want = indexer_scores_paged(*args, scale=scale, **scales)
    finite = torch.isfinite(want)
    records = []
    case = f"indexer scores B{a.batch} ctx{a.ctx} {a.keys} keys"  # the rows the performance page draws

    def row(tile):
        return {"case": case, "backend": "tile " + " ".join(f"{k}={v}" for k, v in tile.items()), **tile}

    # positions as the dot's rows (keys_major 1, the default) over programs of several sizes (split 0: about four
    # programs an SM), and the earlier form (heads as the rows, one dot a program) beside it
    tiles = [dict(block_n=n, split=sp, num_warps=wp, num_stages=st, keys_major=1)
             for n, sp, wp, st in itertools.product((64, 128), (0, 1024, 4096), (4, 8), (2, 3, 4))]
    tiles += [dict(block_n=n, split=sp, num_warps=4, num_stages=st, keys_major=0)
              for n, sp, st in ((128, 128, 3), (64, 64, 3), (128, 0, 3), (128, 0, 2))]
    for tile in tiles:
        try:
            with configured(**tile):
                got = indexer_scores_paged(*args, scale=scale, **scales)
                torch.cuda.synchronize()
                same = bool(torch.equal(torch.isfinite(got), finite)) and bool(torch.allclose(
                    got[finite], want[finite], rtol=1e-3, atol=1e-3))
                us = do_bench(lambda: indexer_scores_paged(*args, scale=scale, **scales)) * 1e3
        except Exception as e:  # a tile the compiler refuses (registers, shared memory): recorded, not fatal
            records.append({**row(tile), "error": str(e)[:200]})
            print(f"{tile}: {str(e)[:80]}")
            continue
        records.append({**row(tile), "time_us": us, "tb_s": keys / us / 1e6, "matches_shipped": same})
        print(f"{tile}: {us:8.1f} us  {keys / us / 1e6:5.2f} TB/s  {'same' if same else 'DIFFERENT'}")
    shipped = do_bench(lambda: indexer_scores_paged(*args, scale=scale, **scales)) * 1e3
    topk_alone = do_bench(lambda: want.topk(a.topk, dim=-1)) * 1e3
    whole = do_bench(lambda: indexer_topk(*args, scale=scale, topk=a.topk, **scales)) * 1e3
    print(f"shipped scores {shipped:.1f} us, torch.topk over them {topk_alone:.1f} us, indexer_topk {whole:.1f} us")
    radix = {}
    if not radix_reasons(want, a.topk):  # sgl_kernel's radix select: alone, its set against torch.topk's, whole
        positions = args[-1]
        picked = radix_topk(want, positions, a.topk)
        same_set = bool(torch.equal(picked.sort(dim=-1).values, finite_topk(want, a.topk).sort(dim=-1).values))
        lengths = (positions + 1).clamp(max=want.shape[1]).to(torch.int32)
        raw = torch.full((want.shape[0], a.topk), -1, dtype=torch.int32, device=want.device)
        fast_topk = lambda: torch.ops.sgl_kernel.fast_topk(want, raw, lengths, None)  # noqa: E731
        fast_topk()
        radix = {"fast_topk_alone_us": do_bench(fast_topk) * 1e3,
                 "sort_positions_us": do_bench(lambda: sort_positions(raw)) * 1e3,
                 "torch_sort_us": do_bench(lambda: raw.long().sort(dim=-1, descending=True)) * 1e3,
                 "radix_alone_us": do_bench(lambda: radix_topk(want, positions, a.topk)) * 1e3,
                 "radix_same_set": same_set,
                 "indexer_topk_radix_us": do_bench(lambda: indexer_topk(*args, scale=scale, topk=a.topk, radix=True,
                                                                        **scales)) * 1e3}
        print(f"fast_topk alone {radix['fast_topk_alone_us']:.1f} us, its picks sorted {radix['sort_positions_us']:.1f}"
              f" us (torch.sort {radix['torch_sort_us']:.1f} us)")
        print(f"radix select alone {radix['radix_alone_us']:.1f} us ({'same set' if same_set else 'DIFFERENT set'}), "
              f"indexer_topk with it {radix['indexer_topk_radix_us']:.1f} us")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": f"python benchmarks/indexer_sweep.py --batch {a.batch} --ctx {a.ctx} "
                                  f"--topk {a.topk} --keys {a.keys} --out {a.out}",
                       "environment": environment(), "shipped_scores_us": shipped, "topk_alone_us": topk_alone,
                       "indexer_topk_us": whole, **radix, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
