"""Qwen3.5-0.8B's decode projections alone, as one chain: 24 layers of in_proj, out_proj, gate / up and down
(~1.03 GB of distinct weights), each a `skinny_linear`, replayed from one CUDA graph. How far from the copy
bandwidth the GEMVs run once nothing else is between them, and what each launch option does to the chain.
From the repository root on a GPU machine:

    python benchmarks/gemv_chain.py [--rows 1 8] [--replays 50] [--out gemv_chain.json]

Variants: the table's configs (PDL on); PDL off; `SkinnyConfig.prefetch` (each GEMV asks L2 for its slab
before its PDL wait); ``early`` 2 / 4 (a wider first load before the wait); 2, 3 and 6 pipeline stages; and
a side stream that streams the next projection's weight into L2 while the one before it runs (``side
prefetch``: one ``prefetch.global.L2`` a cache line; ``side load``: the lines loaded and summed, so they are
surely in L2). ``hot`` runs the same chain over layer 0's weights only (43 MB, mostly L2 hits): the launch
chain's floor where weights cost little. Each variant's graph is replayed in rounds, the variants
interleaved; the record has each variant's median chain time, its GB/s over the weights and its ratio to
the table's.
"""

import argparse
import json
import statistics

import torch
from fnattn.kernels._triton import tl, triton
from fnattn.kernels.skinny_linear import _prefetch_l2, configured, skinny_linear

from fnattn.bench import environment
from fnattn.kernels import pdl

HIDDEN, QKVZ, VALUE, INTER, LAYERS = 1024, 8224, 2048, 3584, 24


@triton.jit
def _side_prefetch(W, n_lines, LINE: tl.constexpr, PER: tl.constexpr):
    i = tl.program_id(0) * PER + tl.arange(0, PER)
    ok = i < n_lines
    _prefetch_l2(tl.where(ok, W + i.to(tl.int64) * LINE, W))


@triton.jit
def _side_load(W, S, n, PER: tl.constexpr, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * PER
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for o in range(0, PER, BLOCK):
        i = base + o + tl.arange(0, BLOCK)
        acc += tl.load(W + i, mask=i < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(S + tl.program_id(0), tl.sum(acc, axis=0))


def side_stream(w, sink, how):
    n = w.numel()
    if how == "prefetch":
        line = 128 // w.element_size()
        lines = triton.cdiv(n, line)
        per = 1024
        _side_prefetch[(triton.cdiv(lines, per),)](w, lines, LINE=line, PER=per, num_warps=4)
    else:
        per = 65536  # elements a program: 128 KB of bf16
        _side_load[(triton.cdiv(n, per),)](w, sink, n, PER=per, BLOCK=2048, num_warps=4)


def build(rows, device, dtype, hot=False):
    g = torch.Generator(device=device).manual_seed(0)
    shapes = [(QKVZ, HIDDEN), (HIDDEN, VALUE), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    layers = 1 if hot else LAYERS
    ws = [[(torch.randn(n, k, device=device, generator=g) * k ** -0.5).to(dtype) for n, k in shapes]
          for _ in range(layers)]
    ops = []
    for layer in range(LAYERS):
        for w in ws[layer % layers]:
            x = torch.randn(rows, w.shape[1], device=device, generator=g).to(dtype)
            ops.append((x, w, torch.empty(rows, w.shape[0], device=device, dtype=dtype)))
    return ops


def capture(ops, *, side=None, sink=None):
    def chain():
        main = torch.cuda.current_stream()
        other = torch.cuda.Stream() if side else None
        for i, (x, w, y) in enumerate(ops):
            if side and i + 1 < len(ops):
                ev = torch.cuda.Event()
                ev.record(main)
                other.wait_event(ev)
                with torch.cuda.stream(other):
                    side_stream(ops[i + 1][1], sink, side)
            skinny_linear(x, w, out=y)
        if side:
            main.wait_stream(other)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()  # compile and warm the allocator
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    return graph


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    sink = torch.empty(1 << 16, device=dev, dtype=torch.float32)
    records = []
    for rows in a.rows:
        ops = build(rows, dev, dt)
        weight_bytes = sum(w.numel() * w.element_size() for _, w, _ in ops)
        variants = {}
        plain = lambda: None  # noqa: E731
        builders = {
            "table": (plain, {}),
            "pdl off": (lambda: pdl(False), {}),
            "prefetch": (lambda: configured(prefetch=True), {}),
            "early 2": (lambda: configured(early=2), {}),
            "early 4": (lambda: configured(early=4), {}),
            "stages 2": (lambda: configured(num_stages=2), {}),
            "stages 3": (lambda: configured(num_stages=3), {}),
            "stages 6": (lambda: configured(num_stages=6), {}),
            "side prefetch": (plain, {"side": "prefetch"}),
            "side load": (plain, {"side": "load"}),
        }
        for name, (ctx, kw) in builders.items():
            try:
                c = ctx()
                if c is None:
                    variants[name] = capture(ops, sink=sink, **kw)
                else:
                    with c:
                        variants[name] = capture(ops, sink=sink, **kw)
            except Exception as e:  # noqa: BLE001 - one variant that fails to build leaves the others
                records.append({"rows": rows, "variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(f"M{rows} {name}: {type(e).__name__}: {str(e)[:200]}")
        hot_ops = build(rows, dev, dt, hot=True)
        try:
            variants["hot"] = capture(hot_ops)
        except Exception as e:  # noqa: BLE001
            records.append({"rows": rows, "variant": "hot", "error": f"{type(e).__name__}: {str(e)[:300]}"})
        if not variants:
            continue
        times = {n: [] for n in variants}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        names = list(variants)
        for r in range(a.replays):
            order = names[r % len(names):] + names[: r % len(names)]
            for n in order:
                start.record()
                variants[n].replay()
                end.record()
                end.synchronize()
                times[n].append(start.elapsed_time(end) * 1e3)
        base = statistics.median(times["table"]) if times.get("table") else None
        for n, ts in times.items():
            us = statistics.median(ts)
            rec = {"rows": rows, "variant": n, "chain_us": us, "per_gemv_us": us / len(ops),
                   "weight_bytes": weight_bytes, "gb_s": weight_bytes / us / 1e3,
                   "ratio_to_table": us / base if base else None, "launches": len(ops)}
            records.append(rec)
            print(f"M{rows} {n:14s} {us:8.1f} us  {us / len(ops):6.2f} us a GEMV  {weight_bytes / us / 1e3:7.1f} GB/s"
                  f"  {us / base if base else float('nan'):.3f}x")
        del variants
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            cmd = f"python benchmarks/gemv_chain.py --rows {' '.join(map(str, a.rows))} --replays {a.replays}"
            json.dump({"command": cmd + f" --out {a.out}", "environment": environment(), "records": records}, f,
                      indent=1)


if __name__ == "__main__":
    main()
