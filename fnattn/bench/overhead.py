"""``fnattn bench overhead``: what the session, the apply and the driver cost over the kernels they launch.

One model (random weights of ``--family`` at ``--shape``: tiny on CPU, 0.8b on CUDA by default), one
decode step of ``--batch`` requests holding ``--prompt`` cached tokens, timed three ways over three
States of the same contents (`bench.setup.cached_state` is deterministic), with the same tokens each step:

- ``direct``: the model's own step function handed a `DirectSession`, a stand-in with only what a
  step reads (``batch``, ``forward``, ``record``). Its ``forward`` calls the chosen decode backend's
  function as written (`Backend.source`, not the session-only guard) with the layer's views and the
  inputs carrying a `StepMeta` (the step's batch, the group's plan built as the session builds it, a
  workspace lease); the rows that come back go to the pools through the same `fnattn.apply.write_step`,
  to the rows the batch names, and the cursors move with `State.advance` (the host half of every
  apply). So the kernels, their order and their arguments are the framework's; what is skipped:

  * session entry: the batch / State / spec checks, the per-step workspace lease, lending the ring rows;
  * per layer: the layer and inputs-type checks, ``inputs.validate``, the purity watch (checks on
    only), the checks on what the backend returned and binding its writes;
  * the apply's validation (`fnattn.apply.validate_step`): the batch against the State (on the CPU its
    device tensors read back and rebuilt), the cursor, every write's names, shape, dtype, device,
    layout and aliasing with the storage.

  Kept in all three ways: building the step's `Batch` (the kernels' metadata; its time is recorded as
  ``batch_build_us``), the backends' plans, and the model's `StepDeltas.collect` (inside its step).
- ``session``: the eager path users run: `fnattn.driver.run_step` (session, step, `State.apply`).
- ``graph``: `fnattn.graph.StepRunner.decode` (lane checks and copies, then a CUDA-graph replay; on the
  CPU its capture-free mode: the same checks around the eager step and the full apply).
- ``direct graph`` (captured runs only): a second runner's captured graph of the same step, replayed by
  `DirectGraph` with none of the runner's checks: the batch built into the bucket's staging (the kernels'
  metadata, as in ``direct``), the tokens copied in, the replay, the logits copied out and the cursors
  moved (`State.advance`). The graph way's ``graph_overhead`` is its step over this one's: what the
  driver adds to a replayed step, less what it saves by building the next step's batch while the device
  runs this one (`StepRunner` ``prepare``; ``prepared_steps`` counts the steps that took one), which
  `DirectGraph` does not. Both replayed ways record ``host_before_replay_us``: the host time from the
  step's start to the replay's launch, while the device has nothing to run.

The session record also has ``breakdown_us``: the medians of run_step's pieces (batch, session entry,
the step, session exit, the apply's validation, its writes, the cursor move), from a few more steps.

Steps are interleaved (each step runs every way of its group, in a rotating order) so drift on a shared
machine lands on all of them alike: the eager ways (direct, session) with each other, then the replayed
ways with each other (a replay right after a 20 ms host-bound eager step finds a device that idled through
it). Each way's record has the median step, ``overhead`` = its median over direct's, and
``paired_overhead`` = the median over rounds of its step over the same round's direct step (the steadier
of the two where the machine drifts; the replayed ways pair with direct by step index, and with each other
by round in ``paired_graph_overhead``). The direct and session logits must be equal: bitwise on the CPU in
fp32 (the run fails otherwise), the largest difference is recorded on a GPU.
Whether ``FNATTN_CHECKS`` was on (decided at import) is in every record: the overhead target is with
checks off.
"""

from __future__ import annotations

import shlex
import statistics
import sys
import time
from dataclasses import replace

import torch

from ..apply import Target, write_step
from ..batch import Batch
from ..checks import CHECKS_ENABLED
from ..declare import StepMeta
from ..workspace import Workspace
from .model import _record, _sync, _tokens, config_for

WAYS = ("direct", "session", "graph", "direct graph")
TARGET = 1.03  # the bound: session (and driver, apply) <= 3% over direct


