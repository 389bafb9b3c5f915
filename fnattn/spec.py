"""Layer specs: the frozen, typed description of one attention layer.

A backend reads nothing about the model but its `LayerSpec`. Each kind has one
frozen config class; invariants are checked at construction and an error names
the offending field. Specs are hashable (they key plans and groups) and are
registered with optree (namespace ``"fnattn"``) as leaves-free pytree nodes, so
a tree of specs and tensors flattens to just the tensors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import optree
import torch

from .checks import fail

KINDS = ("full", "mla", "sparse_mla", "gdn", "kda", "dsv4")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _static_pytree(cls):
    """Register a frozen dataclass with no tensor leaves under namespace fnattn."""
    names = tuple(f.name for f in dataclasses.fields(cls))

    optree.register_pytree_node(
        cls,
        lambda obj: ((), tuple(getattr(obj, n) for n in names), None),
        lambda aux, _children: cls(**dict(zip(names, aux))),
        namespace="fnattn",
    )
    return cls


def _positive(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            fail(type(obj).__name__, name, "a positive int", value)


def _non_negative(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            fail(type(obj).__name__, name, "a non-negative number", value)


def _default_scale(obj, head_dim: int) -> None:
    if obj.scale is None:
        object.__setattr__(obj, "scale", head_dim**-0.5)
    elif not (isinstance(obj.scale, (int, float)) and math.isfinite(obj.scale) and obj.scale > 0):
        fail(type(obj).__name__, "scale", "a positive finite float or None", obj.scale)
    else:
        object.__setattr__(obj, "scale", float(obj.scale))


@_static_pytree
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
        _positive(self, "num_q_heads", "num_kv_heads", "head_dim")
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        _positive(self, "head_dim_v")
        if self.num_q_heads % self.num_kv_heads:
            fail(
                "FullAttentionConfig",
                "num_q_heads",
                f"a multiple of num_kv_heads={self.num_kv_heads}",
                self.num_q_heads,
            )
        _non_negative(self, "sliding_window", "softcap")
        if not isinstance(self.sliding_window, int):
            fail("FullAttentionConfig", "sliding_window", "an int", self.sliding_window)
        _default_scale(self, self.head_dim)

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads


@_static_pytree
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
        _positive(self, "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.q_lora_rank is not None:
            _positive(self, "q_lora_rank")
        _default_scale(self, self.qk_nope_head_dim + self.qk_rope_head_dim)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@_static_pytree
@dataclass(frozen=True)
class IndexerConfig:
    """The DSA lightning indexer that picks the top-k tokens a query attends."""

    num_heads: int
    head_dim: int
    topk: int
    rope_head_dim: int = 64

    def __post_init__(self):
        _positive(self, "num_heads", "head_dim", "topk", "rope_head_dim")
        if self.rope_head_dim > self.head_dim:
            fail("IndexerConfig", "rope_head_dim", f"<= head_dim={self.head_dim}", self.rope_head_dim)


@_static_pytree
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
            _non_negative(self, "index_source_layer")


@_static_pytree
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
        _positive(self, "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel")
        if self.num_v_heads % self.num_k_heads:
            fail("GDNConfig", "num_v_heads", f"a multiple of num_k_heads={self.num_k_heads}", self.num_v_heads)
        if self.conv_kernel < 2:
            fail("GDNConfig", "conv_kernel", "an int >= 2", self.conv_kernel)
        if self.state_dtype not in _DTYPES:
            fail("GDNConfig", "state_dtype", f"one of {_DTYPES}", self.state_dtype)
        _default_scale(self, self.head_k_dim)

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


@_static_pytree
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
        _positive(self, "num_heads", "head_k_dim", "head_v_dim", "conv_kernel")
        if self.conv_kernel < 2:
            fail("KDAConfig", "conv_kernel", "an int >= 2", self.conv_kernel)
        if self.state_dtype not in _DTYPES:
            fail("KDAConfig", "state_dtype", f"one of {_DTYPES}", self.state_dtype)
        _default_scale(self, self.head_k_dim)

    @property
    def conv_dim(self) -> int:
        return self.num_heads * (2 * self.head_k_dim + self.head_v_dim)


@_static_pytree
@dataclass(frozen=True)
class DSV4Config:
    """DeepSeek-V4 compressed attention: a sliding window plus a compressed branch.

    ``compress_ratio`` 4 is the compressed sparse branch (with an indexer picking
    top-k compressed entries), 128 the heavily compressed dense branch, 0 a
    sliding-window-only layer.
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

    def __post_init__(self):
        _positive(self, "num_heads", "head_dim", "qk_rope_head_dim", "sliding_window")
        if self.compress_ratio not in (0, 4, 128):
            fail("DSV4Config", "compress_ratio", "one of 0, 4, 128", self.compress_ratio)
        if self.compress_ratio == 4 and not isinstance(self.indexer, IndexerConfig):
            fail("DSV4Config", "indexer", "an IndexerConfig when compress_ratio == 4", self.indexer)
        if self.compress_ratio != 4 and self.indexer is not None:
            fail("DSV4Config", "indexer", "None unless compress_ratio == 4", self.indexer)
        if self.qk_rope_head_dim > self.head_dim:
            fail("DSV4Config", "qk_rope_head_dim", f"<= head_dim={self.head_dim}", self.qk_rope_head_dim)
        _default_scale(self, self.head_dim)


KindConfig = FullAttentionConfig | MLAConfig | SparseMLAConfig | GDNConfig | KDAConfig | DSV4Config
_CONFIG_TYPES = (FullAttentionConfig, MLAConfig, SparseMLAConfig, GDNConfig, KDAConfig, DSV4Config)


@_static_pytree
@dataclass(frozen=True)
class LayerSpec:
    """One attention layer: its index in the model, its typed config, its dtype."""

    index: int
    config: KindConfig
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            fail("LayerSpec", "index", "a non-negative int", self.index)
        if not isinstance(self.config, _CONFIG_TYPES):
            fail("LayerSpec", "config", f"one of {[c.__name__ for c in _CONFIG_TYPES]}", type(self.config).__name__)
        if self.dtype not in _DTYPES:
            fail("LayerSpec", "dtype", f"one of {_DTYPES}", self.dtype)

    @property
    def kind(self) -> str:
        return self.config.kind
