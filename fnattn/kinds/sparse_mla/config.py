"""Sparse MLA with the DSA indexer (DeepSeek-V3.2, GLM-5): config, storage, inputs, outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ...checks import check_tensor, fail
from ...declare import per_token, static_pytree, tensor_pytree
from ...spec import non_negative, positive
from ..mla.config import FP8_MAX, MLAConfig, MLAInputs

KEY_DTYPES = (None, "fp8_e4m3")


@static_pytree
@dataclass(frozen=True)
class IndexerConfig:
    """The DSA lightning indexer that picks the top-k tokens a query attends."""

    num_heads: int
    head_dim: int
    topk: int
    rope_head_dim: int = 64
    #: ``"fp8_e4m3"`` caches the index keys as float8 e4m3 with one fp32 scale per token (its largest magnitude
    #: over 448, as DeepSeek-V3.2's own inference keeps them): half the bytes the indexer reads. A token's
    #: score is then ``scale[j] * sum_h w[h] * relu(q[h] . k8[j])`` (the scale is positive, so it leaves the
    #: relu), and a step scores its own keys as the cache will hold them. None caches them in the layer dtype.
    key_dtype: str | None = None

    def __post_init__(self):
        positive(self, "num_heads", "head_dim", "topk", "rope_head_dim")
        if self.rope_head_dim > self.head_dim:
            fail("IndexerConfig", "rope_head_dim", f"<= head_dim={self.head_dim}", self.rope_head_dim)
        if self.key_dtype not in KEY_DTYPES:
            fail("IndexerConfig", "key_dtype", f"one of {KEY_DTYPES}", self.key_dtype)

    @property
    def fp8_keys(self) -> bool:
        return self.key_dtype is not None

    def encode_keys(self, keys: Float[Tensor, "T Di"]) -> tuple[Tensor, Tensor]:
        """``-> (keys as float8 e4m3 [T, Di], scales [T, 1] fp32)``: each row over its largest magnitude / 448
        (a zero row keeps scale 1)."""
        amax = keys.float().abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return (keys.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale

    @staticmethod
    def decode_keys(stored: Float[Tensor, "N Di"], scale: Float[Tensor, "N 1"]) -> Float[Tensor, "N Di"]:
        """Stored keys back in fp32 (``stored * scale``, row by row)."""
        return stored.float() * scale



@static_pytree
@dataclass(frozen=True)
class SparseMLAConfig:
    """MLA restricted to the tokens chosen by a DSA indexer (DeepSeek-V3.2, GLM-5).

    ``index_source_layer`` names the layer whose top-k indices this layer reuses
    (GLM-5 shares indices across layers); None means the layer runs its own
    indexer and caches its own index keys.
    """

    kind: ClassVar[str] = "sparse_mla"
    mla: MLAConfig
    indexer: IndexerConfig
    index_source_layer: int | None = None

    def __post_init__(self):
        if not isinstance(self.mla, MLAConfig):
            fail("SparseMLAConfig", "mla", "an MLAConfig", self.mla)
        if not isinstance(self.indexer, IndexerConfig):
            fail("SparseMLAConfig", "indexer", "an IndexerConfig", self.indexer)
        if self.index_source_layer is not None:
            non_negative(self, "index_source_layer")

    def storage(self, dtype: torch.dtype):
        """The MLA latent rows, and the indexer's keys when this layer runs its own indexer (FP8 keys: with
        each token's scale beside them)."""
        if self.indexer.fp8_keys:
            own = (per_token("index_k", (self.indexer.head_dim,), torch.float8_e4m3fn, pool="index"),
                   per_token("index_k_scale", (1,), torch.float32, pool="index"))
        else:
            own = (per_token("index_k", (self.indexer.head_dim,), dtype, pool="index"),)
        return self.mla.storage(dtype) + (own if self.index_source_layer is None else ())

    def index_writes(self, keys: Float[Tensor, "T Di"]) -> dict[str, Tensor]:
        """The write values of this step's new index keys ``[T, Di]`` (layer dtype), as the cache stores them."""
        if not self.indexer.fp8_keys:
            return {"index_k": keys}
        stored, scale = self.indexer.encode_keys(keys)
        return {"index_k": stored, "index_k_scale": scale}



