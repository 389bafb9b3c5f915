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
    def __init__(self, model_attention, state, batch: Batch):
        self.model_attention = model_attention
        self.state = state
        self.batch = batch
        self.id = next(_sessions)
        self._open = False
        self._closed = False
        self._plans: dict[int, object] = {}
        self._metas: dict = {}  # group -> the StepMeta its layers' inputs carry, from entry on
        self._views: Mapping = {}  # layer -> its Views: the storage's, built once (`State.views`)
        self._dispatch: dict = {}  # layer -> (spec, backend, input types, group), from entry on
        self._lease = None
        self._done: set[int] = set()
        #: layer -> output, for layers that returned replay inputs in a replay-mode verify step
        self.replay_outputs: dict[int, object] = {}
        #: name -> tensor a model built inside the step and declared as a generated lane (`record`)
        self.generated: dict[str, torch.Tensor] = {}

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
        for name, size in ma.page_sizes(batch.phase):  # a backend that serves one page size (FlashMLA: 64)
            if batch.page_size != size:
                fail("AttentionSession", "batch.page_size", f"{size}, the one page size backend {name!r} serves "
                     f"(build the State with page_size={size} or prefer another backend)", batch.page_size)
        check_of_state(state, batch, "AttentionSession")
        self._dispatch = ma.dispatch(batch.phase)
        self._lease = ma.workspace.lease()
        try:
            for group, specs in ma.groups(batch.phase).items():
                backend = ma.backend(specs[0].index, batch.phase)
                self._plans[group] = backend.plan(specs, batch, self._lease) if backend.plan else None
        except BaseException:
            self._lease.release()
            self._closed = True
            raise
        # One StepMeta per group (frozen: its layers share it) and the storage's views, looked up per layer.
        self._metas = {group: StepMeta(batch=batch, plan=plan, workspace=self._lease)
                       for group, plan in self._plans.items()}
        self._metas.setdefault(None, StepMeta(batch=batch, plan=None, workspace=self._lease))
        storage = state.storage
        self._views = storage.views  # filled by `State.views`, shared by every session over this storage
        self._device = state.device
        if batch.ring:
            storage.lend_ring(batch.state_version, self.id)
        self._open = True
        return self

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
        spec, backend, expected, group = entry
        if backend is None:
            ma.backend(layer, batch.phase)  # raises, saying why no backend serves it
        if not isinstance(inputs, expected):
            fail("AttentionSession.forward", "inputs",
                 f"{' or '.join(t.__name__ for t in expected)} (layer {layer} is {spec.kind})",
                 type(inputs).__name__)
        inputs.validate(spec, batch, self._device)
        meta = self._metas.get(group) or self._metas[None]
        state = self.state
        state.check_live()
        views = self._views.get(layer)
        if views is None:
            views = state.views(layer)
        if CHECKS_ENABLED and not capturing():
            with debug_check():
                watch = _Watch(self.state, layer, views, batch)
        else:
            watch = None
        result = backend.fn(spec, views, replace(inputs, meta=meta))
        if watch is not None:
            with debug_check():
                watch.check(backend)
        self._done.add(layer)
        if not isinstance(result, tuple) or len(result) != 2:
            fail(f"backend {backend.name!r} ({spec.kind}, {batch.phase})", "return", "a pair (outputs, writes)",
                 type(result).__name__)
        out, writes = result
        if writes is not None and not isinstance(writes, Writes):
            fail(f"backend {backend.name!r} ({spec.kind}, {batch.phase})", "writes",
                 "fnattn.writes(...) or None", type(writes).__name__)
        if writes is not None:
            writes = writes.bound(layer=layer, step=batch.step_id, session=self.id)
        if batch.recovery == "replay" and getattr(out, "replay", None) is not None:
            self.replay_outputs[layer] = out
        return out, writes


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


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
