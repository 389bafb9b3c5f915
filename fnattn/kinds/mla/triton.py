"""MLA on CUDA in the invariant mode (backend ``triton``): every phase in launches whose tiles follow the
dims alone, so a token's output is the same bits in a prefill, a decode and a verify, beside any requests,
padded to any bucket and captured or not.

Three launches a layer: the absorbed query ``[q_nope W_UK, q_pe]`` (`fnattn.kernels.absorb_query` with a fixed
tile of 16 tokens), the latent attention of each token over its cached rows and the step's own new rows up
to itself, key tiles fixed by position (`fnattn.kernels.latent_invariant.latent_attention_invariant`), and
``W_UV`` (`latent_values`, the same fixed token tile). The step's rows are read where they are (the pool below
the request's cache length, the step's ``latent`` at and above it), so nothing is merged in an order that
follows the step.

It serves the invariant mode only: outside it FlashMLA and FlashInfer are faster (their splits and tiles
follow the batch), and `supports` says so. Reads no device value on the host: decode and verify can be
captured.
"""

from __future__ import annotations

import torch

from ...deltas import Writes, writes
from ...kernels.invariant import invariant_on
from ...outputs import AttentionOutput
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ..availability import needs_cuda, needs_dtype, package_missing
from .config import MLAInputs

NAME = "triton"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supports(spec, device) -> list[str]:
    m = spec.config.mla
    reasons = needs_cuda(device) + package_missing("triton") + needs_dtype(spec, _DTYPES)
    if m.fp8_cache:
        reasons.append("an FP8 latent cache (its rows are decoded per read: 'flashinfer' serves it)")
    if not invariant_on():
        reasons.append("serves the invariant mode, which is off (FlashMLA and FlashInfer are faster outside it)")
    return reasons


def _step(spec: LayerSpec, views: Views, inputs: MLAInputs) -> tuple[AttentionOutput, Writes]:
    from ...kernels.latent_absorb import absorb_query
    from ...kernels.latent_invariant import TOKEN_TILE, latent_attention_invariant, latent_values, request_of_token

    m, batch = spec.config.mla, inputs.meta.batch
    q = absorb_query(inputs.q_nope, inputs.q_pe, inputs.w_uk, block_t=TOKEN_TILE)  # [T, H, R + Dr]
    requests = request_of_token(batch.cu_seqlens, batch.num_tokens)  # [T]
    o_lat, lse = latent_attention_invariant(q, views.latent, inputs.latent, batch.block_table, batch.cache_lens,
                                            batch.positions, requests, kv_rank=m.kv_lora_rank,
                                            scale=m.scale)  # [T, H, R] fp32, [T, H]
    return AttentionOutput(o=latent_values(o_lat, inputs.w_uv), lse=lse), writes(latent=inputs.latent)


for _phase in ("prefill", "decode", "verify"):
    _guard = register("mla", _phase, NAME, supports=supports, capturable=_phase != "prefill", invariant=True)(_step)
# The module's name runs only through a session from here on, like every registered backend.
_step = _guard
