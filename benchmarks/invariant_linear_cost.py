"""The invariant mode's projections against the default ones, at the Qwen3.5-0.8B shape's widths.

    python benchmarks/invariant_linear_cost.py [--rows 1 8 32 128 512] [--out invariant_linear_cost.json]

For each projection ``[N, K]`` of the model (GDN's input and output projections, the MLP's, the LM head) and each
row count M: cuBLAS (``F.linear``), the default path of the models (`models.fused.linear`: the skinny GEMV up to
16 rows, cuBLAS above) and the mode's fixed-tile GEMM (`fnattn.kernels.invariant_linear`), timed with
``triton.testing.do_bench``; then whether each keeps a row's bits when the row shares the call with M - 1 others
(``rows_equal``: row 0 of the M-row product against the one-row product).
"""

import argparse
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from fnattn.bench import environment
from fnattn.kernels.invariant_linear import invariant_linear
from fnattn.models.fused import linear as default_linear

SHAPES = {"gdn in_proj (qkvz)": (8192, 1024), "gdn out_proj": (1024, 2048), "mlp gate_up": (7168, 1024),
          "mlp down": (1024, 3584), "lm_head": (248320, 1024)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    records = []
    for name, (N, K) in SHAPES.items():
        w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
        for M in a.rows:
            x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
            row = {"case": f"{name} N{N} K{K} M{M}", "N": N, "K": K, "M": M}
            for label, fn in (("cublas", F.linear), ("default", default_linear), ("invariant", invariant_linear)):
                us = do_bench(lambda: fn(x, w)) * 1e3  # noqa: B023
                same = bool(torch.equal(fn(x, w)[:1], fn(x[:1], w)))
                row[f"{label}_us"], row[f"{label}_rows_equal"] = us, same
            row["invariant_over_default"] = row["invariant_us"] / row["default_us"]
            records.append(row)
            print(f"{row['case']:<36} cublas {row['cublas_us']:8.1f} us {'=' if row['cublas_rows_equal'] else '!'}  "
                  f"default {row['default_us']:8.1f} us {'=' if row['default_rows_equal'] else '!'}  "
                  f"invariant {row['invariant_us']:8.1f} us {'=' if row['invariant_rows_equal'] else '!'}  "
                  f"{row['invariant_over_default']:.2f}x")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": "python benchmarks/invariant_linear_cost.py --rows "
                                  + " ".join(map(str, a.rows)) + f" --out {a.out}",
                       "environment": environment(), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
