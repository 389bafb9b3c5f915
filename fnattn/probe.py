"""Numeric probes: run one layer through several backends and compare.

Every backend runs through the same session entry as a real step, against the
same state and batch (which no backend changes), and is compared with a
reference: the registered ``"reference"`` backend by default, or any other
backend name or function (a researcher's own ground truth). What is compared
is what a step leaves: the outputs, and the rows of the layer's storage after
the step's writes are applied (to a copy), so a backend that writes its new
states into spare ring rows compares with one that returns them as values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import optree
import torch

from .checks import fail
from .deltas import StepDeltas
from .model_attention import ModelAttention
from .registry import Backend


@dataclass(frozen=True)
class ProbeRow:
    backend: str
    max_abs: float  # over outputs and the storage rows the step leaves
    max_rel: float  # max_abs / max |reference|


@dataclass(frozen=True)
class ProbeReport:
    layer: int
    phase: str
    reference: str
    rows: tuple[ProbeRow, ...]

    def __str__(self) -> str:
        lines = [f"probe layer {self.layer} ({self.phase}) against {self.reference}",
                 f"{'backend':<14}{'max abs':>12}{'max rel':>12}"]
        lines += [f"{r.backend:<14}{r.max_abs:>12.3e}{r.max_rel:>12.3e}" for r in self.rows]
        return "\n".join(lines)


def _leaves(tree):
    return [x for x in optree.tree_leaves(tree, namespace="fnattn") if isinstance(x, torch.Tensor)]


def _left_rows(state, spec, batch, writes) -> list[torch.Tensor]:
    """The rows of the layer's storage the step leaves: each new token's, each request's current state."""
    if writes is None:
        return []
    deltas = StepDeltas.collect(batch, [writes])
    after = state._apply(deltas, inplace=False, layers={spec.index})
    views = after.views(spec.index)
    rows = [after.recurrent_row(r) for r in batch.request_ids]
    left = []
    for name, space in state.storage_spaces[spec.index].items():
        t = views[name]
        if space == "token":
            left.append(t.flatten(0, 1).index_select(0, batch.slot_mapping))
        else:
            left.append(t[rows])
    return left


def probe(spec, *, state, batch, inputs, backends: Sequence[str] = ("reference",),
          reference: str | Callable = "reference") -> ProbeReport:
    """Compare ``backends`` with ``reference`` on one layer of one step.

    ``reference``: a registered backend name, or a function
    ``(spec, views, inputs) -> (outputs, writes)`` of the layer's kind.
    """
    if isinstance(backends, str) or not all(isinstance(b, str) for b in backends):
        fail("probe", "backends", "a sequence of backend names", backends)
    if callable(reference):
        ref = Backend(spec.kind, batch.phase, getattr(reference, "__name__", "reference"), reference,
                      builtin=False, source=reference)
        ref_name = f"{ref.name} (given)"
    elif isinstance(reference, str):
        ref, ref_name = reference, reference
    else:
        fail("probe", "reference", "a backend name or a function (spec, views, inputs) -> (outputs, writes)",
             reference)
    results = {}
    for label, choice in ((ref_name, ref), *((name, name) for name in backends)):
        ma = ModelAttention([spec], prefer=(choice,), device=state.device, phases=(batch.phase,))
        with ma.session(state, batch) as s:
            out, writes = s.forward(spec.index, inputs)
        if not _leaves(out):  # an unregistered output type would flatten to nothing and compare nothing
            raise TypeError(f"probe: backend {label!r} returned {type(out).__name__}, which is not a pytree of "
                            "tensors (register it with optree, namespace 'fnattn'); its outputs cannot be compared")
        results[label] = _leaves(out) + _left_rows(state, spec, batch, writes)
    want = results[ref_name]
    rows = []
    for name in backends:
        got = results[name]
        if len(got) != len(want):
            raise ValueError(f"probe: backend {name!r} left {len(got)} tensors (outputs and storage rows), "
                             f"the reference {len(want)}")
        abs_err, scale = 0.0, 0.0
        for a, b in zip(got, want):
            if a.shape != b.shape:
                abs_err = float("inf")
            elif a.is_floating_point():
                abs_err = max(abs_err, (a.float() - b.float()).abs().max().item() if a.numel() else 0.0)
                scale = max(scale, b.float().abs().max().item() if b.numel() else 0.0)
            elif not torch.equal(a, b):
                abs_err = float("inf")
        rows.append(ProbeRow(name, abs_err, abs_err / scale if scale else abs_err))
    return ProbeReport(spec.index, batch.phase, ref_name, tuple(rows))
