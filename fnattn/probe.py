"""Numeric probes: run one layer through several backends and compare.

Every backend runs through the same session entry as a real step, against the
same state and batch (which no backend changes), and is compared with the
reference backend: max abs and max relative error of outputs and deltas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import optree
import torch

from .model_attention import ModelAttention


@dataclass(frozen=True)
class ProbeRow:
    backend: str
    max_abs: float  # over outputs and delta tensors
    max_rel: float  # max_abs / max |reference|


@dataclass(frozen=True)
class ProbeReport:
    layer: int
    phase: str
    rows: tuple[ProbeRow, ...]

    def __str__(self) -> str:
        lines = [f"probe layer {self.layer} ({self.phase})", f"{'backend':<14}{'max abs':>12}{'max rel':>12}"]
        lines += [f"{r.backend:<14}{r.max_abs:>12.3e}{r.max_rel:>12.3e}" for r in self.rows]
        return "\n".join(lines)


def _leaves(tree):
    return [x for x in optree.tree_leaves(tree, namespace="fnattn") if isinstance(x, torch.Tensor)]


def probe(spec, *, state, batch, inputs, backends: Sequence[str] = ("reference",)) -> ProbeReport:
    """Compare ``backends`` against the reference on one layer of one step."""
    results = {}
    for name in dict.fromkeys(("reference", *backends)):
        ma = ModelAttention([spec], prefer=(name,), device=state.device, phases=(batch.phase,))
        with ma.session(state, batch) as s:
            out, deltas = s.forward(spec.index, inputs)
        if not _leaves(out):  # an unregistered output type would flatten to nothing and compare nothing
            raise TypeError(f"probe: backend {name!r} returned {type(out).__name__}, which is not a pytree of "
                            "tensors (register it with optree, namespace 'fnattn'); its outputs cannot be compared")
        results[name] = _leaves((out, deltas))
    ref = results["reference"]
    rows = []
    for name in backends:
        got = results[name]
        if len(got) != len(ref):
            raise ValueError(f"probe: backend {name!r} returned {len(got)} tensors, the reference {len(ref)}")
        abs_err, scale = 0.0, 0.0
        for a, b in zip(got, ref):
            if a.is_floating_point():
                abs_err = max(abs_err, (a.float() - b.float()).abs().max().item() if a.numel() else 0.0)
                scale = max(scale, b.float().abs().max().item() if b.numel() else 0.0)
            elif not torch.equal(a, b):
                abs_err = float("inf")
        rows.append(ProbeRow(name, abs_err, abs_err / scale if scale else abs_err))
    return ProbeReport(spec.index, batch.phase, tuple(rows))
