"""FlashMLA (sglang-kernel 0.4.5, ``sgl_kernel.flash_mla``) for MLA decode and verify.

The step's own latent rows are not in the cache while it runs: FlashMLA attends every new token
over its request's cached rows (not causal: each sees the whole cached prefix) and the new rows
are attended in latent space beside it (at most 1 + k per request), the two merged by LSE. The
query is absorbed (``q_nope W_UK``, then ``q_pe``), so the kernel reads the cache as it is stored.

FlashMLA takes pages of 64 tokens and the 512 + 64 latent of DeepSeek-V3. Its plan is
``get_mla_metadata`` on the batch's ``cache_lens`` tensor, a device op, so decode and verify are
capturable. Its dense FP8 kernel wants an FP8 query as well; a per-tensor FP8 latent cache is
served by the FlashInfer backend instead (`.flashinfer`).
"""

from __future__ import annotations

from ...deltas import Writes, writes
from ...outputs import AttentionOutput
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ..availability import needs_cuda, needs_dtype, package_missing
from .config import MLAInputs
from .latent import absorbed_query, fold_own_rows_out, uniform_new

PAGE_SIZE = 64  # FlashMLA's paged-cache block size


def latent_shape_reasons(m) -> list[str]:
    if (m.kv_lora_rank, m.qk_rope_head_dim) != (512, 64):
        return [f"latent {m.kv_lora_rank} + {m.qk_rope_head_dim} is not FlashMLA's 512 + 64"]
    return []


def supports(spec, device) -> list[str]:
    m = spec.config.mla
    reasons = needs_cuda(device) + package_missing("sgl_kernel") + needs_dtype(spec) + latent_shape_reasons(m)
    if m.heads > 128:
        reasons.append(f"{m.heads} query heads > 128")
    if m.fp8_cache:
        reasons.append("FlashMLA's dense FP8 kernel needs an FP8 query too; the per-tensor FP8 latent cache is "
                       "served by 'flashinfer'")
    return reasons


def plan(specs, batch, lease):
    from sgl_kernel.flash_mla import get_mla_metadata

    n = uniform_new(batch, "mla flashmla")
    meta, splits = get_mla_metadata(batch.cache_lens, n * specs[0].config.mla.heads, 1)
    return {"meta": meta, "splits": splits, "n": n}


def cached_part(spec, views, inputs, q):
    """FlashMLA over each request's cached rows: latent output [T, H, R] and natural-log LSE [T, H] as it
    leaves them (+inf for a query without a cached key: `fold_own_rows` reads that mark)."""
    from sgl_kernel.flash_mla import flash_mla_with_kvcache

    m, batch, p = spec.config.mla, inputs.meta.batch, inputs.meta.plan
    T, H, D = q.shape
    n = p["n"]
    out, lse = flash_mla_with_kvcache(q.view(T // n, n, H, D), views.latent.unsqueeze(2), batch.block_table,
                                      batch.cache_lens, m.kv_lora_rank, p["meta"], p["splits"],
                                      softmax_scale=m.scale, causal=False)  # [B, n, H, R], [B, H, n]
    return out.view(T, H, -1), lse.transpose(1, 2).reshape(T, H)


def _step(spec: LayerSpec, views: Views, inputs: MLAInputs) -> tuple[AttentionOutput, Writes]:
    m = spec.config.mla
    q = absorbed_query(inputs)  # [T, H, R + Dr]
    o_c, lse_c = cached_part(spec, views, inputs, q)
    o, lse = fold_own_rows_out(q, o_c, lse_c, inputs.latent, inputs.w_uv, n=inputs.meta.plan["n"], scale=m.scale,
                               cache_lens=inputs.meta.batch.cache_lens)
    return AttentionOutput(o=o, lse=lse), writes(latent=inputs.latent)


register("mla", "decode", "flashmla", supports=supports, plan=plan, capturable=True, page_size=PAGE_SIZE)(_step)
_step = register("mla", "verify", "flashmla", supports=supports, plan=plan, capturable=True,
                 page_size=PAGE_SIZE)(_step)
