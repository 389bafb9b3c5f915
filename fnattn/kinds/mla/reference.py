"""Reference multi-head latent attention (MLA) over a paged latent cache.

Each new token attends to its request's cached latent rows and to the new rows
up to itself. The cached rows are gathered through the block table (only the
first ``cache_lens[b]`` tokens, so unwritten slots are never read) and the
step's own rows come from the inputs; they leave as the layer's writes, the
backend never writes them.

Prefill computes in the expanded form (per-head keys and values, which many
queries share); decode and verify in the absorbed form (``W_UK`` on the query,
``W_UV`` after the weighted sum), which reads the cache in latent space without
expanding it, as decode kernels do. Both forms give the same result. In the
invariant mode (`fnattn.kernels.invariant`) every phase runs `.math.mla_fixed_order`
instead: the absorbed form with each token reduced in an order fixed by its own
context, so decode, verify and prefill agree bit for bit.
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
from ..full.reference import cached_tokens
from .config import MLAInputs
from .math import mla_absorbed, mla_expanded, mla_fixed_order, topk_mask


def request_rows(pages: Tensor, new: Tensor, batch, b: int, *, decode=None) -> Tensor:
    """Request ``b``'s cached rows from ``pages [P, S, X]`` then its new rows: ``[n_cached + n, X]``.

    Row ``j`` is the token at absolute position ``j`` of the request, so top-k
    positions index it directly. ``decode`` (an `MLAConfig`) turns stored
    latent rows (FP8 with a scale) back into ``new.dtype``.
    """
    n_cached = batch.host_cache_lens[b]
    if not n_cached:
        return new
    cached = cached_tokens(pages, batch.block_table[b], n_cached, batch.page_size)
    if decode is not None:
        cached = decode.decode_latent(cached, new.dtype)
    return torch.cat((cached, new))


def paged_mla(spec: LayerSpec, views: Views, inputs: MLAInputs, *, phase: str,
              selected: Tensor | None = None) -> AttentionOutput:
    """MLA of every new token over its request's cache + the new rows (causal).

    ``selected [T, topk]`` (optional) restricts each token to those absolute
    positions of its request (-1: none), for sparse layers.
    """
    cfg = spec.config.mla
    core = mla_expanded if phase == "prefill" else mla_absorbed
    if invariant_on():
        core = mla_fixed_order
    batch = inputs.meta.batch
    cu = batch.host_cu_seqlens
    outs, lses = [], []
    for b, n_cached in enumerate(batch.host_cache_lens):
        rows = slice(cu[b], cu[b + 1])
        new = cfg.as_cached(inputs.latent[rows])  # [n, R + Dr] at the cache's precision
        latent = request_rows(views.latent, new, batch, b, decode=cfg)  # [N, R + Dr]
        allowed = None if selected is None else topk_mask(selected[rows], n_keys=latent.shape[0])  # [n, N]
        o, lse = core(inputs.q_nope[rows], inputs.q_pe[rows], latent, inputs.w_uk, inputs.w_uv,
                      scale=cfg.scale, n_cached=n_cached, allowed=allowed)  # [n, H, Dv], [n, H]
        outs.append(o)
        lses.append(lse)
    return AttentionOutput(o=torch.cat(outs).to(spec.dtype), lse=torch.cat(lses).float())


# One function per phase, as the registry wants; the reference math is shared.
@register("mla", "prefill", "reference", invariant=True)
def prefill(spec: LayerSpec, views: Views, inputs: MLAInputs) -> tuple[AttentionOutput, Writes]:
    return paged_mla(spec, views, inputs, phase="prefill"), writes(latent=spec.config.mla.encode_latent(inputs.latent))


@register("mla", "decode", "reference", invariant=True)
def decode(spec: LayerSpec, views: Views, inputs: MLAInputs) -> tuple[AttentionOutput, Writes]:
    return paged_mla(spec, views, inputs, phase="decode"), writes(latent=spec.config.mla.encode_latent(inputs.latent))


@register("mla", "verify", "reference", invariant=True)
def verify(spec: LayerSpec, views: Views, inputs: MLAInputs) -> tuple[AttentionOutput, Writes]:
    return paged_mla(spec, views, inputs, phase="verify"), writes(latent=spec.config.mla.encode_latent(inputs.latent))
