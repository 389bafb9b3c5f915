"""The DeepSeek-V4 MTP module as a draft model (depth 1).

Tensors live under ``mtp.0.`` (transformers neither reads nor writes them, so
a transformers-written checkpoint gives a random draft): ``enorm``, ``hnorm``,
``e_proj`` and ``h_proj`` [D, D], one decoder block in the target's naming
(``attn.*``, ``attn_norm``, ``hc_attn_*``, ``ffn.*``, ``ffn_norm``,
``hc_ffn_*``), its hyper head (``hc_head_fn`` / ``_base`` / ``_scale``) and
``norm``; the embedding and the output head are the target's.

    x = e_proj(enorm(embed(tokens))) + h_proj(hnorm(hidden))
    streams = block(x repeated over the hc_mult streams)
    hidden_out = norm(hyper_head(streams)); logits = head(hidden_out)

The block's attention is layer N (= num_hidden_layers) of the target's last
compressed type, so the draft keeps a window, compressed entries and a
compressor state of its own (rolled back with the draft's checkpoints), and
its MLP is learned-routed MoE.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from jaxtyping import Float, Int
from torch import Tensor

from fnattn import LayerSpec, StepDeltas
from fnattn.checks import checked
from fnattn.kinds.dsv4 import DSV4Config
from fnattn.kinds.dsv4.math import rms_norm_fp32w

from . import deepseek_v4 as v4
from .common import check_tokens, logit_rows
from .dsv4_layer import rope_tables as cos_sin
from .mtp import DraftModel, check_step_inputs, draft_weights
from .norm_rope import row_linear

PREFIX = "mtp.0."


def draft_attention(cfg: v4.DeepseekV4Config) -> DSV4Config:
    """The draft block's attention: the type of the target's last compressed layer (or its last layer)."""
    compressed = [i for i, s in enumerate(cfg.specs) if s.config.compress_ratio]
    return cfg.specs[compressed[-1] if compressed else -1].config


def mtp_weight_shapes(cfg: v4.DeepseekV4Config) -> dict[str, tuple[int, ...]]:
    D, N, p = cfg.hidden_size, cfg.hc_mult, PREFIX
    s = {p + "enorm.weight": (D,), p + "hnorm.weight": (D,), p + "e_proj.weight": (D, D), p + "h_proj.weight": (D, D),
         p + "norm.weight": (D,), p + "hc_head_fn": (N, N * D), p + "hc_head_base": (N,), p + "hc_head_scale": (1,)}
    s.update(v4.layer_shapes(cfg, p, draft_attention(cfg), "moe"))
    return s


@dataclass(frozen=True, eq=False)
class MTPParams:
    config: v4.DeepseekV4Config  # the target's
    layer_index: int  # N
    spec_config: DSV4Config
    embed: Tensor  # [V, D], the target's
    head: Tensor  # [V, D], the target's lm_head
    inv_freq_main: Tensor
    inv_freq_compress: Tensor
    enorm: Tensor  # [D] fp32
    hnorm: Tensor  # [D] fp32
    e_proj: Tensor  # [D, D]
    h_proj: Tensor  # [D, D]
    layer: v4.Layer
    head_hc: tuple[Tensor, Tensor, Tensor]
    norm: Tensor  # [D] fp32


def draft(cfg: v4.DeepseekV4Config, target_params: v4.Params, weights: Mapping | None = None, *, seed: int = 0
          ) -> DraftModel:
    """The MTP draft of a loaded target: ``mtp.0.*`` from ``weights`` when it holds them, else random."""
    p, c = PREFIX, draft_attention(cfg)
    w = draft_weights(weights, mtp_weight_shapes(cfg), marker=p + "e_proj.weight", seed=seed, like=target_params.embed)
    params = MTPParams(config=cfg, layer_index=cfg.num_layers, spec_config=c, embed=target_params.embed,
                       head=target_params.lm_head, inv_freq_main=target_params.inv_freq_main,
                       inv_freq_compress=target_params.inv_freq_compress, enorm=w[p + "enorm.weight"].float(),
                       hnorm=w[p + "hnorm.weight"].float(), e_proj=w[p + "e_proj.weight"],
                       h_proj=w[p + "h_proj.weight"], layer=v4.load_layer(cfg, w, p, c, "moe"),
                       head_hc=(w[p + "hc_head_fn"].float(), w[p + "hc_head_base"].float(),
                                w[p + "hc_head_scale"].float()),
                       norm=w[p + "norm.weight"].float())
    # a CSA draft layer builds its indexer's top-k inside the step, as the target's do
    generated = (v4.topk_lane(cfg, cfg.num_layers),) if c.indexer is not None else ()
    return DraftModel(specs=(LayerSpec(cfg.num_layers, c, cfg.dtype),), params=params, step=step,
                      generated_lanes=generated, head="head")


@checked
def step(params: MTPParams, session, tokens: Int[Tensor, " T"], hidden: Float[Tensor, "T D"]
         ) -> tuple[Float[Tensor, "Tl vocab"], Float[Tensor, "T D"], StepDeltas]:
    """One draft step: ``tokens[i]`` follows the position whose target hidden state is ``hidden[i]``."""
    cfg, batch = params.config, session.batch
    check_step_inputs("deepseek_v4 mtp step", batch, tokens, hidden, cfg.hidden_size)
    check_tokens("deepseek_v4 mtp step", tokens, cfg.vocab_size)
    eps = cfg.rms_norm_eps
    e = rms_norm_fp32w(params.embed[tokens], params.enorm, eps)
    h = rms_norm_fp32w(hidden.to(e.dtype), params.hnorm, eps)
    x = row_linear(e, params.e_proj) + row_linear(h, params.h_proj)  # [T, D]
    pos = batch.positions
    ropes = {"main": cos_sin(pos, params.inv_freq_main, x.dtype),
             "compress": cos_sin(pos, params.inv_freq_compress, x.dtype)}
    streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
    streams, deltas = v4.decoder_layer(session, params.layer_index, params.layer, params.spec_config, cfg, streams,
                                       ropes, params.inv_freq_compress, tokens)
    out = v4.collapse(params.head_hc, params.norm, streams, cfg)
    return row_linear(logit_rows(batch, out), params.head).float(), out, StepDeltas.collect(batch, [deltas])



v4.draft.register(draft)  # the target family reaches its draft through this (it cannot import this module)


__all__ = ["draft", "mtp_weight_shapes", "step"]
