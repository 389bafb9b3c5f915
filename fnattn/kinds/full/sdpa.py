"""CPU backend for full / GQA attention: torch's fused SDPA kernel, prefill, decode and verify.

The reference is the truth and stays loop-by-loop fp32; this is the CPU
default. It calls the kernel ``F.scaled_dot_product_attention`` dispatches to
on CPU (``aten._scaled_dot_product_flash_attention_for_cpu``) directly, for
two reasons:

- it also returns the log-sum-exp, which the output carries like every other
  backend's (and which merges the cached part with the new tokens);
- GQA without copies. ``enable_gqa=True`` on CPU takes the math path, which
  repeats K/V to every query head (measured at ctx 8192, 8q/2kv d256, one
  thread: 7.6 ms fp32 / 26 ms bf16, against 2.7 / 2.2 ms here). Instead the
  ``g = Hq / Hkv`` query heads of one K/V head are folded into the query axis,
  so each K/V head is read once by ``g * n`` query rows.

A decode token attends to its cache and to itself in one call (the new row is
appended to the gathered cache; no mask is needed). Several new tokens attend
to the cache (folded, no mask) and to themselves (causal, K/V repeated over the
group: only the step's own rows are copied), merged by LSE. Sliding windows
become boolean masks. Softcap, sinks and ``head_dim_v != head_dim`` are the
reference's: the fused kernel has no softcap and wants one head size. In the
invariant mode (`fnattn.kernels.invariant`) a step goes to the reference's
fixed-order form instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...deltas import Writes, writes
from ...kernels.invariant import invariant_on
from ...outputs import AttentionOutput
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ..cpu_sdpa import additive_mask, flash, fold_heads, heads_first, unfold_heads, without_blind_rows
from ..cpu_sdpa import supports as cpu_supports
from .config import FullAttentionInputs
from .math import merge
from .reference import cached_tokens, paged_attention


def supports(spec, device) -> list[str]:
    c, reasons = spec.config, cpu_supports(spec, device)
    if c.softcap:
        reasons.append("softcap: torch's fused SDPA has no score cap")
    if c.sinks:
        reasons.append("sinks are the reference's on CPU")
    if c.head_dim_v != c.head_dim:
        reasons.append("head_dim_v != head_dim (the fused CPU kernel wants one head size)")
    return reasons


def _visible(q_pos: Tensor, k_pos: Tensor, window: int, *, causal: bool) -> Tensor:
    """Boolean ``[n, m]``: query at ``q_pos[i]`` sees key at ``k_pos[j]``."""
    diff = q_pos[:, None] - k_pos[None, :]
    visible = diff >= 0 if causal else torch.ones_like(diff, dtype=torch.bool)
    return visible & (diff < window) if window else visible


def _one_request(c, q, k, v, kc, vc, q_pos, n_cached) -> tuple[Tensor, Tensor]:
    """``n`` new tokens over ``n_cached`` cached ones and themselves: ``(o [n, Hq, D], lse [n, Hq])``."""
    n, g, scale, W, dt = q.shape[0], c.group_size, c.scale, c.sliding_window, q.dtype
    if n == 1:  # decode: the token sees its cache (within the window) and itself; one call, no merge
        keys = k if kc is None else _with_row(kc, n_cached, k)
        vals = v if vc is None else _with_row(vc, n_cached, v)
        mask = None
        if W:
            seen = _visible(q_pos, torch.arange(n_cached + 1, device=q.device), W, causal=False)
            mask = additive_mask(seen, dt, g)
        o, lse = flash(fold_heads(q, g), heads_first(keys), heads_first(vals), attn_mask=mask, scale=scale)
        return unfold_heads(o, lse, n, g)
    # The new tokens among themselves: causal (square, so top-left aligned), K/V repeated over the group
    # (only the step's own rows are copied).
    kr, vr = (heads_first(x.repeat_interleave(g, dim=1)) for x in (k, v))
    mask = additive_mask(_visible(q_pos, q_pos, W, causal=True), dt) if W else None
    o, lse = flash(heads_first(q), kr, vr, is_causal=mask is None, attn_mask=mask, scale=scale)
    o, lse = o[0].transpose(0, 1), lse[0].transpose(0, 1)  # [n, Hq, D], [n, Hq]
    if kc is None:
        return o, lse
    mask, visible = None, None
    if W:
        visible = _visible(q_pos, torch.arange(n_cached, device=q.device), W, causal=False)  # [n, m]
        mask = additive_mask(visible, dt, g)
    oc, lsec = flash(fold_heads(q, g), heads_first(kc), heads_first(vc), attn_mask=mask, scale=scale)
    oc, lsec = unfold_heads(oc, lsec, n, g)
    if visible is not None:  # a row with no cached key in the window: the merge wants lse = -inf
        oc, lsec = without_blind_rows(oc, lsec, visible)
    o, lse = merge(oc, lsec, o, lse)
    return o, lse


def _gather(pages: Tensor, block_row: Tensor, n: int, page_size: int, room: int) -> Tensor:
    """The first ``n`` cached tokens of one request, in a fresh ``[used pages * S + room, ...]`` buffer whose rows
    past ``n`` are free: a decode step appends its own row there instead of copying the cache again."""
    used = block_row[: -(-n // page_size)].long()
    buf = pages.new_empty((used.numel() * page_size + room, *pages.shape[2:]))
    torch.index_select(pages, 0, used, out=buf[: used.numel() * page_size].view(used.numel(), *pages.shape[1:]))
    return buf


def _with_row(buf: Tensor, n: int, row: Tensor) -> Tensor:
    """``buf[:n]`` followed by ``row`` ([1, ...]), written into the buffer's free row ``n``."""
    buf[n : n + 1] = row
    return buf[: n + 1]


def paged_sdpa(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    if invariant_on():  # the fused kernel's order follows the step's shapes: the reference's fixed order instead
        return paged_attention(spec, views, inputs)
    c, batch = spec.config, inputs.meta.batch
    cu, dt = batch.host_cu_seqlens, inputs.q.dtype
    outs, lses = [], []
    for b, n_cached in enumerate(batch.host_cache_lens):
        rows = slice(cu[b], cu[b + 1])
        kc = vc = None
        if n_cached and batch.host_new_lens[b] == 1:  # [>= m + 1, Hkv, D]: room for the new row
            kc = _gather(views.k, batch.block_table[b], n_cached, batch.page_size, 1)
            vc = _gather(views.v, batch.block_table[b], n_cached, batch.page_size, 1)
        elif n_cached:
            kc = cached_tokens(views.k, batch.block_table[b], n_cached, batch.page_size)  # [m, Hkv, D]
            vc = cached_tokens(views.v, batch.block_table[b], n_cached, batch.page_size)
        o, lse = _one_request(c, inputs.q[rows], inputs.k[rows], inputs.v[rows], kc, vc, batch.positions[rows],
                              n_cached)
        outs.append(o.to(dt))
        lses.append(lse.float())
    return AttentionOutput(o=torch.cat(outs), lse=torch.cat(lses)), writes(k=inputs.k, v=inputs.v)


@register("full", "prefill", "sdpa", supports=supports, invariant=True)
def prefill(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    return paged_sdpa(spec, views, inputs)


@register("full", "decode", "sdpa", supports=supports, invariant=True)
def decode(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    return paged_sdpa(spec, views, inputs)


@register("full", "verify", "sdpa", supports=supports, invariant=True)
def verify(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    return paged_sdpa(spec, views, inputs)
