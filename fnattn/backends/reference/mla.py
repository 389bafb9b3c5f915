"""Reference multi-head latent attention (MLA) over a paged latent cache.

Each new token attends to its request's cached latent rows and to the new rows
up to itself. The cached rows are gathered through the block table (only the
first ``cache_lens[b]`` tokens, so unwritten slots are never read) and the
step's own rows come from the inputs; they leave as a `LatentWrite`, the
backend never writes them.

Prefill computes in the expanded form (per-head keys and values, which many
queries share); decode and verify in the absorbed form (``W_UK`` on the query,
``W_UV`` after the weighted sum), which reads the cache in latent space without
expanding it, as decode kernels do. Both forms give the same result.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...deltas import LatentWrite
from ...inputs import AttentionOutput, MLAInputs
from ...ops.dsa import topk_mask
from ...ops.mla import mla_absorbed, mla_expanded
from ...registry import register
from ...spec import LayerSpec, MLAConfig
from ...state import Views
from .full import cached_tokens


def mla_config(spec: LayerSpec) -> MLAConfig:
    return spec.config if spec.kind == "mla" else spec.config.mla


def request_rows(pages: Tensor, new: Tensor, batch, b: int) -> Tensor:
    """Request ``b``'s cached rows from ``pages [P, S, X]`` then its new rows: ``[n_cached + n, X]``.

    Row ``j`` is the token at absolute position ``j`` of the request, so top-k
    positions index it directly.
    """
    n_cached = batch.host_cache_lens[b]
    if not n_cached:
        return new
    return torch.cat((cached_tokens(pages, batch.block_table[b], n_cached, batch.page_size), new))


def paged_mla(spec: LayerSpec, views: Views, inputs: MLAInputs, *, phase: str,
              selected: Tensor | None = None) -> AttentionOutput:
    """MLA of every new token over its request's cache + the new rows (causal).

    ``selected [T, topk]`` (optional) restricts each token to those absolute
    positions of its request (-1: none), for sparse layers.
    """
    cfg = mla_config(spec)
    core = mla_expanded if phase == "prefill" else mla_absorbed
    batch = inputs.meta.batch
    cu = batch.host_cu_seqlens
    outs, lses = [], []
    for b, n_cached in enumerate(batch.host_cache_lens):
        rows = slice(cu[b], cu[b + 1])
        latent = request_rows(views.latent, inputs.latent[rows], batch, b)  # [N, R + Dr]
        allowed = None if selected is None else topk_mask(selected[rows], n_keys=latent.shape[0])  # [n, N]
        o, lse = core(inputs.q_nope[rows], inputs.q_pe[rows], latent, inputs.w_uk, inputs.w_uv,
                      scale=cfg.scale, n_cached=n_cached, allowed=allowed)  # [n, H, Dv], [n, H]
        outs.append(o)
        lses.append(lse)
    return AttentionOutput(o=torch.cat(outs).to(spec.dtype), lse=torch.cat(lses).float())


def latent_write(spec: LayerSpec, inputs: MLAInputs) -> LatentWrite:
    return LatentWrite(layer=spec.index, slots=inputs.meta.batch.slot_mapping, latent=inputs.latent)


def mla_step(spec: LayerSpec, views: Views, inputs: MLAInputs, phase: str):
    return paged_mla(spec, views, inputs, phase=phase), (latent_write(spec, inputs),)


# One function per phase, as the registry wants; the reference math is shared.
@register("mla", "prefill", "reference")
def mla_prefill(spec, views, inputs):
    return mla_step(spec, views, inputs, "prefill")


@register("mla", "decode", "reference")
def mla_decode(spec, views, inputs):
    return mla_step(spec, views, inputs, "decode")


@register("mla", "verify", "reference")
def mla_verify(spec, views, inputs):
    return mla_step(spec, views, inputs, "verify")
