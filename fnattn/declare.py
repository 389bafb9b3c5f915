"""Kinds: what an attention kind declares, and the registry of kinds.

The core names no kind. A kind (built in under `fnattn.kinds`, or a
researcher's own, from any module) declares in one place:

* its frozen config, with ``kind`` naming it and ``storage(dtype)`` listing
  what `State` allocates for one layer (`per_token` rows live in pages,
  `per_request` rows in recurrent slots, with a ring of rows per slot);
* the inputs class its backends take (`validate` checks one step's tensors);
* one reference backend per phase (`fnattn.register`), then faster ones.

`register_kind` does the registration; the `kind` and `inputs` decorators are
the short way to write a whole new kind as one file (docs/variants.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import optree
import torch
from torch import Tensor

from .checks import fail

SPACES = ("token", "request")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class StorageDecl:
    """One storage tensor a layer owns: rows per token (in pages) or per request (in slots)."""

    name: str  # the view name backends read it by, and the key of its write values
    space: str  # "token": one row per cached token; "request": one row per recurrent slot (and ring row)
    shape: tuple[int, ...]  # one row's shape
    dtype: torch.dtype
    pool: str  # layers whose declarations under one pool label are equal share one pool tensor

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            fail("StorageDecl", "name", "an identifier", self.name)
        if self.space not in SPACES:
            fail("StorageDecl", "space", f"one of {SPACES}", self.space)
        shape = tuple(self.shape) if isinstance(self.shape, (tuple, list, torch.Size)) else self.shape
        if not isinstance(shape, tuple) or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                                    for n in shape):
            fail("StorageDecl", "shape", "a tuple of positive ints", self.shape)
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.dtype, torch.dtype):
            fail("StorageDecl", "dtype", "a torch.dtype", self.dtype)
        if not isinstance(self.pool, str) or not self.pool:
            fail("StorageDecl", "pool", "a non-empty string", self.pool)


def per_token(name: str, shape, dtype: torch.dtype, *, pool: str = "") -> StorageDecl:
    """Rows written for every new token, kept while the request lives (K/V, latents, index keys)."""
    return StorageDecl(name, "token", tuple(shape), dtype, pool or name)


def per_request(name: str, shape, dtype: torch.dtype, *, pool: str = "") -> StorageDecl:
    """One row per request, replaced by every step (recurrent state, conv windows)."""
    return StorageDecl(name, "request", tuple(shape), dtype, pool or name)


@dataclass(frozen=True)
class KindInfo:
    name: str
    config: type  # the frozen config class (has ``kind`` and ``storage(dtype)``)
    inputs: tuple[type, ...]  # the inputs classes its backends accept
    builtin: bool


_KINDS: dict[str, KindInfo] = {}
_DECLARED: dict[str, type] = {}  # configs declared with `kind`, waiting for their `inputs`


def register_kind(name: str, *, config: type, inputs, replace: bool = False) -> KindInfo:
    """Make ``name`` a kind: `LayerSpec`, `State`, sessions and the registry then accept it.

    ``replace=True`` lets a notebook cell that defines a kind run again.
    """
    if not isinstance(name, str) or not name.isidentifier():
        fail("register_kind", "name", "an identifier", name)
    if not isinstance(config, type) or not dataclasses.is_dataclass(config):
        fail("register_kind", "config", "a frozen dataclass type", config)
    if not config.__dataclass_params__.frozen:
        fail("register_kind", "config", "a frozen dataclass (specs are hashable values)", config.__name__)
    if getattr(config, "kind", None) != name:
        fail("register_kind", "config", f"a class whose `kind` is {name!r}", getattr(config, "kind", None))
    if not callable(getattr(config, "storage", None)):
        fail("register_kind", "config", "a class with a storage(dtype) method", config.__name__)
    types = inputs if isinstance(inputs, tuple) else (inputs,)
    if not all(isinstance(t, type) and callable(getattr(t, "validate", None)) for t in types):
        fail("register_kind", "inputs", "an inputs class with validate(spec, batch, device), or a tuple of them "
             "(empty for a kind with no backends yet)", inputs)
    old = _KINDS.get(name)
    if old is not None and not replace and (old.config is not config or old.inputs != types):
        raise ValueError(f"register_kind: kind {name!r} is already registered (by {old.config.__module__}); "
                         "pass replace=True to redefine it")
    info = KindInfo(name, config, types, builtin=config.__module__.startswith("fnattn."))
    _KINDS[name] = info
    return info


# The built-in kinds register themselves like any other (the kinds build on this module, which names none of
# them): the package `fnattn` imports them before it hands out any public name, `import fnattn.kinds` does too.


def kind_info(name: str) -> KindInfo:
    """The registered kind ``name``: its config class, its inputs classes, whether it is built in."""
    if name not in _KINDS:
        fail("fnattn", "kind", f"a registered kind (known: {sorted(_KINDS)})", name)
    return _KINDS[name]


def known_kinds() -> tuple[str, ...]:
    """The names of the registered kinds, sorted."""
    return tuple(sorted(_KINDS))


def is_kind_config(obj) -> bool:
    info = _KINDS.get(getattr(type(obj), "kind", None))
    return info is not None and isinstance(obj, info.config)


# --------------------------------------------------------------------------- field checks


def check_fields(obj) -> None:
    """Check each field against its annotation (int, float, bool, dtype, optional); errors name the field."""
    hints = typing.get_type_hints(type(obj))
    owner = type(obj).__name__
    for f in dataclasses.fields(obj):
        want = hints.get(f.name)
        value = getattr(obj, f.name)
        args = typing.get_args(want)
        optional = type(None) in args
        if optional and value is None:
            continue
        base = next((a for a in args if a is not type(None)), want) if optional else want
        if base is int:
            if isinstance(value, bool) or not isinstance(value, int):
                fail(owner, f.name, "an int" + (" or None" if optional else ""), value)
        elif base is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                fail(owner, f.name, "a finite number" + (" or None" if optional else ""), value)
            object.__setattr__(obj, f.name, float(value))
        elif base is bool:
            if not isinstance(value, bool):
                fail(owner, f.name, "a bool", value)
        elif base is torch.dtype:
            if not isinstance(value, torch.dtype):
                fail(owner, f.name, "a torch.dtype", value)


def static_pytree(cls):
    """Register a frozen dataclass with no tensor leaves under namespace fnattn."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    optree.register_pytree_node(
        cls,
        lambda obj: ((), tuple(getattr(obj, n) for n in names), None),
        lambda aux, _children: cls(**dict(zip(names, aux))),
        namespace="fnattn",
    )
    return cls


