"""DeepSeek-V4: sliding-window, compressed sparse (CSA) and heavily compressed (HCA) attention, mHC, MoE.

A decoder layer keeps ``hc_mult`` residual streams (manifold-constrained
hyper-connections): each block collapses them into one input with learned
``pre`` weights, and the block output is expanded back with ``post`` and added
to the streams mixed by a Sinkhorn-projected ``comb`` matrix. The attention
block is `models.dsv4_layer` around the ``dsv4`` kind; the MLP block is a
routed MoE (learned top-k, or a fixed token -> experts table for the first
``hash_moe`` layers) plus one shared expert, with SwiGLU pre-activations
clipped at ``swiglu_limit``. After the last layer a hyper head collapses the
streams before the final norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F
from fnattn.kernels.invariant import pointwise
from jaxtyping import Float, Int
from torch import Tensor

from fnattn import IndexerConfig, LayerSpec, StepDeltas
from fnattn.checks import checked
from fnattn.kinds.dsv4 import DSV4Config
from fnattn.kinds.dsv4.math import rms_norm_fp32w
from fnattn.tp import all_reduce

from .common import (
    StackedExperts,
    check_config_value,
    check_step_tokens,
    each_layer,
    experts,
    grouped_topk,
    logit_rows,
)
from .deepseek_v32 import get_field, rope_tables
from .dsv4_layer import AttnWeights, attention_inputs, output_projection, unweighted_norm
from .dsv4_layer import rope_tables as cos_sin
from .mla_layer import unpad_heads
from .mtp import DraftHook
from .norm_rope import row_linear
from .registry import Family, register_family

LAYER_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
SCORING = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "softmax": lambda x: x.softmax(-1),
           "sigmoid": torch.sigmoid}


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    layer_types: tuple[str, ...]
    compress_rates: tuple[tuple[str, int], ...]  # (layer type, ratio) of the two compressed types
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_types: tuple[str, ...]  # "hash_moe" | "moe" per layer
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    rope_main: tuple[tuple[str, Any], ...]
    rope_compress: tuple[tuple[str, Any], ...]
    tie_word_embeddings: bool
    dtype: torch.dtype = torch.float32
    padded_heads: int | None = None  # query heads the kernels see (`DSV4Config.padded_heads`); None: num_heads

    def ratio(self, layer_type: str) -> int:
        return dict(self.compress_rates).get(layer_type, 0)

    def attention_config(self, i: int) -> DSV4Config:
        t = self.layer_types[i]
        m = self.ratio(t)
        indexer = None
        if t == "compressed_sparse_attention":
            indexer = IndexerConfig(num_heads=self.index_n_heads, head_dim=self.index_head_dim, topk=self.index_topk,
                                    rope_head_dim=self.qk_rope_head_dim)
        return DSV4Config(num_heads=self.num_heads, head_dim=self.head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                          sliding_window=self.sliding_window, compress_ratio=m, indexer=indexer,
                          compressor={"sliding_attention": None, "compressed_sparse_attention": "csa",
                                      "heavily_compressed_attention": "hca"}[t], norm_eps=self.rms_norm_eps,
                          padded_heads=self.padded_heads)

    @cached_property
    def specs(self) -> tuple[LayerSpec, ...]:
        return tuple(LayerSpec(i, self.attention_config(i), self.dtype) for i in range(self.num_layers))


# --------------------------------------------------------------------------- config.json


def _layer_types(raw: dict, n: int) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        ratios = raw["compress_ratios"]
        if not isinstance(ratios, list) or any(r not in LAYER_TYPES for r in ratios):
            raise ValueError(f"config.json: `compress_ratios` must list 0, 4 or 128 per layer, got {ratios!r}")
        types = [LAYER_TYPES[r] for r in ratios]
    if types is None:
        inter = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                 for i in range(max(n - 2, 0))]
        types = ["heavily_compressed_attention"] * min(n, 2) + inter
    types = list(types)[:n]
    if len(types) != n or set(types) - set(LAYER_TYPES.values()):
        raise ValueError(f"config.json: `layer_types` must list one of {sorted(LAYER_TYPES.values())} for each "
                         f"of the {n} layers, got {types!r}")
    return tuple(types)


def _mlp_types(raw: dict, n: int) -> tuple[str, ...]:
    types = raw.get("mlp_layer_types")
    if types is None:
        n_hash = get_field(raw, "num_hash_layers", "int0", 3)
        types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    types = list(types)[:n]
    if len(types) != n or set(types) - {"hash_moe", "moe"}:
        raise ValueError(f"config.json: `mlp_layer_types` must list 'hash_moe' or 'moe' for each of the {n} "
                         f"layers, got {types!r}")
    return tuple(types)


def _ropes(raw: dict, prf: float) -> tuple[dict, dict]:
    """``(main, compress)`` rope parameters as transformers' DeepseekV4Config normalises them."""
    rp = raw.get("rope_parameters") or {}
    if not isinstance(rp, dict):
        raise ValueError(f"config.json: `rope_parameters` must be an object, got {rp!r}")
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = dict(rp["main"]), dict(rp["compress"])
    else:
        main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
        comp = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        comp["rope_theta"] = raw.get("compress_rope_theta", 160000.0)
        comp.setdefault("rope_type", comp.pop("type", "default"))
        if comp["rope_type"] == "yarn":
            comp.setdefault("attention_factor", 1.0)
    for name, r in (("main", main), ("compress", comp)):
        r.setdefault("rope_type", r.pop("type", "default"))
        r["rope_theta"] = check_config_value("config.json", f"rope_parameters.{name}.rope_theta",
                                             r.get("rope_theta"), float, above=0)
        if r["rope_type"] not in ("default", "yarn"):
            raise ValueError(f"config.json: `rope_parameters.{name}.rope_type` must be 'default' or 'yarn', "
                             f"got {r['rope_type']!r}")
        if r.get("partial_rotary_factor", prf) != prf:
            raise ValueError(f"config.json: `rope_parameters.{name}.partial_rotary_factor` must be the model's "
                             f"{prf}, got {r['partial_rotary_factor']!r}")
        r.pop("partial_rotary_factor", None)
        if r["rope_type"] == "yarn":
            r.setdefault("original_max_position_embeddings", get_field(raw, "max_position_embeddings", "int"))
            if r.get("factor") is None:
                raise ValueError(f"config.json: `rope_parameters.{name}.factor` is required for yarn")
            if r.get("attention_factor", 1.0) != 1.0:  # the compressed entries are roped without it
                raise ValueError(f"config.json: `rope_parameters.{name}.attention_factor` must be 1.0, "
                                 f"got {r['attention_factor']!r}")
    return main, comp


