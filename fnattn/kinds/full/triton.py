"""Triton backends for full / GQA attention (fnattn.kernels.paged_attention).

The step's own K/V enter the kernels as extra inputs and are folded into the
same online softmax as the cached tokens: one launch per layer, no merge, no
write. Decode uses the split-K decode kernel; prefill and verify the varlen
kernel over the paged prefix plus the causal new tokens. In the invariant mode (`fnattn.kernels.invariant`) every
phase takes the kernels' invariant launch: a token alone in its programs, its keys in tiles fixed by position, no
split, so its output is the same bits in a decode, a verify and a prefill, beside any other requests.
"""

from __future__ import annotations

from ...deltas import Writes, writes
from ...kernels.invariant import invariant_on
from ...outputs import AttentionOutput
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ..availability import needs_cuda, needs_dtype, package_missing
from .config import FullAttentionInputs


def supports(spec, device) -> list[str]:
    c = spec.config
    reasons = needs_cuda(device) + package_missing("triton") + needs_dtype(spec)
    for name in ("head_dim", "head_dim_v"):
        if not 16 <= getattr(c, name) <= 256:
            reasons.append(f"{name}={getattr(c, name)} outside 16..256")
    return reasons


def _decode(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    from ...kernels import paged_decode

    c, batch = spec.config, inputs.meta.batch
    o, lse = paged_decode(inputs.q, views.k, views.v, batch.block_table, batch.cache_lens,
                          k_new=inputs.k, v_new=inputs.v, scale=c.scale, softcap=c.softcap,
                          sliding_window=c.sliding_window, sinks=inputs.sinks, invariant=invariant_on())
    return AttentionOutput(o=o, lse=lse), writes(k=inputs.k, v=inputs.v)


def _varlen(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    from ...kernels import paged_prefill

    c, batch = spec.config, inputs.meta.batch
    o, lse = paged_prefill(inputs.q, inputs.k, inputs.v, batch.cu_seqlens, views.k, views.v, batch.block_table,
                           batch.cache_lens, scale=c.scale, softcap=c.softcap, sliding_window=c.sliding_window,
                           sinks=inputs.sinks, max_new_len=max(batch.host_new_lens), invariant=invariant_on())
    return AttentionOutput(o=o, lse=lse), writes(k=inputs.k, v=inputs.v)


# Decode's launch is sized by the block table's width and verify's by its 1 + k tokens: both capturable.
_decode = register("full", "decode", "triton", supports=supports, capturable=True, invariant=True)(_decode)
register("full", "prefill", "triton", supports=supports, invariant=True)(_varlen)
_varlen = register("full", "verify", "triton", supports=supports, capturable=True, invariant=True)(_varlen)
