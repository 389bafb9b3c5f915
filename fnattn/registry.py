"""Backend registry: (kind, phase, name) -> a pure function plus what it accepts.

A backend is ``fn(spec, views, inputs) -> (outputs, writes)`` for one phase of
one registered kind (`fnattn.register_kind`):

* ``views``: the layer's storage by the names its kind declared, read-only;
* ``inputs``: the kind's inputs, with ``inputs.meta.batch`` (the step's
  `Batch`: positions, cache lengths, page table, recurrent rows...),
  ``inputs.meta.plan`` (what ``plan`` built) and ``inputs.meta.workspace``;
* ``writes``: ``fnattn.writes(name=rows, ...)``, one entry per storage tensor
  of the layer (None for a layer that writes nothing this phase).

``supports(spec, device)`` returns the reasons a backend refuses a layer
(empty: accepted), so `ModelAttention.explain()` says why a faster one was
not chosen. ``plan(specs, batch, lease)`` builds per-step metadata once for a
group of layers that share it. A registered function runs only through a
session (`ModelAttention.session`), which validates everything around it:
calling the decorated name directly raises. Under ``FNATTN_CHECKS=1`` its
jaxtyping annotations are checked on every call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .batch import PHASES
from .checks import checked, fail
from .declare import kind_info, known_kinds
from .errors import OutsideSessionError
from .spec import LayerSpec

Supports = Callable[[LayerSpec, torch.device], list[str]]
Planner = Callable[[tuple[LayerSpec, ...], Any, Any], Any]


def _always(spec: LayerSpec, device: torch.device) -> list[str]:
    return []


@dataclass(frozen=True)
class Backend:
    kind: str
    phase: str
    name: str
    fn: Callable = field(repr=False)  # the checked function the session calls
    supports: Supports = field(default=_always, repr=False)
    plan: Planner | None = field(default=None, repr=False)
    builtin: bool = True  # shipped with fnattn (ranked by DEFAULT_PREFER) or registered by a user
    source: Callable | None = field(default=None, repr=False)  # the function as written
    # reads no device value on the host and launches shapes fixed by the batch's shapes: a graph may hold it
    capturable: bool = False
    page_size: int | None = None  # the one page size it serves (FlashMLA's 64); None: any
    # honours the invariant mode (`fnattn.kernels.invariant`): while it is on, a token's result depends only on
    # its own context, whatever shares its step; a backend that does not is refused while the mode is on
    invariant: bool = False

    def __post_init__(self):
        if self.phase not in PHASES:
            fail("Backend", "phase", f"one of {PHASES}", self.phase)
        if not callable(self.fn):
            fail("Backend", "fn", "a callable (spec, views, inputs) -> (outputs, writes)", self.fn)


_REGISTRY: dict[tuple[str, str, str], Backend] = {}


def register(kind: str, phase: str, name: str, *, supports: Supports | None = None, plan: Planner | None = None,
             replace: bool = False, capturable: bool = False, page_size: int | None = None,
             invariant: bool = False):
    """Decorator: register ``fn`` as backend ``name`` for one (kind, phase).

    ``replace=True`` lets a notebook cell re-register its backend. ``capturable=True`` declares that the
    backend (and its ``plan``) never reads a device value on the host and launches work whose shapes depend
    only on the batch's tensor shapes, so `fnattn.graph` may capture it in a CUDA graph. ``page_size``: the
    one page size the backend serves: a session refuses a batch of any other, naming it, and a State for it
    is built with that size (`ModelAttention.page_size` says which a model's chosen backends need).
    ``invariant=True`` declares that while the invariant mode is on (`fnattn.kernels.invariant`) the backend
    computes each token's result in an order that depends only on that token's own context: not on the other
    tokens or requests of the step, its bucket, its phase or whether it is captured. A `ModelAttention` built
    while the mode is on refuses the backends that do not declare it.
    """
    if kind not in known_kinds():
        fail("register", "kind", f"a registered kind (known: {list(known_kinds())}; add one with "
             "fnattn.register_kind)", kind)
    if phase not in PHASES:
        fail("register", "phase", f"one of {PHASES}", phase)
    if not isinstance(name, str) or not name:
        fail("register", "name", "a non-empty string", name)
    for what, flag in (("capturable", capturable), ("invariant", invariant)):
        if not isinstance(flag, bool):
            fail("register", what, "a bool", flag)
    if page_size is not None and (isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1):
        fail("register", "page_size", "a positive int or None", page_size)
    for what, f in (("supports", supports), ("plan", plan)):
        if f is not None and not callable(f):
            fail("register", what, "a callable or None", f)

    def deco(fn):
        if not callable(fn):
            fail("register", "fn", "a function (spec, views, inputs) -> (outputs, writes)", fn)
        key = (kind, phase, name)
        old = _REGISTRY.get(key)
        if old is not None and old.source is not fn and not replace:
            raise ValueError(f"register: backend {key} is already registered (by {old.source.__module__}); "
                             "pass replace=True to redefine it")
        builtin = getattr(fn, "__module__", "").startswith("fnattn.") and kind_info(kind).builtin
        _REGISTRY[key] = Backend(kind, phase, name, checked(fn), supports or _always, plan, builtin, fn, capturable,
                                 page_size, invariant)
        return _session_only(fn, key)

    return deco


def _session_only(fn, key):
    @functools.wraps(fn)
    def guard(*args, **kwargs):
        raise OutsideSessionError(
            f"backend {key} runs only inside a session, which validates its inputs and writes: "
            "`with ModelAttention(specs).session(state, batch) as s: s.forward(layer, inputs)`")

    guard.backend_key = key
    return guard


def lookup(kind: str, phase: str, name: str) -> Backend:
    try:
        return _REGISTRY[(kind, phase, name)]
    except KeyError:
        raise LookupError(f"no backend {name!r} registered for kind {kind!r}, phase {phase!r}; "
                          f"known: {backend_names(kind, phase)}") from None


def backend_names(kind: str | None = None, phase: str | None = None) -> list[str]:
    return sorted({n for (k, p, n) in _REGISTRY if (kind is None or k == kind) and (phase is None or p == phase)})


def all_backends() -> list[Backend]:
    return list(_REGISTRY.values())
