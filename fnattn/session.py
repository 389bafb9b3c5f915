"""AttentionSession: the only way to execute attention for one step.

    with model_attention.session(state, batch) as s:
        out, writes = s.forward(layer, inputs)

On entry it checks the state and batch against the specs, and the batch
against the State with the apply's own check (`check_of_state`), builds each group's
plan once, leases the workspace and, for a batch with a ring, hands the spare
recurrent rows to this session (the in-place states of any earlier session
over the same rows become void). `forward` validates a layer's inputs, calls
its backend with read-only views, checks what came back and binds the writes
to the layer and the step; each layer runs once. After exit every call raises
`SessionClosedError`.

With ``FNATTN_CHECKS=1`` purity is enforced: the version counter and the
bytes of every view are recorded before the backend runs and compared after;
a backend that wrote one raises `PurityError` naming itself and the view. The
spare ring rows the batch handed out are the one declared exception.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import replace

import optree
import torch

from .apply import capturing, check_batch
from .batch import PHASES, Batch
from .checks import CHECKS_ENABLED, fail
from .declare import StepMeta
from .deltas import Writes
from .errors import PurityError, SessionClosedError
from .lanes import debug_check

_sessions = itertools.count(1)


class AttentionSession:
    def __init__(self, model_attention, state, batch: Batch, *, defer_capturable: bool = False):
        self.model_attention = model_attention
        self.state = state
        self.batch = batch
        self.id = next(_sessions)
        self._open = False
        self._closed = False
        self._metas: dict = {}  # group -> the StepMeta its layers' inputs carry, from entry on
        self._views: Mapping = {}  # layer -> its Views: the storage's, built once (`State.views`)
        self._dispatch: dict = {}  # layer -> (spec, backend, input types, group), from entry on
        self._lease = None
        self._done: set[int] = set()
        #: layer -> output, for layers that returned replay inputs in a replay-mode verify step
        self.replay_outputs: dict[int, object] = {}
        #: name -> tensor a model built inside the step and declared as a generated lane (`record`)
        self.generated: dict[str, torch.Tensor] = {}
        self._parts = None  # a mixed step: (phase, its batch, its dispatch, its metas) for decode, then prefill
        # A step captured in pieces (`fnattn.pieces`) holds the layers of capturable backends: their groups
        # plan at their first layer, inside the piece being captured, not on entry.
        self._defer = defer_capturable
        self._deferred: dict = {}  # group -> its specs, planned at its first layer's forward

    # ---------------------------------------------------------------- context
    def __enter__(self) -> AttentionSession:
        if self._closed or self._open:
            raise SessionClosedError("an AttentionSession can be entered once")
        ma, state, batch = self.model_attention, self.state, self.batch
        if not isinstance(batch, Batch):
            fail("AttentionSession", "batch", "a Batch", type(batch).__name__)
        if batch.phase not in PHASES:
            fail("AttentionSession", "batch.phase", f"one of {PHASES}", batch.phase)
        check_version(state, batch, "AttentionSession")
        ma.check_storage_of(state, "AttentionSession")
        if state.device != ma.device:  # its backends were chosen for its device (a CPU kernel cannot read CUDA)
            fail("AttentionSession", "state", f"a State on {ma.device}, the device this ModelAttention chose its "
                 "backends for (ModelAttention(..., device=...))", f"a State on {state.device}")
        if batch.page_size != state.page_size:
            fail("AttentionSession", "batch.page_size", f"the state's page size {state.page_size}", batch.page_size)
        phases = (batch.phase, "decode") if batch.decode_lanes else (batch.phase,)
        for name, size in (pair for phase in phases for pair in ma.page_sizes(phase)):  # FlashMLA serves 64
            if batch.page_size != size:
                fail("AttentionSession", "batch.page_size", f"{size}, the one page size backend {name!r} serves "
                     f"(build the State with page_size={size} or prefer another backend)", batch.page_size)
        check_of_state(state, batch, "AttentionSession")
        self._dispatch = ma.dispatch(batch.phase)
        parts = batch.parts(state) if batch.decode_lanes else None  # refuses a forged decode_lanes by name
        self._lease = ma.workspace.lease()
        try:
            if parts is None:
                self._metas = self._plan(batch.phase, batch)
            else:  # a mixed step: each phase's backends plan for their own lanes only
                self._parts = tuple((phase, part, ma.dispatch(phase), self._plan(phase, part))
                                    for phase, part in zip(("decode", "prefill"), parts))
        except BaseException:
            self._lease.release()
            self._closed = True
            raise
        storage = state.storage
        self._views = storage.views  # filled by `State.views`, shared by every session over this storage
        self._device = state.device
        if batch.ring:
            storage.lend_ring(batch.state_version, self.id)
        self._open = True
        return self

    def _plan(self, phase: str, batch: Batch) -> dict:
        """One StepMeta per group of ``phase`` (frozen: its layers share it), with the plan its backend makes
        for ``batch``; the None group's for layers whose backend plans nothing."""
        ma, metas = self.model_attention, {}
        for group, specs in ma.groups(phase).items():
            backend = ma.backend(specs[0].index, phase)
            if self._defer and self.holds_in_graph(specs[0].index, phase) and backend.plan:
                self._deferred[group] = specs
                continue
            plan = backend.plan(specs, batch, self._lease) if backend.plan else None
            metas[group] = StepMeta(batch=batch, plan=plan, workspace=self._lease)
        metas.setdefault(None, StepMeta(batch=batch, plan=None, workspace=self._lease))
        return metas

    def __exit__(self, *exc) -> None:
        self._open = False
        self._closed = True
        if self._lease is not None:
            self._lease.release()

    # ---------------------------------------------------------------- forward
    def forward(self, layer: int, inputs):
        """Run one layer's backend for this step: ``-> (outputs, writes)``."""
        if not self._open:
            raise SessionClosedError(
                f"forward(layer={layer!r}) outside an open session: sessions are single-use context managers"
            )
        ma, batch = self.model_attention, self.batch
        entry = self._dispatch.get(layer) if type(layer) is int else None
        if entry is None:
            if type(layer) is int and layer in ma.spec_by_layer:
                ma.backend(layer, batch.phase)  # a phase this ModelAttention was not built for: raises, naming it
            fail("AttentionSession.forward", "layer", f"one of {sorted(ma.spec_by_layer)}", layer)
        if layer in self._done:
            fail("AttentionSession.forward", "layer", "a layer not yet run in this step (each layer runs once)",
                 layer)
        spec, _, expected, _ = entry
        if not isinstance(inputs, expected):
            fail("AttentionSession.forward", "inputs",
                 f"{' or '.join(t.__name__ for t in expected)} (layer {layer} is {spec.kind})",
                 type(inputs).__name__)
        self.state.check_live()
        if self._parts is None:
            out, writes = self._run(layer, inputs, batch, entry, self._metas)
        else:
            out, writes = self._run_mixed(layer, inputs)
        self._done.add(layer)
        if writes is not None:
            writes = writes.bound(layer=layer, step=batch.step_id, session=self.id)
        if batch.recovery == "replay" and getattr(out, "replay", None) is not None:
            self.replay_outputs[layer] = out
        return out, writes

    def _run(self, layer: int, inputs, batch: Batch, entry, metas):
        """``layer``'s backend of ``entry`` over ``batch`` (this step's, or one part of a mixed step's)."""
        spec, backend, _, group = entry
        if backend is None:
            self.model_attention.backend(layer, batch.phase)  # raises, saying why no backend serves it
        inputs.validate(spec, batch, self._device)
        if group in self._deferred:  # planned here, inside the graph piece that holds the layer
            metas[group] = StepMeta(batch=batch, plan=backend.plan(self._deferred.pop(group), batch, self._lease),
                                    workspace=self._lease)
        meta = metas.get(group) or metas[None]
        views = self._views.get(layer)
        if views is None:
            views = self.state.views(layer)
        if CHECKS_ENABLED and not capturing():
            with debug_check():
                watch = _Watch(self.state, layer, views, batch)
        else:
            watch = None
        result = backend.fn(spec, views, replace(inputs, meta=meta))
        if watch is not None:
            with debug_check():
                watch.check(backend)
        where = f"backend {backend.name!r} ({spec.kind}, {batch.phase})"
        if not isinstance(result, tuple) or len(result) != 2:
            fail(where, "return", "a pair (outputs, writes)", type(result).__name__)
        out, writes = result
        if writes is not None and not isinstance(writes, Writes):
            fail(where, "writes", "fnattn.writes(...) or None", type(writes).__name__)
        return out, writes

    def holds_in_graph(self, layer: int, phase: str | None = None) -> bool:
        """Whether a step captured in pieces (`fnattn.pieces`) holds ``layer`` (its backend for the phase is
        capturable: in a bucket its launches are shaped by the bucket) rather than running it eagerly between
        pieces. Never in a mixed step, whose parts are built per step."""
        phase = phase or self.batch.phase
        if self.batch.decode_lanes:
            return False
        backend = self.model_attention.backend(layer, phase)
        return backend.capturable

    def _run_mixed(self, layer: int, inputs):
        """A mixed step's layer: its decode backend on the decode lanes' rows, its prefill backend on the rest,
        their outputs and writes joined in the step's row order (decode lanes first)."""
        d = self.batch.decode_lanes
        # a decode lane has one token: the decode part's rows and lanes are the first d alike
        halves = [self._run(layer, split_inputs(inputs, cut, cut, part), part, dispatch[layer], metas)
                  for (_, part, dispatch, metas), cut in zip(self._parts, (slice(0, d), slice(d, None)))]
        (out_d, w_d), (out_p, w_p) = halves
        if w_d is not None and w_p is not None:  # a part that wrote a ring row in place hands its rows on
            w_d, w_p = (self._as_values(layer, w, other, part)
                        for w, other, (_, part, _, _) in ((w_d, w_p, self._parts[0]), (w_p, w_d, self._parts[1])))
        return join_parts(layer, out_d, out_p), join_writes(layer, w_d, w_p)

    def _as_values(self, layer: int, w: Writes, other: Writes, part: Batch) -> Writes:
        """``w`` with each recurrent state the part's backend wrote in place (None: straight into the batch's
        spare ring rows, `fnattn.kinds.delta_rule`) read back from those rows where the other part returns
        values, so the step's writes join; the apply writes them to the same rows again."""
        spaces = self.state.storage_spaces[layer]
        missing = [name for name, v in w.values.items()
                   if v is None and other.values.get(name) is not None and spaces.get(name) == "request"]
        if not missing or not part.ring:
            return w
        views = self._views.get(layer) or self.state.views(layer)
        rows = part.recurrent_write_rows  # [B] the ring rows the part's kernel wrote
        return Writes({**w.values, **{name: views[name].index_select(0, rows) for name in missing}})

    def record(self, name: str, tensor: torch.Tensor) -> None:
        """Name a tensor the step generates on the device (an in-graph top-k, say): the lane of that name in
        the model's manifest (`fnattn.lanes`); a graph runner checks it and never copies into it."""
        if not self._open:
            raise SessionClosedError(f"record({name!r}) outside an open session")
        if not isinstance(name, str) or name in self.generated:
            fail("AttentionSession.record", "name", "a lane name not yet recorded in this step", name)
        if not isinstance(tensor, torch.Tensor):
            fail("AttentionSession.record", "tensor", "a torch.Tensor", type(tensor).__name__)
        self.generated[name] = tensor


