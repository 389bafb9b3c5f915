"""Full / grouped-query attention: config, storage and inputs (its output, `fnattn.outputs.AttentionOutput`, is
shared with the MLA kinds)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from ...checks import check_tensor, fail
from ...declare import StepMeta, per_token, static_pytree, tensor_pytree
from ...spec import default_scale, non_negative, positive


@static_pytree
@dataclass(frozen=True)
class FullAttentionConfig:
    """Full / grouped-query attention over a paged K/V cache."""

    kind: ClassVar[str] = "full"
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int | None = None  # None: same as head_dim
    sliding_window: int = 0  # 0: unlimited; W: key j visible to query p iff p - j < W
    softcap: float = 0.0  # 0: off; c: scores become c * tanh(s / c)
    sinks: bool = False  # per-head sink logits, passed with the layer's inputs
    output_gate: bool = False  # Qwen3.5-style sigmoid gate on the output (applied by the model)
    scale: float | None = None  # None: head_dim ** -0.5

    def __post_init__(self):
        positive(self, "num_q_heads", "num_kv_heads", "head_dim")
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        positive(self, "head_dim_v")
        if self.num_q_heads % self.num_kv_heads:
            fail("FullAttentionConfig", "num_q_heads", f"a multiple of num_kv_heads={self.num_kv_heads}",
                 self.num_q_heads)
        non_negative(self, "sliding_window", "softcap")
        if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int):
            fail("FullAttentionConfig", "sliding_window", "an int", self.sliding_window)
        for name in ("sinks", "output_gate"):
            if not isinstance(getattr(self, name), bool):
                fail("FullAttentionConfig", name, "a bool", getattr(self, name))
        default_scale(self, self.head_dim)

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def storage(self, dtype: torch.dtype):
        """Per cached token: its key and value rows, in one pool with every layer of the same shape."""
        return (per_token("k", (self.num_kv_heads, self.head_dim), dtype, pool="full"),
                per_token("v", (self.num_kv_heads, self.head_dim_v), dtype, pool="full"))


@tensor_pytree
@dataclass(frozen=True)
class FullAttentionInputs:
    q: Float[Tensor, "T Hq D"]  # [T, Hq, D], rope applied
    k: Float[Tensor, "T Hkv D"]  # [T, Hkv, D], rope applied
    v: Float[Tensor, "T Hkv Dv"]  # [T, Hkv, Dv]
    sinks: Float[Tensor, " Hq"] | None = None  # [Hq] sink logits when the config has sinks
    meta: StepMeta | None = field(default=None, repr=False)

    def validate(self, spec, batch, device) -> None:
        c, T, where = spec.config, batch.num_tokens, f"layer {spec.index} inputs"
        check_tensor(where, "q", self.q, (T, c.num_q_heads, c.head_dim), spec.dtype, device)
        check_tensor(where, "k", self.k, (T, c.num_kv_heads, c.head_dim), spec.dtype, device)
        check_tensor(where, "v", self.v, (T, c.num_kv_heads, c.head_dim_v), spec.dtype, device)
        if c.sinks:
            if self.sinks is None:
                fail(where, "sinks", f"a [{c.num_q_heads}] tensor (config has sinks=True)", None)
            dtype = self.sinks.dtype if isinstance(self.sinks, Tensor) and self.sinks.is_floating_point() \
                else torch.float32
            check_tensor(where, "sinks", self.sinks, (c.num_q_heads,), dtype, device)
        elif self.sinks is not None:
            fail(where, "sinks", "None (config has sinks=False)", getattr(self.sinks, "shape", self.sinks))

