"""Whether the invariant mode's GEMV could take wider row tiles: the bits and the time of each row-tile width.

    python benchmarks/gemv_row_tiles.py --rows 128 --shapes 3584x1024 1024x3584 6144x1024

In the invariant mode `skinny_linear` takes rows in tiles of `INVARIANT_ROWS` (16): the smallest ``tl.dot``
tile, so every row count meets the same product shape. At 128 rows that reads each weight eight times, where
the mode-off step runs cuBLAS's large tiles. A wider tile is only open to the mode if a row's bits do not change
with it (on Hopper a 64-row tile of four warps may take another MMA instruction than a 16-row one): what
`wide_invariant_rows` rests on, and this checks. For each
width this prints whether a ``--rows`` call's output is the first width's bits, and one call's time (median,
replayed from a CUDA graph), beside cuBLAS's. The plain product only: the folds' row reductions (the
split norm's squares, the row scale) are not compared here. One JSON line per shape; ``--out``: the lines as
one record too.
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--shapes", nargs="+", default=["3584x1024", "1024x3584", "6144x1024"], help="NxK of each weight")
    p.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
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
        base = None
        try:
            with invariant(True), module.wide_invariant_rows(False):  # each width as given, at every row count
                for width in args.widths:
                    module.INVARIANT_ROWS = width
                    module._plan.cache_clear()
                    y = module.skinny_linear(x, w)
                    base = y if base is None else base
                    rows[width] = {"same_bits_as_first": torch.equal(y, base),
                                   "us": _time_us(lambda x=x, w=w: module.skinny_linear(x, w))}
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
