"""Where an eager step's host time goes: cProfile over eager decode steps (or prefill steps) of a whole model.

    python benchmarks/host_profile.py --family qwen3_5 --shape 0.8b --batch 1 --prompt 512 --steps 8
    python benchmarks/host_profile.py --family qwen3_5 --shape 0.8b --batch 1 --prompt 8192 --steps 3 --prefill
    python benchmarks/host_profile.py --family qwen3_5 --shape 0.8b --batch 1 --prompt 512 --steps 16 --mtp 3

Prints the functions taking the most host time of their own (tottime) and in all (cumtime); ``--only REGEX``
keeps those whose place matches (``--only fnattn/``: the session, the apply, the batch, the kinds). An eager step
that the device finishes in ~1.5 ms but the host needs ~20 ms for is launch-bound: this says which calls.
On CUDA it then runs one more step with torch's sync debug mode on and prints every place that made the host
wait for the device (``.item()``, ``.tolist()``, a copy to the host): each one serializes the host's launches
with the device's work, so a step with one per layer costs host time + device time, not the larger of them.

``--stub-launches`` (a CPU without CUDA): the eager decode step through the CUDA paths (the Triton backends and
the fused model kernels) with every Triton launch a no-op that counts itself, so what is left is the host work
fnattn and torch do around the launches. It prints that step's time without the profiler (the best of a few
rounds), its launches and the host time a launch, then the profile. On a GPU an eager step costs this plus
Triton's own launch work (binding and specializing the arguments, the driver call) for each launch.

    python benchmarks/host_profile.py --shape tiny-24 --stub-launches --only fnattn/

``--bound`` (CUDA): the eager step's time with `fnattn.kernels.launch.bound_launches` on, beside it off, paired.
"""

import argparse
import collections
import cProfile
import os
import pstats
import sys
import traceback
import warnings

if "--stub-launches" in sys.argv:  # the kernels' jit objects become the interpreter's where they are defined
    os.environ["TRITON_INTERPRET"] = "1"

import torch
from fnattn.models.registry import Model, _with_dtype, family_named, random_checkpoint

from fnattn.bench.model import config_for, decode_state, time_decode, time_prefill
from fnattn.bench.profile import kernel_profile, print_profile
from fnattn.model_attention import ModelAttention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen3_5")
    p.add_argument("--shape", default="0.8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--only", default=None, metavar="REGEX",
                   help="print only the functions whose file:line(name) matches (the framework's: 'fnattn/')")
    p.add_argument("--prefill", action="store_true", help="profile prefill steps of --prompt tokens instead")
    p.add_argument("--captured", action="store_true",
                   help="with --prefill: through a PrefillRunner (pieces replayed around eager attention, CUDA)")
    p.add_argument("--stub-launches", action="store_true",
                   help="CPU only: the CUDA paths' eager decode with every Triton launch a no-op (fnattn's host work "
                        "around the launches, timed, counted and profiled)")
    p.add_argument("--bound", action="store_true",
                   help="CUDA, eager decode: then the step with `bound_launches` on and off, paired, twice each "
                        "(`fnattn.kernels.launch`: each kernel's compiled form launched directly after its first)")
    p.add_argument("--mtp", type=int, default=0, metavar="K",
                   help="profile speculative steps with K MTP drafts instead (both runners captured on CUDA), then "
                        "each phase's wall time and each captured graph's replay time alone")
    a = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    launches = None
    if a.stub_launches:
        if dev.type == "cuda" or a.prefill or a.mtp:
            p.error("--stub-launches: expected a machine without CUDA and a decode profile (no --prefill / --mtp)")
        launches, dtype = stub_launches(), torch.bfloat16
    fam = family_named(a.family)
    cfg = _with_dtype(fam.adapt(config_for(a.family, a.shape)), dtype)
    model = Model(fam, cfg, fam.load(cfg, random_checkpoint(fam, cfg, dtype=dtype, device=dev)))
    ma = ModelAttention(model.specs, device=dev, prefer=["triton_fused", "triton"] if launches else None)
    page = ma.page_size or 16  # what the chosen backends need (FlashMLA's 64), else 16
    if a.mtp:
        spec = mtp_speculator(model, dev, a.batch, a.prompt, a.mtp, a.steps)
        steps, what = mtp_steps(spec, dev), f"MTP k={a.mtp} B{a.batch} ctx{a.prompt}"
        steps(3)  # capture and warm up outside the profile
    elif a.prefill and a.captured:
        steps, what = captured_prefill(model, ma, dev, a.batch, a.prompt, page), f"captured prefill B{a.batch} " \
            f"P{a.prompt}"
        steps(2)  # capture, compile and warm up outside the profile
    elif a.prefill:
        def steps(n):
            return time_prefill(model, ma, dev, a.batch, a.prompt, page_size=page, reps=n)

        steps(1)  # compile and warm up outside the profile
        what = f"prefill B{a.batch} P{a.prompt}"
    else:
        room = 3 * a.steps + 8 + (STUBBED_STEPS if launches else 0)
        st = [decode_state(model, dev, a.batch, a.prompt, page_size=page, room=room)]

        def steps(n):
            times, st[0] = time_decode(model, ma, st[0], a.batch, n, warmup=0)
            return times

        steps(2)
        what = f"B{a.batch} ctx{a.prompt} decode"
    if launches is not None:
        print_stubbed_step(steps, launches)
    elif dev.type == "cuda" and not a.mtp:  # the step's own time first: the profiler's hooks slow every call
        print_unprofiled(steps, a, bound=False)
        if a.bound:  # paired: the same model and state, the bound launches' forms remembered in a first round
            from fnattn.kernels.launch import bound_launches

            with bound_launches(True):
                steps(2)
            for on in (True, False, True, False):
                with bound_launches(on):
                    print_unprofiled(steps, a, bound=on)
    prof = cProfile.Profile()
    prof.enable()
    times = steps(a.steps)
    prof.disable()
    kind = kind_of(a)
    print(f"{a.family} {a.shape} {what}: {kind} step {sum(times) / len(times) * 1e3:.2f} ms under cProfile, "
          f"{a.steps} steps")
    for key in ("tottime", "cumtime"):
        pstats.Stats(prof).sort_stats(key).print_stats(*([a.only] if a.only else []), a.rows)
    if dev.type == "cuda":
        print_syncs(lambda: steps(1))
    if a.mtp:
        print_phases(spec, dev, steps)


