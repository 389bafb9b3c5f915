"""Multi-head latent attention (DeepSeek-V3, Kimi Linear's full-attention layers) over a paged latent cache."""

from ...declare import register_kind
from .config import MLAConfig, MLAInputs

register_kind("mla", config=MLAConfig, inputs=MLAInputs)

from . import flashinfer, flashmla, reference, sdpa, triton  # noqa: E402,F401 - registers the backends

__all__ = ["MLAConfig", "MLAInputs"]
