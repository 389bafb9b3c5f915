"""Gated DeltaNet (GDN, Qwen3-Next / Qwen3.5) and Kimi Delta Attention (KDA) kernels.

Plain tensors in and out, state pools only read. One entry point per algorithm; the
decay shape picks the variant: g [T, HV] is GDN (scalar log decay per head),
g [T, HV, K] is KDA (per-key-channel log decay).

    gated_delta_recurrent   decode / verify: token by token, optional state after every token
    gated_delta_chunked     prefill: chunked WY form with tensor-core dots
    causal_conv1d           the short depthwise conv in front of q/k/v, windowed state

Each has a pure-torch `*_ref` beside it with the same pooled contract: a loop over the
requests around the single-sequence fp32 math of gdn_naive (causal_conv1d_seq,
gated_delta_recurrent_seq, gated_delta_chunked_seq), which is also what
fnattn.kinds.delta_rule.conv / .math run. gated_delta_chunked_ref runs the chunked
algorithm in torch so tests can show chunked == recurrent.
"""

from .gdn_chunk import chunk_indices, gated_delta_chunked, gated_delta_chunked_ref
from .gdn_conv import causal_conv1d, causal_conv1d_ref
from .gdn_recurrent import gated_delta_recurrent, gated_delta_recurrent_ref

__all__ = [
    "causal_conv1d",
    "causal_conv1d_ref",
    "chunk_indices",
    "gated_delta_chunked",
    "gated_delta_chunked_ref",
    "gated_delta_recurrent",
    "gated_delta_recurrent_ref",
]
