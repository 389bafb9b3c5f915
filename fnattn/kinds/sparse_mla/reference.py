"""Reference sparse MLA with the DSA indexer (DeepSeek-V3.2, GLM-5) over paged caches.

A layer that runs its own indexer (``index_source_layer is None``) scores every
visible token of the request (the cached index keys plus this step's, causal,
the token itself included), keeps the ``sparse.topk`` best and attends MLA over
only those. Its new latent rows and index keys leave as deltas. A layer that
reuses another layer's selection (GLM-5 "shared") attends over the
``topk_indices`` the model passes in and writes only its latent rows.

Top-k indices are absolute positions within the request, ``-1`` padded, and
are returned so later layers can reuse them. Forms as in `.mla`: prefill
expanded, decode and verify absorbed. In the invariant mode (`fnattn.kernels.invariant`)
the indexer scores on fixed shapes (`.indexer.indexer_scores_fixed_order`) and each
token attends its selected rows in ascending position (`fnattn.kinds.mla.math.mla_fixed_order`),
so decode and verify select and attend alike, bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...checks import fail
from ...deltas import Writes, writes
from ...kernels.invariant import invariant_on
from ...lanes import debug_check
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ..mla.reference import paged_mla, request_rows
from .config import SparseAttentionOutput, SparseMLAInputs
from .indexer import indexer_scores, indexer_scores_fixed_order, topk_indices


def request_keys(spec: LayerSpec, views: Views, inputs: SparseMLAInputs, index_values: dict, b: int,
                 rows: slice) -> Tensor:
    """Request ``b``'s index keys, cached then new, ``[N, Di]``: the step's own keys as the cache will hold them
    (``index_values``, `SparseMLAConfig.index_writes`), FP8 keys dequantized with their scales."""
    batch = inputs.meta.batch
    keys = request_rows(views.index_k, index_values["index_k"][rows], batch, b)
    if not spec.config.indexer.fp8_keys:
        return keys
    scales = request_rows(views.index_k_scale, index_values["index_k_scale"][rows], batch, b)
    return spec.config.indexer.decode_keys(keys, scales)


def select(spec: LayerSpec, views: Views, inputs: SparseMLAInputs, index_values: dict) -> Tensor:
    """The indexer's top-k of every new token: ``[T, topk]`` int64 positions, -1 padded, over the cached keys
    and the step's ``index_values`` (its keys as they will be written)."""
    batch = inputs.meta.batch
    cu = batch.host_cu_seqlens
    score = indexer_scores_fixed_order if invariant_on() else indexer_scores
    picked = []
    for b, n_cached in enumerate(batch.host_cache_lens):
        rows = slice(cu[b], cu[b + 1])
        keys = request_keys(spec, views, inputs, index_values, b, rows)  # [N, Di]
        scores = score(inputs.index_q[rows], inputs.index_w[rows], keys)  # [n, N] fp32
        picked.append(topk_indices(scores, n_cached=n_cached, topk=inputs.sparse.topk))  # [n, topk]
    return torch.cat(picked)


def check_reused(spec: LayerSpec, inputs: SparseMLAInputs) -> Tensor:
    """Reused indices must be causal positions of the token's own request.

    The mask would silently drop any other value, which would hide a wiring bug
    (indices from another step or another request's layout).
    """
    idx = inputs.topk_indices  # [T, topk]
    positions = inputs.meta.batch.positions  # [T]
    bad = (idx < -1) | (idx > positions[:, None])
    with debug_check():  # the reference's own check; a capturable backend leaves it to the indexer
        found = bool(bad.any())
    if found:
        t = int(bad.any(dim=1).nonzero()[0, 0])
        fail(f"layer {spec.index} inputs", "topk_indices",
             f"positions in -1..{int(positions[t])} for token {t} (causal, within its request)",
             idx[t].tolist())
    return idx


def sparse_step(spec: LayerSpec, views: Views, inputs: SparseMLAInputs, phase: str):
    index_values = own_index_values(spec, inputs)
    selected = select(spec, views, inputs, index_values) if index_values else check_reused(spec, inputs)
    att = paged_mla(spec, views, inputs, phase=phase, selected=selected)
    out = SparseAttentionOutput(o=att.o, lse=att.lse, topk_indices=selected)
    return out, writes(latent=spec.config.mla.encode_latent(inputs.latent), **index_values)


def own_index_values(spec: LayerSpec, inputs: SparseMLAInputs) -> dict:
    """The write values of the step's index keys, encoded once for both the selection and the writes; empty
    for a layer that reuses another layer's top-k."""
    return spec.config.index_writes(inputs.index_k) if spec.config.index_source_layer is None else {}


# One function per phase, as the registry wants; the reference math is shared.
@register("sparse_mla", "prefill", "reference", invariant=True)
def prefill(spec: LayerSpec, views: Views, inputs: SparseMLAInputs) -> tuple[SparseAttentionOutput, Writes]:
    return sparse_step(spec, views, inputs, "prefill")


@register("sparse_mla", "decode", "reference", invariant=True)
def decode(spec: LayerSpec, views: Views, inputs: SparseMLAInputs) -> tuple[SparseAttentionOutput, Writes]:
    return sparse_step(spec, views, inputs, "decode")


@register("sparse_mla", "verify", "reference", invariant=True)
def verify(spec: LayerSpec, views: Views, inputs: SparseMLAInputs) -> tuple[SparseAttentionOutput, Writes]:
    return sparse_step(spec, views, inputs, "verify")
