"""FlashMLA's sparse kernel (``flash_mla_sparse_fwd``, sglang-kernel 0.4.5) for DeepSeek-V4 attention, every phase.

DeepSeek-V4 attention is MQA with one shared K=V head of 512 dims, which is
FlashMLA's sparse layout (``d_qk = d_v = 512``, one KV head). Each query
attends a list of rows in one flat key array, so the backend names, for every
token, the rows it may see and splits them by where they live:

* cached window rows, as slots of the paged ``kv`` pool (``[P * S, 512]``);
* cached compressed entries (HCA: every closed window; CSA: the indexer's
  top-k), as the slots of their closing tokens in the paged ``comp`` pool;
* this step's own window rows and its new entries, which are not in the
  pools yet (the step writes nothing), as rows of ``cat(kv, new entries)``.

One kernel call per part without sinks, then one merge by log-sum-exp in
which the sink joins the denominator: ``o = sum_i e^lse_i o_i / (sum_i e^lse_i
+ e^sink)``. The kernel takes 64 or 128 query heads: a layer with fewer gets
them from the model (``DSV4Config.padded_heads``), which pads its queries and
slices the output back; the backend never knows the model's own head count.
Lists go to the kernel padded with -1 to a multiple of 128.

Every phase advances the compressors and runs the indexer for all of the
step's tokens at once (`.batched`: shapes from the batch only, no host loop
and no host read), so decode and verify are capturable and the top-k is
computed inside the graph.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from ...deltas import Writes, writes
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ..availability import needs_cuda, needs_dtype, package_missing
from .batched import compressed_entries, merge_with_sink, token_requests
from .config import DSV4Inputs, DSV4Output

LN2 = math.log(2.0)
TOPK_BLOCK = 128
HEAD_DIM = 512
PADDED_HEADS = (64, 128)


def supports(spec, device) -> list[str]:
    c = spec.config
    reasons = needs_cuda(device) + package_missing("sgl_kernel") + needs_dtype(spec, (torch.bfloat16,))
    if c.head_dim != HEAD_DIM:
        reasons.append(f"FlashMLA's sparse kernel takes a {HEAD_DIM}-dim K=V head, the layer has {c.head_dim}")
    if c.heads not in PADDED_HEADS:
        reasons.append(f"FlashMLA's sparse kernel takes {' or '.join(map(str, PADDED_HEADS))} query heads, the "
                       f"layer gives {c.heads} (set DSV4Config.padded_heads)")
    return reasons


def kernel(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float):
    """``flash_mla_sparse_fwd`` of ``q [T, Hp, 512]`` over rows ``idx [T, K]`` (-1: none) of ``kv [N, 512]``:
    ``-> (o [T, Hp, 512] fp32, natural-log lse [T, Hp], -inf for a query without rows)``."""
    from sgl_kernel.flash_mla import flash_mla_sparse_fwd

    pad = -idx.shape[1] % TOPK_BLOCK
    idx = F.pad(idx, (0, pad), value=-1) if pad else idx
    out, _, lse = flash_mla_sparse_fwd(q.contiguous(), kv.reshape(-1, 1, kv.shape[-1]).contiguous(),
                                       idx.to(torch.int32).unsqueeze(1).contiguous(), scale, kv.shape[-1])
    lse = lse * LN2  # the kernel's lse is base 2
    empty = (idx < 0).all(dim=1, keepdim=True) | torch.isnan(lse) | torch.isposinf(lse)
    return out.float(), lse.masked_fill(empty, float("-inf"))


def _rows(batch, positions, req, valid):
    """Paged slots of ``positions`` [T, K] of each token's request ``req`` [T]; -1 where not ``valid``."""
    S = batch.page_size
    p = positions.clamp(min=0)
    page = batch.block_table.long()[req[:, None], p // S]
    return torch.where(valid, page * S + p % S, torch.full_like(p, -1))


def sparse_step(spec: LayerSpec, views: Views, inputs: DSV4Inputs, phase: str):
    c, batch = spec.config, inputs.meta.batch
    device, T, W, m = inputs.q.device, batch.num_tokens, c.sliding_window, c.compress_ratio
    req = token_requests(batch)  # [T] from the device's cu_seqlens: no host tensor, so every phase can be captured
    pos = batch.positions.long()
    c0 = batch.cache_lens.long()[req]  # [T]
    cu = batch.cu_seqlens.long()[req]  # [T] first row of the token's request
    # The window: positions t, t - 1, ..., t - W + 1.
    wpos = pos[:, None] - torch.arange(W, device=device)[None, :]  # [T, W]
    cached_w = _rows(batch, wpos, req, (wpos >= 0) & (wpos < c0[:, None]))
    fresh_w = torch.where(wpos >= c0[:, None], cu[:, None] + wpos - c0[:, None], torch.full_like(wpos, -1))
    parts = [(views.kv, cached_w)]
    step_rows, step_idx = [inputs.kv], [fresh_w]
    values, picks = {"kv": inputs.kv}, None
    if m:
        comp, ent, picks, compressed = compressed_entries(spec, views, inputs, phase, req, pos)
        values.update(compressed)
        first_new = (c0 // m)[:, None]  # entries closed before the step: in the comp pool
        parts.append((views.comp, _rows(batch, ent * m + m - 1, req, (ent >= 0) & (ent < first_new))))
        # the step's own entries: the closing tokens' rows of the step's entry rows, after the T window rows
        closer = cu[:, None] + ent * m + m - 1 - c0[:, None]
        step_rows.append(comp)
        step_idx.append(torch.where(ent >= first_new, T + closer, torch.full_like(ent, -1)))
    parts.append((torch.cat(step_rows), torch.cat(step_idx, dim=1)))
    os, lses = [], []
    for kv, idx in parts:
        if idx.shape[1]:
            o, lse = kernel(inputs.q, kv.reshape(-1, kv.shape[-1]), idx, c.scale)  # [T, 64 | 128, 512]
            os.append(o)
            lses.append(lse)
    o = merge_with_sink(os, lses, inputs.sinks)
    out = DSV4Output(o=o.to(spec.dtype), topk_indices=picks)
    if phase == "verify" and m:
        out = replace(out, replay=replace(inputs, meta=None))
    return out, writes(**values)


@register("dsv4", "prefill", "flashmla", supports=supports)
def prefill(spec: LayerSpec, views: Views, inputs: DSV4Inputs) -> tuple[DSV4Output, Writes]:
    return sparse_step(spec, views, inputs, "prefill")


@register("dsv4", "decode", "flashmla", supports=supports, capturable=True)
def decode(spec: LayerSpec, views: Views, inputs: DSV4Inputs) -> tuple[DSV4Output, Writes]:
    return sparse_step(spec, views, inputs, "decode")


@register("dsv4", "verify", "flashmla", supports=supports, capturable=True)
def verify(spec: LayerSpec, views: Views, inputs: DSV4Inputs) -> tuple[DSV4Output, Writes]:
    return sparse_step(spec, views, inputs, "verify")
