"""Full / grouped-query attention (sliding window, sinks, softcap, head_dim_v) over a paged K/V cache.

``reference`` is the ground truth for every phase; ``triton`` folds the
step's own K/V into the kernels' softmax; ``flashinfer`` attends the cache
with FlashInfer and merges the new tokens by LSE. Its backends return
`fnattn.outputs.AttentionOutput`, which the MLA kinds share.
"""

from ...declare import register_kind
from ...outputs import AttentionOutput  # noqa: F401 - where code written against this kind imports it from
from .config import FullAttentionConfig, FullAttentionInputs

register_kind("full", config=FullAttentionConfig, inputs=FullAttentionInputs)

from . import flashinfer, reference, sdpa, triton  # noqa: E402,F401 - registers the backends

# AttentionOutput is documented once, where it is defined (fnattn.outputs).
__all__ = ["FullAttentionConfig", "FullAttentionInputs"]
