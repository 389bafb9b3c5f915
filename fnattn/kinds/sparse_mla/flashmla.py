"""FlashMLA's sparse kernel (``flash_mla_sparse_fwd``, sglang-kernel 0.4.5) for sparse MLA, every phase.

The kernel attends each query over the rows named by its indices in one flat key array. Over the
paged latent pool (``[P * S, 1, R + Dr]``) the indexer's absolute positions become physical slots
(``block_table[r, j // S] * S + j % S``) for the cached ones; positions of this step's own tokens
are not in the pool yet, so they are attended separately and merged by LSE: by a second kernel
call over the step's rows (prefill) or in latent space beside the kernel (decode / verify, at most
1 + k rows per request). The indexer runs as the Triton kernel `fnattn.kernels.indexer_topk`, which
reads cached index keys from their pages and the step's keys from the inputs.

The kernel takes 64 or 128 query heads (the model pads: `MLAConfig.padded_heads`), bf16, the 512 + 64
latent, and top-k lists in blocks of 64 (the backend pads them with -1). Decode and verify read no
device value on the host and are capturable. FlashMLA's FP8 sparse kernels use their own 656-byte
row layout with per-tile scales, so a per-tensor FP8 latent cache is refused here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...apply import capturing
from ...deltas import Writes, writes
from ...kernels.invariant import invariant_on
from ...lanes import in_static_step
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ...switches import declare, switched
from ..availability import needs_cuda, needs_dtype, package_missing
from ..mla.flashmla import latent_shape_reasons
from ..mla.latent import absorbed_query, fold_own_rows_out, merge, no_keys_as_neg_inf, uniform_new, values_out
from .config import SparseAttentionOutput, SparseMLAInputs
from .reference import check_reused, own_index_values

LN2 = math.log(2.0)
TOPK_BLOCK = 128  # top-k lists are padded to a multiple of this (the kernel walks them in blocks)
LSE_BASE2 = True  # flash_mla_sparse_fwd returns log2-sum-exp2 (its docstring; its max_logits are log2e-scaled too)
_ONE_PASS = declare(
    "one_pass_slots", True, __name__,
    on="a sparse layer's top-k positions become pool slots, own-row indices and the picked mask in one launch "
       "(`fnattn.kernels.topk_slots`)",
    off="its torch form `topk_slots_ref` (the same values, some fifteen launches)",
    why="a B64 sparse MLA layer on the H200 took 113.5 against 165.2 us through the torch form")


# benchmarks/indexer_sweep.py --keys fp8 (B64, ctx 32k, top-k 2048): the indexer with the radix select and its
# one-launch sort 256.5 us against 639.2 through the ordered top-k on the H200 (c8a6db6), 259.8 against 428.6 on an
# H100 (dc6cd1a)
_RADIX = declare(
    "radix_select", True, __name__,
    on="a layer's own top-k of 2048 is selected by sgl_kernel's radix select (`fnattn.kernels.radix_topk`), its "
       "picks sorted by position in one launch; the invariant mode keeps the ordered top-k",
    off="`fnattn.kernels.indexer.ordered_topk`: torch.topk over keys of score then earlier position",
    why="on: the indexer took 256.5 against 639.2 us with it (H200, B64, 32k, FP8 keys; the one-launch sort 18.9 us "
        "of it). Where more than 16384 of a row's scores share its first pass's bin it may keep another set than "
        "torch.topk, not the same every run: the invariant mode, or this switch off, keeps the ordered top-k")

def radix_select(enabled: bool):
    """Within this block a layer's own top-k (2048) is selected by sgl_kernel's radix select
    (`fnattn.kernels.radix_topk`: the same set as ``torch.topk``'s where scores are distinct, ordered by
    position; the default outside the invariant mode) or by `fnattn.kernels.indexer.ordered_topk`; other top-k
    sizes keep the ordered top-k."""
    return switched(_RADIX, "radix_select", enabled)


# mla_merge_layers.json (9a881b6): the own-row merge and W_UV in one launch in the sparse layer (B x ctx 32k, top-k
# 2048) 91.0 against 91.6 us at B8, 117.7 against 110.7 at B64 (111.8 at its best tile): off, unlike dense MLA's.
_MERGE_VALUES = declare(
    "sparse_merge_values_kernel", False, __name__,
    on="a sparse decode token's own-row merge and W_UV take one launch "
       "(`fnattn.kernels.latent_absorb.merge_own_values`)",
    off="the merge kernel and a batched product",
    why="in the sparse layer (ctx 32k, top-k 2048) on the H200 it took 91.0 against 91.6 us at B8 but 117.7 "
        "against 110.7 at B64: off, unlike dense MLA's")


def merge_values_kernel(enabled: bool):
    """Within this block a sparse decode token's own-row merge and ``W_UV`` take one launch
    (`fnattn.kernels.latent_absorb.merge_own_values`) instead of the merge kernel and a batched product (the
    default)."""
    return switched(_MERGE_VALUES, "sparse_merge_values_kernel", enabled)


def one_pass_slots(enabled: bool):
    """Within this block the top-k positions become pool slots, own-row indices and the picked mask in one
    launch (`fnattn.kernels.topk_slots`, the default) or through its torch form `topk_slots_ref` (the same
    values, some fifteen launches)."""
    return switched(_ONE_PASS, "one_pass_slots", enabled)


def supports(spec, device) -> list[str]:
    m = spec.config.mla
    reasons = needs_cuda(device) + package_missing("sgl_kernel") + package_missing("triton")
    reasons += needs_dtype(spec, (torch.bfloat16,)) + latent_shape_reasons(m)
    if m.heads not in (64, 128):
        reasons.append(f"FlashMLA's sparse kernel takes 64 or 128 query heads, the layer gives {m.heads} "
                       "(set MLAConfig.padded_heads)")
    if m.fp8_cache:
        reasons.append("FlashMLA's FP8 sparse kernels read their own 656-byte rows with per-tile scales, not "
                       "a per-tensor FP8 latent cache")
    return reasons


def select(spec, views: Views, inputs: SparseMLAInputs, index_values: dict) -> torch.Tensor:
    """The step's top-k positions ``[T, topk]`` int64 (-1 padded): the layer's own indexer over its cached keys
    and ``index_values`` (the step's keys as the cache will store them: `SparseMLAConfig.index_writes`), or the
    reused ones."""
    if spec.config.index_source_layer is not None:
        # The check reads device values on the host; a captured step skips it (its eager warm-up ran it).
        # (and a static-shape step, captured or not, reads nothing back: both give the same bits)
        return inputs.topk_indices if capturing() or in_static_step() else check_reused(spec, inputs)
    from ...kernels import indexer_topk

    b, ix = inputs.meta.batch, spec.config.indexer
    scales = dict(cache_scale=views.index_k_scale, new_scale=index_values["index_k_scale"]) if ix.fp8_keys else {}
    return indexer_topk(inputs.index_q, inputs.index_w, views.index_k, index_values["index_k"], b.block_table,
                        inputs.sparse.request_of_token, b.cache_lens, b.cu_seqlens, b.positions,
                        scale=ix.head_dim ** -0.5, topk=inputs.sparse.topk, radix=_RADIX[-1] and not invariant_on(),
                        **scales)


def sparse_kernel(q, kv, indices, scale, R, *, natural: bool = True):
    """``flash_mla_sparse_fwd`` over ``kv [N, Dq]`` at ``indices [T, topk]``: latent out, natural-log LSE
    (``-inf``: no key). ``natural=False``: the kernel's own LSE (base 2 when `LSE_BASE2`, +inf: no key), for
    a merge that reads those marks itself."""
    from sgl_kernel.flash_mla import flash_mla_sparse_fwd

    pad = -indices.shape[1] % TOPK_BLOCK
    idx = F.pad(indices, (0, pad), value=-1) if pad else indices
    out, _, lse = flash_mla_sparse_fwd(q, kv.view(-1, 1, kv.shape[-1]), idx.to(torch.int32).unsqueeze(1).contiguous(),
                                       scale, R)
    if not natural:
        return out, lse
    return out, no_keys_as_neg_inf(lse * LN2 if LSE_BASE2 else lse)  # a query with no key: zero output


def sparse_step(spec: LayerSpec, views: Views, inputs: SparseMLAInputs, phase: str):
    m, batch = spec.config.mla, inputs.meta.batch
    R = m.kv_lora_rank
    index_values = own_index_values(spec, inputs)
    selected = select(spec, views, inputs, index_values)  # [T, topk]
    n = 0 if phase == "prefill" else uniform_new(batch, "sparse_mla flashmla")
    # pool slots of the cached positions, rows of the step's own ones (prefill), and which of its request's
    # new rows each token picked (decode / verify): one launch, or the same in torch ops
    from ...kernels.sparse_slots import topk_slots, topk_slots_ref

    translate = topk_slots if _ONE_PASS[-1] else topk_slots_ref
    slots, rows, picked = translate(selected, inputs.sparse.request_of_token, batch.cache_lens, batch.cu_seqlens,
                                    batch.block_table, page_size=batch.page_size, pad_to=TOPK_BLOCK,
                                    rows=phase == "prefill", new=n)
    q = absorbed_query(inputs)  # [T, H, R + Dr]
    # decode / verify: the merge with the own rows reads the kernel's own LSE and no-key marks
    o_c, lse_c = sparse_kernel(q, views.latent, slots, m.scale, R, natural=phase == "prefill")
    if phase == "prefill":
        o_n, lse_n = sparse_kernel(q, inputs.latent, rows, m.scale, R)
        o_lat, lse = merge(o_c, lse_c, o_n, lse_n)
        o = values_out(o_lat, inputs.w_uv)
    else:
        o, lse = fold_own_rows_out(q, o_c, lse_c, inputs.latent, inputs.w_uv, n=n, scale=m.scale, allowed=picked,
                                   lse_base2=LSE_BASE2, one_launch=_MERGE_VALUES[-1])
    out = SparseAttentionOutput(o=o, lse=lse, topk_indices=selected)
    return out, writes(latent=inputs.latent, **index_values)


@register("sparse_mla", "prefill", "flashmla", supports=supports)
def prefill(spec: LayerSpec, views: Views, inputs: SparseMLAInputs) -> tuple[SparseAttentionOutput, Writes]:
    return sparse_step(spec, views, inputs, "prefill")


@register("sparse_mla", "decode", "flashmla", supports=supports, capturable=True)
def decode(spec: LayerSpec, views: Views, inputs: SparseMLAInputs) -> tuple[SparseAttentionOutput, Writes]:
    return sparse_step(spec, views, inputs, "decode")


@register("sparse_mla", "verify", "flashmla", supports=supports, capturable=True)
def verify(spec: LayerSpec, views: Views, inputs: SparseMLAInputs) -> tuple[SparseAttentionOutput, Writes]:
    return sparse_step(spec, views, inputs, "verify")
