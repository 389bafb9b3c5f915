"""DeepSeek-V3.2 (MLA + DSA sparse attention) and DeepSeek-V3 (dense MLA).

Two families share this file: ``deepseek_v32`` (every layer sparse MLA with its
own lightning indexer) and ``deepseek_v3`` (dense MLA, no indexer). GLM-5
(``models/glm5.py``) reuses the config reader, loading and step and only adds
top-k sharing across layers.

A decoder layer is ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; the MLP is
dense for the first layers and a routed MoE with shared experts after them.
Routing is DeepSeek's: sigmoid scores, ``e_score_correction_bias`` added for
the choice only, the best ``topk_group`` of ``n_group`` groups, the top-k
experts inside them, weights from the unbiased scores (renormalised when
``norm_topk_prob``) times ``routed_scaling_factor``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from fnattn.kernels.invariant import pointwise
from jaxtyping import Float, Int
from torch import Tensor

from fnattn import (
    IndexerConfig,
    LayerSpec,
    MLAConfig,
    MLAInputs,
    SparseMLAConfig,
    SparseMLAInputs,
    SparseQueryMetadata,
    StepDeltas,
)
from fnattn.checks import checked
from fnattn.lanes import Lane
from fnattn.tp import all_reduce

from .common import (
    StackedExperts,
    SwiGLU,
    check_config_value,
    check_step_tokens,
    each_layer,
    grouped_topk,
    logit_rows,
    moe_sum,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
)
from .dsa_layer import INDEXER_ROPE_INTERLEAVE, IndexerWeights, indexer_keys, indexer_queries, topk_source_layers
from .mla_layer import MLAWeights, mla_project, mla_shapes, mla_softmax_scale, pad_heads, padded_kv_b, unpad_heads
from .mtp import DraftHook
from .norm_rope import row_linear
from .registry import Family, register_family

_MISSING = object()


# --------------------------------------------------------------------------- #
# Config
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class MoEConfig:
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    moe_intermediate_size: int
    n_shared_experts: int


@dataclass(frozen=True)
class DeepseekConfig:
    model_type: str  # "deepseek_v3", "deepseek_v32" or "glm_moe_dsa"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    rope_interleave: bool  # MLA's rope: adjacent dim pairs (DeepSeek checkpoints) or halves
    rope: tuple[tuple[str, Any], ...]  # normalised rope parameters, sorted (key, value) pairs
    rms_norm_eps: float
    intermediate_size: int
    mlp_types: tuple[str, ...]  # "dense" | "sparse" per layer
    moe: MoEConfig | None  # None when every layer is dense
    tie_word_embeddings: bool
    indexer: IndexerConfig | None = None  # None: dense MLA (DeepSeek-V3)
    indexer_rope_interleave: bool | None = None
    indexer_types: tuple[str, ...] | None = None  # GLM-5: "full" | "shared" per layer; None: all full
    checkpoint_dtype: str | None = None  # the config's `dtype`, for reference; specs use `dtype`
    dtype: torch.dtype = torch.float32
    padded_heads: int | None = None  # MLA heads the kernels see (`MLAConfig.padded_heads`); None: num_heads
    cache_dtype: str | None = None  # MLA latent cache (`MLAConfig.cache_dtype`, e.g. "fp8_e4m3")

    @property
    def rope_parameters(self) -> dict:
        return dict(self.rope)

    def index_source(self, layer: int) -> int | None:
        """The layer whose top-k this layer reuses, or None when it runs its own indexer."""
        if self.indexer is None or self.indexer_types is None:
            return None
        src = topk_source_layers(self.indexer_types)[layer]
        return None if src == layer else src

    @cached_property
    def specs(self) -> tuple[LayerSpec, ...]:
        scale = mla_softmax_scale(qk_head_dim=self.qk_nope_head_dim + self.qk_rope_head_dim,
                                  rope_parameters=self.rope_parameters)
        mla = MLAConfig(num_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank,
                        qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                        v_head_dim=self.v_head_dim, q_lora_rank=self.q_lora_rank, scale=scale,
                        padded_heads=self.padded_heads, cache_dtype=self.cache_dtype)
        if self.indexer is None:
            return tuple(LayerSpec(i, mla, self.dtype) for i in range(self.num_layers))
        return tuple(LayerSpec(i, SparseMLAConfig(mla, self.indexer, index_source_layer=self.index_source(i)),
                               self.dtype) for i in range(self.num_layers))


def get_field(raw: dict, name: str, kind: str, default=_MISSING, *, minimum=None, above=None):
    """``raw[name]`` checked to be a ``kind`` ("int" positive, "int0" >= 0, "float" finite, "bool", "optint")
    by the shared `check_config_value` (``minimum`` / ``above`` bound it further)."""
    value = raw.get(name, default)
    if value is _MISSING:
        raise ValueError(f"config.json: `{name}` is required")
    if kind == "optint" and value is None:
        return None
    py, low = {"int": (int, 1), "int0": (int, 0), "optint": (int, 1), "float": (float, None),
               "bool": (bool, None)}[kind]
    low = low if minimum is None else minimum
    return check_config_value("config.json", name, value, py, minimum=low, above=above)


def _rope(raw: dict) -> tuple[tuple[str, Any], ...]:
    """Rope parameters as transformers normalises them (``rope_parameters`` or legacy ``rope_scaling``)."""
    src = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(src, dict):
        raise ValueError(f"config.json: `rope_parameters` must be an object, got {src!r}")
    rope = dict(src)
    rope_type = rope.pop("type", None)
    rope.setdefault("rope_type", rope_type or "default")
    rope.setdefault("rope_theta", get_field(raw, "rope_theta", "float", 10000.0, above=0))
    rope["rope_theta"] = check_config_value("config.json", "rope_parameters.rope_theta", rope["rope_theta"], float,
                                            above=0)
    if rope["rope_type"] not in ("default", "yarn"):
        raise ValueError(f"config.json: `rope_parameters.rope_type` must be 'default' or 'yarn', "
                         f"got {rope['rope_type']!r}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"config.json: `rope_parameters.partial_rotary_factor` must be 1.0, "
                         f"got {rope['partial_rotary_factor']!r}")
    if rope["rope_type"] == "yarn":
        if "original_max_position_embeddings" in raw:  # transformers lets the top-level field win
            rope["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        rope.setdefault("original_max_position_embeddings", get_field(raw, "max_position_embeddings", "int"))
        check_config_value("config.json", "rope_parameters.original_max_position_embeddings",
                           rope["original_max_position_embeddings"], int, minimum=1)
        if rope.get("factor") is None:
            rope["factor"] = raw["max_position_embeddings"] / rope["original_max_position_embeddings"]
        check_config_value("config.json", "rope_parameters.factor", rope["factor"], float, above=0)
    return tuple(sorted(rope.items()))


def rope_tables(rope: dict, dim: int) -> tuple[Tensor, float]:
    """``(inv_freq [dim / 2], attention_scaling)`` as transformers' default / YaRN rope init computes them."""
    base = float(rope["rope_theta"])
    if rope["rope_type"] == "default":
        return rope_inv_freq(dim, base), 1.0
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    factor, orig = rope["factor"], rope["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does, to avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def _mlp_types(raw: dict, model_type: str, num_layers: int) -> tuple[str, ...]:
    # DeepSeek-V3's modeling reads only first_k_dense_replace; V3.2 / GLM-5 let mlp_layer_types override it.
    types = raw.get("mlp_layer_types") if model_type != "deepseek_v3" else None
    if types is None:
        n_dense = min(get_field(raw, "first_k_dense_replace", "int0", 3), num_layers)
        return ("dense",) * n_dense + ("sparse",) * (num_layers - n_dense)
    if not isinstance(types, list) or len(types) != num_layers or set(types) - {"dense", "sparse"}:
        raise ValueError(f"config.json: `mlp_layer_types` must list 'dense' or 'sparse' for each of the "
                         f"{num_layers} layers, got {types!r}")
    return tuple(types)


def _moe(raw: dict) -> MoEConfig:
    for name, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if raw.get(name, allowed) != allowed:
            raise ValueError(f"config.json: `{name}` must be {allowed!r}, got {raw[name]!r}")
    moe = MoEConfig(
        n_routed_experts=get_field(raw, "n_routed_experts", "int"),
        num_experts_per_tok=get_field(raw, "num_experts_per_tok", "int"),
        n_group=get_field(raw, "n_group", "int"),
        topk_group=get_field(raw, "topk_group", "int"),
        norm_topk_prob=get_field(raw, "norm_topk_prob", "bool"),
        routed_scaling_factor=get_field(raw, "routed_scaling_factor", "float"),
        moe_intermediate_size=get_field(raw, "moe_intermediate_size", "int"),
        n_shared_experts=get_field(raw, "n_shared_experts", "int"),
    )
    if moe.n_routed_experts % moe.n_group or moe.n_routed_experts // moe.n_group < 2:
        raise ValueError(f"config.json: `n_group` must split n_routed_experts={moe.n_routed_experts} into groups "
                         f"of at least 2 experts (groups are ranked by their best two), got {moe.n_group}")
    if moe.topk_group > moe.n_group:
        raise ValueError(f"config.json: `topk_group` must be <= n_group={moe.n_group}, got {moe.topk_group}")
    if moe.num_experts_per_tok > moe.topk_group * (moe.n_routed_experts // moe.n_group):
        raise ValueError(f"config.json: `num_experts_per_tok` must be <= the experts of the kept groups "
                         f"({moe.topk_group * (moe.n_routed_experts // moe.n_group)}), got {moe.num_experts_per_tok}")
    return moe


def adapt_config(raw: dict, *, model_type: str, indexer_types: tuple[str, ...] | None = None) -> DeepseekConfig:
    """A `DeepseekConfig` from a config.json dict of ``model_type``; ValueError names a bad field."""
    if raw.get("model_type") != model_type:
        raise ValueError(f"config.json: `model_type` must be {model_type!r}, got {raw.get('model_type')!r}")
    if raw.get("quantization_config") is not None:
        raise ValueError("config.json: `quantization_config` is not supported (dequantize the checkpoint first)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: `hidden_act` must be 'silu', got {raw['hidden_act']!r}")
    num_layers = get_field(raw, "num_hidden_layers", "int")
    num_heads = get_field(raw, "num_attention_heads", "int")
    if raw.get("num_key_value_heads") not in (None, num_heads):
        # MLA expands the latent into every head; a different kv head count has no meaning here.
        raise ValueError(f"config.json: `num_key_value_heads` must equal num_attention_heads={num_heads}, "
                         f"got {raw['num_key_value_heads']!r}")
    sparse = model_type != "deepseek_v3"
    rope_interleave = get_field(raw, "rope_interleave", "bool", True)
    if sparse and not rope_interleave:
        raise ValueError(f"config.json: `rope_interleave` must be true for {model_type} (its MLA rope is "
                         "always interleaved in transformers), got false")
    # V3.2 / GLM-5 always take the q_lora path: its normalised latent also feeds the indexer.
    q_lora_rank = get_field(raw, "q_lora_rank", "int" if sparse else "optint")
    rope_dim = get_field(raw, "qk_rope_head_dim", "int")
    if rope_dim % 2:
        raise ValueError(f"config.json: `qk_rope_head_dim` must be even, got {rope_dim}")
    mlp_types = _mlp_types(raw, model_type, num_layers)
    indexer, index_interleave = None, None
    if sparse:
        index_dim = get_field(raw, "index_head_dim", "int")
        if index_dim < rope_dim:  # the indexer ropes its first qk_rope_head_dim dims
            raise ValueError(f"config.json: `index_head_dim` must be >= qk_rope_head_dim={rope_dim}, got {index_dim}")
        indexer = IndexerConfig(num_heads=get_field(raw, "index_n_heads", "int"), head_dim=index_dim,
                                topk=get_field(raw, "index_topk", "int"), rope_head_dim=rope_dim)
        index_interleave = INDEXER_ROPE_INTERLEAVE[model_type]
        declared = raw.get("indexer_rope_interleave", index_interleave)
        if declared != index_interleave:
            raise ValueError(f"config.json: `indexer_rope_interleave` must be {str(index_interleave).lower()} for "
                             f"{model_type} (as transformers applies it), got {declared!r}")
    if indexer_types is not None and len(indexer_types) != num_layers:
        raise ValueError(f"config.json: `indexer_types` must have one entry per layer ({num_layers}), "
                         f"got {len(indexer_types)}")
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    return DeepseekConfig(
        model_type=model_type,
        vocab_size=get_field(raw, "vocab_size", "int"),
        hidden_size=get_field(raw, "hidden_size", "int"),
        num_layers=num_layers,
        num_heads=num_heads,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=get_field(raw, "kv_lora_rank", "int"),
        qk_nope_head_dim=get_field(raw, "qk_nope_head_dim", "int"),
        qk_rope_head_dim=rope_dim,
        v_head_dim=get_field(raw, "v_head_dim", "int"),
        attention_bias=get_field(raw, "attention_bias", "bool", False),
        rope_interleave=rope_interleave,
        rope=_rope(raw),
        rms_norm_eps=get_field(raw, "rms_norm_eps", "float", minimum=0),
        intermediate_size=get_field(raw, "intermediate_size", "int"),
        mlp_types=mlp_types,
        moe=_moe(raw) if "sparse" in mlp_types else None,
        tie_word_embeddings=get_field(raw, "tie_word_embeddings", "bool", False),
        indexer=indexer,
        indexer_rope_interleave=index_interleave,
        indexer_types=tuple(indexer_types) if indexer_types is not None else None,
        checkpoint_dtype=dtype if isinstance(dtype, str) else None,
    )


def adapt_v32(raw: dict) -> DeepseekConfig:
    return adapt_config(raw, model_type="deepseek_v32")


def adapt_v3(raw: dict) -> DeepseekConfig:
    return adapt_config(raw, model_type="deepseek_v3")


# --------------------------------------------------------------------------- #
# Weights
# --------------------------------------------------------------------------- #


def weight_shapes(cfg: DeepseekConfig) -> dict[str, tuple[int, ...]]:
    D = cfg.hidden_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, D), "model.norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, D)
    for i in range(cfg.num_layers):
        shapes.update(layer_shapes(cfg, i))
    return shapes


def layer_shapes(cfg: DeepseekConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Decoder layer ``i``'s tensors (``model.layers.{i}.*``)."""
    D = cfg.hidden_size
    p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    shapes = {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,)}
    shapes.update(mla_shapes(cfg, a))
    if cfg.indexer is not None and cfg.index_source(i) is None:
        ix, x = cfg.indexer, a + "indexer."
        shapes.update({x + "wq_b.weight": (ix.num_heads * ix.head_dim, cfg.q_lora_rank),
                       x + "wk.weight": (ix.head_dim, D), x + "k_norm.weight": (ix.head_dim,),
                       x + "k_norm.bias": (ix.head_dim,), x + "weights_proj.weight": (ix.num_heads, D)})
    m = p + "mlp."
    if cfg.mlp_types[i] == "dense":
        shapes.update(SwiGLU.shapes(m, D, cfg.intermediate_size))
    else:
        moe = cfg.moe
        shapes[m + "gate.weight"] = (moe.n_routed_experts, D)
        shapes[m + "gate.e_score_correction_bias"] = (moe.n_routed_experts,)
        for e in range(moe.n_routed_experts):
            shapes.update(SwiGLU.shapes(f"{m}experts.{e}.", D, moe.moe_intermediate_size))
        shapes.update(SwiGLU.shapes(m + "shared_experts.", D, moe.moe_intermediate_size * moe.n_shared_experts))
    return shapes


@dataclass(frozen=True, eq=False)
class MoE:
    router: Tensor  # [E, D]
    bias: Tensor  # [E] e_score_correction_bias: steers the choice, not the weights
    experts: StackedExperts  # [E, 2I, D] / [E, D, I]; experts[e] is expert e's SwiGLU (views)
    shared: SwiGLU


@dataclass(frozen=True, eq=False)
class Layer:
    input_norm: Tensor  # [D]
    post_norm: Tensor  # [D]
    attn: MLAWeights
    indexer: IndexerWeights | None  # None: dense MLA, or a layer reusing another layer's top-k
    index_source: int | None  # the layer whose top-k this layer attends with (None: its own, or dense)
    mlp: SwiGLU | MoE


@dataclass(frozen=True, eq=False)
class Params:
    config: DeepseekConfig
    embed: Tensor  # [V, D]
    layers: tuple[Layer, ...]
    norm: Tensor  # [D]
    lm_head: Tensor  # [V, D]
    inv_freq: Tensor  # [Dr / 2]
    attention_scaling: float  # YaRN's cos/sin factor (1.0 for default rope)


def load(cfg: DeepseekConfig, weights) -> Params:
    """Arrange checkpoint tensors (by HF name) into `Params`; views only."""
    layers = tuple(load_layer(cfg, weights, i) for i in range(cfg.num_layers))
    embed = weights["model.embed_tokens.weight"]
    inv_freq, scaling = rope_tables(cfg.rope_parameters, cfg.qk_rope_head_dim)
    return Params(cfg, embed, layers, weights["model.norm.weight"],
                  embed if cfg.tie_word_embeddings else weights["lm_head.weight"],
                  inv_freq.to(embed.device), scaling)


def load_layer(cfg: DeepseekConfig, weights, i: int) -> Layer:
    """Decoder layer ``i`` from ``model.layers.{i}.*``."""
    p, m = f"model.layers.{i}.", f"model.layers.{i}.mlp."
    attn = MLAWeights.from_state_dict(weights, prefix=p + "self_attn.", num_heads=cfg.num_heads)
    indexer = None
    if cfg.indexer is not None and cfg.index_source(i) is None:
        indexer = IndexerWeights.from_state_dict(weights, prefix=p + "self_attn.indexer.")
    if cfg.mlp_types[i] == "dense":
        mlp = SwiGLU.take(weights, m)
    else:
        experts = StackedExperts.take(weights, m + "experts.", cfg.moe.n_routed_experts)
        mlp = MoE(weights[m + "gate.weight"], weights[m + "gate.e_score_correction_bias"], experts,
                  SwiGLU.take(weights, m + "shared_experts."))
    return Layer(weights[p + "input_layernorm.weight"], weights[p + "post_attention_layernorm.weight"],
                 attn, indexer, cfg.index_source(i), mlp)


# --------------------------------------------------------------------------- #
# Step
# --------------------------------------------------------------------------- #


def moe(block: MoE, cfg: MoEConfig, x: Float[Tensor, "T D"]) -> Float[Tensor, "T D"]:
    """Routed experts plus the always-on shared experts."""
    scores = pointwise(torch.sigmoid, row_linear(x.float(), block.router.float()))  # [T, E], fp32 as the HF router
    ids, w = grouped_topk(scores, block.bias.float(), cfg.num_experts_per_tok, n_group=cfg.n_group,
                          topk_group=cfg.topk_group, normalize=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor)
    # fp32 weights, cast after, as HF does
    out = moe_sum(x, ids, w, len(block.experts), lambda e, xs: block.experts[e](xs), lambda y, w: y * w,
                  stacked=block.experts)
    return out + block.shared(x)


def attention_inputs(layer: Layer, cfg: DeepseekConfig, h: Tensor, cos: Tensor, sin: Tensor,
                     sparse: SparseQueryMetadata | None, reused: Tensor | None) -> MLAInputs:
    """One layer's projections as the session wants them (rope applied, kv_b_proj split)."""
    p = mla_project(layer.attn, h, cos, sin, rope_interleave=cfg.rope_interleave)
    heads = cfg.padded_heads or layer.attn.num_heads
    w_uk, w_uv = padded_kv_b(layer.attn, heads)
    base = dict(q_nope=pad_heads(p.q_nope, heads), q_pe=pad_heads(p.q_pe, heads), latent=p.latent_rows,
                w_uk=w_uk, w_uv=w_uv)
    if sparse is None:
        return MLAInputs(**base)
    if layer.indexer is None:
        return SparseMLAInputs(**base, sparse=sparse, topk_indices=reused)
    interleave = cfg.indexer_rope_interleave
    q = indexer_queries(layer.indexer, p.q_resid, h, cos, sin, rope_interleave=interleave)
    k = indexer_keys(layer.indexer, h, cos, sin, rope_interleave=interleave)
    return SparseMLAInputs(**base, sparse=sparse, index_q=q.q, index_w=q.w, index_k=k)


def decoder_layer(session, i: int, layer: Layer, cfg: DeepseekConfig, x: Float[Tensor, "T D"], cos: Tensor,
                  sin: Tensor, sparse: SparseQueryMetadata | None, topk: dict[int, Tensor]):
    """Decoder layer ``i``: ``-> (x [T, D], layer deltas)``; records its own top-k in ``topk``."""
    h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
    reused = topk[layer.index_source] if layer.index_source is not None else None
    out, deltas = session.forward(i, attention_inputs(layer, cfg, h, cos, sin, sparse, reused))
    if sparse is not None and layer.indexer is not None:
        topk[i] = out.topk_indices
        session.record(f"indexer_topk_{i}", out.topk_indices)  # a generated lane of a captured step
    # o_proj and the MLPs' down projections are row-parallel under TP (models/tp.py)
    o = unpad_heads(out.o, layer.attn.num_heads)  # drop the kernels' padding heads (`padded_heads`)
    x = x + all_reduce(row_linear(o.reshape(x.shape[0], -1), layer.attn.o_proj, layer.attn.o_proj_bias))
    h = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
    return x + all_reduce(layer.mlp(h) if isinstance(layer.mlp, SwiGLU) else moe(layer.mlp, cfg.moe, h)), deltas


@checked
def step_hidden(params: Params, session, tokens: Int[Tensor, " T"]
                ) -> tuple[Float[Tensor, "Tl vocab"], Float[Tensor, "T D"], StepDeltas]:
    """`step` that also returns the final norm's output (lm_head's input), which MTP drafts read."""
    cfg, batch = params.config, session.batch
    check_step_tokens(f"{cfg.model_type}.step", batch, tokens, cfg.vocab_size)
    x = params.embed[tokens]  # [T, D]
    cos, sin = rope_cos_sin(batch.positions, params.inv_freq, attention_scaling=params.attention_scaling,
                            dtype=x.dtype)  # [T, Dr]
    # One metadata value per step, shared by every sparse layer.
    sparse = SparseQueryMetadata.build(batch, topk=cfg.indexer.topk) if cfg.indexer is not None else None
    topk: dict[int, Tensor] = {}  # layer -> its [T, topk] selection, for the layers that reuse it
    layer_deltas = []
    for i, layer in each_layer(params.layers):
        x, deltas = decoder_layer(session, i, layer, cfg, x, cos, sin, sparse, topk)
        layer_deltas.append(deltas)
    hidden = rms_norm(x, params.norm, cfg.rms_norm_eps)  # [T, D]
    # The cursor advances once, after every layer has read the state.
    logits = row_linear(logit_rows(batch, hidden), params.lm_head).float()
    return logits, hidden, StepDeltas.collect(batch, layer_deltas)


@checked
def step(params: Params, session, tokens: Int[Tensor, " T"]) -> tuple[Float[Tensor, "Tl vocab"], StepDeltas]:
    """One step of any phase: ``(params, session, tokens) -> (logits [T, vocab] fp32, deltas)``."""
    logits, _, deltas = step_hidden(params, session, tokens)
    return logits, deltas


# The NextN (MTP) draft model: `models/deepseek_mtp.py` builds on this module and registers itself here.
draft = DraftHook("models/deepseek_mtp.py")


# --------------------------------------------------------------------------- #
# Tiny configs and registration
# --------------------------------------------------------------------------- #


def tiny_config(model_type: str = "deepseek_v32") -> dict:
    """Three layers: one dense MLP, then two MoE layers routed over 2 of 4 expert groups."""
    raw = {
        "model_type": model_type, "vocab_size": 160, "hidden_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "intermediate_size": 96,
        "moe_intermediate_size": 24, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "n_group": 4, "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False,
    }
    if model_type != "deepseek_v3":
        raw.update(index_n_heads=4, index_head_dim=16, index_topk=8)
    return raw


def generated_lanes(cfg: DeepseekConfig) -> tuple[Lane, ...]:
    """The top-k each indexer layer builds inside the step ([T, topk] int64): generated, never copied."""
    if cfg.indexer is None:
        return ()
    return tuple(Lane(f"indexer_topk_{i}", ("T", cfg.indexer.topk), torch.int64, "generated")
                 for i in range(cfg.num_layers) if cfg.index_source(i) is None)


register_family(Family(name="deepseek_v32", model_types=("deepseek_v32",), adapt=adapt_v32,
                       weight_shapes=weight_shapes, load=load, step=step, tiny_config=tiny_config,
                       step_hidden=step_hidden, draft=draft, generated_lanes=generated_lanes))
register_family(Family(name="deepseek_v3", model_types=("deepseek_v3",), adapt=adapt_v3,
                       weight_shapes=weight_shapes, load=load, step=step,
                       tiny_config=lambda: tiny_config("deepseek_v3"), step_hidden=step_hidden, draft=draft))
