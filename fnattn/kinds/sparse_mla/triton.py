"""Sparse MLA on CUDA in the invariant mode (backend ``triton``): dense MLA's invariant launches
(`fnattn.kinds.mla.triton`) over each token's own selection.

The indexer is `fnattn.kernels.indexer_topk` (each key's score from one product over its dims, a token's
positions picked by score then position: the ordered top-k, which the invariant mode keeps; shared with
`.flashmla`), or the source layer's picks for a layer that reuses them. The picks, ascending
(`fnattn.kernels.latent_invariant.ascending_picks`), are the token's key tiles in
`latent_attention_invariant`: cached rows from the pool, the step's own from its ``latent``, so no merge
follows the step. The absorbed query and ``W_UV`` take fixed tiles of 16 tokens. A token's output and its
picks are then the same bits in a prefill, a decode and a verify, and beside any requests.

It serves the invariant mode only (FlashMLA's sparse kernel is faster outside it), reads no device value on
the host in decode and verify (capturable), and stores the latent in the layer dtype (no FP8 latent cache).
"""

from __future__ import annotations

from ...deltas import Writes, writes
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ..mla.triton import supports
from .config import SparseAttentionOutput, SparseMLAInputs
from .flashmla import select
from .reference import own_index_values

NAME = "triton"


def _step(spec: LayerSpec, views: Views, inputs: SparseMLAInputs) -> tuple[SparseAttentionOutput, Writes]:
    from ...kernels.latent_absorb import absorb_query
    from ...kernels.latent_invariant import TOKEN_TILE, ascending_picks, latent_attention_invariant, latent_values

    m, batch = spec.config.mla, inputs.meta.batch
    index_values = own_index_values(spec, inputs)
    selected = select(spec, views, inputs, index_values)  # [T, topk] positions, -1: none
    q = absorb_query(inputs.q_nope, inputs.q_pe, inputs.w_uk, block_t=TOKEN_TILE)  # [T, H, R + Dr]
    o_lat, lse = latent_attention_invariant(q, views.latent, inputs.latent, batch.block_table, batch.cache_lens,
                                            batch.positions, inputs.sparse.request_of_token,
                                            kv_rank=m.kv_lora_rank, scale=m.scale,
                                            indices=ascending_picks(selected))  # [T, H, R] fp32, [T, H]
    out = SparseAttentionOutput(o=latent_values(o_lat, inputs.w_uv), lse=lse, topk_indices=selected)
    return out, writes(latent=inputs.latent, **index_values)


for _phase in ("prefill", "decode", "verify"):
    _guard = register("sparse_mla", _phase, NAME, supports=supports, capturable=_phase != "prefill",
                      invariant=True)(_step)
# The module's name runs only through a session from here on, like every registered backend.
_step = _guard
