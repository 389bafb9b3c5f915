"""MLA's weight absorptions at DeepSeek-V3's shape (128 heads, 128 nope / value dims, 512 + 64 latent),
graph-timed: `fnattn.kernels.absorb_query` over its tiles against the batched product and copy
(`absorbed_query_torch`), and `merge_own_values` over its tiles against the merge kernel and ``W_UV``'s
batched product (`fold_own_rows` + `values_out`).

    python benchmarks/mla_absorb_sweep.py [--tokens 1 8 32 64 128] [--out mla_absorb_sweep.json]

Each weight (16.8 MB) is read once a call: ``tb_s`` counts every byte a call moves.
"""

import argparse
import itertools
import json

import torch
from fnattn.kernels.latent_absorb import absorb_query, merge_own_values

from fnattn.bench import environment, timed
from fnattn.bench.cases.mla import deepseek_mla, random_inputs
from fnattn.kinds.mla.latent import absorbed_query_torch, fold_own_rows, values_out


def sweep(what, T, heads, ways, want, moved):
    records, base = [], None
    for name, fn in ways.items():
        rel = float((fn().float() - want).abs().max() / want.abs().max())
        us = timed(fn)
        base = base or us
        rec = {"op": what, "tokens": T, "heads": heads, "way": name, "time_us": us,
               "tb_s": moved / (us * 1e-6) / 1e12, "speedup_vs_torch": base / us, "max_rel_err_vs_torch": rel}
        records.append(rec)
        print(f"T {T:4d}  {name:84s} {us:8.2f} us  {rec['tb_s']:5.2f} TB/s  x{rec['speedup_vs_torch']:.2f}"
              f"  err {rel:.1e}")
    return records


# (tokens a product, programs that share a weight tile) tried at each token count (the nearest one's)
TOKEN_TILES = {1: [(16, 1)], 8: [(16, 1)], 32: [(16, 1), (16, 2), (32, 1)],
               64: [(16, 1), (16, 4), (32, 2), (64, 1)], 128: [(64, 1), (64, 2), (32, 4), (16, 8)]}


def floors(T, heads, w):
    """Rows to read the others by, timed in this run: a launch that moves one element (the timing's own floor,
    which no way beats) and one read of the weight by a torch reduction (a generic kernel's pace over the same
    bytes; the absorption kernels may beat it)."""
    one = torch.zeros(1, device="cuda")
    records = []
    for what, fn, moved in (("floor: one-element launch", lambda: one.add_(1), 8),
                            ("reference: the weight read once (torch.sum)", lambda: w.sum(dtype=torch.float32),
                             2 * w.numel())):
        us = timed(fn)
        records.append({"op": what, "tokens": T, "heads": heads, "way": "torch", "time_us": us,
                        "tb_s": moved / (us * 1e-6) / 1e12})
        print(f"T {T:4d}  {what:44s} {us:8.2f} us  {records[-1]['tb_s']:5.2f} TB/s")
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    cfg = deepseek_mla(a.heads)
    records = []
    for T in a.tokens:
        x = random_inputs(cfg, T)
        moved = 2 * (x.w_uk.numel() + x.q_nope.numel() + x.q_pe.numel() + T * a.heads * cfg.latent_dim)
        want = absorbed_query_torch(x).float()
        records += floors(T, a.heads, x.w_uk)
        ways = {"bmm + copy (torch)": lambda x=x: absorbed_query_torch(x)}
        token_tiles = TOKEN_TILES[min(TOKEN_TILES, key=lambda n: abs(n - T))]
        for block_r, (block_k, stages), warps, (block_t, split) in itertools.product(
                (64, 128), ((None, 2), (64, 2), (32, 3)), (4, 8), token_tiles):
            ways[f"absorb_query block_r {block_r} block_k {block_k or 'all'} stages {stages} warps {warps} "
                 f"block_t {block_t} split {split}"] = (
                lambda x=x, b=block_r, k=block_k, s=stages, w=warps, bt=block_t, sp=split: absorb_query(
                    x.q_nope, x.q_pe, x.w_uk, block_r=b, block_k=k, num_stages=s, num_warps=w, block_t=bt,
                    token_split=sp))
        records += sweep("absorbed query", T, a.heads, ways, want, moved)
        # the own row's merge and W_UV: over a random cached part
        q = absorbed_query_torch(x)
        g = torch.Generator(device="cuda").manual_seed(T)
        o_c = torch.randn(T, a.heads, cfg.kv_lora_rank, device="cuda", generator=g).to(torch.bfloat16)
        lse_c = torch.randn(T, a.heads, device="cuda", generator=g) * 4
        moved = 2 * (x.w_uv.numel() + o_c.numel() + q.numel() + T * a.heads * cfg.v_head_dim)

        def torch_way(q=q, o_c=o_c, lse_c=lse_c, x=x):
            o_lat, _ = fold_own_rows(q, o_c, lse_c, x.latent, n=1, scale=cfg.scale)
            return values_out(o_lat, x.w_uv)

        ways = {"merge kernel + bmm": torch_way}
        for block_t, block_v, block_r, warps in itertools.product((16, 32, 64), (None, 64, 32), (64, 128), (4, 8)):
            if block_t > max(16, T):
                continue
            ways[f"merge_own_values block_t {block_t} block_v {block_v or 'all'} block_r {block_r} warps {warps}"] = (
                lambda q=q, o_c=o_c, lse_c=lse_c, x=x, bt=block_t, bv=block_v, br=block_r, w=warps: merge_own_values(
                    o_c, lse_c, q, x.latent, x.w_uv, scale=cfg.scale, block_t=bt, block_v=bv, block_r=br,
                    num_warps=w)[0])
        records += sweep("own-row merge + W_UV", T, a.heads, ways, torch_way().float(), moved)
    for (op, T), group in itertools.groupby(records, key=lambda r: (r["op"], r["tokens"])):
        group = list(group)
        if not op.startswith(("floor", "reference")):
            best = min(group, key=lambda r: r["time_us"])
            print(f"best  {op:22s} T {T:4d}  {best['time_us']:7.2f} us ({group[0]['time_us']:.2f} the first way): "
                  f"{best['way']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": "python benchmarks/mla_absorb_sweep.py " + " ".join(
                f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(a).items()
                if v is not None and k != "out"), "environment": environment(), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
