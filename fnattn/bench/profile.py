"""Where a step's time goes: the kernels of a few steps (the torch ops on a CPU), grouped by name, per step.

``fnattn bench model --profile N`` profiles N decode steps of each case, eager and replayed, with
`torch.profiler` (CUPTI records the kernels a graph replay launches, one by one; on a CPU each
``aten::`` op's own time stands in for kernel time, and the outermost ops for launches). Each record says:

- ``busy_us``: the summed kernel (and device copy) time a step, i.e. what the device is busy with;
- ``span_us``: first kernel start to last kernel end, over the steps: busy plus the device's idle gaps
  (on a CPU: the steps' wall time, the host's Python between the ops included);
- ``kernels``: launches a step (CPU: the torch calls the step makes, not the ops inside them);
- ``by_kind``: busy time split into GEMMs, attention / recurrent kernels (Triton and library), element-wise
  and reduction ops, copies (a coarse, name-based split: what to fuse next);
- ``top``: the kernels taking the most time a step, with their launch counts;
- ``ranges`` (when asked for, by a name prefix): each profiler range's kernel time a step, the kernels
  launched inside it (on a CPU: its ops' time), e.g. each layer's under `models.common.layer_ranges`.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict

import torch

_KINDS = (  # first match wins; names as CUPTI reports them, then torch's op names (a CPU profile)
    ("copy", re.compile(r"memcpy|memset|copy_kernel|CatArrayBatched|direct_copy|aten::(copy_|cat|clone)$", re.I)),
    ("gemm", re.compile(r"gemm|gemv|cutlass|cublas|sm90_xmma|nvjet|splitKreduce|dot_kernel"
                        r"|aten::(mm|addmm|bmm|baddbmm)$", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|index_|scatter|gather"
                               r"|aten::(add|mul|sub|div|exp|neg|silu|sigmoid|softplus|where|masked_fill|pow"
                               r"|rsqrt|clamp_min|fill_|zero_)_?$", re.I)),
    ("reduce", re.compile(r"reduce|softmax|norm|argmax|topk|sort|aten::(sum|mean|amax|max|logsumexp)$", re.I)),
)


def kind_of(name: str) -> str:
    for kind, pattern in _KINDS:
        if pattern.search(name):
            return kind
    return "attention / other"  # Triton kernels, FlashInfer, fla, FlashMLA: named by their op


def kernel_profile(fn, *, steps: int, device: torch.device, top: int = 25, ranges: str | None = None) -> dict:
    """Profile ``steps`` calls of ``fn`` (after one unprofiled call); ``-> the per-step summary`` above.

    ``ranges``: also sum, per step, the time of each `torch.profiler.record_function` range whose name starts
    with it (``ranges`` in the summary, in order of first appearance)."""
    import time

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    fn()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        wall = time.perf_counter() - started
    per_name: dict[str, list[float]] = defaultdict(list)
    annotations = []  # each range's device-side span (the profiler draws one per range on the device too)
    if cuda:
        events = []
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                ranged = e.is_user_annotation or (ranges is not None and e.name.startswith(ranges))
                (annotations if ranged else events).append(e)
        if not events:
            return {"steps": steps, "error": "the profiler recorded no device events (CUPTI unavailable?)"}
        for e in events:
            per_name[e.name].append(e.time_range.end - e.time_range.start)
        span = max(e.time_range.end for e in events) - min(e.time_range.start for e in events)
    else:  # every torch op by its own time (its time less the ops inside it); launches: the outermost ops
        ops = [e for e in prof.events() if e.name.startswith("aten::")]
        for e in ops:
            per_name[e.name].append(e.self_cpu_time_total)
        events = [e for e in ops if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
        span = wall * 1e6
    busy = sum(sum(v) for v in per_name.values())
    by_kind: dict[str, float] = defaultdict(float)
    for name, times in per_name.items():
        by_kind[kind_of(name)] += sum(times) / steps
    rows = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))
    out = {
        "steps": steps,
        "device": device.type,
        "busy_us": busy / steps,
        "span_us": span / steps,
        "kernels": len(events) / steps,
        "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top": [{"name": name[:160], "kind": kind_of(name), "per_step": len(t) / steps,
                 "us_per_step": sum(t) / steps, "mean_us": sum(t) / len(t)} for name, t in rows[:top]],
    }
    if ranges is not None:
        out["ranges"] = (range_kernel_times(annotations, events, ranges, steps=steps) if cuda else
                         range_op_times(prof.events(), ranges, steps=steps))
    return out


def range_kernel_times(annotations, kernels, prefix: str, *, steps: int) -> dict[str, float]:
    """Per step, each range named ``prefix...``: the time of the kernels that ran inside its span on the device
    (a step's kernels run one after another on one stream, so the spans do not overlap)."""
    kernels = sorted(kernels, key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in kernels]
    times: dict[str, float] = {}
    for a in annotations:
        if not a.name.startswith(prefix):
            continue
        spent = 0.0
        for e in kernels[bisect.bisect_left(starts, a.time_range.start):]:
            if e.time_range.start >= a.time_range.end:
                break
            if e.time_range.end <= a.time_range.end:
                spent += e.time_range.end - e.time_range.start
        times[a.name] = times.get(a.name, 0.0) + spent / steps
    return times


def range_op_times(events, prefix: str, *, steps: int) -> dict[str, float]:
    """On a CPU, per step, each range named ``prefix...``: the time of the torch ops called inside it."""
    times: dict[str, float] = {}
    for e in events:
        if e.name.startswith(prefix) and e.device_type.name == "CPU":
            times[e.name] = times.get(e.name, 0.0) + sum(c.cpu_time_total for c in e.cpu_children) / steps
    return times


def print_profile(label: str, p: dict, rows: int = 15, log=print) -> None:
    if "error" in p:
        log(f"{label}: {p['error']}")
        return
    kinds = ", ".join(f"{k} {v:.0f}" for k, v in p["by_kind"].items())
    launches = "torch calls" if p.get("device") == "cpu" else "kernels"
    log(f"{label}: busy {p['busy_us']:.0f} us/step, span {p['span_us']:.0f} us/step, "
        f"{p['kernels']:.0f} {launches}/step ({kinds})")
    for r in p["top"][:rows]:
        log(f"  {r['us_per_step']:8.1f} us  x{r['per_step']:<5.0f} {r['mean_us']:7.2f} us  {r['name'][:100]}")
