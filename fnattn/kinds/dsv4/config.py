"""DeepSeek-V4 attention: config, storage, inputs and outputs.

Three layer types share one kind (transformers' ``layer_types``):

* ``sliding_attention`` (``compress_ratio == 0``): shared-KV MQA over the
  last ``sliding_window`` tokens, with per-head sinks;
* ``compressed_sparse_attention`` (CSA, ``compressor == "csa"``): the window
  plus one compressed entry per ``compress_ratio`` tokens, pooled over two
  overlapping windows, of which a lightning indexer keeps the top-k;
* ``heavily_compressed_attention`` (HCA, ``compressor == "hca"``): the window
  plus every compressed entry (non-overlapping windows, no indexer).

Storage, per layer:

* ``kv`` per token: the window's K=V row of every token. Only the last
  ``sliding_window`` are read; rows stay while the request lives, like the
  pages of a full-attention layer with a window.
* ``comp`` (and ``index_k`` for CSA) per token: the row of the token that
  closes a compression window holds that window's entry (normalised, rope at
  the window's first position); other rows are zero. Keying entries by the
  closing token makes rejected drafts, rollbacks and transfer plain token
  bookkeeping.
* ``comp_state`` (and ``index_state``) per request: the compressor state,
  the raw projections ``(kv, gate + position bias)`` of the last
  ``overlap * compress_ratio`` tokens in a ring indexed by position. It holds
  the tokens not yet compressed and, for CSA, the previous window whose first
  half each new entry also pools. It is a pure function of the tokens, so
  verify recovers it natively (a state per token) or by replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from ...checks import check_tensor, fail
from ...declare import StepMeta, per_request, per_token, static_pytree, tensor_pytree
from ...spec import default_scale, positive
from ..sparse_mla.config import IndexerConfig

COMPRESSORS = ("csa", "hca")
#: The compressor transformers' V4 checkpoints use for each ratio (other ratios name it explicitly).
DEFAULT_COMPRESSOR = {4: "csa", 128: "hca"}


@static_pytree
@dataclass(frozen=True)
class DSV4Config:
    """DeepSeek-V4 attention: a sliding window plus, optionally, a compressed branch.

    ``compress_ratio`` 0 is a sliding-window-only layer. A ratio ``m >= 2``
    adds one compressed entry per ``m`` tokens: ``compressor="csa"`` pools two
    overlapping windows and needs an ``indexer`` picking the top-k entries;
    ``"hca"`` pools one window and attends every entry. ``compressor`` None
    takes transformers' defaults (4: CSA, 128: HCA).
    """

    kind: ClassVar[str] = "dsv4"
    num_heads: int
    head_dim: int
    qk_rope_head_dim: int
    sliding_window: int
    compress_ratio: int
    indexer: IndexerConfig | None = None
    sinks: bool = True
    scale: float | None = None  # None: head_dim ** -0.5
    compressor: str | None = None  # "csa" | "hca"; None: the default of the ratio (none for ratio 0)
    norm_eps: float = 1e-6  # the compressors' RMSNorm epsilon
    # Query heads the kernels see (FlashMLA's sparse kernel takes 64 or 128): the model pads its queries and
    # sinks with heads that attend nothing of its own and drops them from the output; None: num_heads.
    padded_heads: int | None = None

    def __post_init__(self):
        positive(self, "num_heads", "head_dim", "qk_rope_head_dim", "sliding_window")
        m = self.compress_ratio
        if isinstance(m, bool) or not isinstance(m, int) or m < 0 or m == 1:
            fail("DSV4Config", "compress_ratio", "0 (sliding window only) or an int >= 2", m)
        if m == 0:
            if self.compressor is not None:
                fail("DSV4Config", "compressor", "None when compress_ratio == 0", self.compressor)
        elif self.compressor is None:
            if m not in DEFAULT_COMPRESSOR:
                fail("DSV4Config", "compress_ratio",
                     f"one of {sorted(DEFAULT_COMPRESSOR)} unless `compressor` names the branch", m)
            object.__setattr__(self, "compressor", DEFAULT_COMPRESSOR[m])
        elif self.compressor not in COMPRESSORS:
            fail("DSV4Config", "compressor", f"one of {COMPRESSORS} or None", self.compressor)
        if self.compressor == "csa" and not isinstance(self.indexer, IndexerConfig):
            fail("DSV4Config", "indexer", "an IndexerConfig for the compressed sparse (csa) branch", self.indexer)
        if self.compressor != "csa" and self.indexer is not None:
            fail("DSV4Config", "indexer", "None unless the compressor is csa", self.indexer)
        if self.indexer is not None and self.indexer.fp8_keys:
            fail("DSV4Config", "indexer.key_dtype", "None (the compressed indexer keeps its entries in the layer "
                 "dtype)", self.indexer.key_dtype)
        if self.qk_rope_head_dim > self.head_dim or self.qk_rope_head_dim % 2:
            fail("DSV4Config", "qk_rope_head_dim", f"an even int <= head_dim={self.head_dim}",
                 self.qk_rope_head_dim)
        if self.indexer is not None and self.indexer.head_dim < self.qk_rope_head_dim:
            # The indexer's entries take the compressed branch's rope on their trailing dims.
            fail("DSV4Config", "indexer", f"head_dim >= qk_rope_head_dim={self.qk_rope_head_dim}",
                 self.indexer.head_dim)
        if not isinstance(self.sinks, bool):
            fail("DSV4Config", "sinks", "a bool", self.sinks)
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) or not \
                0 <= self.norm_eps < 1:
            fail("DSV4Config", "norm_eps", "a float in [0, 1)", self.norm_eps)
        object.__setattr__(self, "norm_eps", float(self.norm_eps))
        if self.padded_heads is not None and (isinstance(self.padded_heads, bool) or not isinstance(
                self.padded_heads, int) or self.padded_heads < self.num_heads):
            fail("DSV4Config", "padded_heads", f"None or an int >= num_heads={self.num_heads}", self.padded_heads)
        default_scale(self, self.head_dim)

    @property
    def heads(self) -> int:
        """Query heads the inputs and outputs carry (``padded_heads``, else ``num_heads``)."""
        return self.padded_heads or self.num_heads

    @property
    def layer_type(self) -> str:
        """transformers' name of the layer type."""
        return {None: "sliding_attention", "csa": "compressed_sparse_attention",
                "hca": "heavily_compressed_attention"}[self.compressor]

    @property
    def overlap(self) -> int:
        """Windows each compressed entry pools: 2 for CSA (the previous window's first half), else 1."""
        return 2 if self.compressor == "csa" else 1

    @property
    def ring_len(self) -> int:
        """Raw token rows the compressor state keeps: the last ``overlap * compress_ratio`` positions."""
        return self.overlap * self.compress_ratio

    def storage(self, dtype: torch.dtype):
        m = self.compress_ratio
        if not m:
            return (per_token("kv", (self.head_dim,), dtype, pool="dsv4_swa"),)
        tag = f"dsv4_{self.compressor}{m}"
        c = self.overlap
        decls = [per_token("kv", (self.head_dim,), dtype, pool=tag),
                 per_token("comp", (self.head_dim,), dtype, pool=tag)]
        # fp32: the gates carry the fp32 position bias; the kv rows are exact in fp32 whatever the dtype.
        state = [per_request("comp_state", (self.ring_len, 2, c * self.head_dim), torch.float32,
                             pool=tag + "_state")]
        if self.indexer is not None:
            Di = self.indexer.head_dim
            decls.append(per_token("index_k", (Di,), dtype, pool=tag))
            state.append(per_request("index_state", (self.ring_len, 2, c * Di), torch.float32, pool=tag + "_state"))
        return tuple(decls + state)


