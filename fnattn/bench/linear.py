"""``fnattn bench linear``: decode-sized projections, cuBLAS (``F.linear``) vs `skinny_linear`.

For each row count M and each of Qwen3.5-0.8B's per-token projections ``[M, K] @ [N, K]^T`` (bf16), one
case times cuBLAS and `skinny_linear` with `pick_config`'s config (the table). A time is one call's share
of a CUDA graph of 20 calls, each call reading its own copy of the weight (as a decode step's layers each
read their own), so the weight comes from memory, not L2; ``do_bench`` flushes L2 between replays too. TB/s
counts the weight's bytes only (the rows of ``x`` and ``y`` are a rounding error at these shapes).

The table in `fnattn.kernels.skinny_linear` is tuned from a sweep of configs around it,
``benchmarks/linear_sweep.py``, whose ``skinny best`` record lists the whole sweep (config and time each).

The fold cases time a residual-add + RMSNorm between an output projection and the next input projection:
unfused, [down GEMV; `add_rms_norm_offset_` (FlashInfer's fused add + RMSNorm); up GEMV], against the
folded pair [down GEMV with ``residual=``; up GEMV with ``norm=``], every GEMV `skinny_linear` with the
table's configs, one call being the whole pair.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F

CALLS = 20  # projections per graph (one decode step has a few dozen of each)
COPY_BYTES = 4 << 30  # weight copies in all, at most (the lm_head's 0.5 GB cycles through 8 copies)

# (name, K, N, act): Qwen3.5-0.8B (hidden 1024, MLP 3584, GDN 16 x 128 heads, vocab 248320)
SHAPES = (
    ("mlp gate_up", 1024, 7168, None),
    ("mlp down", 3584, 1024, None),
    ("mlp down + silu_mul", 3584, 1024, "silu_mul"),
    ("gdn in_proj", 1024, 8224, None),
    ("out_proj / o_proj", 2048, 1024, None),
    ("attn qkv", 1024, 5120, None),
    ("lm_head", 1024, 248320, None),
)
# (name, K of the output projection, N of the input projection after it; the hidden size between is HIDDEN)
HIDDEN = 1024
FOLD_PAIRS = (
    ("o_proj / out_proj + norm + mlp gate_up", 2048, 7168),
    ("mlp down + norm + gdn in_proj", 3584, 8224),
    ("mlp down + norm + attn qkv", 3584, 5120),
)
FOLD_EPS = 1e-6


def per_call_us(call, copies: int, *, rep_ms: int = 25) -> float:
    """Median microseconds of one of `CALLS` calls ``call(i)`` (``i``: the weight copy) replayed from a graph."""
    from . import timed

    def body():
        for i in range(CALLS):
            call(i % copies)

    return timed(body, warmup=1, bench_warmup_ms=5, rep_ms=rep_ms) / CALLS


def linear_inputs(*, rows: int, K: int, N: int, act: str | None, dtype=torch.bfloat16, device="cuda"):
    """``-> (x, weight copies)`` of one shape, the same for the same arguments (seeded): ``x`` [rows, K] (2K
    with ``act``: `silu_and_mul`'s input) and as many [N, K] weights as `COPY_BYTES` holds, at most `CALLS`."""
    copies = max(1, min(CALLS, COPY_BYTES // (N * K * dtype.itemsize)))
    g = torch.Generator(device=device).manual_seed(0)
    ws = [(torch.randn(N, K, device=device, generator=g) * K ** -0.5).to(dtype) for _ in range(copies)]
    x = torch.randn(rows, 2 * K if act else K, device=device, generator=g).to(dtype)
    return x, ws


def linear_case(*, rows: int, name: str, K: int, N: int, act: str | None, log=lambda line: None,
                dtype=torch.bfloat16, device="cuda", timer=per_call_us) -> list[dict]:
    """cuBLAS (after `silu_and_mul` with ``act``) and the table's config on one shape.
    ``timer(call, copies, **options)``: `per_call_us` (another only to check the records without a GPU)."""
    from ..kernels.skinny_linear import pick_config, skinny_linear
    from ..models.fused import silu_and_mul

    wbytes = N * K * dtype.itemsize
    x, ws = linear_inputs(rows=rows, K=K, N=N, act=act, dtype=dtype, device=device)
    copies = len(ws)
    case = f"linear {name} M{rows} K{K} N{N}"
    base = {"case": case, "rows": rows, "K": K, "N": N, "act": act, "weight_bytes": wbytes, "calls": CALLS,
            "weight_copies": copies, "dtype": str(dtype).removeprefix("torch.")}
    peer = "silu_and_mul + F.linear" if act else "cublas (F.linear)"
    if act:
        cublas = lambda i: F.linear(silu_and_mul(x), ws[i])  # noqa: E731 - the unfused MLP tail
    else:
        cublas = lambda i: F.linear(x, ws[i])  # noqa: E731

    def record(backend, us, **extra):
        return {**base, "backend": backend, "peer": peer, "time_us": us, "tb_s": wbytes / (us * 1e-6) / 1e12,
                **extra}

    records = [record(peer, timer(cublas, copies))]
    table = pick_config(rows, N, K, dtype)
    records.append(record("skinny table", timer(lambda i: skinny_linear(x, ws[i], act=act, config=table), copies),
                          config=asdict(table)))
    log(f"{case}: {peer} {records[0]['time_us']:.2f} us, table {records[1]['time_us']:.2f} us")
    if table.split_k > 1:  # the same config with the partials summed by a second kernel, as before one_launch
        two = replace(table, one_launch=False)
        records.append(record("skinny table, reduce kernel",
                              timer(lambda i: skinny_linear(x, ws[i], act=act, config=two), copies),
                              config=asdict(two)))
    return records


def fold_case(*, rows: int, name: str, K: int, N: int, hidden: int = HIDDEN, log=lambda line: None,
              dtype=torch.bfloat16, device="cuda", timer=per_call_us) -> list[dict]:
    """[down; add + RMSNorm(1 + w); up] unfused against the folded [down with residual=; up with norm=] for
    ``x [rows, K] -> [rows, hidden] -> [rows, N]``. FlashInfer's add writes the running sum into the
    residual, as in a model (its values grow over replays; the times do not depend on them)."""
    import importlib.util

    from ..kernels.skinny_linear import pick_config, skinny_linear
    from ..models.fused import add_rms_norm_offset_

    wbytes = (hidden * K + N * hidden) * dtype.itemsize
    copies = max(1, min(CALLS, COPY_BYTES // wbytes))
    g = torch.Generator(device=device).manual_seed(0)
    downs = [(torch.randn(hidden, K, device=device, generator=g) * K ** -0.5).to(dtype) for _ in range(copies)]
    ups = [(torch.randn(N, hidden, device=device, generator=g) * hidden ** -0.5).to(dtype) for _ in range(copies)]
    x = torch.randn(rows, K, device=device, generator=g).to(dtype)
    residual = torch.randn(rows, hidden, device=device, generator=g).to(dtype)
    weight = (torch.randn(hidden, device=device, generator=g) * 0.1).to(dtype)
    case = f"fold {name} M{rows} K{K} H{hidden} N{N}"
    cuda = torch.device(device).type == "cuda"
    norm_kernel = "flashinfer" if cuda and importlib.util.find_spec("flashinfer") else "torch"
    peer = "down + add_rmsnorm + up"
    base = {"case": case, "rows": rows, "K": K, "N": N, "hidden": hidden, "act": None, "weight_bytes": wbytes,
            "calls": CALLS, "weight_copies": copies, "dtype": str(dtype).removeprefix("torch."), "peer": peer,
            "norm_kernel": norm_kernel, "configs": {"down": asdict(pick_config(rows, hidden, K, dtype)),
                                                    "up": asdict(pick_config(rows, N, hidden, dtype))}}

    def unfused(i):
        y = skinny_linear(x, downs[i])
        _, h = add_rms_norm_offset_(y, residual, weight, FOLD_EPS)
        return skinny_linear(h, ups[i])

    def folded(i):
        hidden_state = skinny_linear(x, downs[i], residual=residual)
        return skinny_linear(hidden_state, ups[i], norm=(weight, FOLD_EPS, 1.0))

    records = []
    for backend, call in ((peer, unfused), ("skinny fold (residual=, norm=)", folded)):
        us = timer(call, copies)
        records.append({**base, "backend": backend, "time_us": us, "tb_s": wbytes / (us * 1e-6) / 1e12})
    log(f"{case}: unfused {records[0]['time_us']:.2f} us, folded {records[1]['time_us']:.2f} us")
    return records


def print_linear_table(records: list[dict]) -> None:
    print(f"{'case':<64}{'backend':<32}{'µs':>8}{'TB/s':>7}{'vs peer':>9}  config")
    for r in records:
        c = r.get("config")
        cfg = f"n{c['block_n']} k{c['block_k']} s{c['split_k']} w{c['num_warps']} st{c['num_stages']}" if c else ""
        ratio = f"{r['ratio_to_peer']:.2f}x" if r.get("ratio_to_peer") else ""
        print(f"{r['case']:<64}{r['backend']:<32}{r['time_us']:>8.2f}{r['tb_s']:>7.2f}{ratio:>9}  {cfg}")


def run_linear(args, batches: list[int], *, command: str) -> int:
    """``fnattn bench linear``: every shape and fold pair at every row count; JSON at ``args.out``, recording
    ``command`` (the command line, which the caller parsed ``args`` from)."""
    import signal

    from ..kernels.skinny_linear import MAX_M
    from . import with_ratios, write_json

    bad = [b for b in batches if not 1 <= b <= MAX_M]
    if bad:
        print(f"fnattn bench: linear: --batch values must be 1..{MAX_M} rows, got {bad}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("fnattn bench: needs a CUDA device (none found)", file=sys.stderr)
        return 2
    records = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # a time limit still writes what finished
    try:
        for rows in batches:
            for name, K, N, act in SHAPES:
                records += linear_case(rows=rows, name=name, K=K, N=N, act=act,
                                       log=lambda line: print(line, file=sys.stderr))
            for name, K, N in FOLD_PAIRS:
                records += fold_case(rows=rows, name=name, K=K, N=N, log=lambda line: print(line, file=sys.stderr))
    finally:
        if records:
            with_ratios(records)
            print_linear_table(records)
            write_json(records, args.out, command=command)
    return 0
