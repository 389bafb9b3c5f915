"""The gated delta rule pair: Gated DeltaNet (Qwen3-Next, Qwen3.5) and Kimi Delta Attention (Kimi Linear).

Both keep a recurrent state and a conv window per request (a ring of rows per
slot, see `fnattn.State`) and take the same inputs; ``reference`` runs the
chunked prefill and the token-by-token decode/verify in torch, ``triton`` the
kernels of `fnattn.kernels`, ``fla`` fla-core's chunked prefill.
"""

from ...declare import register_kind
from .config import GDNConfig, KDAConfig, RecurrentInputs, RecurrentOutput

register_kind("gdn", config=GDNConfig, inputs=RecurrentInputs)
register_kind("kda", config=KDAConfig, inputs=RecurrentInputs)

# registers the backends; fused is the opt-in one-launch decode ("triton_fused")
from . import fused, reference, triton  # noqa: E402,F401

__all__ = ["GDNConfig", "KDAConfig", "RecurrentInputs", "RecurrentOutput"]