def print_unprofiled(steps, a, *, bound: bool) -> None:
    """The step's median and best time over ``a.steps`` steps, without the profiler."""
    plain = sorted(steps(a.steps))
    print(f"{kind_of(a)} step without the profiler{', bound launches' if bound else ''}: median "
          f"{plain[len(plain) // 2] * 1e3:.2f} ms, best {plain[0] * 1e3:.2f} ms over {a.steps} steps")


def kind_of(a) -> str:
    return "captured" if (a.captured and a.prefill) or a.mtp else "eager"


def stub_launches() -> list[int]:
    """Every Triton kernel (the interpreter's objects) a no-op that counts its launches in the list returned;
    the CUDA-only backends' device check and the fused model paths' allowed on this CPU. Outputs are left
    unwritten: the step's logits mean nothing, its host work is the CUDA path's."""
    import triton.runtime.interpreter as interpreter

    import fnattn.kinds  # noqa: F401 - every built-in kind and its backends: each module's own name is patched
    from fnattn.kinds import availability
    from fnattn.models import fused

    count = [0]

    def launch(self, grid):
        def run(*args, **kwargs):
            count[0] += 1
        return run

    interpreter.InterpretedFunction.__getitem__ = launch
    real = availability.needs_cuda
    for module in [m for name, m in sys.modules.items() if name.startswith("fnattn.")]:
        if getattr(module, "needs_cuda", None) is real:
            module.needs_cuda = lambda device: []
    # `fused._kernel` without its CUDA check, for Triton's kernels only (the interpreter's objects, stubbed above)
    fused._kernel = lambda package, *ts: package == "triton" and fused._kernel_rule(package, *ts)
    return count


STUBBED_ROUNDS, STUBBED_PER_ROUND = 5, 4
STUBBED_STEPS = 1 + STUBBED_ROUNDS * STUBBED_PER_ROUND  # a warm-up step, then the timed rounds


def print_stubbed_step(steps, launches: list[int]) -> None:
    """The stubbed step's best time over `STUBBED_ROUNDS` rounds of `STUBBED_PER_ROUND` steps (no profiler),
    its launches and the host time a launch."""
    steps(1)
    launches[0], best = 0, float("inf")
    for _ in range(STUBBED_ROUNDS):
        best = min(best, *steps(STUBBED_PER_ROUND))
    per_step = launches[0] / (STUBBED_STEPS - 1)
    print(f"stubbed launches: eager step {best * 1e3:.2f} ms (best of {STUBBED_STEPS - 1}), {per_step:.0f} "
          f"launches a step, {best * 1e6 / max(per_step, 1):.1f} us of host work a launch")