class DirectSession:
    """What a model's step reads of a session, and no more: ``batch``, ``forward``, ``record``.

    ``forward`` runs the layer's chosen backend function as written over the views, without validating
    the inputs or what comes back, and keeps each layer's writes in ``writes``.
    """

    def __init__(self, direct: Direct, batch: Batch, plans: dict):
        self.batch = batch
        self._direct = direct
        self._plans = plans
        self.writes: dict[int, object] = {}
        self._metas = {g: StepMeta(batch=batch, plan=p, workspace=direct.lease) for g, p in plans.items()}
        self.generated: dict[str, torch.Tensor] = {}
        self.replay_outputs: dict[int, object] = {}

    def forward(self, layer: int, inputs):
        d = self._direct
        fn, spec, group = d.layers[layer]
        meta = self._metas.get(group) or StepMeta(batch=self.batch, plan=None, workspace=d.lease)
        out, writes = fn(spec, d.views[layer], replace(inputs, meta=meta))
        self.writes[layer] = writes
        return out, writes

    def record(self, name: str, tensor: torch.Tensor) -> None:
        self.generated[name] = tensor


class Direct:
    """The kernels of one model's decode step without the framework around them (module docstring).

    Everything that does not change between steps is looked up once: each layer's backend function,
    spec and plan group, its views (the pools are written in place, so they stay valid), and where each
    of its storage tensors lives in the pools.
    """

    def __init__(self, model, model_attention, state):
        ma = model_attention
        self.model, self.pools = model, state.storage.pools
        self.layers = {}
        for spec in ma.specs:
            choice = ma.choices[(spec.index, "decode")]
            ma.backend(spec.index, "decode")  # a layer without a decode backend fails here, naming why
            self.layers[spec.index] = (choice.backend.source, spec, choice.group)
        self.groups = [(g, ma.backend(specs[0].index, "decode"), specs) for g, specs in ma.groups("decode").items()]
        self.views = {spec.index: state.views(spec.index) for spec in ma.specs}
        storage = state.storage
        self.where = {}  # (layer, storage name) -> (pool, layer's position in it, "token" | "request")
        for layer, names in state.storage_spaces.items():
            for p in storage.layer_pools[layer]:
                pool = storage.pools[p]
                for name in pool.tensors:
                    if name in names:
                        self.where[(layer, name)] = (p, pool.position(layer), pool.index_space)
        # its own workspace and one lease for the whole run: no per-step lease (the session takes one)
        self.workspace = Workspace(ma.device)
        self.lease = self.workspace.lease()

    def close(self) -> None:
        self.lease.release()

    def step(self, state, ids, tokens):
        """``-> (state after the step, logits, seconds building the batch)``."""
        t0 = time.perf_counter()
        batch = Batch.decode(state, ids)
        built = time.perf_counter() - t0
        plans = {g: b.plan(specs, batch, self.lease) if b.plan else None for g, b, specs in self.groups}
        s = DirectSession(self, batch, plans)
        logits, _ = self.model.step(self.model.params, s, tokens)
        targets = []
        for layer, w in s.writes.items():
            if w is None:
                continue
            for name, value in w.values.items():
                if value is None:  # already in the spare ring rows the batch names
                    continue
                pool, pos, space = self.where[(layer, name)]
                rows = batch.slot_mapping if space == "token" else batch.recurrent_write_rows
                targets.append(Target(pool, name, pos, rows, value.detach(), True))
        write_step(self.pools, targets)
        cursor = batch.cursor_after(batch.host_new_lens)
        return state.advance(cursor, batch.step_id), logits, built


class DirectGraph:
    """A captured decode step (a runner's bucket entry, `_captured`) replayed with none of `StepRunner`'s
    checks (module docstring)."""

    def __init__(self, entry):
        self.entry = entry

    def step(self, state, ids, tokens):
        """``-> (state after the step, logits)``."""
        e, b = self.entry, self.entry.bucket
        batch = Batch.decode(state, ids, pad_to=b.lanes, columns=b.columns, staging=e.staging)
        e.inputs["tokens"][:len(ids)].copy_(tokens)
        e.graph.replay()
        logits = e.outputs["logits"][:len(ids)].clone()
        return state.advance(batch.cursor_after(batch.host_new_lens), batch.step_id), logits


class _LaunchClock:
    """A captured graph whose replays note when the host launched them (the bench's instrument only)."""

    def __init__(self, graph):
        self.graph, self.launched = graph, []

    def replay(self) -> None:
        self.launched.append(time.perf_counter())
        self.graph.replay()


