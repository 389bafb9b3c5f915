"""Backend registry: (kind, phase, name) -> a pure function plus what it accepts.

A backend is ``fn(spec, views, inputs) -> (outputs, deltas)``. Its ``supports``
predicate returns the reasons it refuses a layer on a device (empty: accepted),
so `ModelAttention.explain()` can say why a faster backend was not chosen. An
optional ``plan(specs, batch, lease)`` builds per-step metadata once for a
group of layers that share it (``lease`` is the session's workspace lease).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .batch import PHASES
from .spec import KINDS, LayerSpec

Supports = Callable[[LayerSpec, torch.device], list[str]]
Planner = Callable[[tuple[LayerSpec, ...], Any, Any], Any]


def _always(spec: LayerSpec, device: torch.device) -> list[str]:
    return []


@dataclass(frozen=True)
class Backend:
    kind: str
    phase: str
    name: str
    fn: Callable = field(repr=False)
    supports: Supports = field(default=_always, repr=False)
    plan: Planner | None = field(default=None, repr=False)


_REGISTRY: dict[tuple[str, str, str], Backend] = {}


def register(kind: str, phase: str, name: str, *, supports: Supports | None = None, plan: Planner | None = None):
    """Decorator: register ``fn`` as backend ``name`` for one (kind, phase)."""
    if kind not in KINDS:
        raise ValueError(f"register: `kind` must be one of {KINDS}, got {kind!r}")
    if phase not in PHASES:
        raise ValueError(f"register: `phase` must be one of {PHASES}, got {phase!r}")

    def deco(fn):
        key = (kind, phase, name)
        if key in _REGISTRY and _REGISTRY[key].fn is not fn:
            raise ValueError(f"register: backend {key} is already registered")
        _REGISTRY[key] = Backend(kind, phase, name, fn, supports or _always, plan)
        return fn

    return deco


def lookup(kind: str, phase: str, name: str) -> Backend:
    _load_builtin()
    try:
        return _REGISTRY[(kind, phase, name)]
    except KeyError:
        raise LookupError(f"no backend {name!r} registered for kind {kind!r}, phase {phase!r}; "
                          f"known: {backend_names(kind, phase)}") from None


def backend_names(kind: str, phase: str) -> list[str]:
    _load_builtin()
    return sorted(n for (k, p, n) in _REGISTRY if k == kind and p == phase)


def all_backends() -> list[Backend]:
    _load_builtin()
    return list(_REGISTRY.values())


def _load_builtin() -> None:
    # Importing the package registers every built-in backend; fast backends
    # import their GPU libraries lazily, so this stays cheap on a CPU.
    from . import backends  # noqa: F401
