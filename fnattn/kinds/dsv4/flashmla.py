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

Decode advances every request's compressor and runs the indexer at once
(`.decode`: shapes from the batch only, no host reads), so it is capturable
and the top-k is computed inside the graph. Prefill and verify run the
reference's compressor and indexer request by request (host loops).
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
from .config import DSV4Inputs, DSV4Output
from .decode import compressor_step, decode_top_k, max_entries
from .reference import _branch, _top_k

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
    if phase == "decode":  # one token per request: no host tensor to build inside a captured step
        req = torch.arange(batch.num_requests, device=device)
    else:
        lens = torch.tensor(batch.host_new_lens, device=device)
        req = torch.repeat_interleave(torch.arange(batch.num_requests, device=device), lens)  # [T]
    pos = batch.positions.long()
    c0 = batch.cache_lens.long()[req]  # [T]
    cu = batch.cu_seqlens.long()[req]  # [T] first row of the token's request
    # The window: positions t, t - 1, ..., t - W + 1.
    wpos = pos[:, None] - torch.arange(W, device=device)[None, :]  # [T, W]
    cached_w = _rows(batch, wpos, req, (wpos >= 0) & (wpos < c0[:, None]))
    fresh_w = torch.where(wpos >= c0[:, None], cu[:, None] + wpos - c0[:, None], torch.full_like(wpos, -1))
    parts = [(views.kv, cached_w)]
    step_rows, step_idx = [inputs.kv], [fresh_w]
    per_token = phase == "verify" and batch.recovery != "replay"
    values, picks = {"kv": inputs.kv}, None
    if m and phase == "decode":
        ent, new_rows, fresh_e, more = _decode_compressor(spec, views, inputs, batch)
        values.update(more)
        picks = ent if c.indexer is not None else None
        parts.append((views.comp, _rows(batch, ent * m + m - 1, req, (ent >= 0) & (ent < (c0 // m)[:, None]))))
        step_rows.append(new_rows)
        step_idx.append(fresh_e)
    elif m:
        ent, new_entries, more = _compressor_per_request(spec, views, inputs, batch, per_token)
        values.update(more)
        picks = ent if c.indexer is not None else None
        first_new = (c0 // m)[:, None]  # entries closed before the step: in the comp pool
        cached_e = _rows(batch, ent * m + m - 1, req, (ent >= 0) & (ent < first_new))
        counts = torch.tensor([e.shape[0] for e in new_entries], device=device)
        offset = T + torch.cumsum(counts, 0) - counts  # row of each request's first new entry in the step array
        fresh_e = torch.where(ent >= first_new, offset[req][:, None] + ent - first_new, torch.full_like(ent, -1))
        parts.append((views.comp, cached_e))
        step_rows += new_entries
        step_idx.append(fresh_e)
    parts.append((torch.cat(step_rows), torch.cat(step_idx, dim=1)))
    os, lses = [], []
    for kv, idx in parts:
        if idx.shape[1]:
            o, lse = kernel(inputs.q, kv.reshape(-1, kv.shape[-1]), idx, c.scale)  # [T, 64 | 128, 512]
            os.append(o)
            lses.append(lse)
    o = _merge_with_sink(os, lses, inputs.sinks)
    out = DSV4Output(o=o.to(spec.dtype), topk_indices=picks)
    if phase == "verify" and m:
        out = replace(out, replay=replace(inputs, meta=None))
        if batch.recovery == "replay":
            values = {k: v for k, v in values.items() if k not in ("comp_state", "index_state")}
    return out, writes(**values)


def _compressor_per_request(spec, views, inputs, batch, per_token: bool):
    """Prefill and verify: the reference's compressor and indexer, request by request.

    ``-> (entry ids [T, E] each token attends, -1 padded; each request's new entries; writes)``."""
    c, device, m = spec.config, inputs.q.device, spec.config.compress_ratio
    cu_host = batch.host_cu_seqlens
    comp_rows, comp_states, index_rows, index_states, picked, new_entries = [], [], [], [], [], []
    for b in range(batch.num_requests):
        rows = slice(cu_host[b], cu_host[b + 1])
        br = _branch(spec, views, batch, b, rows, kv_in=inputs.comp_kv, gate_in=inputs.comp_gate,
                     norm=inputs.comp_norm, inv_freq=inputs.comp_inv_freq, store="comp", state="comp_state",
                     per_token_states=per_token)
        comp_rows.append(br.new_rows)
        comp_states.append(br.states)
        c0, n, E = batch.host_cache_lens[b], batch.host_new_lens[b], br.entries.shape[0]
        new_entries.append(br.entries[c0 // m:])
        q_pos = torch.arange(c0, c0 + n, device=device)
        visible = torch.arange(E, device=device)[None, :] < ((q_pos + 1) // m)[:, None]  # [n, E]
        if c.indexer is not None:
            ix = _branch(spec, views, batch, b, rows, kv_in=inputs.index_kv, gate_in=inputs.index_gate,
                         norm=inputs.index_norm, inv_freq=inputs.comp_inv_freq, store="index_k",
                         state="index_state", per_token_states=per_token)
            index_rows.append(ix.new_rows)
            index_states.append(ix.states)
            picked.append(_top_k(inputs, rows, ix.entries, visible, c.indexer))  # [n, topk]
        else:
            picked.append(torch.where(visible, torch.arange(E, device=device)[None, :], -1))
    width = max(p.shape[1] for p in picked)
    ent = torch.cat([F.pad(p, (0, width - p.shape[1]), value=-1) for p in picked])  # [T, width]
    more = {"comp": torch.cat(comp_rows), "comp_state": torch.cat(comp_states)}
    if c.indexer is not None:
        more.update(index_k=torch.cat(index_rows), index_state=torch.cat(index_states))
    return ent, new_entries, more


def _decode_compressor(spec, views, inputs, batch):
    """Decode, every request at once (`.decode`): ``-> (entry ids [B, E], the new entries [B, D], their
    rows in the step array [B, E], writes)``."""
    c, B, m = spec.config, batch.num_requests, spec.config.compress_ratio
    c0 = batch.cache_lens.long()
    entry, closes, ring = compressor_step(spec, views, batch, kv_in=inputs.comp_kv, gate_in=inputs.comp_gate,
                                          norm=inputs.comp_norm, inv_freq=inputs.comp_inv_freq, state="comp_state")
    more = {"comp": entry, "comp_state": ring}
    if c.indexer is not None:
        ientry, _, iring = compressor_step(spec, views, batch, kv_in=inputs.index_kv, gate_in=inputs.index_gate,
                                           norm=inputs.index_norm, inv_freq=inputs.comp_inv_freq,
                                           state="index_state")
        ent = decode_top_k(views, batch, inputs.index_q, inputs.index_w, ientry, closes, c.indexer, m)
        more.update(index_k=ientry, index_state=iring)
    else:
        j = torch.arange(max_entries(batch, m), device=c0.device)[None, :]
        ent = torch.where(j < ((c0 + 1) // m)[:, None], j, torch.full_like(j, -1))
    own = (ent == (c0 // m)[:, None]) & closes[:, None]  # the entry the token closes: row B + b of the step array
    fresh = torch.where(own, B + torch.arange(B, device=c0.device)[:, None], torch.full_like(ent, -1))
    return ent, entry, fresh, more


def _merge_with_sink(os, lses, sinks):
    """``sum_i e^lse_i o_i / (sum_i e^lse_i + e^sink)`` over the parts, fp32."""
    lse = torch.stack(lses)  # [P, T, H]
    top = lse.max(dim=0).values
    if sinks is not None:
        top = torch.maximum(top, sinks.float()[None, :])
    w = torch.exp(lse - top[None])  # [P, T, H]
    den = w.sum(dim=0)
    if sinks is not None:
        den = den + torch.exp(sinks.float()[None, :] - top)
    num = sum(wi[..., None] * oi for wi, oi in zip(w, os))
    return num / den[..., None]


@register("dsv4", "prefill", "flashmla", supports=supports)
def prefill(spec: LayerSpec, views: Views, inputs: DSV4Inputs) -> tuple[DSV4Output, Writes]:
    return sparse_step(spec, views, inputs, "prefill")


@register("dsv4", "decode", "flashmla", supports=supports, capturable=True)
def decode(spec: LayerSpec, views: Views, inputs: DSV4Inputs) -> tuple[DSV4Output, Writes]:
    return sparse_step(spec, views, inputs, "decode")


@register("dsv4", "verify", "flashmla", supports=supports)
def verify(spec: LayerSpec, views: Views, inputs: DSV4Inputs) -> tuple[DSV4Output, Writes]:
    return sparse_step(spec, views, inputs, "verify")
