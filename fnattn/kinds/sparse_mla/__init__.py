"""Sparse MLA: MLA over the tokens a DSA lightning indexer picks (DeepSeek-V3.2, GLM-5 index sharing)."""

from ...declare import register_kind
from .config import IndexerConfig, SparseAttentionOutput, SparseMLAConfig, SparseMLAInputs, SparseQueryMetadata

register_kind("sparse_mla", config=SparseMLAConfig, inputs=SparseMLAInputs)

from . import flashmla, reference, sdpa, triton  # noqa: E402,F401 - registers the backends

__all__ = ["IndexerConfig", "SparseAttentionOutput", "SparseMLAConfig", "SparseMLAInputs", "SparseQueryMetadata"]
