"""FlashInfer's MLA path (``BatchMLAPagedAttentionWrapper``, flashinfer-python 0.6.18) for decode and verify.

The second dense MLA backend: any page size, and the FP8 e4m3 latent cache with its per-tensor scale
(FlashInfer's fa3 kernels take ``ckv_scale`` / ``kpe_scale``). As with FlashMLA the cache is attended
without the step's own rows (not causal) and those are merged by LSE (`.latent`). The wrapper plans
on the host (it copies the page layout to the CPU), so this backend is not capturable. FlashInfer
reports LSE in base 2; the outputs here use the natural log.
"""

from __future__ import annotations

import torch

from ...deltas import Writes, writes
from ...outputs import AttentionOutput
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ..availability import needs_cuda, needs_dtype, package_missing
from ..full.flashinfer import cache_layout
from .config import MLAInputs
from .flashmla import latent_shape_reasons
from .latent import absorbed_query, fold_own_rows_out, uniform_new

_WORKSPACE_BYTES = 128 * 1024 * 1024


def supports(spec, device) -> list[str]:
    m = spec.config.mla
    reasons = needs_cuda(device) + package_missing("flashinfer") + latent_shape_reasons(m)
    reasons += needs_dtype(spec, (torch.bfloat16,) if m.fp8_cache else (torch.bfloat16, torch.float16))
    if m.heads > 128:
        reasons.append(f"{m.heads} query heads > 128")
    return reasons


def plan(specs, batch, lease):
    import flashinfer

    spec = specs[0]
    m, device = spec.config.mla, lease.workspace.device
    n = uniform_new(batch, "mla flashinfer")

    def build():
        buf = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return flashinfer.mla.BatchMLAPagedAttentionWrapper(buf, backend="auto")

    w = lease.cached(("fi_mla", m, spec.dtype), build)
    B = batch.num_requests
    qo_indptr = torch.arange(0, B * n + 1, n, dtype=torch.int32, device=device)
    indptr, indices, _ = cache_layout(batch, device)
    kv_lens = torch.tensor(batch.host_cache_lens, dtype=torch.int32, device=device)
    w.plan(qo_indptr, indptr, indices, kv_lens, m.heads, m.kv_lora_rank, m.qk_rope_head_dim, batch.page_size,
           False, m.scale, spec.dtype, m.latent_dtype(spec.dtype))
    return {"wrapper": w, "n": n}


def _step(spec: LayerSpec, views: Views, inputs: MLAInputs) -> tuple[AttentionOutput, Writes]:
    m, batch, p = spec.config.mla, inputs.meta.batch, inputs.meta.plan
    R, n = m.kv_lora_rank, p["n"]
    q = absorbed_query(inputs)  # [T, H, R + Dr]
    scales = dict(ckv_scale=m.cache_scale, kpe_scale=m.cache_scale) if m.fp8_cache else {}
    o_c, lse_c = p["wrapper"].run(q[..., :R], q[..., R:], views.latent[..., :R], views.latent[..., R:],
                                  return_lse=True, **scales)  # [T, H, R], [T, H] base 2
    # the step's own rows at the cache's precision, as a later step reads them back; an empty cache part's
    # output is undefined here (cache_lens marks it)
    o, lse = fold_own_rows_out(q, o_c, lse_c, m.as_cached(inputs.latent), inputs.w_uv, n=n, scale=m.scale,
                               lse_base2=True, cache_lens=batch.cache_lens)
    return AttentionOutput(o=o, lse=lse), writes(latent=m.encode_latent(inputs.latent))


register("mla", "decode", "flashinfer", supports=supports, plan=plan)(_step)
_step = register("mla", "verify", "flashinfer", supports=supports, plan=plan)(_step)