@tensor_pytree
@dataclass(frozen=True)
class DSV4Inputs:
    """One DeepSeek-V4 attention layer's step: queries, the window row and the compressor's raw rows.

    The model owns the projections, the norms of q and kv and their rope, and
    adds each compressor's position bias to its gate (bias row ``position %
    compress_ratio``). The backend owns the compressor (pooling closed windows,
    their norm and rope, from ``comp_norm`` and ``comp_inv_freq``), the indexer's
    top-k and the attention with sinks. The inverse rope of the output and the
    grouped output projection stay with the model.
    """

    q: Float[Tensor, "T H D"]  # [T, H, D] queries (H = config.heads), normalised, rope on the trailing dims
    kv: Float[Tensor, "T D"]  # [T, D] this step's K=V window rows, normalised, rope applied
    sinks: Float[Tensor, " H"] | None = None  # [H] fp32 sink logits (config.sinks; -inf for padding heads)
    comp_kv: Float[Tensor, "T CD"] | None = None  # [T, overlap * D] compressor kv projection
    comp_gate: Float[Tensor, "T CD"] | None = None  # [T, overlap * D] fp32 gate + position bias
    comp_norm: Float[Tensor, " D"] | None = None  # [D] fp32 the compressor's RMSNorm weight
    comp_inv_freq: Float[Tensor, " R2"] | None = None  # [Dr / 2] fp32 rope frequencies of the entries
    index_q: Float[Tensor, "T Hi Di"] | None = None  # [T, Hi, Di] indexer queries, rope applied (csa)
    index_w: Float[Tensor, "T Hi"] | None = None  # [T, Hi] fp32 per-head weights (weights_proj * Hi^-0.5)
    index_kv: Float[Tensor, "T CDi"] | None = None  # [T, 2 * Di] the indexer compressor's kv projection
    index_gate: Float[Tensor, "T CDi"] | None = None  # [T, 2 * Di] fp32 gate + position bias
    index_norm: Float[Tensor, " Di"] | None = None  # [Di] fp32 the indexer compressor's RMSNorm weight
    meta: StepMeta | None = field(default=None, repr=False)

    def validate(self, spec, batch, device) -> None:
        c, T, where = spec.config, batch.num_tokens, f"layer {spec.index} inputs"
        H, D, f32 = c.heads, c.head_dim, torch.float32
        check_tensor(where, "q", self.q, (T, H, D), spec.dtype, device)
        check_tensor(where, "kv", self.kv, (T, D), spec.dtype, device)
        _optional(where, "sinks", self.sinks, c.sinks, (H,), f32, device, "config.sinks")
        has = c.compress_ratio > 0
        _optional(where, "comp_kv", self.comp_kv, has, (T, c.overlap * D), spec.dtype, device, "a compressor")
        _optional(where, "comp_gate", self.comp_gate, has, (T, c.overlap * D), f32, device, "a compressor")
        _optional(where, "comp_norm", self.comp_norm, has, (D,), f32, device, "a compressor")
        _optional(where, "comp_inv_freq", self.comp_inv_freq, has, (c.qk_rope_head_dim // 2,), f32, device,
                  "a compressor")
        ix = c.indexer
        Hi, Di = (ix.num_heads, ix.head_dim) if ix is not None else (0, 0)
        _optional(where, "index_q", self.index_q, ix is not None, (T, Hi, Di), spec.dtype, device, "an indexer")
        _optional(where, "index_w", self.index_w, ix is not None, (T, Hi), f32, device, "an indexer")
        _optional(where, "index_kv", self.index_kv, ix is not None, (T, 2 * Di), spec.dtype, device, "an indexer")
        _optional(where, "index_gate", self.index_gate, ix is not None, (T, 2 * Di), f32, device, "an indexer")
        _optional(where, "index_norm", self.index_norm, ix is not None, (Di,), f32, device, "an indexer")


def _optional(where, name, t, wanted: bool, shape, dtype, device, why: str) -> None:
    if wanted:
        check_tensor(where, name, t, shape, dtype, device)
    elif t is not None:
        fail(where, name, f"None (only a layer with {why} takes it)", tuple(getattr(t, "shape", ())))


@tensor_pytree
@dataclass(frozen=True)
class DSV4Output:
    o: Float[Tensor, "T H D"]  # [T, H, D] before the inverse rope and the grouped output projection
    # CSA: [T, topk] int64 compressed entries each token attended (-1: none); None otherwise
    topk_indices: Tensor | None = None
    replay: DSV4Inputs | None = None  # verify: the step's inputs, to replay the compressor state
