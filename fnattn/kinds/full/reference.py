"""Reference full / GQA attention over a paged K/V cache: prefill, decode, verify.

Each new token attends to its request's cached tokens and to the new tokens up
to itself. The two parts are computed separately and merged by log-sum-exp, so
the step's own K/V never has to be in the cache; they leave as the layer's writes.
"""

from __future__ import annotations

import torch

from ...deltas import Writes, writes
from ...outputs import AttentionOutput
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from .config import FullAttentionInputs
from .math import apply_sinks, attend, merge


def cached_tokens(pages: torch.Tensor, block_row: torch.Tensor, n: int, page_size: int) -> torch.Tensor:
    """The first ``n`` tokens of one request from a paged cache ``[P, S, ...]``."""
    used = block_row[: -(-n // page_size)].long()  # ceil(n / S) pages
    return pages.index_select(0, used).flatten(0, 1)[:n]


def paged_attention(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    cfg = spec.config
    batch = inputs.meta.batch
    cu = batch.host_cu_seqlens
    outs, lses = [], []
    for b, n_cached in enumerate(batch.host_cache_lens):
        rows = slice(cu[b], cu[b + 1])
        q, q_pos = inputs.q[rows], batch.positions[rows]  # [n, Hq, D], [n]
        o, lse = attend(q, inputs.k[rows], inputs.v[rows], q_pos=q_pos, k_pos=q_pos, scale=cfg.scale,
                        sliding_window=cfg.sliding_window, softcap=cfg.softcap)
        if n_cached:
            kc = cached_tokens(views.k, batch.block_table[b], n_cached, batch.page_size)  # [m, Hkv, D]
            vc = cached_tokens(views.v, batch.block_table[b], n_cached, batch.page_size)  # [m, Hkv, Dv]
            k_pos = torch.arange(n_cached, device=q_pos.device)
            oc, lsec = attend(q, kc, vc, q_pos=q_pos, k_pos=k_pos, scale=cfg.scale,
                              sliding_window=cfg.sliding_window, softcap=cfg.softcap)
            o, lse = merge(oc, lsec, o, lse)
        if cfg.sinks:
            o = apply_sinks(o, lse, inputs.sinks)
        outs.append(o)
        lses.append(lse)
    out = AttentionOutput(o=torch.cat(outs).to(inputs.q.dtype), lse=torch.cat(lses))
    return out, writes(k=inputs.k, v=inputs.v)


# One function per phase, as the registry wants; the reference math is shared.
@register("full", "prefill", "reference")
def prefill(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    return paged_attention(spec, views, inputs)


@register("full", "decode", "reference")
def decode(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    return paged_attention(spec, views, inputs)


@register("full", "verify", "reference")
def verify(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    return paged_attention(spec, views, inputs)
