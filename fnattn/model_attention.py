"""ModelAttention: pick a backend for every (layer, phase), group, bind, explain."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .batch import PHASES
from .errors import NoBackendError
from .registry import Backend, all_backends
from .spec import LayerSpec
from .workspace import Workspace

DEFAULT_PREFER = ("triton", "flashinfer", "sgl_kernel", "fla", "reference")


@dataclass(frozen=True)
class Choice:
    layer: int
    phase: str
    backend: Backend | None
    refused: tuple[tuple[str, tuple[str, ...]], ...]  # (backend name, reasons)
    group: int | None  # layers in one group share one plan per step


class ModelAttention:
    """Binds each layer spec to one backend per phase, by capability and preference.

    ``prefer`` lists backend names in order of preference; names not listed are
    never chosen. Layers of the same config, dtype, phase and backend form one
    group: a backend's plan is built once per group per step.
    """

    def __init__(
        self,
        specs: Iterable[LayerSpec],
        *,
        prefer: Sequence[str] = DEFAULT_PREFER,
        device: str | torch.device = "cpu",
        phases: Sequence[str] = PHASES,
    ):
        self.specs = tuple(specs)
        if not self.specs or not all(isinstance(s, LayerSpec) for s in self.specs):
            raise ValueError(f"ModelAttention: `specs` must be a non-empty sequence of LayerSpec, got {specs!r}")
        if isinstance(prefer, str):
            raise ValueError(f"ModelAttention: `prefer` must be a sequence of backend names, got the string {prefer!r}")
        for p in phases:
            if p not in PHASES:
                raise ValueError(f"ModelAttention: `phases` entries must be in {PHASES}, got {p!r}")
        self.prefer = tuple(prefer)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.spec_by_layer = {s.index: s for s in self.specs}
        rank = {name: i for i, name in enumerate(self.prefer)}
        backends = all_backends()
        group_ids: dict[tuple, int] = {}
        self.choices: dict[tuple[int, str], Choice] = {}
        for spec in self.specs:
            for phase in phases:
                options = sorted(
                    (b for b in backends if b.kind == spec.kind and b.phase == phase and b.name in rank),
                    key=lambda b: rank[b.name],
                )
                refused, chosen = [], None
                for b in options:
                    reasons = tuple(b.supports(spec, self.device))
                    if reasons:
                        refused.append((b.name, reasons))
                    else:
                        chosen = b
                        break
                group = None
                if chosen is not None:
                    key = (phase, chosen.name, spec.config, spec.dtype)
                    group = group_ids.setdefault(key, len(group_ids))
                self.choices[(spec.index, phase)] = Choice(spec.index, phase, chosen, tuple(refused), group)
        self.workspace = Workspace(self.device)

    def backend(self, layer: int, phase: str) -> Backend:
        choice = self.choices.get((layer, phase))
        if choice is None:
            raise ValueError(f"ModelAttention: no layer {layer} / phase {phase!r} here "
                             f"(layers {sorted(self.spec_by_layer)})")
        if choice.backend is None:
            why = "; ".join(f"{n}: {', '.join(r)}" for n, r in choice.refused) or \
                f"no backend named in prefer={self.prefer} is registered for this kind"
            raise NoBackendError(f"layer {layer} ({self.spec_by_layer[layer].kind}), phase {phase!r}: {why}")
        return choice.backend

    def groups(self, phase: str) -> dict[int, tuple[LayerSpec, ...]]:
        out: dict[int, list[LayerSpec]] = {}
        for (layer, p), c in self.choices.items():
            if p == phase and c.group is not None:
                out.setdefault(c.group, []).append(self.spec_by_layer[layer])
        return {g: tuple(s) for g, s in out.items()}

    def session(self, state, batch):
        from .session import AttentionSession

        return AttentionSession(self, state, batch)

    def explain(self) -> str:
        """A table: the backend chosen for every (layer, phase), and who was refused and why."""
        rows = [("layer", "kind", "phase", "backend", "group", "refused")]
        for (layer, phase), c in self.choices.items():
            refused = "; ".join(f"{n} ({', '.join(r)})" for n, r in c.refused) or "-"
            rows.append((str(layer), self.spec_by_layer[layer].kind, phase,
                         c.backend.name if c.backend else "NONE", "-" if c.group is None else str(c.group), refused))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:5], widths)) + "  " + r[5] for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)
