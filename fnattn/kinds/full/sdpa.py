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
reference's: the fused kernel has no softcap and wants one head size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...deltas import Writes, writes
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from .config import AttentionOutput, FullAttentionInputs
from .math import merge
from .reference import cached_tokens

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def supports(spec, device) -> list[str]:
    c, reasons = spec.config, []
    if device.type != "cpu":
        reasons.append(f"runs on CPU, the model runs on {device.type}")
    if c.softcap:
        reasons.append("softcap: torch's fused SDPA has no score cap")
    if c.sinks:
        reasons.append("sinks are the reference's on CPU")
    if c.head_dim_v != c.head_dim:
        reasons.append("head_dim_v != head_dim (the fused CPU kernel wants one head size)")
    if spec.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        reasons.append(f"dtype {spec.dtype} not in (float32, bfloat16, float16)")
    return reasons


def _folded(q: Tensor, g: int) -> Tensor:
    """``[n, Hq, D] -> [1, Hkv, g n, D]``: the query heads of one K/V head, stacked along the query axis."""
    n, hq, d = q.shape
    return q.view(n, hq // g, g, d).permute(1, 2, 0, 3).reshape(1, hq // g, g * n, d)


def _unfold(o: Tensor, lse: Tensor, n: int, g: int) -> tuple[Tensor, Tensor]:
    """Inverse of `_folded` for the output ``[1, Hkv, g n, D]`` and its LSE ``[1, Hkv, g n]``."""
    hkv, d = o.shape[1], o.shape[-1]
    o = o[0].view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hkv * g, d)  # [n, Hq, D]
    lse = lse[0].view(hkv, g, n).permute(2, 0, 1).reshape(n, hkv * g)  # [n, Hq]
    return o, lse


def _heads_first(x: Tensor) -> Tensor:
    return x.transpose(0, 1)[None]  # [m, H, D] -> [1, H, m, D]


def _visible(q_pos: Tensor, k_pos: Tensor, window: int, *, causal: bool) -> Tensor:
    """Boolean ``[n, m]``: query at ``q_pos[i]`` sees key at ``k_pos[j]``."""
    diff = q_pos[:, None] - k_pos[None, :]
    visible = diff >= 0 if causal else torch.ones_like(diff, dtype=torch.bool)
    return visible & (diff < window) if window else visible


def _bias(visible: Tensor, g: int, dtype: torch.dtype) -> Tensor:
    """The kernel's additive mask (it takes the query's dtype, not bool), rows repeated for ``g`` folded heads."""
    zeros = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return zeros.masked_fill(~visible, float("-inf")).repeat(g, 1)


def _one_request(c, q, k, v, kc, vc, q_pos, n_cached) -> tuple[Tensor, Tensor]:
    """``n`` new tokens over ``n_cached`` cached ones and themselves: ``(o [n, Hq, D], lse [n, Hq])``."""
    n, g, scale, W, dt = q.shape[0], c.group_size, c.scale, c.sliding_window, q.dtype
    if n == 1:  # decode: the token sees its cache (within the window) and itself; one call, no merge
        keys = k if kc is None else _with_row(kc, n_cached, k)
        vals = v if vc is None else _with_row(vc, n_cached, v)
        mask = None
        if W:
            mask = _bias(_visible(q_pos, torch.arange(n_cached + 1, device=q.device), W, causal=False), g, dt)
        o, lse = _flash(_folded(q, g), _heads_first(keys), _heads_first(vals), attn_mask=mask, scale=scale)
        return _unfold(o, lse, n, g)
    # The new tokens among themselves: causal (square, so top-left aligned), K/V repeated over the group
    # (only the step's own rows are copied).
    kr, vr = (_heads_first(x.repeat_interleave(g, dim=1)) for x in (k, v))
    mask = _bias(_visible(q_pos, q_pos, W, causal=True), 1, dt) if W else None
    o, lse = _flash(_heads_first(q), kr, vr, is_causal=mask is None, attn_mask=mask, scale=scale)
    o, lse = o[0].transpose(0, 1), lse[0].transpose(0, 1)  # [n, Hq, D], [n, Hq]
    if kc is None:
        return o, lse
    mask, blind = None, None
    if W:
        visible = _visible(q_pos, torch.arange(n_cached, device=q.device), W, causal=False)  # [n, m]
        mask = _bias(visible, g, dt)
        blind = ~visible.any(-1)  # [n]: no cached key in the window
    oc, lsec = _flash(_folded(q, g), _heads_first(kc), _heads_first(vc), attn_mask=mask, scale=scale)
    oc, lsec = _unfold(oc, lsec, n, g)
    if blind is not None:  # the kernel gives such a row o = 0, lse = 0; the merge wants lse = -inf
        lsec = lsec.masked_fill(blind[:, None], float("-inf"))
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


@register("full", "prefill", "sdpa", supports=supports)
def prefill(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    return paged_sdpa(spec, views, inputs)


@register("full", "decode", "sdpa", supports=supports)
def decode(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    return paged_sdpa(spec, views, inputs)


@register("full", "verify", "sdpa", supports=supports)
def verify(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    return paged_sdpa(spec, views, inputs)