def adapt(raw: dict) -> DeepseekV4Config:
    """A `DeepseekV4Config` from a config.json dict; ValueError names a bad field."""
    if raw.get("model_type") != "deepseek_v4":
        raise ValueError(f"config.json: `model_type` must be 'deepseek_v4', got {raw.get('model_type')!r}")
    if raw.get("quantization_config") is not None:
        raise ValueError("config.json: `quantization_config` is not supported (dequantize the checkpoint first)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: `hidden_act` must be 'silu', got {raw['hidden_act']!r}")
    if raw.get("num_key_value_heads", 1) != 1:
        raise ValueError(f"config.json: `num_key_value_heads` must be 1 (one shared K=V head), "
                         f"got {raw['num_key_value_heads']!r}")
    for name in ("attention_bias", "mlp_bias"):
        if raw.get(name, False):
            raise ValueError(f"config.json: `{name}` must be false, got {raw[name]!r}")
    n = get_field(raw, "num_hidden_layers", "int")
    head_dim = get_field(raw, "head_dim", "int")
    prf = raw.get("partial_rotary_factor")
    if prf is None:
        qk = raw.get("qk_rope_head_dim")
        prf = qk / head_dim if isinstance(qk, int) and not isinstance(qk, bool) else 64 / 512
    prf = check_config_value("config.json", "partial_rotary_factor", prf, float, above=0)
    rope_dim = int(head_dim * prf)
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise ValueError(f"config.json: `partial_rotary_factor` must give an even rope dim <= head_dim={head_dim}, "
                         f"got {rope_dim}")
    rates = dict(raw.get("compress_rates") or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    for legacy, t in (("compress_rate_csa", "compressed_sparse_attention"),
                      ("compress_rate_hca", "heavily_compressed_attention")):
        if raw.get(legacy) is not None:
            rates[t] = raw[legacy]
    for t in ("compressed_sparse_attention", "heavily_compressed_attention"):
        check_config_value("config.json", f"compress_rates.{t}", rates.get(t), int, minimum=2)
    heads, groups = get_field(raw, "num_attention_heads", "int"), get_field(raw, "o_groups", "int")
    if heads * head_dim % groups:
        raise ValueError(f"config.json: `o_groups` must divide num_attention_heads * head_dim = {heads * head_dim}, "
                         f"got {groups}")
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING:
        raise ValueError(f"config.json: `scoring_func` must be one of {sorted(SCORING)}, got {scoring!r}")
    main, comp = _ropes(raw, prf)
    index_dim = get_field(raw, "index_head_dim", "int")
    if index_dim < rope_dim:
        raise ValueError(f"config.json: `index_head_dim` must be >= the rope dim {rope_dim}, got {index_dim}")
    n_experts, k = get_field(raw, "n_routed_experts", "int", minimum=2), get_field(raw, "num_experts_per_tok", "int")
    if k > n_experts:
        raise ValueError(f"config.json: `num_experts_per_tok` must be <= n_routed_experts={n_experts}, got {k}")
    if get_field(raw, "n_shared_experts", "int") != 1:
        raise ValueError(f"config.json: `n_shared_experts` must be 1 (one shared expert), "
                         f"got {raw['n_shared_experts']!r}")
    return DeepseekV4Config(
        vocab_size=get_field(raw, "vocab_size", "int"), hidden_size=get_field(raw, "hidden_size", "int"),
        num_layers=n, num_heads=heads, head_dim=head_dim, q_lora_rank=get_field(raw, "q_lora_rank", "int"),
        qk_rope_head_dim=rope_dim, layer_types=_layer_types(raw, n),
        compress_rates=tuple(sorted((t, int(rates[t])) for t in ("compressed_sparse_attention",
                                                                   "heavily_compressed_attention"))),
        sliding_window=get_field(raw, "sliding_window", "int"), o_groups=groups,
        o_lora_rank=get_field(raw, "o_lora_rank", "int"), index_n_heads=get_field(raw, "index_n_heads", "int"),
        index_head_dim=index_dim, index_topk=get_field(raw, "index_topk", "int"),
        hc_mult=get_field(raw, "hc_mult", "int", 4), hc_sinkhorn_iters=get_field(raw, "hc_sinkhorn_iters", "int", 20),
        hc_eps=get_field(raw, "hc_eps", "float", 1e-6, minimum=0), mlp_types=_mlp_types(raw, n),
        n_routed_experts=n_experts, num_experts_per_tok=k, n_shared_experts=1,
        moe_intermediate_size=get_field(raw, "moe_intermediate_size", "int"), scoring_func=scoring,
        routed_scaling_factor=get_field(raw, "routed_scaling_factor", "float", 1.5),
        swiglu_limit=get_field(raw, "swiglu_limit", "float", 10.0, above=0),
        rms_norm_eps=get_field(raw, "rms_norm_eps", "float", 1e-6, minimum=0),
        rope_main=tuple(sorted(main.items())), rope_compress=tuple(sorted(comp.items())),
        tie_word_embeddings=get_field(raw, "tie_word_embeddings", "bool", False),
    )


# --------------------------------------------------------------------------- weights


def _hc_shapes(p: str, cfg: DeepseekV4Config) -> dict[str, tuple[int, ...]]:
    N = cfg.hc_mult
    return {p + "_fn": ((2 + N) * N, N * cfg.hidden_size), p + "_base": ((2 + N) * N,), p + "_scale": (3,)}


def weight_shapes(cfg: DeepseekV4Config) -> dict[str, tuple[int, ...]]:
    """Every float tensor, by the names transformers writes (DeepSeek's own: ``attn.wq_a``, ``ffn.experts.{e}.w1``)."""
    D, N = cfg.hidden_size, cfg.hc_mult
    s = {"model.embed_tokens.weight": (cfg.vocab_size, D), "model.norm.weight": (D,),
         "model.hc_head.hc_fn": (N, N * D), "model.hc_head.hc_base": (N,), "model.hc_head.hc_scale": (1,)}
    if not cfg.tie_word_embeddings:
        s["head.weight"] = (cfg.vocab_size, D)
    for i, spec in enumerate(cfg.specs):
        s.update(layer_shapes(cfg, f"model.layers.{i}.", spec.config, cfg.mlp_types[i]))
    return s


def layer_shapes(cfg: DeepseekV4Config, p: str, c: DSV4Config, mlp_type: str) -> dict[str, tuple[int, ...]]:
    """One decoder block's float tensors under ``p`` (``model.layers.{i}.``)."""
    D, E, inner = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    s = AttnWeights.shapes(p + "attn.", c, hidden=D, q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups,
                           o_lora_rank=cfg.o_lora_rank)
    s.update({p + "attn_norm.weight": (D,), p + "ffn_norm.weight": (D,)})
    s.update(_hc_shapes(p + "hc_attn", cfg))
    s.update(_hc_shapes(p + "hc_ffn", cfg))
    m = p + "ffn."
    s[m + "gate.weight"] = (E, D)
    if mlp_type == "moe":
        s[m + "gate.bias"] = (E,)
    for e in range(E):  # w1: gate, w3: up, w2: down
        s.update({f"{m}experts.{e}.w1.weight": (inner, D), f"{m}experts.{e}.w3.weight": (inner, D),
                  f"{m}experts.{e}.w2.weight": (D, inner)})
    s.update({m + "shared_experts.w1.weight": (inner, D), m + "shared_experts.w3.weight": (inner, D),
              m + "shared_experts.w2.weight": (D, inner)})
    return s


def index_shapes(cfg: DeepseekV4Config) -> dict[str, tuple[int, ...]]:
    """The integer tensors: each hash-routed layer's token -> experts table, with its bound."""
    return {f"model.layers.{i}.ffn.gate.tid2eid": ((cfg.vocab_size, cfg.num_experts_per_tok), cfg.n_routed_experts)
            for i, t in enumerate(cfg.mlp_types) if t == "hash_moe"}


@dataclass(frozen=True, eq=False)
class HC:
    fn: Tensor  # [(2 + N) * N, N * D] fp32
    base: Tensor  # [(2 + N) * N] fp32
    scale: Tensor  # [3] fp32

    @classmethod
    def take(cls, w, p: str) -> HC:
        return cls(w[p + "_fn"].float(), w[p + "_base"].float(), w[p + "_scale"].float())


@dataclass(frozen=True, eq=False)
class MoE:
    router: Tensor  # [E, D]
    bias: Tensor | None  # [E] fp32 (learned routing only)
    tid2eid: Tensor | None  # [vocab, k] int64 (hash routing only)
    experts: StackedExperts  # the routed experts: gate_up [E, 2I, D] (w1 rows, then w3), down [E, D, I] (w2)
    shared: tuple[Tensor, Tensor, Tensor]  # gate [I, D], up [I, D], down [D, I]


@dataclass(frozen=True, eq=False)
class Layer:
    attn: AttnWeights
    input_norm: Tensor  # [D] fp32
    post_norm: Tensor  # [D] fp32
    attn_hc: HC
    ffn_hc: HC
    mlp: MoE


@dataclass(frozen=True, eq=False)
class Params:
    config: DeepseekV4Config
    embed: Tensor
    layers: tuple[Layer, ...]
    norm: Tensor  # [D] fp32
    head_hc: tuple[Tensor, Tensor, Tensor]  # hc_fn [N, N * D], hc_base [N], hc_scale [1], fp32
    lm_head: Tensor
    inv_freq_main: Tensor  # [Dr / 2]
    inv_freq_compress: Tensor  # [Dr / 2]


def load_layer(cfg: DeepseekV4Config, w, p: str, c: DSV4Config, mlp_type: str) -> Layer:
    """One decoder block from the tensors under ``p``."""
    m, hashed = p + "ffn.", mlp_type == "hash_moe"
    # stacked [E, 2I, D] / [E, D, I] for `common.experts`, as transformers merges them on load
    routed = StackedExperts.stack([tuple(w[f"{m}experts.{e}.{n}.weight"] for n in ("w1", "w3", "w2"))
                                   for e in range(cfg.n_routed_experts)])
    mlp = MoE(w[m + "gate.weight"], None if hashed else w[m + "gate.bias"].float(),
              w[m + "gate.tid2eid"].long() if hashed else None, routed,
              tuple(w[m + f"shared_experts.{n}.weight"] for n in ("w1", "w3", "w2")))
    return Layer(AttnWeights.take(w, p + "attn.", c), w[p + "attn_norm.weight"].float(),
                 w[p + "ffn_norm.weight"].float(), HC.take(w, p + "hc_attn"), HC.take(w, p + "hc_ffn"), mlp)


def load(cfg: DeepseekV4Config, w) -> Params:
    layers = tuple(load_layer(cfg, w, f"model.layers.{i}.", spec.config, cfg.mlp_types[i])
                   for i, spec in enumerate(cfg.specs))
    embed = w["model.embed_tokens.weight"]
    main, _ = rope_tables(dict(cfg.rope_main), cfg.qk_rope_head_dim)
    comp, _ = rope_tables(dict(cfg.rope_compress), cfg.qk_rope_head_dim)
    return Params(cfg, embed, layers, w["model.norm.weight"].float(),
                  (w["model.hc_head.hc_fn"].float(), w["model.hc_head.hc_base"].float(),
                   w["model.hc_head.hc_scale"].float()),
                  embed if cfg.tie_word_embeddings else w["head.weight"], main.to(embed.device),
                  comp.to(embed.device))


# --------------------------------------------------------------------------- step


def hyper(hc: HC, streams: Float[Tensor, "T N D"], cfg: DeepseekV4Config):
    """mHC weights of a block: ``-> (post [T, N], comb [T, N, N], collapsed input [T, D])``, fp32 weights."""
    T, N = streams.shape[:2]
    flat = unweighted_norm(streams.reshape(T, -1).float(), cfg.rms_norm_eps)
    mix = row_linear(flat, hc.fn)
    pre_w, post_w, comb_w = mix.split([N, N, N * N], dim=-1)
    pre_b, post_b, comb_b = hc.base.split([N, N, N * N])
    pre_s, post_s, comb_s = hc.scale.unbind(0)
    pre = pointwise(torch.sigmoid, pre_w * pre_s + pre_b) + cfg.hc_eps
    post = 2 * pointwise(torch.sigmoid, post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(T, N, N) * comb_s + comb_b.view(N, N), dim=-1) + cfg.hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):  # Sinkhorn-Knopp: rows and columns sum to 1
        comb = comb / (comb.sum(dim=-1, keepdim=True) + cfg.hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + cfg.hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def merge(post: Tensor, comb: Tensor, out: Float[Tensor, "T D"], streams: Float[Tensor, "T N D"]) -> Tensor:
    """Expand a block output into the streams and add the streams mixed by ``comb`` (its transpose)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def moe(block: MoE, cfg: DeepseekV4Config, x: Float[Tensor, "T D"], tokens: Tensor) -> Float[Tensor, "T D"]:
    scores = pointwise(SCORING[cfg.scoring_func], row_linear(x, block.router))  # [T, E]
    if block.tid2eid is None:
        ids, w = grouped_topk(scores, block.bias, cfg.num_experts_per_tok, n_group=1, topk_group=1,
                              normalize=True, scaling=cfg.routed_scaling_factor)
    else:  # hash routing: the experts are fixed per token id, the weights still come from the router
        ids = block.tid2eid.index_select(0, tokens)
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
    routed = experts(x, ids, w, block.experts.gate_up, block.experts.down, limit=cfg.swiglu_limit)
    g, u, d = block.shared
    lim = cfg.swiglu_limit
    gate = pointwise(F.silu, row_linear(x, g).clamp(max=lim))
    shared = row_linear(gate * row_linear(x, u).clamp(min=-lim, max=lim), d)
    return routed + shared


def decoder_layer(session, i: int, layer: Layer, c: DSV4Config, cfg: DeepseekV4Config,
                  streams: Float[Tensor, "T N D"], ropes: dict, comp_inv_freq: Tensor, tokens: Tensor):
    """Decoder block ``i`` (attention layer ``i`` of the session): ``-> (streams [T, N, D], layer writes)``."""
    cos, sin = ropes["main" if c.compress_ratio == 0 else "compress"]
    post, comb, h = hyper(layer.attn_hc, streams, cfg)
    h = rms_norm_fp32w(h, layer.input_norm, cfg.rms_norm_eps)
    inputs = attention_inputs(layer.attn, c, h, session.batch.positions, cos, sin,
                              comp_inv_freq if c.compress_ratio else None, cfg.rms_norm_eps)
    out, deltas = session.forward(i, inputs)
    if out.topk_indices is not None:  # CSA: the indexer's top-k, a generated lane of a captured step
        session.record(f"indexer_topk_{i}", out.topk_indices)
    # the grouped output projection and the MoE are row-parallel under TP (models/tp.py)
    o = unpad_heads(out.o, c.num_heads)  # drop the kernels' padding heads (`padded_heads`)
    streams = merge(post, comb, all_reduce(output_projection(layer.attn, o, cos, sin, cfg.o_groups)), streams)
    post, comb, h = hyper(layer.ffn_hc, streams, cfg)
    h = rms_norm_fp32w(h, layer.post_norm, cfg.rms_norm_eps)
    return merge(post, comb, all_reduce(moe(layer.mlp, cfg, h, tokens)), streams), deltas


def collapse(head_hc: tuple[Tensor, Tensor, Tensor], norm: Tensor, streams: Float[Tensor, "T N D"],
             cfg: DeepseekV4Config) -> Float[Tensor, "T D"]:
    """The hyper head (learned ``pre`` weights over the streams), then the final norm."""
    fn, base, scale = head_hc
    flat = unweighted_norm(streams.flatten(1).float(), cfg.rms_norm_eps)
    pre = pointwise(torch.sigmoid, row_linear(flat, fn) * scale + base) + cfg.hc_eps  # [T, N]
    return rms_norm_fp32w((pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype), norm, cfg.rms_norm_eps)


@checked
def step_hidden(params: Params, session, tokens: Int[Tensor, " T"]
                ) -> tuple[Float[Tensor, "Tl vocab"], Float[Tensor, "T D"], StepDeltas]:
    """`step` that also returns the final norm's output."""
    cfg, batch = params.config, session.batch
    check_step_tokens("deepseek_v4.step", batch, tokens, cfg.vocab_size)
    x = params.embed[tokens]  # [T, D]
    pos = batch.positions
    ropes = {"main": cos_sin(pos, params.inv_freq_main, x.dtype), "compress": cos_sin(pos, params.inv_freq_compress,
                                                                                      x.dtype)}
    streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()  # [T, N, D]
    layer_deltas = []
    for i, layer in each_layer(params.layers):
        streams, deltas = decoder_layer(session, i, layer, cfg.specs[i].config, cfg, streams, ropes,
                                        params.inv_freq_compress, tokens)
        layer_deltas.append(deltas)
    hidden = collapse(params.head_hc, params.norm, streams, cfg)
    logits = row_linear(logit_rows(batch, hidden), params.lm_head).float()
    return logits, hidden, StepDeltas.collect(batch, layer_deltas)


@checked
def step(params: Params, session, tokens: Int[Tensor, " T"]) -> tuple[Float[Tensor, "Tl vocab"], StepDeltas]:
    """One step of any phase: ``(params, session, tokens) -> (logits [T, vocab] fp32, deltas)``."""
    logits, _, deltas = step_hidden(params, session, tokens)
    return logits, deltas


def generated_lanes(cfg: DeepseekV4Config) -> tuple:
    """The top-k each CSA layer's indexer builds inside the step ([T, index_topk] int64): generated, never copied."""
    return tuple(topk_lane(cfg, i) for i, s in enumerate(cfg.specs) if s.config.indexer is not None)


def topk_lane(cfg: DeepseekV4Config, layer: int):
    """The generated lane of CSA layer ``layer``'s top-k (the MTP draft's layer too)."""
    from fnattn.lanes import Lane

    return Lane(f"indexer_topk_{layer}", ("T", cfg.index_topk), torch.int64, "generated")


# The MTP draft model: `models/deepseek_v4_mtp.py` builds on this module and registers itself here.
draft = DraftHook("models/deepseek_v4_mtp.py")


def tiny_config() -> dict:
    """Four layers (sliding, CSA every 4 tokens with an 8-head top-3 indexer, HCA every 8, CSA), a window of 6,
    two streams, 4 experts (the first layer hash-routed)."""
    return {
        "model_type": "deepseek_v4", "vocab_size": 160, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "q_lora_rank": 32,
        "partial_rotary_factor": 0.25, "layer_types": ["sliding_attention", "compressed_sparse_attention",
                                                         "heavily_compressed_attention", "compressed_sparse_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"], "sliding_window": 6, "o_groups": 2,
        "o_lora_rank": 16, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 3, "hc_mult": 2,
        "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "moe_intermediate_size": 32, "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0, "max_position_embeddings": 1024, "hidden_act": "silu",
        "tie_word_embeddings": False,
    }


register_family(Family(name="deepseek_v4", model_types=("deepseek_v4",), adapt=adapt, weight_shapes=weight_shapes,
                       load=load, step=step, tiny_config=tiny_config, step_hidden=step_hidden,
                       draft=draft, index_shapes=index_shapes, generated_lanes=generated_lanes))