def check_version(state, batch: Batch, where: str) -> None:
    """``batch`` was built from this very handle (a twin State's batch or a stale one is refused)."""
    if batch.state_version != state.version:  # also raises if the state handle is stale
        fail(where, "batch", f"a batch built from this state (version {state.version})",
             f"version {batch.state_version}")


def check_of_state(state, batch: Batch, where: str) -> None:
    """``batch`` is this State's as it is now: the apply's own check (its requests, cursors, pages, ring, and
    its tensors' rows where they read back without a sync), on tensors that are dense and contiguous.

    A copy of a batch (`dataclasses.replace`) pointing at another request's pages, or a batch whose tensors
    were rewritten after it was built, is refused here, before any backend reads through it."""
    check_version(state, batch, where)
    check_batch(state, batch, where)  # its tensors' layout first


class _Watch:
    """What a layer's views hold before its backend runs: version counters and the bytes.

    Version counters name an in-place op on a view; the bytes catch writes
    that bypass them (``.data``, memory shared through another tensor). The
    spare ring rows a ring batch handed out are not compared.
    """

    def __init__(self, state, layer: int, views, batch: Batch):
        self.views = views
        self.versions = {name: t._version for name, t in views.items()}
        spaces = state.storage_spaces[layer]
        self.kept = {}
        for name, t in views.items():
            keep = None
            if batch.ring and spaces[name] == "request":
                spare = batch.recurrent_write_rows
                keep = torch.ones(t.shape[0], dtype=torch.bool, device=t.device)
                keep[spare[spare >= 0]] = False
            self.kept[name] = (keep, (t if keep is None else t[keep]).clone())

    def check(self, backend) -> None:
        for name, t in self.views.items():
            keep, before = self.kept[name]
            changed = not _same_bits(t if keep is None else t[keep], before)
            if changed or (t._version != self.versions[name] and keep is None):
                raise PurityError(f"backend {backend.name!r} ({backend.kind}, {backend.phase}) wrote into its "
                                  f"view {name!r}: backends return writes and never change the storage they read")


