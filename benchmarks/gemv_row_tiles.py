"""Whether the invariant mode's GEMV could take wider row tiles: the bits and the time of each row-tile width.

    python benchmarks/gemv_row_tiles.py --rows 128 --shapes 3584x1024 1024x3584 6144x1024

In the invariant mode `skinny_linear` takes rows in tiles of `INVARIANT_ROWS` (16): the smallest ``tl.dot``
tile, so every row count meets the same product shape. At 128 rows that reads each weight eight times, where
the mode-off step runs cuBLAS's large tiles. A wider tile is only open to the mode if a row's bits do not change
with it (on Hopper a 64-row tile of four warps may take another MMA instruction than a 16-row one): what
`wide_invariant_rows` rests on, and this checks. For each
width this prints whether a ``--rows`` call's output is the first width's bits, and one call's time (median,
replayed from a CUDA graph), beside cuBLAS's. ``--folds`` also compares, per width, the bits of the launches that
fold an op in (`FOLDS`): those that reduce along a row (the norm on load, the split norm's row scale, the residual
add with its squares) take 16-row tiles under `wide_invariant_rows` until their bits are shown the same here.
One JSON line per shape; ``--out``: the lines as one record too.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from fnattn.kernels.invariant import invariant

from fnattn.bench import timed, write_json
from fnattn.kernels import skinny_linear as module


def _time_us(fn) -> float:
    """One call's device time, replayed from a CUDA graph (`fnattn.bench.timed`: an eager loop would time the
    host, whose checks and plan cost more than the launch at these sizes); NaN without CUDA."""
    return timed(fn) if torch.cuda.is_available() else float("nan")


def _folds(x, w):
    """``{fold: a function of no arguments -> its outputs}``: each fold of the GEMV on ``x``'s rows, with fixed
    random operands (the row scale's squares in as many parts as a 1024-wide GEMV before it leaves)."""
    from fnattn.kernels.skinny_folds import skinny_linear_add_, skinny_linear_gating, skinny_linear_swiglu

    M, N, K = x.shape[0], w.shape[0], w.shape[1]
    g = torch.Generator().manual_seed(1)
    on = dict(device=x.device, dtype=x.dtype)
    residual = torch.randn(M, N, generator=g).to(**on)
    weight = (torch.randn(N, generator=g) / 4).to(**on)
    norm_w = (torch.randn(K, generator=g) / 4).to(**on)
    squares = (torch.rand(M, 32, generator=g) * K / 32 + 0.5).to(x.device)  # fp32 [M, P]
    H = 16 if N >= 64 else 1
    neg_decay = -torch.rand(H, generator=g).to(x.device)
    dt_bias = torch.randn(H, generator=g).to(x.device)
    xx = torch.cat([x, x.flip(0)], dim=1)  # gate | up for silu_mul on load
    return {
        "norm": lambda: (module.skinny_linear(x, w, norm=(norm_w, 1e-6, 1.0)),),
        "rms": lambda: (module.skinny_linear(x, w, rms=(squares, 1e-6)),),
        "add_squares": lambda: skinny_linear_add_(x, w, residual.clone(), weight, 1.0),
        "silu_mul": lambda: (module.skinny_linear(xx, w, act="silu_mul"),),
        "residual": lambda: (module.skinny_linear(x, w, residual=residual),),
        "swiglu": lambda: (skinny_linear_swiglu(x, w),) if N % 2 == 0 else (),
        "gating": lambda: skinny_linear_gating(x, w, 0, neg_decay, dt_bias) if N >= 2 * H else (),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--shapes", nargs="+", default=["3584x1024", "1024x3584", "6144x1024"], help="NxK of each weight")
    p.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--folds", action="store_true",
                   help="also compare each fold's bits at each width (the norm, the row scale, the squares, ...)")
    p.add_argument("--out", default=None, help="also write the lines as one record (JSON: command, environment)")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    default = module.INVARIANT_ROWS
    records = []
    for shape in args.shapes:
        N, K = (int(v) for v in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(args.rows, K, generator=g).to(device, dtype)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
        rows = {}
        base, fold_base = None, {}
        folds = _folds(x, w) if args.folds else {}
        try:
            with invariant(True), module.wide_invariant_rows(False):  # each width as given, at every row count
                for width in args.widths:
                    module.INVARIANT_ROWS = width
                    module._plan.cache_clear()
                    y = module.skinny_linear(x, w)
                    base = y if base is None else base
                    rows[width] = {"same_bits_as_first": torch.equal(y, base),
                                   "us": _time_us(lambda x=x, w=w: module.skinny_linear(x, w))}
                    if folds:
                        same = {}
                        for name, fold in folds.items():
                            outs = fold()
                            first = fold_base.setdefault(name, outs)
                            same[name] = all(torch.equal(a, b) for a, b in zip(outs, first))
                        rows[width]["folds_same_bits_as_first"] = same
        finally:
            module.INVARIANT_ROWS = default
            module._plan.cache_clear()
        off = _time_us(lambda x=x, w=w: torch.nn.functional.linear(x, w))
        records.append({"case": f"gemv row tiles {N}x{K} rows {args.rows}", "N": N, "K": K, "rows": args.rows,
                        "dtype": args.dtype, "device": device, "widths": rows, "mode_off_cublas_us": off})
        print(json.dumps(records[-1]))
    if args.out:
        write_json(records, args.out, command="python benchmarks/gemv_row_tiles.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
