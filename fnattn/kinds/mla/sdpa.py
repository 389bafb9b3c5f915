"""CPU backend for MLA prefill and decode through torch's fused SDPA kernel (backend ``sdpa``).

The reference (`.reference`) builds every new token's ``[H, N]`` scores in fp32, then a masked log-sum-exp
and a softmax over them: the truth, and on a CPU most of a Kimi Linear tiny prefill. Here each request's
latent rows are expanded as the reference expands them (``k_nope = c_kv W_UK``, ``v = c_kv W_UV``, the shared
``k_pe`` on every head) and handed, in fp32, to the kernel ``F.scaled_dot_product_attention`` dispatches to on
a CPU, which also returns the log-sum-exp the output carries (as `fnattn.kinds.full.sdpa` does):

- the new tokens among themselves: causal (a square, so the kernel's top-left alignment is right);
- the new tokens over the cached ones: no mask; the two parts merge by their log-sum-exps.

The kernel wants one head size for q, k and v, so ``v`` is zero-padded to ``q``'s (``Dn + Dr``) and the
output sliced back.

Decode, in the absorbed form (``q_nope W_UK`` against the latent rows, ``W_UV`` after), is one call for the
whole batch where the reference loops over requests: every request's cached rows are gathered through the
block table into ``[B, rows, R + Dr]`` (rows past its cache zeroed, so a NaN in an unwritten slot cannot reach
the products), its own new row appended, and the kernel runs the heads as the query axis of one shared latent
head (MQA), masked to each request's rows. Verify, a few tokens a request, is the absorbed form one call per
request: its heads and tokens folded into the query axis over its rows, causal among the new ones.

In the invariant mode (`fnattn.kernels.invariant`) every phase goes to the reference's fixed-order form
(`.math.mla_fixed_order`): the fused kernel's reduction order follows the shapes of the step.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from ...deltas import Writes, writes
from ...kernels.invariant import invariant_on
from ...outputs import AttentionOutput
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ..cpu_sdpa import additive_mask, flash, fold_heads, heads_first, supports, unfold_heads, without_blind_rows
from ..full.math import merge
from .config import MLAInputs
from .math import key_visibility, topk_mask
from .reference import paged_mla, request_rows

NAME = "sdpa"


def _attend(q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool = False,
            allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``q [n, H, D]`` over ``k``, ``v [m, H, D]`` -> ``(o [n, H, D], lse [n, H])``, fp32; ``allowed [n, m]``:
    the keys each query may attend (a row with none gets ``o = 0``, ``lse = -inf``, as the reference's)."""
    mask = None if allowed is None else additive_mask(allowed, q.dtype)[None, None]
    o, lse = flash(heads_first(q), heads_first(k), heads_first(v), is_causal=causal, attn_mask=mask,
                   scale=scale)[:2]
    o, lse = o[0].transpose(0, 1), lse[0].transpose(0, 1)
    return (o, lse) if allowed is None else without_blind_rows(o, lse, allowed)


def _absorbed_query(q_nope: Tensor, q_pe: Tensor, w_uk: Tensor) -> Tensor:
    """``[..., H, Dn]``, ``[..., H, Dr]`` -> ``[q_nope W_UK, q_pe]`` ``[..., H, R + Dr]`` in fp32, what the
    latent rows are scored against (the reference's `mla_absorbed` in fp32 too)."""
    f32 = torch.float32
    return torch.cat([torch.einsum("...hd,hdr->...hr", q_nope.to(f32), w_uk.to(f32)), q_pe.to(f32)], dim=-1)


def _latent_values(keys: Tensor, R: int) -> Tensor:
    """The ``c_kv`` part of latent rows ``[..., R + Dr]``, zero-padded back to ``R + Dr`` (the kernel takes one
    head size)."""
    return torch.nn.functional.pad(keys[..., :R], (0, keys.shape[-1] - R))