def split_inputs(inputs, rows: slice, lanes: slice, part: Batch):
    """One part of a mixed step's layer inputs (``part`` its batch): every field whose first dimension is the
    step's tokens (``T``) at ``rows``, every one of its requests (``B``) at ``lanes``, nested inputs alike; a
    field with a ``for_part(batch, rows, lanes)`` method (per-step metadata that names lanes) is asked for its
    own; the rest (weights of the layer) whole."""
    import dataclasses

    from .declare import field_dims

    cut = {}
    for f in dataclasses.fields(inputs):
        value = getattr(inputs, f.name)
        if callable(getattr(value, "for_part", None)):
            cut[f.name] = value.for_part(part, rows, lanes)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type) and f.name != "meta":
            cut[f.name] = split_inputs(value, rows, lanes, part)
    for name, dims in field_dims(type(inputs)):
        value = getattr(inputs, name)
        if isinstance(value, torch.Tensor) and dims and dims[0] in ("T", "B"):
            cut[name] = value[rows if dims[0] == "T" else lanes]
    return replace(inputs, **cut)


def join_parts(layer: int, a, b):
    """The outputs of a mixed step's two parts, joined along their first dimension (tokens)."""
    la, spec_a = optree.tree_flatten(a, namespace="fnattn", none_is_leaf=True)
    lb, spec_b = optree.tree_flatten(b, namespace="fnattn", none_is_leaf=True)
    if spec_a != spec_b:
        fail("AttentionSession.forward", f"layer {layer}'s outputs", "the same structure from its decode and "
             "prefill backends (a mixed step joins them)", f"{type(a).__name__} and {type(b).__name__}")
    return optree.tree_unflatten(spec_a, [_join(layer, x, y) for x, y in zip(la, lb)])


def join_writes(layer: int, a, b):
    if a is None and b is None:
        return None
    if a is None or b is None or set(a.values) != set(b.values):
        fail("AttentionSession.forward", f"layer {layer}'s writes", "the same storage names from its decode and "
             "prefill backends (a mixed step joins them)",
             (None if a is None else sorted(a.values), None if b is None else sorted(b.values)))
    return Writes({name: _join(layer, a[name], b[name]) for name in a.values})


def _join(layer: int, x, y):
    if x is None and y is None:
        return None
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape[1:] == y.shape[1:] \
            and x.dtype == y.dtype:
        return torch.cat([x, y])
    fail("AttentionSession.forward", f"layer {layer}'s outputs", "tensors of the same row shape and dtype from "
         "its decode and prefill backends, or None from both (a mixed step joins them)",
         (_shape(x), _shape(y)))


def _shape(x):
    return (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
