"""The host time of a captured step, on any machine: `StepRunner`s whose graphs are stand-ins that launch nothing.

    python benchmarks/captured_host_time.py --batch 1 8 --draft 3 --steps 200 --out captured_host_time.json
    python benchmarks/captured_host_time.py --batch 8 --profile 30      # then cProfile's top functions

A captured decode or speculative step is host-bound when the host needs longer to reach its replays than the
device needs to run them: on the H100 a Qwen3.5-0.8B MTP step (k = 3, batch 1) took 3.3 ms with the device busy
2.3 ms. Here every bucket is "captured" by running its step once eagerly (the outputs become the entry's buffers,
as a capture's do) and replayed by a stand-in whose replay does nothing, so a step's time is what the runner, the
batch builds, the State's bookkeeping and the speculative step's own tensor ops cost the host, without the model's
kernels. On the CPU those tensor ops run (on tiny tensors); on a GPU each would be a launch instead.

Times per step (the lowest of ten medians over ``--steps`` in all, after a warm-up): ``decode_us``
(`StepRunner.decode`, the next batch prepared as on CUDA) and ``speculative_us`` (`Speculator.step` with both
runners, every draft kept by force: the most tokens a step to carry). One thread. A shared machine's clock makes
times of one run differ by up to 2x from the next, so each step is also counted: ``*_calls``, the Python function
calls (the interpreter's work, which host time follows), and ``*_ops``, the tensor operations that reach a kernel
(views left out: on a GPU each is a launch of its own, ~5 us of host time, outside the graphs). Those are the same
on every run.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fnattn import ModelAttention
from fnattn.bench import write_json
from fnattn.bench import generate as gen
from fnattn.bench.model import build_model
from fnattn.driver import prefill
from fnattn.graph import StepRunner, advance_past
from fnattn.kernels.invariant import invariant_on
from fnattn.speculative import Speculator


class _Launches:
    """A captured graph's stand-in: replaying it launches nothing (the buffers keep the step run at capture)."""

    replays = 0

    def replay(self) -> None:
        self.replays += 1


class HostRunner(StepRunner):
    """A `StepRunner` that captures on any device: each bucket's step runs once eagerly into its buffers, and
    its "graph" launches nothing, so every replay costs the host what a real one's bookkeeping does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, capture=False, **kwargs)
        self.capture = self.capture_verify = self.prepare = True

    def _capture(self, state, entry):
        batch = self._pad_batch(state, entry)
        outputs, deltas, replay_outputs = self._eager(state, entry, batch)
        self._write(state, deltas)
        entry.graph = _Launches()
        state = advance_past(state, batch, deltas.cursor)
        entry.outputs, entry.replay_outputs = outputs, replay_outputs
        entry.lineage, entry.invariant = state.lineage, invariant_on()
        return state


def _synced(fn, device):
    """``fn`` and, on CUDA, a wait for the device: a step's time is then its host work or its tensor ops'
    device time, whichever is longer (a graph stand-in launches nothing)."""
    if device.type != "cuda":
        return fn

    def call():
        fn()
        torch.cuda.synchronize(device)

    return call


def _median_us(fn, steps: int, rounds: int = 10) -> float:
    """The lowest of ``rounds`` medians of ``steps / rounds`` steps: a shared machine's slow spells (another
    process, a clock that drops) land on whole rounds, which the lowest leaves out."""
    medians = []
    for _ in range(rounds):
        times = []
        for _ in range(max(1, steps // rounds)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    return min(medians) * 1e6


class _CountOps(TorchDispatchMode):
    """Counts the tensor operations that reach a device kernel (on a GPU each is a launch, or a copy)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _VIEWS:
            self.ops += 1
        return func(*args, **(kwargs or {}))


_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.slice.Tensor,
          torch.ops.aten.select.int, torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim,
          torch.ops.aten.alias.default, torch.ops.aten.detach.default, torch.ops.aten.as_strided.default,
          torch.ops.aten.expand.default, torch.ops.aten.reshape.default, torch.ops.aten.t.default,
          torch.ops.aten.transpose.int, torch.ops.aten.permute.default}


