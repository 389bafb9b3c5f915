"""Layer specs: the frozen, typed description of one attention layer.

A backend reads nothing about the model but its `LayerSpec`: the layer's
index, its kind's frozen config and its dtype. Config classes live with their
kind (`fnattn.kinds.<kind>`, or a researcher's own module registered with
`fnattn.register_kind`); invariants are checked at construction and an error
names the offending field. Specs are hashable (they key plans and groups) and
are registered with optree (namespace ``"fnattn"``) as leaves-free pytree
nodes, so a tree of specs and tensors flattens to just the tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .checks import fail
from .declare import DTYPES, is_kind_config, known_kinds, static_pytree


def positive(obj, *names: str) -> None:
    """Each named field of ``obj`` is a positive int (the error names the field)."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            fail(type(obj).__name__, name, "a positive int", value)


def non_negative(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            fail(type(obj).__name__, name, "a non-negative number", value)


def default_scale(obj, head_dim: int) -> None:
    """Fill ``obj.scale`` with ``head_dim ** -0.5`` when None, else check it is a positive finite float."""
    if obj.scale is None:
        object.__setattr__(obj, "scale", head_dim**-0.5)
    elif isinstance(obj.scale, bool) or not (isinstance(obj.scale, (int, float)) and math.isfinite(obj.scale)
                                              and obj.scale > 0):
        fail(type(obj).__name__, "scale", "a positive finite float or None", obj.scale)
    else:
        object.__setattr__(obj, "scale", float(obj.scale))


def state_dtype(obj, name: str = "state_dtype") -> None:
    if getattr(obj, name) not in DTYPES:
        fail(type(obj).__name__, name, f"one of {DTYPES}", getattr(obj, name))


@static_pytree
@dataclass(frozen=True)
class LayerSpec:
    """One attention layer: its index in the model, its kind's typed config, its dtype."""

    index: int
    config: Any  # the frozen config of a registered kind
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            fail("LayerSpec", "index", "a non-negative int", self.index)
        known = known_kinds()
        if not is_kind_config(self.config):
            fail("LayerSpec", "config", f"the config of a registered kind (known: {list(known)})",
                 type(self.config).__name__)
        if self.dtype not in DTYPES:
            fail("LayerSpec", "dtype", f"one of {DTYPES}", self.dtype)

    @property
    def kind(self) -> str:
        return self.config.kind