def tensor_pytree(cls):
    """Register a dataclass whose every field is a child (tensors, None, nested inputs)."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    optree.register_pytree_node(
        cls,
        lambda obj: (tuple(getattr(obj, n) for n in names), None, names),
        lambda _, children: cls(**dict(zip(names, children))),
        namespace="fnattn",
    )
    return cls


def kind(name: str, *, replace: bool = False):
    """Class decorator: a frozen, hashable, optree-registered config of kind ``name``.

    Fields are checked against their annotations (int, float, bool, dtype) at
    construction, then the class's own ``__post_init__`` runs. Register its
    inputs with `inputs`. A config without ``storage`` owns no storage.
    """

    def deco(cls):
        own_post = cls.__dict__.get("__post_init__")

        def __post_init__(self):
            check_fields(self)
            if own_post is not None:
                own_post(self)

        cls.__post_init__ = __post_init__
        cls.kind = name
        cls.__annotations__ = {"kind": ClassVar[str], **cls.__dict__.get("__annotations__", {})}
        if not hasattr(cls, "storage"):
            cls.storage = lambda self, dtype: ()
        cls = static_pytree(dataclass(frozen=True)(cls))
        cls._fnattn_replace = replace
        _DECLARED[name] = cls
        return cls

    return deco


@dataclass(frozen=True)
class StepMeta:
    """What the session adds to a layer's inputs before its backend sees them."""

    batch: Any  # the step's Batch
    plan: Any = None  # the backend's plan for this layer's group, if it makes one
    workspace: Any = None  # the session's workspace lease


