"""Which launch config the invariant mode's GEMV should take per weight shape: a sweep against the mode-off path.

    python benchmarks/invariant_gemv_sweep.py --rows 1 8 32 128 --out sweep.json
    python benchmarks/invariant_gemv_sweep.py --shapes 7168x1024 --block-n 64 128 --warps 4 --stages 3

In the invariant mode `skinny_linear` takes one config per weight shape whatever the row count (`launch_config`:
the table's at 16 rows, by ``tl.dot``, its column tile widened under `invariant_tiles`, which this sweep set), so
a row's sums are the same additions in a call of any size. The table was tuned at one row; at 128 rows the
mode-off path is cuBLAS's GEMM, and the mode's step cost there follows its GEMVs. Any config serves the mode as
long as it is the same at every row count, so this times each candidate (``--block-n`` x ``--warps`` x
``--stages`` x the current split of K or none) at each of ``--rows`` in the mode,
beside the mode-off path at that row count (fnattn's GEMV up to 16 rows, cuBLAS above: `fnattn.models.fused.linear`
without the mode), and checks that the candidate keeps a row's bits across row counts (the first row of the
largest call against the same row alone). Per shape it prints the worst ratio of the config the mode takes
now (`launch_config`, under `invariant_tiles`) and the candidate whose worst ratio is least among those that keep
the bits. Times: one call replayed from a CUDA graph (`fnattn.bench.
timed`), medians in us; NaN without CUDA (a smoke run under TRITON_INTERPRET=1 checks the plan and the bits).
The default shapes are the Qwen3.5-0.8B step's projections and its lm_head.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys

import torch
from fnattn.kernels.invariant import invariant

from fnattn.bench import timed, write_json
from fnattn.kernels import skinny_linear as module
from fnattn.models import fused

SHAPES = ("7168x1024", "1024x3584", "8224x1024", "1024x2048", "5120x1024", "248320x1024")  # N x K


def _time_us(fn) -> float:
    return timed(fn, bench_warmup_ms=10, rep_ms=25) if torch.cuda.is_available() else float("nan")


def candidates(current: module.SkinnyConfig, block_n, warps, stages) -> list[module.SkinnyConfig]:
    """The config the mode takes now first (`launch_config`: by ``tl.dot``, a first load of one tile), then each
    combination of the grid's fields, with its split of K and with none."""
    base = dataclasses.replace(current, dot=True, early=1)
    out = [base]
    for bn, nw, ns, split in itertools.product(block_n, warps, stages, sorted({current.split_k, 1})):
        c = dataclasses.replace(base, block_n=bn, num_warps=nw, num_stages=ns, split_k=split)
        if c not in out:
            out.append(c)
    return out


def sweep_shape(N: int, K: int, rows: list[int], cands, dtype, device) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(rows), K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    off = {}
    with invariant(False):
        for m in rows:
            off[m] = _time_us(lambda m=m: fused.linear(x[:m], w))
    results = []
    for c in cands:
        times, keeps = {}, True
        try:
            with invariant(True):
                alone = module.skinny_linear(x[:1], w, config=c)
                for m in rows:
                    y = module.skinny_linear(x[:m], w, config=c)
                    keeps &= torch.equal(y[:1], alone)
                    times[m] = _time_us(lambda m=m, c=c: module.skinny_linear(x[:m], w, config=c))
        except Exception as e:  # noqa: BLE001 - a config the kernel refuses (shared memory, registers) is a result
            results.append({"config": dataclasses.asdict(c), "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        ratios = {m: times[m] / off[m] for m in rows}
        results.append({"config": dataclasses.asdict(c), "us": times, "over_mode_off": ratios,
                        "worst": max(ratios.values()), "keeps_row_bits": keeps})
    timed_ok = [r for r in results if "worst" in r and r["keeps_row_bits"] and not math.isnan(r["worst"])]
    best = min(timed_ok, key=lambda r: r["worst"]) if timed_ok else None
    return {"case": f"invariant gemv sweep {N}x{K}", "N": N, "K": K, "rows": rows, "mode_off_us": off,
            "current": results[0], "best": best, "candidates": results}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="NxK of each weight")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--out", default=None, help="also write the lines as one record (JSON: command, environment)")
    args = p.parse_args()
    for name, values in (("--rows", args.rows), ("--block-n", args.block_n), ("--warps", args.warps),
                         ("--stages", args.stages)):
        if any(v < 1 for v in values):
            p.error(f"{name}: expected values >= 1, got {values}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    sms = module.num_sms(torch.cuda.current_device() if device == "cuda" else None)
    records = []
    for shape in args.shapes:
        try:
            N, K = (int(v) for v in shape.split("x"))
        except ValueError:
            p.error(f"--shapes: expected NxK (e.g. 7168x1024), got {shape!r}")
        with invariant(True):
            current = module.launch_config(16, N, K, dtype, sms=sms)
        r = sweep_shape(N, K, sorted(set(args.rows)), candidates(current, args.block_n, args.warps, args.stages),
                        dtype, device)
        records.append(r)
        best = r["best"]
        print(json.dumps({"case": r["case"], "current_worst": r["current"].get("worst"),
                          "current_keeps_row_bits": r["current"].get("keeps_row_bits"),
                          "best_worst": best and best["worst"], "best": best and best["config"],
                          "best_over_mode_off": best and best["over_mode_off"]}))
    if args.out:
        write_json(records, args.out, command="python benchmarks/invariant_gemv_sweep.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
