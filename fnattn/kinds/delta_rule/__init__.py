"""The gated delta rule pair: Gated DeltaNet (Qwen3-Next, Qwen3.5) and Kimi Delta Attention (Kimi Linear).

Both keep a recurrent state and a conv window per request (a ring of rows per
slot, see `fnattn.State`) and take the same inputs; ``reference`` runs the
chunked prefill and the token-by-token decode/verify in torch, ``triton`` the
kernels of `fnattn.kernels`, ``fla`` fla-core's chunked prefill, ``torch`` the CPU
decode of every request at once.
"""

from ...declare import register_kind
from .config import GDNConfig, KDAConfig, RecurrentInputs, RecurrentOutput

register_kind("gdn", config=GDNConfig, inputs=RecurrentInputs)
register_kind("kda", config=KDAConfig, inputs=RecurrentInputs)

# registers the backends: "triton_fused" (one-launch decode), "triton", "fla", "torch" (batched CPU decode)
from . import batched, fused, reference, triton  # noqa: E402,F401

__all__ = ["GDNConfig", "KDAConfig", "RecurrentInputs", "RecurrentOutput"]