def counts(fn, steps: int = 10) -> tuple[float, float]:
    """``-> (Python function calls, tensor operations)`` a call of ``fn``, the mean of ``steps``: what its host
    time is made of, counted (the same on every machine, whatever its clock does)."""
    calls = [0]

    def tally(frame, event, arg):
        if event in ("call", "c_call"):
            calls[0] += 1

    with _CountOps():  # the mode's first use does work of its own
        fn()
    mode = _CountOps()
    sys.setprofile(tally)
    try:
        with mode:
            for _ in range(steps):
                fn()
    finally:
        sys.setprofile(None)
    return calls[0] / steps, mode.ops / steps


def decode_step(model, ma, batch: int, prompt: int, steps: int):
    """``-> a call that runs one captured decode step`` of ``batch`` requests after ``prompt`` tokens (room for
    ``steps`` of them)."""
    room = prompt + steps + 40
    runner = HostRunner(model.step, model.params, ma, model.manifest(), buckets=(batch,), max_context=room)
    st = gen._state(model, ma.device, batch, room)
    ids = list(range(batch))
    for r in ids:
        st = st.admit(r)
    prompts = {r: gen._ids(prompt, model.config.vocab_size, 10 + r) for r in ids}
    st, _ = prefill(model.step, model.params, ma, st, prompts)
    holder = {"st": st, "tok": torch.zeros(batch, dtype=torch.long, device=ma.device)}

    def once():
        st = holder["st"].reserve({r: 1 for r in ids})
        holder["st"], logits = runner.decode(st, ids, holder["tok"])
        holder["tok"] = logits.argmax(-1)

    for _ in range(5):
        once()
    return once


def speculator(model, batch: int, prompt: int, k: int, steps: int) -> Speculator:
    fam, dev = model.family, model.params.embed.device
    draft = fam.draft(model.config, model.params, None, seed=1)
    room = prompt + (k + 1) * (steps + 10) + 8
    attn, d_attn = ModelAttention(model.specs, device=dev), ModelAttention(draft.specs, device=dev)
    runner = HostRunner(fam.step_hidden, model.params, attn, model.manifest(hidden=True), buckets=(batch,),
                        max_context=room)
    draft_runner = HostRunner(draft.step, draft.params, d_attn, draft.manifest(model.config), buckets=(batch,),
                              max_context=room + k)
    spec = Speculator(target_step=fam.step_hidden, target_params=model.params, target_attn=attn,
                      target_state=gen._state(model, dev, batch, room, ring=k + 2), draft_step=draft.step,
                      draft_params=draft.params, draft_attn=d_attn, draft_state=gen._state(draft, dev, batch, room + k),
                      num_draft=k, target_runner=runner, draft_runner=draft_runner, force_accept=k + 1)
    spec.start({r: gen._ids(prompt, model.config.vocab_size, 10 + r) for r in range(batch)})
    for _ in range(5):
        spec.step()
    return spec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default="qwen3_5")
    p.add_argument("--shape", default="tiny")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--draft", type=int, default=3, help="k, the drafts a speculative step verifies")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--profile", type=int, default=0, help="then cProfile this many speculative steps (last batch)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the step's own tensor ops then launch kernels")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.draft < 1 or args.steps < 1 or args.prompt < 1 or any(b < 1 for b in args.batch):
        p.error(f"--batch, --prompt, --draft, --steps: expected values >= 1, got {args.batch}, {args.prompt}, "
                f"{args.draft}, {args.steps}")
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        p.error(f"--device: expected cpu, or cuda on a machine with CUDA, got {args.device}")
    torch.set_num_threads(1)
    model, ma, _ = build_model(args.family, args.shape, args.device)
    records, spec = [], None
    for b in args.batch:
        spec = speculator(model, b, args.prompt, args.draft, args.steps + args.profile + 20)
        decode = decode_step(model, ma, b, args.prompt, args.steps + 20)
        row = {"case": f"host b{b}", "family": args.family, "shape": args.shape, "batch": b, "k": args.draft,
               "device": args.device, "decode_us": _median_us(_synced(decode, ma.device), args.steps),
               "speculative_us": _median_us(_synced(spec.step, ma.device), args.steps)}
        row["speculative_over_decode"] = row["speculative_us"] / row["decode_us"]
        row["decode_calls"], row["decode_ops"] = counts(decode)
        row["speculative_calls"], row["speculative_ops"] = counts(spec.step)
        records.append(row)
        print(json.dumps(row))
    if args.out:
        write_json(records, args.out, command="python " + " ".join(sys.argv))
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.profile):
            spec.step()
        prof.disable()
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
