"""`skinny_linear`'s configs swept on Qwen3.5-0.8B's projections: what the config table in
`fnattn.kernels.skinny_linear` is tuned from.

    python benchmarks/linear_sweep.py [--batch 1] [--out linear_sweep.json]

The record is `fnattn bench linear`'s (cuBLAS, the table's config, the folds, at the same rows and shapes) with one
more row a shape: ``skinny best``, the fastest config of a small grid, with the whole sweep (config and time each,
or the error of a config the device cannot run) and the table's time over the best (``table_vs_best``).
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import signal
import sys
from dataclasses import asdict

import torch

from fnattn.bench import with_ratios, write_json
from fnattn.bench.linear import (
    FOLD_PAIRS,
    SHAPES,
    fold_case,
    linear_case,
    linear_inputs,
    per_call_us,
    print_linear_table,
)

# Each config compiles once per row bucket (about a second each): the grid stays a few dozen per shape. With a
# program's K loop a handful of tiles long, pipeline depth matters little, so it is not swept.
GRID = dict(block_n=(16, 32, 64), block_k=(128, 256), split_k=(1, 2, 4, 8), num_warps=(4, 8), num_stages=(4,),
            dot=(True, False))
FMA_ROWS = 4  # the FMA form (dot=False) is timed up to this many rows
FMA_PRODUCTS = 128 * 128  # and only while [rows, block_n, block_k] products fit 128 fp32 registers a thread


def sweep_configs(K: int, rows: int) -> list:
    """The grid's configs for ``rows`` rows and a reduction of length K: a K piece holds at least two K
    tiles; the FMA form only for a few rows and tiles whose products fit in registers."""
    from fnattn.kernels.skinny_linear import SkinnyConfig

    out = []
    for bn, bk, split, warps, stages, dot in itertools.product(*GRID.values()):
        if split > 1 and K // split < 2 * bk:
            continue
        padded = 1 << (rows - 1).bit_length()  # the FMA form's rows: the next power of two
        if not dot and (rows > FMA_ROWS or padded * bn * bk > FMA_PRODUCTS * warps // 4):
            continue
        out.append(SkinnyConfig(block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=stages, dot=dot))
    return out


def sweep_case(*, rows: int, name: str, K: int, N: int, act: str | None, log=lambda line: None,
               dtype=torch.bfloat16, device="cuda", timer=per_call_us) -> list[dict]:
    """`fnattn.bench.linear.linear_case`'s records, then the sweep's best (``skinny best``) on the same inputs.
    ``timer(call, copies, **options)``: `per_call_us` (another only to check the records without a GPU)."""
    from fnattn.kernels.skinny_linear import skinny_linear

    records = linear_case(rows=rows, name=name, K=K, N=N, act=act, log=log, dtype=dtype, device=device, timer=timer)
    x, ws = linear_inputs(rows=rows, K=K, N=N, act=act, dtype=dtype, device=device)
    timings = []
    for cfg in sweep_configs(K, rows):
        try:
            us = timer(lambda i, cfg=cfg: skinny_linear(x, ws[i], act=act, config=cfg), len(ws), rep_ms=15)
            timings.append({**asdict(cfg), "time_us": us})
        except Exception as e:  # noqa: BLE001 - a config the device cannot run (shared memory) is a result
            timings.append({**asdict(cfg), "error": f"{type(e).__name__}: {str(e)[:120]}"})
    ok = [t for t in timings if "time_us" in t]
    if ok:
        best = min(ok, key=lambda t: t["time_us"])
        config = {k: v for k, v in best.items() if k != "time_us"}
        base, table = records[0], records[1]
        us = best["time_us"]
        records.append({**{k: v for k, v in base.items() if k not in ("backend", "time_us", "tb_s")},
                        "backend": "skinny best", "time_us": us, "tb_s": base["weight_bytes"] / (us * 1e-6) / 1e12,
                        "config": config, "table_time_us": table["time_us"], "table_vs_best": table["time_us"] / us,
                        "sweep": timings})
        log(f"{records[0]['case']}: best {us:.2f} us {config}")
    return records


def main(argv=None) -> int:
    from fnattn.kernels.skinny_linear import MAX_M

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="rows of each projection (default 1)")
    p.add_argument("--out", default="linear_sweep.json", help="JSON output path")
    words = sys.argv[1:] if argv is None else list(argv)
    a = p.parse_args(words)
    bad = [b for b in a.batch if not 1 <= b <= MAX_M]
    if bad:
        print(f"linear_sweep: --batch values must be 1..{MAX_M} rows, got {bad}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("linear_sweep: needs a CUDA device (none found)", file=sys.stderr)
        return 2
    log = lambda line: print(line, file=sys.stderr)  # noqa: E731
    records: list[dict] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # a time limit still writes what finished
    try:
        for rows in a.batch:
            for name, K, N, act in SHAPES:
                records += sweep_case(rows=rows, name=name, K=K, N=N, act=act, log=log)
            for name, K, N in FOLD_PAIRS:
                records += fold_case(rows=rows, name=name, K=K, N=N, log=log)
    finally:
        if records:
            with_ratios(records)
            print_linear_table(records)
            write_json(records, a.out, command=shlex.join(["python", "benchmarks/linear_sweep.py", *words]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
