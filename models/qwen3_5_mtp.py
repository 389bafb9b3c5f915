"""The Qwen3.5 / Qwen3-Next MTP module as a draft model (depth 1).

Checkpoint tensors (top level, beside ``model.``): ``mtp.fc.weight`` [D, 2D],
``mtp.pre_fc_norm_embedding.weight``, ``mtp.pre_fc_norm_hidden.weight``,
``mtp.layers.{j}.*`` (a gated full-attention decoder layer with the target's
MLP kind) and ``mtp.norm.weight``; every norm stores ``weight - 1``. The
embedding and lm_head are the target's.

    x = fc(cat([pre_fc_norm_embedding(embed(tokens)), pre_fc_norm_hidden(hidden)]))
    x = mtp.layers[j](x) for each j
    hidden_out = mtp.norm(x); logits = lm_head(hidden_out)

The MTP layer ``j`` is attention layer ``num_hidden_layers + j``. Its MLP is
MoE when any target layer is (the released MoE checkpoints route their MTP
layer too), dense SwiGLU of ``intermediate_size`` otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from fnattn import StepDeltas
from fnattn.checks import checked

from . import qwen3_5 as q
from .common import check_tokens, logit_rows, rope_cos_sin
from .fused import linear, rms_norm_offset, step_rope_table
from .mtp import DraftModel, check_step_inputs, draft_weights

MARKER = "mtp.fc.weight"


def mtp_config(cfg: q.QwenConfig) -> q.QwenConfig:
    """The MTP layers as a QwenConfig of their own (full attention, the target's MLP kind).

    Transformers' configs have no ``mtp_num_hidden_layers``; a random draft
    then gets one layer, as every released checkpoint has.
    """
    n = cfg.mtp_num_hidden_layers or 1
    return dataclasses.replace(cfg, layer_types=(q.FULL,) * n, moe_layers=(any(cfg.moe_layers),) * n)


def mtp_weight_shapes(cfg: q.QwenConfig) -> dict[str, tuple[int, ...]]:
    D, m = cfg.hidden_size, mtp_config(cfg)
    shapes = {"mtp.fc.weight": (D, 2 * D), "mtp.pre_fc_norm_embedding.weight": (D,),
              "mtp.pre_fc_norm_hidden.weight": (D,)}
    for j in range(m.num_layers):
        shapes.update(q.layer_shapes(m, j, f"mtp.layers.{j}."))
    shapes["mtp.norm.weight"] = (D,)
    return shapes


@dataclass(frozen=True, eq=False)
class MTPParams:
    config: q.QwenConfig  # the target's
    first_layer: int  # attention layer index of mtp.layers.0 (the target's num_hidden_layers)
    embed: Tensor  # [V, D], the target's
    lm_head: Tensor  # [V, D], the target's
    inv_freq: Tensor  # [rotary_dim / 2], the target's rope
    fc: Tensor  # [D, 2D]: input columns are [embedding, hidden]
    norm_embedding: Tensor  # [D], stored as weight - 1
    norm_hidden: Tensor  # [D], stored as weight - 1
    layers: tuple[q.Layer, ...]
    norm: Tensor  # [D], stored as weight - 1


def random_weights(cfg: q.QwenConfig, target_params: q.Params, *, seed: int = 0) -> dict[str, Tensor]:
    """The tensors a random draft is built from, by checkpoint name."""
    return draft_weights(None, mtp_weight_shapes(cfg), marker=MARKER, seed=seed, like=target_params.embed)


def draft(cfg: q.QwenConfig, target_params: q.Params, weights: Mapping | None = None, *, seed: int = 0
          ) -> DraftModel:
    """The MTP draft of a loaded target: ``mtp.*`` from ``weights`` when it holds them, else random."""
    w = draft_weights(weights, mtp_weight_shapes(cfg), marker=MARKER, seed=seed, like=target_params.embed)
    m, first = mtp_config(cfg), cfg.num_layers
    layers = tuple(q.load_layer(m, w, j, f"mtp.layers.{j}.") for j in range(m.num_layers))
    params = MTPParams(config=cfg, first_layer=first, embed=target_params.embed, lm_head=target_params.lm_head,
                       inv_freq=target_params.inv_freq, fc=w["mtp.fc.weight"],
                       norm_embedding=w["mtp.pre_fc_norm_embedding.weight"],
                       norm_hidden=w["mtp.pre_fc_norm_hidden.weight"], layers=layers, norm=w["mtp.norm.weight"])
    specs = tuple(dataclasses.replace(s, index=first + s.index) for s in m.specs)
    return DraftModel(specs=specs, params=params, step=step)


@checked
def step(params: MTPParams, session, tokens: Int[Tensor, " T"], hidden: Float[Tensor, "T D"]
         ) -> tuple[Float[Tensor, "Tl vocab"], Float[Tensor, "T D"], StepDeltas]:
    """One draft step: ``tokens[i]`` follows the position whose target hidden state is ``hidden[i]``."""
    cfg, batch = params.config, session.batch
    check_step_inputs(f"{cfg.model_type} mtp step", batch, tokens, hidden, cfg.hidden_size)
    check_tokens(f"{cfg.model_type} mtp step", tokens, cfg.vocab_size)
    eps, layers = cfg.rms_norm_eps, params.layers
    cos, sin = rope_cos_sin(batch.positions, params.inv_freq)  # [T, rotary_dim]
    e = rms_norm_offset(F.embedding(tokens, params.embed), params.norm_embedding, eps)  # [T, D]
    h = rms_norm_offset(hidden.to(e.dtype), params.norm_hidden, eps)  # [T, D]
    x = linear(torch.cat([e, h], dim=-1), params.fc)  # [T, D]; the residual stream, this step's own tensor
    # The target's fused layer path (`qwen3_5.step_hidden`): each residual add and the norm after it go with
    # the projection before them; the last layer's MLP output meets the final norm.
    table = step_rope_table(cos, sin, x)
    h = rms_norm_offset(x, layers[0].input_norm, eps)
    layer_deltas = []
    for j, layer in enumerate(layers):
        last = j + 1 == len(layers)
        x, h, deltas = q._chained_layer(session, params.first_layer + j, layer, x, h,
                                        params.norm if last else layers[j + 1].input_norm, cos, sin, cfg, table,
                                        split_next=not last)
        layer_deltas.append(deltas)
    logits = linear(logit_rows(batch, h), params.lm_head, widen=True)  # [Tl, vocab] fp32
    return logits, h, StepDeltas.collect(batch, layer_deltas)

q.draft.register(draft)  # the target family reaches its draft through this (it cannot import this module)
