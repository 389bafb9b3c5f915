"""Triton kernels: plain tensors in and out, each with a pure-torch `*_ref` beside it.

Importing this package imports neither torch nor triton; names load on first use.
The delta-rule math for one sequence (`gdn_naive`, fp32 torch) is the reference of the
GDN / KDA kernels and the arithmetic of `fnattn.kinds.delta_rule`. Of the attention
kernels (paged_attention, lse_merge, scatter), only `scatter_kv` / `scatter_rows`
write into their arguments. `skinny_linear` is ``x @ w.T`` for decode-sized ``x``
(at most 64 rows), optionally with SwiGLU's SiLU-and-mul or an RMSNorm folded into its load and a
residual added to its result (``norm=``, ``residual=``); `skinny_folds` takes the op after it into the same
launch: `skinny_linear_swiglu` (SwiGLU's activation), `skinny_linear_gating` (GDN's g and beta),
`skinny_linear_add_` (the residual add and the next RMSNorm's row-local half); `gdn_gating` is GDN's g and beta in one
launch, and
`qk_norm_rope` is attention's q / k head norms and rope (and v's copy to contiguous heads) in one;
`gated_rms_norm_silu` and `sigmoid_gate` are the gates on a mixer's output, reading strided gates in place;
`add_rms_norm_` and `silu_and_mul` the residual add + RMSNorm and SwiGLU's activation; `topk_slots` a
sparse layer's top-k positions as the pool slots and own-row indices its attention kernel reads;
`absorb_query` MLA's absorbed decode query (``[q_nope W_UK, q_pe]``) in one launch;
`latent_attention_invariant` and `latent_values` MLA's latent attention and ``W_UV`` in the invariant mode
(each token alone in its programs, key tiles fixed by position, products in fixed token tiles).
The decode-step kernels (the GEMV, gating, fused GDN decode, q / k norms and rope, paged attention and
its merge, the output gates, the add + norm and activation) launch with programmatic dependent launch on
Hopper and later, unless within `pdl(False)`.

The modules live in the repository's top-level kernels/ folder; an install copies them beside this file.
"""

import importlib
import sys

from ..checkout import checkout_folder

__path__ += checkout_folder("kernels")  # noqa: F821 - the package's own search path

# `skinny_linear` and `qk_norm_rope` are not exported here: a name shared with its module would be the
# function before the module is first imported and the module after. Import them from their modules.

_EXPORTS = {
    "attention_fixed_order": "attention_naive",
    "paged_decode": "paged_attention",
    "paged_decode_ref": "paged_attention",
    "paged_prefill": "paged_attention",
    "paged_prefill_ref": "paged_attention",
    "merge_attention_states": "lse_merge",
    "merge_attention_states_ref": "lse_merge",
    "merge_new_token": "lse_merge",
    "merge_new_token_ref": "lse_merge",
    "scatter_kv": "scatter",
    "scatter_kv_ref": "scatter",
    "scatter_rows": "scatter",
    "scatter_rows_ref": "scatter",
    "scatter_rows_pair": "scatter",
    "gated_delta_recurrent": "gated_delta",
    "gated_delta_recurrent_ref": "gated_delta",
    "gated_delta_chunked": "gated_delta",
    "gated_delta_chunked_ref": "gated_delta",
    "causal_conv1d": "gated_delta",
    "causal_conv1d_ref": "gated_delta",
    "chunk_indices": "gated_delta",
    "gated_delta_decode_fused": "gdn_decode_fused",
    "gated_delta_decode_fused_ref": "gdn_decode_fused",
    "gdn_gating": "gdn_gate", "gdn_gating_ref": "gdn_gate",
    "qk_norm_rope_ref": "qk_norm_rope",
    "skinny_linear_ref": "skinny_linear",
    "skinny_linear_add_": "skinny_folds",
    "skinny_linear_gating": "skinny_folds",
    "skinny_linear_swiglu": "skinny_folds", "skinny_linear_swiglu_ref": "skinny_folds",
    "SkinnyConfig": "skinny_linear",
    "pick_config": "skinny_linear", "launch_config": "skinny_linear",
    "pdl": "_triton",
    "gated_rms_norm_silu": "output_gate", "gated_rms_norm_silu_ref": "output_gate",
    "sigmoid_gate": "output_gate", "sigmoid_gate_ref": "output_gate",
    "add_rms_norm_": "norm_act", "add_rms_norm_ref": "norm_act",
    "topk_slots": "sparse_slots", "topk_slots_ref": "sparse_slots",
    "absorb_query": "latent_absorb", "absorb_query_ref": "latent_absorb",
    "latent_attention_invariant": "latent_invariant", "latent_attention_invariant_ref": "latent_invariant",
    "latent_values": "latent_invariant", "latent_values_ref": "latent_invariant",
    "silu_and_mul": "norm_act", "silu_and_mul_ref": "norm_act",
    "indexer_scores_paged": "indexer",
    "indexer_scores_paged_ref": "indexer",
    "indexer_topk": "indexer",
    "indexer_topk_ref": "indexer",
    "radix_topk": "indexer",
    "sort_positions": "indexer",
    "causal_conv1d_seq": "gdn_naive",
    "gated_delta_recurrent_seq": "gdn_naive",
    "gated_delta_chunked_seq": "gdn_naive",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # Backends import their kernels from here inside each call: the loaded module straight from sys.modules.
    # The name is not kept here, so a kernel replaced in its own module (a test's spy) is what callers get.
    loaded = sys.modules.get(f"{__name__}.{module}")
    return getattr(loaded if loaded is not None else importlib.import_module(f".{module}", __name__), name)
