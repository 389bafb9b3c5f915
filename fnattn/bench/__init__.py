"""``fnattn bench``: kernel and backend timings on a GPU, written as JSON (and a PNG).

Every case times fnattn next to its peer in the same process, on the same
inputs: FlashInfer's usual append-then-decode, torch SDPA, fla-core. Times are
medians of CUDA-graph replays (``triton.testing.do_bench``), so launch gaps
count as little as they would in a served decode step. Each record carries the
shapes, the backend, the time, achieved TB/s or TFLOP/s and the ratio to the
peer measured in the same run.
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from pathlib import Path


def timed(fn, *, graph: bool = True, warmup: int = 3, bench_warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median microseconds of ``fn()``; replayed from a CUDA graph when ``graph`` (``bench_warmup_ms`` and
    ``rep_ms``: ``do_bench``'s warm-up and measuring time)."""
    import torch
    from triton.testing import do_bench

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # allocator warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    return do_bench(run, warmup=bench_warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def timed_session(model_attention, state, batch, body, *, graph: bool = True, warmup: int = 3) -> float:
    """Median microseconds of one fnattn step: ``body(session)`` runs the step's layers (each once, as a
    session allows) and whatever of the apply the case times.

    With ``graph`` the warm-up calls run in sessions of their own, then one session opens outside the
    capture (its plans built on entry, as a served step plans before it replays its graph), its body is
    captured once and the replays are timed. Eager, every call opens a session of its own, so the time
    includes the session's entry (checks, plans, workspace lease).
    """
    import torch
    from triton.testing import do_bench

    def once():
        with model_attention.session(state, batch) as s:
            body(s)

    for _ in range(warmup):
        once()
    torch.cuda.synchronize()
    if not graph:
        return do_bench(once, warmup=25, rep=100, return_mode="median") * 1e3
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        once()  # allocator warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with model_attention.session(state, batch) as s:
        with torch.cuda.graph(g):
            body(s)
    return do_bench(g.replay, warmup=25, rep=100, return_mode="median") * 1e3


def copy_bandwidth_tbs(nbytes: int = 2 << 30) -> float:
    """Device copy bandwidth (read + write) measured now: the memory roofline."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = timed(lambda: dst.copy_(src), graph=False)
    return 2 * nbytes / (us * 1e-6) / 1e12


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
    for name in ("triton", "flashinfer", "fla", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - absence is a fact worth recording, not an error
            env[name] = None
    env["commit"] = commit()
    env["switches"] = switches()
    return env


def switches() -> dict:
    """Every fast-path switch and tile override stack in force (`fnattn.switches.snapshot`)."""
    from .. import switches as registry

    return registry.snapshot()


def commit() -> str | None:
    """The source commit: FNATTN_COMMIT when set (copies without git history), else git's answer, with
    ``+changes`` appended when the tracked files differ from it (a copied tree whose git metadata is older than
    its files reports an older HEAD: the suffix keeps a record from naming code that did not run)."""
    import os

    if os.environ.get("FNATTN_COMMIT"):
        return os.environ["FNATTN_COMMIT"]
    here = Path(__file__).parent
    try:
        out = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], capture_output=True, text=True,
                             cwd=here).stdout.strip()
        if len(out) != 40:
            return None
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, cwd=here)
    except OSError:
        return None
    return out + "+changes" if changed.returncode != 0 or changed.stdout.strip() else out


def write_json(records: list[dict], path: str | Path, *, command: str) -> dict:
    doc = {"command": command, "environment": environment(), "records": records}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1))
    return doc


def draw_png(records: list[dict], path: str | Path) -> None:
    """One bar group per case: time of every backend, labelled with its ratio to the peer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in records))
    fig, axes = plt.subplots(len(cases), 1, figsize=(9, 2.2 * len(cases)), squeeze=False)
    for ax, case in zip(axes[:, 0], cases):
        rows = [r for r in records if r["case"] == case and r.get("time_us")]
        ax.barh([r["backend"] for r in rows], [r["time_us"] for r in rows], color="#4c72b0")
        for i, r in enumerate(rows):
            label = f" {r['time_us']:.1f} µs"
            if r.get("ratio_to_peer"):
                label += f"  ({r['ratio_to_peer']:.2f}x {r['peer']})"
            ax.text(r["time_us"], i, label, va="center", fontsize=7)
        ax.set_title(case, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("µs (median, lower is better)", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(records: list[dict]) -> None:
    print(f"{'case':<44}{'backend':<26}{'µs':>10}{'TB/s':>8}{'TFLOP/s':>9}{'vs peer':>9}")
    for r in records:
        if r.get("error"):
            print(f"{r['case']:<44}{r['backend']:<26}  ERROR {r['error'][:60]}")
            continue
        if "time_us" not in r:  # a row of figures without a time of its own (a floor missing its kernel half)
            print(f"{r['case']:<44}{r['backend']:<26}{'—':>10}  {r.get('why', '')[:60]}")
            continue
        tb = f"{r['tb_s']:.2f}" if r.get("tb_s") else ""
        tf = f"{r['tflop_s']:.0f}" if r.get("tflop_s") else ""
        ratio = f"{r['ratio_to_peer']:.2f}x" if r.get("ratio_to_peer") else ""
        print(f"{r['case']:<44}{r['backend']:<26}{r['time_us']:>10.1f}{tb:>8}{tf:>9}{ratio:>9}")


def with_ratios(records: list[dict]) -> list[dict]:
    """peer time / own time for each record that names a peer in its case (>1: faster than the peer)."""
    by = {(r["case"], r["backend"]): r for r in records if r.get("time_us")}
    for r in records:
        peer = by.get((r["case"], r.get("peer")))
        if peer and r.get("time_us") and r is not peer:
            r["ratio_to_peer"] = peer["time_us"] / r["time_us"]
    return records
