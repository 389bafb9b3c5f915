"""Reference full / GQA attention over a paged K/V cache: prefill, decode, verify.

Each new token attends to its request's cached tokens and to the new tokens up
to itself. The two parts are computed separately and merged by log-sum-exp, so
the step's own K/V never has to be in the cache; they leave as the layer's writes.
In the invariant mode (`fnattn.kernels.invariant`) they are read together instead,
in key tiles fixed by position, so a token's result does not depend on the phase.
"""

from __future__ import annotations

import torch

from ...deltas import Writes, writes
from ...kernels.invariant import invariant_on
from ...outputs import AttentionOutput
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from .config import FullAttentionInputs
from .math import apply_sinks, attend, attend_fixed_order, merge


def cached_tokens(pages: torch.Tensor, block_row: torch.Tensor, n: int, page_size: int) -> torch.Tensor:
    """The first ``n`` tokens of one request from a paged cache ``[P, S, ...]``."""
    used = block_row[: -(-n // page_size)].long()  # ceil(n / S) pages
    return pages.index_select(0, used).flatten(0, 1)[:n]


def paged_attention(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    cfg = spec.config
    batch = inputs.meta.batch
    cu = batch.host_cu_seqlens
    one_request = _fixed_order if invariant_on() else _cached_then_new
    outs, lses = [], []
    for b, n_cached in enumerate(batch.host_cache_lens):
        o, lse = one_request(cfg, views, inputs, b, slice(cu[b], cu[b + 1]), n_cached)
        if cfg.sinks:
            o = apply_sinks(o, lse, inputs.sinks)
        outs.append(o)
        lses.append(lse)
    out = AttentionOutput(o=torch.cat(outs).to(inputs.q.dtype), lse=torch.cat(lses))
    return out, writes(k=inputs.k, v=inputs.v)


def _cached_then_new(cfg, views: Views, inputs: FullAttentionInputs, b: int, rows: slice, n_cached: int):
    """Request ``b``'s queries over its new keys, merged with their attention over its cached keys."""
    batch = inputs.meta.batch
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
    return o, lse


def _fixed_order(cfg, views: Views, inputs: FullAttentionInputs, b: int, rows: slice, n_cached: int):
    """The invariant mode (`fnattn.kernels.invariant`): request ``b``'s queries over its cached and new keys
    together, in key tiles fixed by position, so where the cache ends does not move a split point."""
    batch = inputs.meta.batch
    q, q_pos = inputs.q[rows], batch.positions[rows]  # [n, Hq, D], [n]
    k, v = inputs.k[rows], inputs.v[rows]
    if n_cached:
        k = torch.cat([cached_tokens(views.k, batch.block_table[b], n_cached, batch.page_size), k])  # [m, Hkv, D]
        v = torch.cat([cached_tokens(views.v, batch.block_table[b], n_cached, batch.page_size), v])
    k_pos = torch.cat([torch.arange(n_cached, device=q_pos.device), q_pos])
    return attend_fixed_order(q, k, v, q_pos=q_pos, k_pos=k_pos, scale=cfg.scale,
                              sliding_window=cfg.sliding_window, softcap=cfg.softcap)


# One function per phase, as the registry wants; the reference math is shared.
@register("full", "prefill", "reference", invariant=True)
def prefill(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    return paged_attention(spec, views, inputs)


@register("full", "decode", "reference", invariant=True)
def decode(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    return paged_attention(spec, views, inputs)


@register("full", "verify", "reference", invariant=True)
def verify(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    return paged_attention(spec, views, inputs)
