"""AttentionSession: the only way to execute attention for one step.

    with model_attention.session(state, batch) as s:
        out, deltas = s.forward(layer, inputs)

On entry it checks the state and batch against the specs, builds each group's
plan once and leases the workspace; `forward` validates a layer's inputs and
calls its backend with read-only views; after exit every call raises
`SessionClosedError`.
"""

from __future__ import annotations

from dataclasses import replace

from .batch import PHASES, Batch
from .checks import fail
from .errors import SessionClosedError
from .inputs import INPUTS_BY_KIND, StepMeta


class AttentionSession:
    def __init__(self, model_attention, state, batch: Batch):
        self.model_attention = model_attention
        self.state = state
        self.batch = batch
        self._open = False
        self._closed = False
        self._plans: dict[int, object] = {}
        self._lease = None
        #: layer -> output, for layers that returned replay inputs in a replay-mode verify step
        self.replay_outputs: dict[int, object] = {}

    # ---------------------------------------------------------------- context
    def __enter__(self) -> "AttentionSession":
        if self._closed or self._open:
            raise SessionClosedError("an AttentionSession can be entered once")
        ma, state, batch = self.model_attention, self.state, self.batch
        if not isinstance(batch, Batch):
            fail("AttentionSession", "batch", "a Batch", type(batch).__name__)
        if batch.phase not in PHASES:
            fail("AttentionSession", "batch.phase", f"one of {PHASES}", batch.phase)
        if batch.state_version != state.version:  # also raises if the state handle is stale
            fail("AttentionSession", "batch",
                 f"a batch built from this state (version {state.version})", f"version {batch.state_version}")
        for spec in ma.specs:
            if state.spec(spec.index) != spec:
                fail("AttentionSession", "state", f"storage for layer {spec.index} as {spec}", state.spec(spec.index))
        if batch.page_size != state.page_size:
            fail("AttentionSession", "batch.page_size", f"the state's page size {state.page_size}", batch.page_size)
        if batch.block_table.device != state.device:
            fail("AttentionSession", "batch", f"tensors on {state.device}", batch.block_table.device)
        self._lease = ma.workspace.lease()
        try:
            for group, specs in ma.groups(batch.phase).items():
                backend = ma.backend(specs[0].index, batch.phase)
                self._plans[group] = backend.plan(specs, batch, self._lease) if backend.plan else None
        except BaseException:
            self._lease.release()
            self._closed = True
            raise
        self._open = True
        return self

    def __exit__(self, *exc) -> None:
        self._open = False
        self._closed = True
        if self._lease is not None:
            self._lease.release()

    # ---------------------------------------------------------------- forward
    def forward(self, layer: int, inputs):
        """Run one layer's backend for this step: ``-> (outputs, deltas)``."""
        if not self._open:
            raise SessionClosedError(
                f"forward(layer={layer}) outside an open session: sessions are single-use context managers"
            )
        ma, batch = self.model_attention, self.batch
        if layer not in ma.spec_by_layer:
            fail("AttentionSession.forward", "layer", f"one of {sorted(ma.spec_by_layer)}", layer)
        spec = ma.spec_by_layer[layer]
        backend = ma.backend(layer, batch.phase)
        expected = INPUTS_BY_KIND.get(spec.kind)
        if expected is None or not isinstance(inputs, expected):
            fail("AttentionSession.forward", "inputs",
                 f"{expected.__name__ if expected else 'inputs'} (layer {layer} is {spec.kind})", type(inputs).__name__)
        inputs.validate(spec, batch, self.state.device)
        group = ma.choices[(layer, batch.phase)].group
        meta = StepMeta(batch=batch, plan=self._plans.get(group), workspace=self._lease)
        out, deltas = backend.fn(spec, self.state.views(layer), replace(inputs, meta=meta))
        if batch.recovery == "replay" and getattr(out, "replay", None) is not None:
            self.replay_outputs[layer] = out
        return out, deltas
