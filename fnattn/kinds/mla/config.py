"""Multi-head latent attention (DeepSeek-V3): config, storage and inputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from ...checks import check_tensor
from ...declare import StepMeta, per_token, static_pytree, tensor_pytree
from ...spec import default_scale, positive


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

    def __post_init__(self):
        positive(self, "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.q_lora_rank is not None:
            positive(self, "q_lora_rank")
        default_scale(self, self.qk_nope_head_dim + self.qk_rope_head_dim)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mla(self) -> MLAConfig:
        """The MLA part of a layer's config (itself; a sparse layer's `.mla` is its MLA part)."""
        return self

    def storage(self, dtype: torch.dtype):
        """Per cached token: the latent ``c_kv`` then the roped ``k_pe``, ``[R + Dr]``."""
        return (per_token("latent", (self.latent_dim,), dtype, pool="mla"),)



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
        H, R = m.num_heads, m.kv_lora_rank
        check_tensor(where, "q_nope", self.q_nope, (T, H, m.qk_nope_head_dim), spec.dtype, device)
        check_tensor(where, "q_pe", self.q_pe, (T, H, m.qk_rope_head_dim), spec.dtype, device)
        check_tensor(where, "latent", self.latent, (T, m.latent_dim), spec.dtype, device)
        check_tensor(where, "w_uk", self.w_uk, (H, m.qk_nope_head_dim, R), spec.dtype, device)
        check_tensor(where, "w_uv", self.w_uv, (H, m.v_head_dim, R), spec.dtype, device)


