"""MLA's absorbed query: `fnattn.kernels.absorb_query` over its tiles against the batched product and copy
(`absorbed_query_torch`), at DeepSeek-V3's shape (128 heads, 128 nope dims, 512 + 64 latent), graph-timed.

    python benchmarks/mla_absorb_sweep.py [--tokens 1 8 32 64 128] [--out mla_absorb_sweep.json]

The weight ``W_UK`` (16.8 MB) is read once a call: ``tb_s`` counts every byte a call moves.
"""

import argparse
import json

import torch

from fnattn.bench import environment, timed
from fnattn.kernels.latent_absorb import absorb_query
from fnattn.kinds.mla.bench import deepseek_mla, random_inputs
from fnattn.kinds.mla.latent import absorbed_query_torch


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
        base = None
        for name, fn in ways.items():
            rel = float((fn().float() - want).abs().max() / want.abs().max())
            us = timed(fn)
            base = base or us
            rec = {"tokens": T, "heads": a.heads, "way": name, "time_us": us, "tb_s": moved / (us * 1e-6) / 1e12,
                   "speedup_vs_torch": base / us, "max_rel_err_vs_torch": rel}
            records.append(rec)
            print(f"T {T:4d}  {name:40s} {us:8.2f} us  {rec['tb_s']:5.2f} TB/s  x{rec['speedup_vs_torch']:.2f}"
                  f"  err {rel:.1e}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": "python benchmarks/mla_absorb_sweep.py " + " ".join(
                f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(a).items()
                if v is not None and k != "out"), "environment": environment(), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