def _captured(runner, state, batch: int):
    """Capture ``runner``'s decode bucket of ``batch`` lanes now, its replays clocked: ``-> (state, entry)``
    (``entry.graph`` is the `_LaunchClock`)."""
    from ..lanes import Bucket

    state, entry = runner.bucket_entry(state, Bucket("decode", batch, 0, runner.columns(state)))
    entry.graph = _LaunchClock(entry.graph)
    return state, entry


def _runner(model, ma, batch: int, max_context: int, graph: bool):
    """The StepRunner of the graph way (captured on CUDA), or None with the reason."""
    from ..graph import StepRunner

    if not graph:
        return None, "--eager"
    capture = None if ma.device.type == "cuda" else False
    runner = StepRunner(model.step, model.params, ma, model.manifest(), buckets=(batch,), max_context=max_context,
                        capture=capture)
    return runner, None


def session_breakdown(model, ma, state, ids, steps: int, seed: int = 500) -> tuple[dict, object]:
    """Median microseconds of each piece of `fnattn.driver.run_step` (what `State.apply` does, in its
    parts), over ``steps`` steps; ``-> (breakdown, state after)``. Synchronized after every piece on a GPU,
    so each piece's device work is counted in it."""
    from ..apply import validate_step

    dev, parts = ma.device, {k: [] for k in ("batch_build", "session_entry", "step", "session_exit",
                                             "apply_validation", "apply_write", "advance")}
    with torch.no_grad():
        for i in range(steps):
            tokens = _tokens(len(ids), model.config.vocab_size, dev, seed + i)
            state = state.reserve({r: 1 for r in ids})
            _sync(dev)
            marks = [time.perf_counter()]

            def mark(marks=marks):
                _sync(dev)
                marks.append(time.perf_counter())

            batch = Batch.decode(state, ids)
            mark()
            s = ma.session(state, batch)
            s.__enter__()
            mark()
            try:
                _, deltas = model.step(model.params, s, tokens)
                mark()
            finally:
                s.__exit__(None, None, None)
            mark()
            targets = validate_step(state, deltas)
            mark()
            write_step(state.storage.pools, targets)
            mark()
            state = state.advance(deltas.cursor, deltas.step_id)
            mark()
            for k, a, b in zip(parts, marks, marks[1:]):
                parts[k].append(b - a)
    return {k: statistics.median(v) * 1e6 for k, v in parts.items()}, state


