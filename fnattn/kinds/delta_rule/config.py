"""Gated DeltaNet and Kimi Delta Attention: configs, storage, inputs and outputs.

The two kinds share their storage (a recurrent state and a conv window per
request), their inputs and their backends; they differ in the gate (a scalar
per head for GDN, a vector per key channel for KDA) and in how q and k are
split and normalized.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from ...checks import check_tensor, fail
from ...declare import StepMeta, per_request, static_pytree, tensor_pytree
from ...spec import default_scale, positive, state_dtype


def recurrent_storage(c, dtype: torch.dtype, *, pool: str):
    """Per request: the delta-rule state ``[H, K, V]`` and the conv window ``[C, W - 1]``."""
    return (per_request("ssm", (c.num_state_heads, c.head_k_dim, c.head_v_dim), c.state_dtype, pool=pool),
            per_request("conv", (c.conv_dim, c.conv_kernel - 1), dtype, pool=pool))


def check_shared(c) -> None:
    """The invariants both delta-rule configs share: a conv of at least 2 taps, the state dtype, the scale."""
    if c.conv_kernel < 2:
        fail(type(c).__name__, "conv_kernel", "an int >= 2", c.conv_kernel)
    state_dtype(c)
    default_scale(c, c.head_k_dim)


@static_pytree
@dataclass(frozen=True)
class GDNConfig:
    """Gated DeltaNet (Qwen3-Next / Qwen3.5): causal conv + scalar-gated delta rule."""

    kind: ClassVar[str] = "gdn"
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    state_dtype: torch.dtype = torch.float32
    scale: float | None = None  # None: head_k_dim ** -0.5

    def __post_init__(self):
        positive(self, "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel")
        if self.num_v_heads % self.num_k_heads:
            fail("GDNConfig", "num_v_heads", f"a multiple of num_k_heads={self.num_k_heads}", self.num_v_heads)
        check_shared(self)

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def num_state_heads(self) -> int:
        """Heads of the recurrent state: the value heads (q/k heads are repeated onto them)."""
        return self.num_v_heads

    @property
    def num_qk_heads(self) -> int:
        return self.num_k_heads

    def gate_shape(self, T: int) -> tuple[int, ...]:
        """One scalar log decay per token and head."""
        return (T, self.num_v_heads)

    def storage(self, dtype: torch.dtype):
        return recurrent_storage(self, dtype, pool="gdn")

    def split_qkv(self, mixed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Conv output ``[n, C]`` -> q, k ``[n, H, K]`` (fp32, l2-normalized, repeated onto the value
        heads) and v ``[n, H, V]``."""
        from .qkv import gdn_qkv

        return gdn_qkv(mixed, num_k_heads=self.num_k_heads, num_v_heads=self.num_v_heads,
                       head_k_dim=self.head_k_dim, head_v_dim=self.head_v_dim)


@static_pytree
@dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention: per-channel gated delta rule with q/k/v short convs."""

    kind: ClassVar[str] = "kda"
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    state_dtype: torch.dtype = torch.float32
    scale: float | None = None  # None: head_k_dim ** -0.5

    def __post_init__(self):
        positive(self, "num_heads", "head_k_dim", "head_v_dim", "conv_kernel")
        check_shared(self)

    @property
    def conv_dim(self) -> int:
        return self.num_heads * (2 * self.head_k_dim + self.head_v_dim)

    @property
    def num_state_heads(self) -> int:
        return self.num_heads

    @property
    def num_qk_heads(self) -> int:
        return self.num_heads

    def gate_shape(self, T: int) -> tuple[int, ...]:
        """A log decay per token, head and key channel."""
        return (T, self.num_heads, self.head_k_dim)

    def storage(self, dtype: torch.dtype):
        return recurrent_storage(self, dtype, pool="kda")

    def split_qkv(self, mixed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Conv output ``[n, C]`` -> q, k ``[n, H, K]`` (fp32, l2-normalized) and v ``[n, H, V]``."""
        from .qkv import kda_qkv

        return kda_qkv(mixed, num_heads=self.num_heads, head_k_dim=self.head_k_dim, head_v_dim=self.head_v_dim)


@tensor_pytree
@dataclass(frozen=True)
class RecurrentInputs:
    """Gated DeltaNet / Kimi Delta Attention: the conv input and the gates of this step.

    The backend owns the causal conv (its window is state), the split into
    q/k/v, the l2 norm of q and k, and the recurrence. Projections, the output
    norm and gate stay with the model.
    """

    x: Float[Tensor, "T C"]  # [T, C] conv input: q | k | v channels, before the causal conv
    conv_weight: Float[Tensor, "C W"]  # [C, W] depthwise conv taps
    g: Float[Tensor, "T H *K"]  # [T, H] (GDN, scalar) or [T, H, K] (KDA, per channel) log decay, fp32
    beta: Float[Tensor, "T H"]  # [T, H] delta-rule step size, after the sigmoid
    conv_bias: Float[Tensor, " C"] | None = None  # [C]
    meta: StepMeta | None = field(default=None, repr=False)

    def validate(self, spec, batch, device) -> None:
        c, T, where, dtype = spec.config, batch.num_tokens, f"layer {spec.index} inputs", spec.dtype
        C = c.conv_dim  # a property: read once
        check_tensor(where, "x", self.x, (T, C), dtype, device)
        check_tensor(where, "conv_weight", self.conv_weight, (C, c.conv_kernel), dtype, device)
        if self.conv_bias is not None:
            check_tensor(where, "conv_bias", self.conv_bias, (C,), dtype, device)
        check_tensor(where, "g", self.g, c.gate_shape(T), torch.float32, device)
        beta = self.beta
        beta_dtype = beta.dtype if isinstance(beta, Tensor) and beta.dtype in (dtype, torch.float32) else dtype
        check_tensor(where, "beta", beta, (T, c.num_state_heads), beta_dtype, device)


@tensor_pytree
@dataclass(frozen=True)
class RecurrentOutput:
    o: Float[Tensor, "T H V"]  # [T, H, V] in the layer dtype, before the output norm
    # Verify only: the step's own inputs, kept so accepted tokens can be replayed
    # from the pre-step state instead of keeping a state per draft position.
    replay: RecurrentInputs | None = None


