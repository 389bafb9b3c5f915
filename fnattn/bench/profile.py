"""Where a step's device time goes: the kernels of a few steps, grouped by name, per step.

``fnattn bench model --profile N`` profiles N decode steps of each case, eager and replayed, with
`torch.profiler` (CUPTI records the kernels a graph replay launches, one by one). Each record says:

- ``busy_us``: the summed kernel (and device copy) time a step, i.e. what the device is busy with;
- ``span_us``: first kernel start to last kernel end, over the steps: busy plus the device's idle gaps;
- ``kernels``: launches a step;
- ``by_kind``: busy time split into GEMMs, attention / recurrent kernels (Triton and library), element-wise
  and reduction ops, copies (a coarse, name-based split: what to fuse next);
- ``top``: the kernels taking the most time a step, with their launch counts.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

_KINDS = (  # first match wins; names as CUPTI reports them
    ("copy", re.compile(r"memcpy|memset|copy_kernel|CatArrayBatched|direct_copy", re.I)),
    ("gemm", re.compile(r"gemm|gemv|cutlass|cublas|sm90_xmma|nvjet|splitKreduce|dot_kernel", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|index_|scatter|gather", re.I)),
    ("reduce", re.compile(r"reduce|softmax|norm|argmax|topk|sort", re.I)),
)


def kind_of(name: str) -> str:
    for kind, pattern in _KINDS:
        if pattern.search(name):
            return kind
    return "attention / other"  # Triton kernels, FlashInfer, fla, FlashMLA: named by their op


def kernel_profile(fn, *, steps: int, device: torch.device, top: int = 25) -> dict:
    """Profile ``steps`` calls of ``fn`` (after one unprofiled call); ``-> the per-step summary`` above."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize(device)
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not events:
        return {"steps": steps, "error": "the profiler recorded no device events (CUPTI unavailable?)"}
    per_name: dict[str, list[float]] = defaultdict(list)
    for e in events:
        per_name[e.name].append(e.time_range.end - e.time_range.start)
    busy = sum(sum(v) for v in per_name.values())
    span = max(e.time_range.end for e in events) - min(e.time_range.start for e in events)
    by_kind: dict[str, float] = defaultdict(float)
    for name, times in per_name.items():
        by_kind[kind_of(name)] += sum(times) / steps
    rows = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))
    return {
        "steps": steps,
        "busy_us": busy / steps,
        "span_us": span / steps,
        "kernels": len(events) / steps,
        "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top": [{"name": name[:160], "kind": kind_of(name), "per_step": len(t) / steps,
                 "us_per_step": sum(t) / steps, "mean_us": sum(t) / len(t)} for name, t in rows[:top]],
    }


def print_profile(label: str, p: dict, rows: int = 15, log=print) -> None:
    if "error" in p:
        log(f"{label}: {p['error']}")
        return
    kinds = ", ".join(f"{k} {v:.0f}" for k, v in p["by_kind"].items())
    log(f"{label}: busy {p['busy_us']:.0f} us/step, span {p['span_us']:.0f} us/step, "
        f"{p['kernels']:.0f} kernels/step ({kinds})")
    for r in p["top"][:rows]:
        log(f"  {r['us_per_step']:8.1f} us  x{r['per_step']:<5.0f} {r['mean_us']:7.2f} us  {r['name'][:100]}")
