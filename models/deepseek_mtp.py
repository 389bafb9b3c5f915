"""The DeepSeek-V3 / V3.2 / GLM-5 NextN (MTP) layer as a draft model (depth 1).

Checkpoint tensors live under ``model.layers.{N}.`` with N = num_hidden_layers
(transformers neither reads nor writes them): ``enorm``, ``hnorm``,
``eh_proj`` [D, 2D], a decoder layer (``input_layernorm``, ``self_attn.*``,
``post_attention_layernorm``, ``mlp.*``), ``shared_head.norm`` and
``shared_head.head`` [V, D]. The embedding is the target's (the copy a
checkpoint may store as ``model.layers.{N}.embed_tokens`` is not read).

    x = eh_proj(cat([enorm(embed(tokens)), hnorm(hidden)]))
    x = decoder_layer(x)
    hidden_out = shared_head.norm(x); logits = shared_head.head(hidden_out)

The decoder layer is attention layer N, of the target's attention kind: dense
MLA (DeepSeek-V3), or sparse MLA with its own indexer (V3.2, GLM-5: a draft
has no earlier layer to share top-k with). Its MLP is MoE whenever the target
has MoE layers (N is past ``first_k_dense_replace``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor

from fnattn import SparseQueryMetadata, StepDeltas
from fnattn.checks import checked

from . import deepseek_v32 as ds
from .common import check_tokens, logit_rows, rms_norm, rope_cos_sin
from .mtp import DraftModel, check_step_inputs, draft_weights
from .norm_rope import row_linear


def nextn_config(cfg: ds.DeepseekConfig) -> ds.DeepseekConfig:
    """``cfg`` with the NextN layer appended as layer N (its own indexer, the target's MLP kind)."""
    types = None if cfg.indexer_types is None else cfg.indexer_types + ("full",)
    return dataclasses.replace(cfg, num_layers=cfg.num_layers + 1, indexer_types=types,
                               mlp_types=cfg.mlp_types + ("dense" if cfg.moe is None else "sparse",))


def _prefix(cfg: ds.DeepseekConfig) -> str:
    return f"model.layers.{cfg.num_layers}."


def mtp_weight_shapes(cfg: ds.DeepseekConfig) -> dict[str, tuple[int, ...]]:
    D, V, p = cfg.hidden_size, cfg.vocab_size, _prefix(cfg)
    shapes = {p + "enorm.weight": (D,), p + "hnorm.weight": (D,), p + "eh_proj.weight": (D, 2 * D)}
    shapes.update(ds.layer_shapes(nextn_config(cfg), cfg.num_layers))
    shapes.update({p + "shared_head.norm.weight": (D,), p + "shared_head.head.weight": (V, D)})
    return shapes


@dataclass(frozen=True, eq=False)
class NextNParams:
    config: ds.DeepseekConfig  # the target's
    layer_index: int  # N: the attention layer index of the NextN layer
    embed: Tensor  # [V, D], the target's
    inv_freq: Tensor  # [Dr / 2], the target's rope
    attention_scaling: float
    enorm: Tensor  # [D]
    hnorm: Tensor  # [D]
    eh_proj: Tensor  # [D, 2D]: input columns are [embedding, hidden]
    layer: ds.Layer
    norm: Tensor  # [D] shared_head.norm
    head: Tensor  # [V, D] shared_head.head


def _draft_weights(cfg, target_params, weights, seed):
    p = _prefix(cfg)
    # A random draft predicts with the target's lm_head, as the released checkpoints' heads are copies of it.
    return draft_weights(weights, mtp_weight_shapes(cfg), marker=p + "eh_proj.weight", seed=seed,
                         like=target_params.embed, shared={p + "shared_head.head.weight": target_params.lm_head})


def random_weights(cfg: ds.DeepseekConfig, target_params: ds.Params, *, seed: int = 0) -> dict[str, Tensor]:
    """The tensors a random draft is built from, by checkpoint name."""
    return _draft_weights(cfg, target_params, None, seed)


def draft(cfg: ds.DeepseekConfig, target_params: ds.Params, weights: Mapping | None = None, *, seed: int = 0
          ) -> DraftModel:
    """The NextN draft of a loaded target: ``model.layers.{N}.*`` from ``weights`` when it holds them, else random."""
    w, p, N = _draft_weights(cfg, target_params, weights, seed), _prefix(cfg), cfg.num_layers
    full = nextn_config(cfg)
    params = NextNParams(config=cfg, layer_index=N, embed=target_params.embed, inv_freq=target_params.inv_freq,
                         attention_scaling=target_params.attention_scaling, enorm=w[p + "enorm.weight"],
                         hnorm=w[p + "hnorm.weight"], eh_proj=w[p + "eh_proj.weight"],
                         layer=ds.load_layer(full, w, N), norm=w[p + "shared_head.norm.weight"],
                         head=w[p + "shared_head.head.weight"])
    generated = tuple(lane for lane in ds.generated_lanes(full) if lane.name == f"indexer_topk_{N}")
    return DraftModel(specs=(full.specs[N],), params=params, step=step, generated_lanes=generated,
                      head="head")


@checked
def step(params: NextNParams, session, tokens: Int[Tensor, " T"], hidden: Float[Tensor, "T D"]
         ) -> tuple[Float[Tensor, "Tl vocab"], Float[Tensor, "T D"], StepDeltas]:
    """One draft step: ``tokens[i]`` follows the position whose target hidden state is ``hidden[i]``."""
    cfg, batch = params.config, session.batch
    check_step_inputs(f"{cfg.model_type} nextn step", batch, tokens, hidden, cfg.hidden_size)
    check_tokens(f"{cfg.model_type} nextn step", tokens, cfg.vocab_size)
    eps = cfg.rms_norm_eps
    e = rms_norm(params.embed[tokens], params.enorm, eps)  # [T, D]
    h = rms_norm(hidden.to(e.dtype), params.hnorm, eps)  # [T, D]
    x = row_linear(torch.cat([e, h], dim=-1), params.eh_proj)  # [T, D]
    cos, sin = rope_cos_sin(batch.positions, params.inv_freq, attention_scaling=params.attention_scaling,
                            dtype=x.dtype)  # [T, Dr]
    sparse = SparseQueryMetadata.build(batch, topk=cfg.indexer.topk) if cfg.indexer is not None else None
    x, deltas = ds.decoder_layer(session, params.layer_index, params.layer, cfg, x, cos, sin, sparse, {})
    out = rms_norm(x, params.norm, eps)  # [T, D]
    return row_linear(logit_rows(batch, out), params.head).float(), out, StepDeltas.collect(batch, [deltas])


ds.draft.register(draft)  # the target family reaches its draft through this (it cannot import this module)
