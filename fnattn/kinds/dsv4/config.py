"""DeepSeek-V4 compressed attention: the config (storage and backends are not built yet)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ...checks import fail
from ...declare import static_pytree
from ...spec import default_scale, positive
from ..sparse_mla.config import IndexerConfig


@static_pytree
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
        positive(self, "num_heads", "head_dim", "qk_rope_head_dim", "sliding_window")
        if self.compress_ratio not in (0, 4, 128):
            fail("DSV4Config", "compress_ratio", "one of 0, 4, 128", self.compress_ratio)
        if self.compress_ratio == 4 and not isinstance(self.indexer, IndexerConfig):
            fail("DSV4Config", "indexer", "an IndexerConfig when compress_ratio == 4", self.indexer)
        if self.compress_ratio != 4 and self.indexer is not None:
            fail("DSV4Config", "indexer", "None unless compress_ratio == 4", self.indexer)
        if self.qk_rope_head_dim > self.head_dim:
            fail("DSV4Config", "qk_rope_head_dim", f"<= head_dim={self.head_dim}", self.qk_rope_head_dim)
        default_scale(self, self.head_dim)

    def storage(self, dtype: torch.dtype):
        raise NotImplementedError(
            "DeepSeek-V4 compressed attention has a config but no storage layout or backends yet: "
            "a State cannot hold a dsv4 layer")