def inputs(name: str):
    """Class decorator: the inputs of kind ``name`` (registers the kind with its config).

    Adds the ``meta`` field the session fills, and a ``validate`` that checks
    every tensor field: on the State's device, and jaxtyping dimensions
    consistent across fields, with ``T`` the step's new tokens and ``B`` its
    requests. A class may define its own ``validate(spec, batch, device)``.
    """

    def deco(cls):
        ann = dict(cls.__dict__.get("__annotations__", {}))
        if "meta" not in ann:
            # An object, not a string: it resolves whatever the user's module imported.
            ann["meta"] = typing.Optional[StepMeta]  # noqa: UP045 - a runtime object on every Python
            cls.meta = dataclasses.field(default=None, repr=False)
            cls.__annotations__ = ann
        if "validate" not in cls.__dict__:
            cls.validate = validate_tensor_fields
        cls = tensor_pytree(dataclass(frozen=True)(cls))
        config = _DECLARED.get(name)
        if config is None:
            fail("fnattn.inputs", "name", "a kind whose config was declared with @fnattn.kind first", name)
        old = _KINDS.get(name)
        # A re-run notebook cell redefines its own kind; a built-in one needs replace=True on its config.
        register_kind(name, config=config, inputs=cls,
                      replace=config._fnattn_replace or old is None or not old.builtin or old.config is config)
        return cls

    return deco


def _dims(annotation) -> tuple[str, ...] | None:
    """The dimension names of a jaxtyping annotation (``Float[Tensor, "T H D"]``), or None."""
    for a in (annotation, *typing.get_args(annotation)):
        dims = getattr(a, "dim_str", None)
        if isinstance(dims, str):
            return tuple(dims.split())
    return None


@functools.cache
def field_dims(cls) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``(field, dims)`` of every jaxtyping-annotated field of an inputs class, resolved once per class
    (type hints are costly to resolve, and validation runs for every layer of every step)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    found = ((f.name, _dims(hints.get(f.name))) for f in dataclasses.fields(cls) if f.name != "meta")
    return tuple((name, dims) for name, dims in found if dims is not None)


def validate_tensor_fields(self, spec, batch, device) -> None:
    """Every tensor field on ``device``; named dims consistent, ``T``/``B`` the batch's."""
    where = f"layer {spec.index} inputs"
    sizes: dict[str, int] = {"T": batch.num_tokens, "B": batch.num_requests}
    for name, dims in field_dims(type(self)):
        value = getattr(self, name)
        if value is None:
            continue
        if not isinstance(value, Tensor):
            fail(where, name, "a torch.Tensor", type(value).__name__)
        if value.device != device:
            fail(where, name, f"a tensor on {device}", value.device)
        named = [d for d in dims if not d.startswith("*") and d != "..."]
        if len(named) == len(dims) and value.dim() != len(dims):
            fail(where, name, f"a {len(dims)}-D tensor [{' '.join(dims)}]", tuple(value.shape))
        for d, n in zip(dims, value.shape):
            if d.startswith("*") or d == "..." or d.isdigit() and int(d) == n:
                continue
            if d.isdigit():
                fail(where, name, f"size {d} in [{' '.join(dims)}]", tuple(value.shape))
            if sizes.setdefault(d, n) != n:
                fail(where, name, f"{d}={sizes[d]} in [{' '.join(dims)}]", tuple(value.shape))


def select_tokens(inputs, keep: Tensor):
    """``inputs`` with every per-token field (first jaxtyping dim ``T``) restricted to rows ``keep``."""
    changes = {}
    for name, dims in field_dims(type(inputs)):
        value = getattr(inputs, name)
        if isinstance(value, Tensor) and dims[0] == "T":
            changes[name] = value.index_select(0, keep)
    return dataclasses.replace(inputs, **changes)