def expanded_sdpa(q_nope: Float[Tensor, "n H Dn"], q_pe: Float[Tensor, "n H Dr"], latent: Float[Tensor, "N Dlat"],
                  w_uk: Float[Tensor, "H Dn R"], w_uv: Float[Tensor, "H Dv R"], *, scale: float, n_cached: int,
                  allowed: Bool[Tensor, "n N"] | None = None
                  ) -> tuple[Float[Tensor, "n H Dv"], Float[Tensor, "n H"]]:
    """One request: ``q_nope [n, H, Dn]``, ``q_pe [n, H, Dr]`` over ``latent [n_cached + n, R + Dr]`` (its
    cached rows then its new ones), causal -> ``(o [n, H, Dv], lse [n, H])`` in fp32: `mla_expanded`'s
    result. ``allowed [n, N]`` (sparse layers: the selected positions) further limits each token's keys:
    then one masked call over every key."""
    f32 = torch.float32
    n, H, _ = q_nope.shape
    R, Dv = w_uk.shape[2], w_uv.shape[1]
    c_kv, k_pe = latent[:, :R].to(f32), latent[:, R:].to(f32)
    k_nope = torch.einsum("nr,hdr->nhd", c_kv, w_uk.to(f32))  # [N, H, Dn]
    value = torch.einsum("nr,hvr->nhv", c_kv, w_uv.to(f32))  # [N, H, Dv]
    q = torch.cat([q_nope.to(f32), q_pe.to(f32)], dim=-1)  # [n, H, Dn + Dr]
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, H, -1)], dim=-1)  # [N, H, Dn + Dr]
    D = q.shape[-1]
    if Dv < D:  # the kernel takes one head size: zero columns, sliced off after
        value = torch.nn.functional.pad(value, (0, D - Dv))
    if allowed is not None:
        visible = key_visibility(n, latent.shape[0], n_cached=n_cached, device=q.device) & allowed
        o, lse = _attend(q, k, value, scale=scale, allowed=visible)
        return o[..., :Dv], lse
    o, lse = _attend(q, k[n_cached:], value[n_cached:], scale=scale, causal=True)
    if n_cached:
        oc, lsec = _attend(q, k[:n_cached], value[:n_cached], scale=scale, causal=False)
        o, lse = merge(oc, lsec, o, lse)
    return o[..., :Dv], lse


def absorbed_sdpa(q_nope: Float[Tensor, "n H Dn"], q_pe: Float[Tensor, "n H Dr"], latent: Float[Tensor, "N Dlat"],
                  w_uk: Float[Tensor, "H Dn R"], w_uv: Float[Tensor, "H Dv R"], *, scale: float, n_cached: int,
                  allowed: Bool[Tensor, "n N"] | None = None
                  ) -> tuple[Float[Tensor, "n H Dv"], Float[Tensor, "n H"]]:
    """`expanded_sdpa`'s arguments and result (`mla_absorbed`'s) in the absorbed form: the heads and tokens
    folded into the query axis of one call over the request's latent rows, causal among its new ones."""
    n, H, _ = q_nope.shape
    R = w_uk.shape[2]
    visible = key_visibility(n, latent.shape[0], n_cached=n_cached, device=latent.device)
    if allowed is not None:
        visible = visible & allowed
    q = _absorbed_query(q_nope, q_pe, w_uk)  # [n, H, D]
    keys = latent.to(torch.float32)[None, None]  # [1, 1, N, D]: one latent head for every query head
    mask = additive_mask(visible, q.dtype, H)[None, None]
    o, lse = flash(fold_heads(q, H), keys, _latent_values(keys, R), attn_mask=mask, scale=scale)[:2]
    o, lse = unfold_heads(o, lse, n, H)  # [n, H, D], [n, H]
    o = torch.einsum("nhr,hvr->nhv", o[..., :R], w_uv.to(torch.float32))
    return without_blind_rows(o, lse, visible)


def paged_mla_sdpa(spec: LayerSpec, views: Views, inputs: MLAInputs, *, phase: str,
                   selected: Tensor | None = None) -> AttentionOutput:
    """Every request's tokens, prefill in the expanded form, verify in the absorbed one (as the reference
    chooses); ``selected [T, topk]`` (sparse layers): the positions each token attends."""
    if invariant_on():
        return paged_mla(spec, views, inputs, phase=phase, selected=selected)
    cfg, batch = spec.config.mla, inputs.meta.batch
    core = expanded_sdpa if phase == "prefill" else absorbed_sdpa
    cu = batch.host_cu_seqlens
    outs, lses = [], []
    for b, n_cached in enumerate(batch.host_cache_lens):
        rows = slice(cu[b], cu[b + 1])
        new = cfg.as_cached(inputs.latent[rows])  # [n, R + Dr] at the cache's precision, as the reference
        latent = request_rows(views.latent, new, batch, b, decode=cfg)
        allowed = None if selected is None else topk_mask(selected[rows], n_keys=latent.shape[0])
        o, lse = core(inputs.q_nope[rows], inputs.q_pe[rows], latent, inputs.w_uk, inputs.w_uv, scale=cfg.scale,
                      n_cached=n_cached, allowed=allowed)
        outs.append(o.to(inputs.q_nope.dtype))  # the reference's rounding: to q's dtype, then the layer's
        lses.append(lse)
    return AttentionOutput(o=torch.cat(outs).to(spec.dtype), lse=torch.cat(lses).float())


