"""CPU backend for sparse MLA prefill (backend ``sdpa``): the reference's indexer, then the attention over the
selected positions through torch's fused SDPA kernel.

The selection is the reference's (`.reference.select`, or the top-k a shared layer is handed, checked as
there); the attention is `fnattn.kinds.mla.sdpa`'s expanded form with the selected positions as a mask, one
kernel call per request over its cached and new keys. Decode and verify stay the reference's.
"""

from __future__ import annotations

from ...deltas import Writes, writes
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ..mla.sdpa import NAME, paged_mla_sdpa, supports
from .config import SparseAttentionOutput, SparseMLAInputs
from .reference import check_reused, select


@register("sparse_mla", "prefill", NAME, supports=supports)
def prefill(spec: LayerSpec, views: Views, inputs: SparseMLAInputs) -> tuple[SparseAttentionOutput, Writes]:
    owns_indexer = spec.config.index_source_layer is None
    selected = select(views, inputs) if owns_indexer else check_reused(spec, inputs)
    att = paged_mla_sdpa(spec, views, inputs, selected=selected)
    out = SparseAttentionOutput(o=att.o, lse=att.lse, topk_indices=selected)
    latent = spec.config.mla.encode_latent(inputs.latent)
    return out, (writes(latent=latent, index_k=inputs.index_k) if owns_indexer else writes(latent=latent))
