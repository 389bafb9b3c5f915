"""Per-kind layer inputs and outputs passed through a session to a backend.

Callers fill the activations; the session fills ``meta`` (the step's batch and
the group's plan) before the backend sees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from .checks import fail


@dataclass(frozen=True)
class StepMeta:
    batch: Any  # the step's Batch
    plan: Any = None  # the backend's plan for this layer's group, if it makes one
    workspace: Any = None  # the session's workspace lease


def _check(where: str, name: str, t: Tensor, shape: tuple, dtype: torch.dtype, device) -> None:
    if not isinstance(t, Tensor):
        fail(where, name, "a torch.Tensor", type(t).__name__)
    if tuple(t.shape) != shape:
        fail(where, name, f"shape {shape}", tuple(t.shape))
    if t.dtype != dtype:
        fail(where, name, f"dtype {dtype}", t.dtype)
    if t.device != device:
        fail(where, name, f"a tensor on {device}", t.device)


@dataclass(frozen=True)
class FullAttentionInputs:
    q: Float[Tensor, "T Hq D"]  # [T, Hq, D], rope applied
    k: Float[Tensor, "T Hkv D"]  # [T, Hkv, D], rope applied
    v: Float[Tensor, "T Hkv Dv"]  # [T, Hkv, Dv]
    sinks: Float[Tensor, " Hq"] | None = None  # [Hq] sink logits when the config has sinks
    meta: StepMeta | None = field(default=None, repr=False)

    def validate(self, spec, batch, device) -> None:
        c, T, where = spec.config, batch.num_tokens, f"layer {spec.index} inputs"
        _check(where, "q", self.q, (T, c.num_q_heads, c.head_dim), spec.dtype, device)
        _check(where, "k", self.k, (T, c.num_kv_heads, c.head_dim), spec.dtype, device)
        _check(where, "v", self.v, (T, c.num_kv_heads, c.head_dim_v), spec.dtype, device)
        if c.sinks:
            if self.sinks is None:
                fail(where, "sinks", f"a [{c.num_q_heads}] tensor (config has sinks=True)", None)
            _check(where, "sinks", self.sinks, (c.num_q_heads,), self.sinks.dtype, device)
        elif self.sinks is not None:
            fail(where, "sinks", "None (config has sinks=False)", tuple(self.sinks.shape))


@dataclass(frozen=True)
class AttentionOutput:
    o: Float[Tensor, "T Hq Dv"]  # [T, Hq, Dv] in the layer dtype
    lse: Float[Tensor, "T Hq"] | None = None  # [T, Hq] fp32 natural-log LSE, without sinks