def mtp_speculator(model, dev, batch: int, prompt: int, k: int, steps: int):
    """A started `Speculator` (every draft kept by force) over ``batch`` random prompts."""
    from fnattn.bench.generate import _ids, speculator

    prompts = {r: _ids(prompt, model.config.vocab_size, 10 + r) for r in range(batch)}
    spec = speculator(model, dev, prompts, k, 4 * steps + 16, accept_all=True, graph=dev.type == "cuda")
    spec.start(prompts)
    return spec


def mtp_steps(spec, dev):
    import time

    def steps(n):
        times = []
        for _ in range(n):
            torch.cuda.synchronize(dev) if dev.type == "cuda" else None
            t0 = time.perf_counter()
            spec.step()
            torch.cuda.synchronize(dev) if dev.type == "cuda" else None
            times.append(time.perf_counter() - t0)
        return times

    return steps


def print_phases(spec, dev, steps) -> None:
    """Each phase of a speculative step timed with a sync on either side (its wall: the larger of its host and
    device time), then every captured graph's replay alone (its device time)."""
    import statistics
    import time

    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    spent = collections.defaultdict(list)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            spent[name].append(time.perf_counter() - t0)
            return out
        return wrapper

    saved = {name: getattr(spec, name) for name in ("_draft_chain", "_catch_up_verify")}
    spec._draft_chain = timed("draft proposals", saved["_draft_chain"])
    spec._catch_up_verify = timed("draft catch-up", saved["_catch_up_verify"])
    verify = spec.runner.verify if spec.runner is not None else None
    if verify is not None:
        spec.runner.verify = timed("target verify", verify)
    try:
        steps(8)
    finally:
        for name in saved:
            delattr(spec, name)
        if verify is not None:
            del spec.runner.verify
    print("speculative step phases, median wall ms with a sync either side:")
    for name, times in spent.items():
        print(f"  {name:18s} {statistics.median(times) * 1e3:8.3f}  ({len(times)} calls)")
    for who, runner in (("target", spec.runner), ("draft", spec.draft_runner)):
        for entry in runner.entries() if runner is not None else []:
            if entry.graph is None:
                continue
            entry.graph.replay()
            sync()
            t0 = time.perf_counter()
            for _ in range(20):
                entry.graph.replay()
            sync()
            print(f"  {who} graph {entry.bucket}: {(time.perf_counter() - t0) / 20 * 1e3:.3f} ms a replay alone")
            print_profile("    its kernels", kernel_profile(entry.graph.replay, steps=3, device=dev), rows=12)


def captured_prefill(model, ma, dev, batch: int, prompt: int, page: int):
    """``steps(n)``: n prefills of ``batch`` fresh prompts through one PrefillRunner (one State: a runner's
    graphs replay into the State they were captured on), each admitted, prefilled and released."""
    import time

    from fnattn.driver import prefill
    from fnattn.prefill_graph import PrefillRunner, tokens_up_to
    from fnattn.state import State

    runner = PrefillRunner(model.step, model.params, ma, tokens=tokens_up_to(batch * prompt), max_context=prompt)
    st = [State(model.specs, num_pages=batch * (-(-prompt // page) + 1) + 2, page_size=page, max_requests=batch + 1,
                device=dev)]
    prompts = {r: [(7 * r + i) % 1000 for i in range(prompt)] for r in range(batch)}

    def steps(n):
        times = []
        for _ in range(n):
            s = st[0]
            for r in prompts:
                s = s.admit(r)
            torch.cuda.synchronize(dev) if dev.type == "cuda" else None
            t0 = time.perf_counter()
            s, last = prefill(model.step, model.params, ma, s, prompts, runner=runner)
            int(last[0].argmax())
            times.append(time.perf_counter() - t0)
            for r in prompts:
                s = s.release(r)
            st[0] = s
        return times

    return steps


def print_syncs(step) -> None:
    """Every place in one ``step()`` where the host waited for the device, by the innermost caller frame
    outside torch, with the count."""
    where = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename
                  and "warnings" not in f.filename and "host_profile" not in f.filename]
        where[" <- ".join(f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                          for f in frames[-3:][::-1])] += 1

    with warnings.catch_warnings():  # restores showwarning and the filters on the way out
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"host waits for the device in one step: {sum(where.values())}")
    for place, n in where.most_common(40):
        print(f"{n:5d}  {place}")


if __name__ == "__main__":
    main()
