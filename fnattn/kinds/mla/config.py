"""Multi-head latent attention (DeepSeek-V3): config, storage and inputs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from ...checks import check_tensor, fail
from ...declare import StepMeta, per_token, static_pytree, tensor_pytree
from ...spec import default_scale, positive

CACHE_DTYPES = {None: None, "fp8_e4m3": torch.float8_e4m3fn}
FP8_MAX = 448.0  # largest finite float8 e4m3fn


@static_pytree
@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek-V3 multi-head latent attention: a latent + rope cache per token."""

    kind: ClassVar[str] = "mla"
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    scale: float | None = None  # None: (nope + rope) ** -0.5
    #: Heads the inputs and outputs carry, when kernels want more than the model has (FlashMLA's sparse
    #: kernels take 64 or 128): the model pads queries and weights with zero heads up to it and drops the
    #: extra output heads (``models.mla_layer.pad_heads``). None: ``num_heads``.
    padded_heads: int | None = None
    #: ``"fp8_e4m3"`` stores the latent rows as float8 e4m3 with one per-tensor scale
    #: (``stored = row / cache_scale``); None stores them in the layer dtype.
    cache_dtype: str | None = None
    cache_scale: float = 1.0

    def __post_init__(self):
        positive(self, "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.q_lora_rank is not None:
            positive(self, "q_lora_rank")
        default_scale(self, self.qk_nope_head_dim + self.qk_rope_head_dim)
        if self.padded_heads is not None:
            positive(self, "padded_heads")
            if self.padded_heads < self.num_heads:
                fail("MLAConfig", "padded_heads", f">= num_heads={self.num_heads} (or None)", self.padded_heads)
        if self.cache_dtype not in CACHE_DTYPES:
            fail("MLAConfig", "cache_dtype", f"one of {tuple(CACHE_DTYPES)}", self.cache_dtype)
        s = self.cache_scale
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
            fail("MLAConfig", "cache_scale", "a positive finite float", s)
        object.__setattr__(self, "cache_scale", float(s))

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def heads(self) -> int:
        """Heads of the inputs and outputs: ``padded_heads`` when set, else ``num_heads``."""
        return self.padded_heads or self.num_heads

    @property
    def fp8_cache(self) -> bool:
        return self.cache_dtype is not None

    def latent_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the stored latent rows for a layer computing in ``dtype``."""
        return CACHE_DTYPES[self.cache_dtype] or dtype

    def encode_latent(self, rows: Tensor) -> Tensor:
        """Rows as the cache stores them (quantized with the per-tensor scale for an FP8 cache)."""
        if not self.fp8_cache:
            return rows
        return (rows.float() / self.cache_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

    def decode_latent(self, stored: Tensor, dtype: torch.dtype) -> Tensor:
        """Stored rows back in ``dtype`` (what every backend attends)."""
        if not self.fp8_cache:
            return stored
        return (stored.float() * self.cache_scale).to(dtype)

    def as_cached(self, rows: Tensor) -> Tensor:
        """New rows as a later step will read them back from the cache: the step attends its own
        rows at the cache's precision, so a token scores the same keys now and later."""
        return rows if not self.fp8_cache else self.decode_latent(self.encode_latent(rows), rows.dtype)

    @property
    def mla(self) -> MLAConfig:
        """The MLA part of a layer's config (itself; a sparse layer's `.mla` is its MLA part)."""
        return self

    def storage(self, dtype: torch.dtype):
        """Per cached token: the latent ``c_kv`` then the roped ``k_pe``, ``[R + Dr]``."""
        return (per_token("latent", (self.latent_dim,), self.latent_dtype(dtype), pool="mla"),)



@tensor_pytree
@dataclass(frozen=True)
class MLAInputs:
    """DeepSeek-V3 multi-head latent attention, after projections and rope."""

    q_nope: Float[Tensor, "T H Dn"]  # [T, H, Dn]
    q_pe: Float[Tensor, "T H Dr"]  # [T, H, Dr], rope applied
    latent: Float[Tensor, "T RDr"]  # [T, R + Dr] new cache rows: normalized c_kv, then roped k_pe
    w_uk: Float[Tensor, "H Dn R"]  # [H, Dn, R] key half of kv_b_proj
    w_uv: Float[Tensor, "H Dv R"]  # [H, Dv, R] value half of kv_b_proj
    meta: StepMeta | None = field(default=None, repr=False)

    def validate(self, spec, batch, device) -> None:
        T, where = batch.num_tokens, f"layer {spec.index} inputs"
        m = spec.config.mla
        H, R = m.heads, m.kv_lora_rank
        check_tensor(where, "q_nope", self.q_nope, (T, H, m.qk_nope_head_dim), spec.dtype, device)
        check_tensor(where, "q_pe", self.q_pe, (T, H, m.qk_rope_head_dim), spec.dtype, device)
        check_tensor(where, "latent", self.latent, (T, m.latent_dim), spec.dtype, device)
        check_tensor(where, "w_uk", self.w_uk, (H, m.qk_nope_head_dim, R), spec.dtype, device)
        check_tensor(where, "w_uv", self.w_uv, (H, m.v_head_dim, R), spec.dtype, device)


