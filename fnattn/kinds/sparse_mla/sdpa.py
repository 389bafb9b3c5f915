"""CPU backend for sparse MLA prefill and decode (backend ``sdpa``): the reference's indexer, then the
attention over the selected positions through torch's fused SDPA kernel.

The selection is the reference's (`.reference.select`, or the top-k a shared layer is handed, checked as
there); the attention is `fnattn.kinds.mla.sdpa`'s with the selected positions as a mask: prefill in the
expanded form, one call per request over its cached and new keys; decode in the absorbed form, one call for
the whole batch; verify in the absorbed form, one call per request. In the invariant mode
(`fnattn.kernels.invariant`) both the selection and the attention are the reference's fixed-order forms.
"""

from __future__ import annotations

from ...deltas import Writes, writes
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ..cpu_sdpa import supports
from ..mla.sdpa import NAME, paged_decode_sdpa, paged_mla_sdpa
from .config import SparseAttentionOutput, SparseMLAInputs
from .reference import check_reused, own_index_values, select


def _step(spec: LayerSpec, views: Views, inputs: SparseMLAInputs, phase: str) -> tuple[SparseAttentionOutput, Writes]:
    index_values = own_index_values(spec, inputs)
    selected = select(spec, views, inputs, index_values) if index_values else check_reused(spec, inputs)
    if phase == "decode":
        att = paged_decode_sdpa(spec, views, inputs, selected)
    else:
        att = paged_mla_sdpa(spec, views, inputs, phase=phase, selected=selected)
    out = SparseAttentionOutput(o=att.o, lse=att.lse, topk_indices=selected)
    return out, writes(latent=spec.config.mla.encode_latent(inputs.latent), **index_values)


@register("sparse_mla", "prefill", NAME, supports=supports, invariant=True)
def prefill(spec: LayerSpec, views: Views, inputs: SparseMLAInputs) -> tuple[SparseAttentionOutput, Writes]:
    return _step(spec, views, inputs, "prefill")


@register("sparse_mla", "decode", NAME, supports=supports, invariant=True)
def decode(spec: LayerSpec, views: Views, inputs: SparseMLAInputs) -> tuple[SparseAttentionOutput, Writes]:
    return _step(spec, views, inputs, "decode")


@register("sparse_mla", "verify", NAME, supports=supports, invariant=True)
def verify(spec: LayerSpec, views: Views, inputs: SparseMLAInputs) -> tuple[SparseAttentionOutput, Writes]:
    return _step(spec, views, inputs, "verify")
