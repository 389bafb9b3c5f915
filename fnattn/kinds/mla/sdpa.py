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
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...deltas import Writes, writes
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ..full.config import AttentionOutput
from ..full.math import merge
from .config import MLAInputs
from .math import key_visibility, topk_mask
from .reference import request_rows

NAME = "sdpa"
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def supports(spec, device) -> list[str]:
    reasons = []
    if device.type != "cpu":
        reasons.append(f"runs on CPU, the model runs on {device.type}")
    if spec.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        reasons.append(f"dtype {spec.dtype} not in (float32, bfloat16, float16)")
    return reasons


def _heads_first(x: Tensor) -> Tensor:
    return x.transpose(0, 1)[None]  # [m, H, D] -> [1, H, m, D]


def _attend(q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool = False,
            allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``q [n, H, D]`` over ``k``, ``v [m, H, D]`` -> ``(o [n, H, D], lse [n, H])``, fp32; ``allowed [n, m]``:
    the keys each query may attend (a row with none gets ``o = 0``, ``lse = -inf``, as the reference's)."""
    bias = None
    if allowed is not None:
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
        bias = bias[None, None]
    o, lse = _flash(_heads_first(q), _heads_first(k), _heads_first(v), is_causal=causal, attn_mask=bias,
                    scale=scale)[:2]
    o, lse = o[0].transpose(0, 1), lse[0].transpose(0, 1)
    if allowed is not None:
        blind = ~allowed.any(-1)  # [n]
        o, lse = o.masked_fill(blind[:, None, None], 0.0), lse.masked_fill(blind[:, None], float("-inf"))
    return o, lse


def expanded_sdpa(q_nope: Tensor, q_pe: Tensor, latent: Tensor, w_uk: Tensor, w_uv: Tensor, *, scale: float,
                  n_cached: int, allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
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


def paged_mla_sdpa(spec: LayerSpec, views: Views, inputs: MLAInputs, selected: Tensor | None = None
                   ) -> AttentionOutput:
    """Every request's prefill; ``selected [T, topk]`` (sparse layers): the positions each token attends."""
    cfg, batch = spec.config.mla, inputs.meta.batch
    cu = batch.host_cu_seqlens
    outs, lses = [], []
    for b, n_cached in enumerate(batch.host_cache_lens):
        rows = slice(cu[b], cu[b + 1])
        new = cfg.as_cached(inputs.latent[rows])  # [n, R + Dr] at the cache's precision, as the reference
        latent = request_rows(views.latent, new, batch, b, decode=cfg)
        allowed = None if selected is None else topk_mask(selected[rows], n_keys=latent.shape[0])
        o, lse = expanded_sdpa(inputs.q_nope[rows], inputs.q_pe[rows], latent, inputs.w_uk, inputs.w_uv,
                               scale=cfg.scale, n_cached=n_cached, allowed=allowed)
        outs.append(o.to(inputs.q_nope.dtype))  # the reference's rounding: to q's dtype, then the layer's
        lses.append(lse)
    return AttentionOutput(o=torch.cat(outs).to(spec.dtype), lse=torch.cat(lses).float())


def absorbed_decode(q_nope: Tensor, q_pe: Tensor, rows: Tensor, visible: Tensor, w_uk: Tensor, w_uv: Tensor, *,
                    scale: float) -> tuple[Tensor, Tensor]:
    """One token per request: ``q_nope [B, H, Dn]``, ``q_pe [B, H, Dr]`` over ``rows [B, N, R + Dr]`` (zero
    where not ``visible [B, N]``) -> ``(o [B, H, Dv], lse [B, H])`` in fp32: `mla_absorbed`'s result."""
    f32 = torch.float32
    R = w_uk.shape[2]
    q = torch.cat([torch.einsum("bhd,hdr->bhr", q_nope.to(f32), w_uk.to(f32)), q_pe.to(f32)], dim=-1)  # [B, H, D]
    keys = rows.to(f32)[:, None]  # [B, 1, N, D]: one latent head for every query head
    values = torch.nn.functional.pad(keys[..., :R], (0, keys.shape[-1] - R))  # c_kv, zero-padded to D
    bias = torch.zeros(visible.shape, dtype=f32, device=q.device).masked_fill(~visible, float("-inf"))
    o, lse = _flash(q[:, None], keys, values, attn_mask=bias[:, None, None, :], scale=scale)[:2]
    o, lse = torch.einsum("bhr,hvr->bhv", o[:, 0, :, :R], w_uv.to(f32)), lse[:, 0]
    blind = ~visible.any(-1)  # [B]: a token that may attend nothing (a sparse layer's empty selection)
    return o.masked_fill(blind[:, None, None], 0.0), lse.masked_fill(blind[:, None], float("-inf"))


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
    cfg = spec.config.mla
    rows, visible = decode_rows(spec, views, inputs, selected)
    o, lse = absorbed_decode(inputs.q_nope, inputs.q_pe, rows, visible, inputs.w_uk, inputs.w_uv, scale=cfg.scale)
    return AttentionOutput(o=o.to(inputs.q_nope.dtype).to(spec.dtype), lse=lse.float())


def absorbed_request(q_nope: Tensor, q_pe: Tensor, rows: Tensor, visible: Tensor, w_uk: Tensor, w_uv: Tensor, *,
                     scale: float) -> tuple[Tensor, Tensor]:
    """One request's tokens: ``q_nope [n, H, Dn]``, ``q_pe [n, H, Dr]`` over its ``rows [N, R + Dr]``, each token
    the keys ``visible [n, N]`` gives it -> ``(o [n, H, Dv], lse [n, H])`` in fp32: `mla_absorbed`'s result."""
    f32 = torch.float32
    n, H, _ = q_nope.shape
    R = w_uk.shape[2]
    q = torch.cat([torch.einsum("nhd,hdr->nhr", q_nope.to(f32), w_uk.to(f32)), q_pe.to(f32)], dim=-1)  # [n, H, D]
    D = q.shape[-1]
    keys = rows.to(f32)[None, None]  # [1, 1, N, D]
    values = torch.nn.functional.pad(keys[..., :R], (0, D - R))
    bias = torch.zeros(visible.shape, dtype=f32, device=q.device).masked_fill(~visible, float("-inf"))
    folded = q.permute(1, 0, 2).reshape(1, 1, H * n, D)  # query row h * n + t
    o, lse = _flash(folded, keys, values, attn_mask=bias.repeat(H, 1)[None, None], scale=scale)[:2]
    o, lse = o.view(H, n, D)[..., :R].transpose(0, 1), lse.view(H, n).transpose(0, 1)  # [n, H, R], [n, H]
    o = torch.einsum("nhr,hvr->nhv", o, w_uv.to(f32))
    blind = ~visible.any(-1)
    return o.masked_fill(blind[:, None, None], 0.0), lse.masked_fill(blind[:, None], float("-inf"))


def paged_verify_sdpa(spec: LayerSpec, views: Views, inputs: MLAInputs, selected: Tensor | None = None
                      ) -> AttentionOutput:
    """Every request's verify tokens, causal; ``selected [T, topk]`` (sparse layers): the positions each attends."""
    cfg, batch = spec.config.mla, inputs.meta.batch
    cu = batch.host_cu_seqlens
    outs, lses = [], []
    for b, n_cached in enumerate(batch.host_cache_lens):
        rows = slice(cu[b], cu[b + 1])
        latent = request_rows(views.latent, cfg.as_cached(inputs.latent[rows]), batch, b, decode=cfg)
        n, N = rows.stop - rows.start, latent.shape[0]
        visible = key_visibility(n, N, n_cached=n_cached, device=latent.device)
        if selected is not None:
            visible = visible & topk_mask(selected[rows], n_keys=N)
        o, lse = absorbed_request(inputs.q_nope[rows], inputs.q_pe[rows], latent, visible, inputs.w_uk, inputs.w_uv,
                                  scale=cfg.scale)
        outs.append(o.to(inputs.q_nope.dtype))
        lses.append(lse)
    return AttentionOutput(o=torch.cat(outs).to(spec.dtype), lse=torch.cat(lses).float())


@register("mla", "verify", NAME, supports=supports)
def verify(spec: LayerSpec, views: Views, inputs: MLAInputs) -> tuple[AttentionOutput, Writes]:
    return paged_verify_sdpa(spec, views, inputs), writes(latent=spec.config.mla.encode_latent(inputs.latent))


@register("mla", "decode", NAME, supports=supports)
def decode(spec: LayerSpec, views: Views, inputs: MLAInputs) -> tuple[AttentionOutput, Writes]:
    return paged_decode_sdpa(spec, views, inputs), writes(latent=spec.config.mla.encode_latent(inputs.latent))


@register("mla", "prefill", NAME, supports=supports)
def prefill(spec: LayerSpec, views: Views, inputs: MLAInputs) -> tuple[AttentionOutput, Writes]:
    return paged_mla_sdpa(spec, views, inputs), writes(latent=spec.config.mla.encode_latent(inputs.latent))