def absorbed_decode(q_nope: Float[Tensor, "B H Dn"], q_pe: Float[Tensor, "B H Dr"], rows: Float[Tensor, "B N Dlat"],
                    visible: Bool[Tensor, "B N"], w_uk: Float[Tensor, "H Dn R"], w_uv: Float[Tensor, "H Dv R"], *,
                    scale: float) -> tuple[Float[Tensor, "B H Dv"], Float[Tensor, "B H"]]:
    """One token per request: ``q_nope [B, H, Dn]``, ``q_pe [B, H, Dr]`` over ``rows [B, N, R + Dr]`` (zero
    where not ``visible [B, N]``) -> ``(o [B, H, Dv], lse [B, H])`` in fp32: `mla_absorbed`'s result."""
    R = w_uk.shape[2]
    q = _absorbed_query(q_nope, q_pe, w_uk)  # [B, H, D]
    keys = rows.to(torch.float32)[:, None]  # [B, 1, N, D]: one latent head for every query head
    mask = additive_mask(visible, q.dtype)[:, None, None, :]  # each request's own rows
    o, lse = flash(q[:, None], keys, _latent_values(keys, R), attn_mask=mask, scale=scale)[:2]
    o = torch.einsum("bhr,hvr->bhv", o[:, 0, :, :R], w_uv.to(torch.float32))
    return without_blind_rows(o, lse[:, 0], visible)  # a sparse layer's token may select nothing


def decode_rows(spec: LayerSpec, views: Views, inputs: MLAInputs, selected: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
    """Every request's cached latent rows then its new one: ``(rows [B, N, R + Dr], visible [B, N])``; row
    ``p < cache length`` is position ``p`` of the request, the last row its new token. ``selected [B, topk]``
    (sparse layers: positions, -1 padded) limits ``visible`` to those positions."""
    cfg, batch = spec.config.mla, inputs.meta.batch
    pages, S = views.latent, batch.page_size
    cached = torch.tensor(batch.host_cache_lens, device=pages.device)  # [B]
    used = -(-max(batch.host_cache_lens, default=0) // S)
    new = cfg.as_cached(inputs.latent)  # [B, X] at the cache's precision, as the reference reads it
    if used:
        table = batch.block_table[:, :used].reshape(-1).long()
        rows = cfg.decode_latent(pages.index_select(0, table).view(len(cached), used * S, -1), new.dtype)
        seen = torch.arange(used * S, device=pages.device)[None, :] < cached[:, None]  # [B, used * S]
        rows = torch.cat([rows.masked_fill(~seen[..., None], 0), new[:, None]], dim=1)
        visible = torch.cat([seen, torch.ones_like(seen[:, :1])], dim=1)
    else:
        rows, visible = new[:, None], torch.ones(new.shape[0], 1, dtype=torch.bool, device=new.device)
    if selected is not None:
        last = used * S  # the new token's row; one more column takes the -1 padding
        cols = torch.where(selected == cached[:, None], last, selected)
        cols = torch.where(selected < 0, last + 1, cols).long()
        picked = torch.zeros(len(cached), last + 2, dtype=torch.bool, device=cols.device).scatter(1, cols, True)
        visible = visible & picked[:, :last + 1]
    return rows, visible


def paged_decode_sdpa(spec: LayerSpec, views: Views, inputs: MLAInputs, selected: Tensor | None = None
                      ) -> AttentionOutput:
    """Every request's one new token; ``selected [B, topk]`` (sparse layers): the positions each attends."""
    if invariant_on():
        return paged_mla(spec, views, inputs, phase="decode", selected=selected)
    cfg = spec.config.mla
    rows, visible = decode_rows(spec, views, inputs, selected)
    o, lse = absorbed_decode(inputs.q_nope, inputs.q_pe, rows, visible, inputs.w_uk, inputs.w_uv, scale=cfg.scale)
    return AttentionOutput(o=o.to(inputs.q_nope.dtype).to(spec.dtype), lse=lse.float())


@register("mla", "verify", NAME, supports=supports, invariant=True)
def verify(spec: LayerSpec, views: Views, inputs: MLAInputs) -> tuple[AttentionOutput, Writes]:
    return paged_mla_sdpa(spec, views, inputs, phase="verify"), writes(
        latent=spec.config.mla.encode_latent(inputs.latent))


@register("mla", "decode", NAME, supports=supports, invariant=True)
def decode(spec: LayerSpec, views: Views, inputs: MLAInputs) -> tuple[AttentionOutput, Writes]:
    return paged_decode_sdpa(spec, views, inputs), writes(latent=spec.config.mla.encode_latent(inputs.latent))


@register("mla", "prefill", NAME, supports=supports, invariant=True)
def prefill(spec: LayerSpec, views: Views, inputs: MLAInputs) -> tuple[AttentionOutput, Writes]:
    return paged_mla_sdpa(spec, views, inputs, phase="prefill"), writes(
        latent=spec.config.mla.encode_latent(inputs.latent))
