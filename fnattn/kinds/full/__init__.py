"""Full / grouped-query attention (sliding window, sinks, softcap, head_dim_v) over a paged K/V cache.

``reference`` is the ground truth for every phase; ``triton`` folds the
step's own K/V into the kernels' softmax; ``flashinfer`` attends the cache
with FlashInfer and merges the new tokens by LSE.
"""

from ...declare import register_kind
from .config import AttentionOutput, FullAttentionConfig, FullAttentionInputs

register_kind("full", config=FullAttentionConfig, inputs=FullAttentionInputs)

from . import flashinfer, reference, sdpa, triton  # noqa: E402,F401 - registers the backends

__all__ = ["AttentionOutput", "FullAttentionConfig", "FullAttentionInputs"]