@dataclass(frozen=True)
class SparseQueryMetadata:
    """Per-step metadata shared by every sparse layer of a model; built once per step."""

    topk: int  # tokens each query attends
    request_of_token: Tensor  # [T] int64: which request (batch row) each new token belongs to
    visible_keys: Tensor  # [T] int64: keys a token may select (its position + 1: causal, itself included)

    @staticmethod
    def build(batch, *, topk: int) -> "SparseQueryMetadata":
        if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
            fail("SparseQueryMetadata", "topk", "a positive int", topk)
        # From the device tensors alone (no host-to-device copy), so a captured step can build it:
        # token t belongs to request b where cu[b] <= t < cu[b + 1].
        tokens = torch.arange(batch.positions.shape[0], device=batch.positions.device, dtype=batch.cu_seqlens.dtype)
        rows = torch.searchsorted(batch.cu_seqlens[1:], tokens, right=True)
        return SparseQueryMetadata(topk=topk, request_of_token=rows, visible_keys=batch.positions + 1)

    def for_part(self, batch, rows: slice, lanes: slice) -> "SparseQueryMetadata":
        """The metadata of one part of a mixed step (`fnattn.session.split_inputs`): its lanes count from 0."""
        return SparseQueryMetadata.build(batch, topk=self.topk)


@tensor_pytree
@dataclass(frozen=True)
class SparseMLAInputs(MLAInputs):
    """MLA plus the DSA indexer's query side; a layer either scores or reuses indices."""

    sparse: SparseQueryMetadata | None = None
    index_q: Float[Tensor, "T Hi Di"] | None = None  # [T, Hi, Di] indexer queries, rope applied
    index_w: Float[Tensor, "T Hi"] | None = None  # [T, Hi] per-head indexer weights (scales folded in)
    index_k: Float[Tensor, "T Di"] | None = None  # [T, Di] this step's new indexer keys
    topk_indices: Int[Tensor, "T K"] | None = None  # [T, topk] int64 positions chosen by the source layer (-1: none)

    def validate(self, spec, batch, device) -> None:
        super().validate(spec, batch, device)
        c, T, where = spec.config, batch.num_tokens, f"layer {spec.index} inputs"
        if not isinstance(self.sparse, SparseQueryMetadata):
            fail(where, "sparse", "the step's SparseQueryMetadata", type(self.sparse).__name__)
        check_tensor(where, "sparse.visible_keys", self.sparse.visible_keys, (T,), torch.int64, device)
        if c.index_source_layer is None:
            ix = c.indexer
            check_tensor(where, "index_q", self.index_q, (T, ix.num_heads, ix.head_dim), spec.dtype, device)
            w_dtype = self.index_w.dtype if isinstance(self.index_w, Tensor) else spec.dtype
            check_tensor(where, "index_w", self.index_w, (T, ix.num_heads), w_dtype, device)
            if not w_dtype.is_floating_point:
                fail(where, "index_w", "a floating-point tensor", w_dtype)
            check_tensor(where, "index_k", self.index_k, (T, ix.head_dim), spec.dtype, device)
            if self.topk_indices is not None:
                fail(where, "topk_indices", "None (this layer runs its own indexer)", tuple(self.topk_indices.shape))
        else:
            check_tensor(where, "topk_indices", self.topk_indices, (T, self.sparse.topk), torch.int64, device)
            # A layer that reuses another layer's top-k has no indexer: indexer
            # inputs given to it are a wiring mistake, not something to ignore.
            for name in ("index_q", "index_w", "index_k"):
                if getattr(self, name) is not None:
                    fail(where, name, f"None (this layer reuses layer {c.index_source_layer}'s top-k)",
                         tuple(getattr(self, name).shape))


@tensor_pytree
@dataclass(frozen=True)
class SparseAttentionOutput:
    o: Float[Tensor, "T H Dv"]  # [T, H, Dv]
    lse: Float[Tensor, "T H"] | None  # [T, H]
    topk_indices: Tensor  # [T, topk] int64 positions attended (-1: padding); reusable by later layers