def overhead_case(model, ma, *, name: str, batch: int, prompt: int, steps: int, page_size: int,
                  graph: bool = True, warmup: int = 3, log=print) -> list[dict]:
    """The ways of one decode case (module docstring): ``-> records``."""
    from ..driver import run_step
    from .model import decode_state

    dev = ma.device
    ids = list(range(batch))
    pieces = min(steps, 16)  # steps of the session's breakdown, after the timed ones
    room = warmup + steps + pieces + 1
    states = {w: decode_state(model, dev, batch, prompt, page_size=page_size, room=room) for w in WAYS}
    runner, why = _runner(model, ma, batch, prompt + room, graph)
    replayed, clocks = None, {}  # the direct graph way, and each captured way's launch times
    if runner is not None and runner.capture and not runner.in_pieces:  # one graph a step to clock
        states["graph"], entry = _captured(runner, states["graph"], batch)
        second, _ = _runner(model, ma, batch, prompt + room, graph)
        states["direct graph"], second_entry = _captured(second, states["direct graph"], batch)
        clocks = {"graph": entry.graph, "direct graph": second_entry.graph}
        replayed = DirectGraph(second_entry)
    ways = [w for w in WAYS if (w != "graph" or runner is not None) and (w != "direct graph" or replayed)]
    direct = Direct(model, ma, states["direct"])
    times, starts = {w: [] for w in ways}, {w: [] for w in ways}
    logits = {w: [] for w in ways}  # per step: the same tokens at the same step, over the same contents
    built = []
    # The eager ways interleave with each other, the replayed ones with each other: a replay right after a
    # 20 ms host-bound eager step runs on a device that idled through it, and would be timed slower for it.
    groups = [[w for w in ways if w in ("direct", "session")], [w for w in ways if w in ("graph", "direct graph")]]
    try:
        with torch.no_grad():
            for group in groups:
                for i in range(warmup + steps):
                    tokens = _tokens(batch, model.config.vocab_size, dev, 100 + i)
                    k = i % len(group)
                    for way in group[k:] + group[:k]:
                        st = states[way].reserve({r: 1 for r in ids})
                        _sync(dev)
                        t0 = time.perf_counter()
                        if way == "direct":
                            st, out, b = direct.step(st, ids, tokens)
                        elif way == "session":
                            st, out = run_step(model.step, model.params, ma, st, Batch.decode(st, ids), tokens)
                        elif way == "graph":
                            st, out = runner.decode(st, ids, tokens)
                        else:
                            st, out = replayed.step(st, ids, tokens)
                        _sync(dev)
                        starts[way].append(t0)
                        if i >= warmup:
                            times[way].append(time.perf_counter() - t0)
                            if way == "direct":
                                built.append(b)
                        states[way] = st
                        logits[way].append(out)
        breakdown, states["session"] = session_breakdown(model, ma, states["session"], ids, pieces)
    finally:
        direct.close()
    diffs = {w: max((a.float() - b.float()).abs().max().item() for a, b in zip(logits[w], logits["direct"]))
             for w in ways}
    equal = all(torch.equal(a, b) for a, b in zip(logits["session"], logits["direct"]))
    exact = dev.type == "cpu" and next(iter(ma.specs)).dtype == torch.float32
    # the same captured kernels over the same contents: the same bits
    graph_equal = replayed is not None and all(torch.equal(a, b) for a, b in zip(logits["direct graph"],
                                                                                 logits["graph"]))
    if exact and not equal:
        raise RuntimeError(f"bench overhead: {name} B{batch}: the direct and session logits differ (max "
                           f"{diffs['session']:.3g}) on the CPU in fp32; the direct way is not the same math")
    case = f"{name} B{batch} ctx{prompt}"
    base = statistics.median(times["direct"])
    common = {"checks": CHECKS_ENABLED, "threads": torch.get_num_threads(), "steps": steps}
    records = [_record(case, "direct", "decode", base, batch, **common,
                       batch_build_us=statistics.median(built) * 1e6,
                       note="the model's step over the chosen backends' functions, no session or apply validation")]
    for way in ways[1:]:
        t = statistics.median(times[way])
        # Each round runs every way back to back: the median of the rounds' own ratios leaves out the drift of
        # a shared machine, which moves the medians' ratio by a few percent between runs.
        paired = statistics.median(a / b for a, b in zip(times[way], times["direct"]))  # the replayed: by step
        extra = {"overhead": t / base, "paired_overhead": paired, "logits_max_diff": diffs[way],
                 "target_overhead": TARGET}
        if way == "session":
            extra.update(logits_equal=equal, breakdown_us=breakdown)
        if way in clocks:
            extra.update(host_before_replay_us=statistics.median(
                at - t0 for at, t0 in zip(clocks[way].launched[warmup:], starts[way][warmup:])) * 1e6)
        if way == "graph":
            extra.update(captured=bool(runner.capture), validation_us=runner.last_validation_s * 1e6,
                         prepared_steps=sum(e.prepared_used for e in runner.entries()))
            if replayed is not None:  # what the driver adds to a replayed step
                extra.update(graph_overhead=t / statistics.median(times["direct graph"]),
                             paired_graph_overhead=statistics.median(
                                 a / b for a, b in zip(times[way], times["direct graph"])),
                             target_overhead=TARGET)
        elif way == "direct graph":
            extra.update(logits_equal_graph=graph_equal)
        backend = {"session": "fnattn session", "direct graph": "direct graph"}.get(way) or (
            "fnattn graph" if runner.capture else "fnattn graph (no capture)")
        records.append(_record(case, backend, "decode", t, batch, **common, **extra))
    if runner is None:
        records.append({"case": case, "backend": "fnattn graph", "phase": "decode", "skipped": why})
    for r in records[1:]:
        if r.get("overhead"):
            log(f"{case}: {r['backend']} {r['time_us']:.1f} us, {r['overhead']:.3f}x direct "
                f"({base * 1e6:.1f} us; paired by round {r['paired_overhead']:.3f}x); logits max diff "
                f"{r['logits_max_diff']:.3g}")
        if r.get("graph_overhead"):
            log(f"{case}: fnattn graph {r['graph_overhead']:.3f}x direct graph (paired by round "
                f"{r['paired_graph_overhead']:.3f}x)")
    return records


