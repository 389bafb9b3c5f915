"""MLA's weight absorptions at DeepSeek-V3's shape (128 heads, 128 nope / value dims, 512 + 64 latent),
graph-timed: `fnattn.kernels.absorb_query` over its tiles against the batched product and copy
(`absorbed_query_torch`), and `merge_own_values` over its tiles against the merge kernel and ``W_UV``'s
batched product (`fold_own_rows` + `values_out`).

    python benchmarks/mla_absorb_sweep.py [--tokens 1 8 32 64 128] [--out mla_absorb_sweep.json]

Each weight (16.8 MB) is read once a call: ``tb_s`` counts every byte a call moves.
"""

import argparse
import json

import torch
from fnattn.kernels.latent_absorb import absorb_query, merge_own_values

from fnattn.bench import environment, timed
from fnattn.kinds.mla.bench import deepseek_mla, random_inputs
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
        print(f"T {T:4d}  {name:44s} {us:8.2f} us  {rec['tb_s']:5.2f} TB/s  x{rec['speedup_vs_torch']:.2f}"
              f"  err {rel:.1e}")
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
        ways = {"bmm + copy (torch)": lambda x=x: absorbed_query_torch(x)}
        for block_r in (32, 64, 128):
            for warps in (4, 8):
                ways[f"absorb_query block_r {block_r} warps {warps}"] = (
                    lambda x=x, b=block_r, w=warps: absorb_query(x.q_nope, x.q_pe, x.w_uk, block_r=b, num_warps=w))
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
        for block_t in (16, 32, 64):
            for warps in (4, 8):
                ways[f"merge_own_values block_t {block_t} warps {warps}"] = (
                    lambda q=q, o_c=o_c, lse_c=lse_c, x=x, b=block_t, w=warps: merge_own_values(
                        o_c, lse_c, q, x.latent, x.w_uv, scale=cfg.scale, block_t=b, num_warps=w)[0])
        records += sweep("own-row merge + W_UV", T, a.heads, ways, torch_way().float(), moved)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": "python benchmarks/mla_absorb_sweep.py " + " ".join(
                f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(a).items()
                if v is not None and k != "out"), "environment": environment(), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
