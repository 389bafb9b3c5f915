"""DeepSeek-V4 attention: sliding window, compressed sparse (CSA, with an indexer) and heavily compressed (HCA).

The config with its storage, the inputs and outputs live in `.config`, the
math in `.math`, the reference backend per phase in `.reference`, the
FlashMLA sparse path (CUDA, bf16, 512-dim heads) in `.flashmla` and the
invariant mode's Triton path in `.triton`.
"""

from ...declare import register_kind
from .config import DSV4Config, DSV4Inputs, DSV4Output

register_kind("dsv4", config=DSV4Config, inputs=DSV4Inputs)

from . import flashmla, reference, sdpa, triton  # noqa: E402,F401 - registers the backends

__all__ = ["DSV4Config", "DSV4Inputs", "DSV4Output"]