def run_overhead_bench(*, family: str, shape: str | None, batches, prompts, steps: int, device=None,
                       page_size: int | None = None, graph: bool = True, records: list | None = None,
                       log=print) -> list[dict]:
    """Every batch of one model; appends to ``records`` as it goes."""
    from ..model_attention import ModelAttention
    from ..models.registry import Model, _with_dtype, family_named, random_checkpoint

    records = [] if records is None else records
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = shape or ("0.8b" if dev.type == "cuda" else "tiny")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    fam = family_named(family)
    cfg = _with_dtype(fam.adapt(config_for(family, shape)), dtype)
    model = Model(fam, cfg, fam.load(cfg, random_checkpoint(fam, cfg, dtype=dtype, device=dev)))
    ma = ModelAttention(model.specs, device=dev)
    page_size = page_size or ma.page_size or 16  # what the chosen backends need (FlashMLA's 64), else 16
    name = f"{family} {shape}"
    log(f"{name} on {dev}, {dtype}: FNATTN_CHECKS {'ON (the target is with checks off)' if CHECKS_ENABLED else 'off'}"
        f", {torch.get_num_threads()} threads")
    for prompt in prompts:
        for b in batches:
            records += overhead_case(model, ma, name=name, batch=b, prompt=prompt, steps=steps, page_size=page_size,
                                     graph=graph, log=log)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return records


def print_overhead_table(records: list[dict]) -> None:
    print(f"{'case':<32}{'way':<28}{'us':>10}{'x direct':>10}{'max diff':>10}")
    for r in records:
        if r.get("skipped"):
            print(f"{r['case']:<32}{r['backend']:<28}  skipped: {r['skipped'][:60]}")
            continue
        ratio = f"{r['overhead']:.3f}" if r.get("overhead") else "1"
        diff = f"{r['logits_max_diff']:.2g}" if "logits_max_diff" in r else ""
        print(f"{r['case']:<32}{r['backend']:<28}{r['time_us']:>10.1f}{ratio:>10}{diff:>10}")
        if r.get("graph_overhead"):
            print(f"{'':<32}  {r['graph_overhead']:.3f}x the direct graph way (paired by round "
                  f"{r['paired_graph_overhead']:.3f}x)")
        if r.get("host_before_replay_us"):
            print(f"{'':<32}  host time before the replay's launch: {r['host_before_replay_us']:.1f} us")
        if r.get("breakdown_us"):
            print(f"{'':<32}  run_step pieces (us): " + ", ".join(f"{k} {v:.1f}" for k, v in r["breakdown_us"].items()))
    if any(r.get("checks") for r in records):
        print("FNATTN_CHECKS is on: these times include the runtime checks (the target is with checks off)")


def run_overhead(args) -> int:
    """The ``fnattn bench overhead`` command: user mistakes exit 2 with one line."""
    from . import write_json

    def mistake(text: str) -> int:
        print(f"fnattn bench: {text}", file=sys.stderr)
        return 2

    if any(v < 1 for v in args.batch):
        return mistake(f"--batch values must be >= 1, got {args.batch}")
    if any(v < 1 for v in args.prompt):
        return mistake(f"--prompt values must be >= 1, got {args.prompt}")
    if args.steps is not None and args.steps < 1:
        return mistake(f"--steps must be >= 1, got {args.steps}")
    if args.device not in (None, "cpu") and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        return mistake(f"--device must be cpu or an available cuda device, got {args.device!r}")
    steps = args.steps or 32
    # the defaults resolved, so the recorded command says what ran
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.shape = args.shape or ("0.8b" if args.device.startswith("cuda") else "tiny")
    records: list[dict] = []
    try:
        run_overhead_bench(family=args.family, shape=args.shape, batches=args.batch, prompts=args.prompt,
                           steps=steps, device=args.device, page_size=args.page_size, graph=not args.eager,
                           records=records, log=lambda line: print(line, file=sys.stderr))
    except ValueError as e:
        if not records:  # a user mistake (family, shape): one line
            return mistake(str(e))
        raise
    finally:
        if records:
            print_overhead_table(records)
            write_json(records, args.out, command=_command(args, steps))
    return 0


def _command(args, steps: int) -> str:
    parts = ["fnattn bench overhead", f"--family {args.family}", f"--shape {args.shape}"]
    parts += ["--batch " + " ".join(map(str, args.batch)), "--prompt " + " ".join(map(str, args.prompt)),
              f"--steps {steps}"]
    parts += [f"--device {args.device}"]
    parts += [f"--page-size {args.page_size}"] if args.page_size else []
    parts += ["--eager"] if args.eager else []
    return " ".join(parts + [f"--out {shlex.quote(args.out)}"])
