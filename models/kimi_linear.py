"""Kimi Linear (model_type "kimi_linear"): KDA and MLA layers, a dense or MoE MLP each.

Matches transformers' ``KimiLinearForCausalLM``:

- attention: each decoder layer is Kimi Delta Attention ("linear_attention")
  or multi-head latent attention ("full_attention"). The MLA is NoPE: no
  rotary embedding anywhere, yet the query still has ``qk_rope_head_dim``
  extra dims per head that score against a shared per-token key slice of
  ``kv_a_proj_with_mqa``, unrotated. Those dims are the spec's rope dims, so
  the cache row stays ``[c_kv, k_rot]``. With ``qk_rope_head_dim == 0`` the
  layer keeps one zero rope dim (MLAConfig needs a positive one; zeros add
  nothing to any score) and the softmax scale stays ``qk_nope_head_dim**-0.5``.
- MLP: "dense" layers run a SwiGLU MLP; "sparse" layers run DeepSeek-V3
  routing (sigmoid scores, ``e_score_correction_bias`` for the choice only,
  grouped top-k, optional renormalisation, ``routed_scaling_factor``) over
  SwiGLU experts, plus always-on shared experts.
- the lm_head is never tied to the embeddings (transformers' Kimi Linear
  declares no tied weights, whatever ``tie_word_embeddings`` says).

Tensor names are the released checkpoint's, which is also what transformers'
``save_pretrained`` writes back: per-expert ``w1``/``w3``/``w2`` under
``block_sparse_moe``, the three short convs and the forget-gate weights
directly under ``self_attn``. One difference: ``save_pretrained`` files the
dense MLPs under ``block_sparse_moe`` too, where the release has ``mlp``; a
config.json carrying ``mlp_layer_types`` (always written by transformers,
never by the release) selects the former.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from fnattn.kernels.invariant import pointwise
from jaxtyping import Float, Int
from torch import Tensor

from fnattn import Batch, KDAConfig, LayerSpec, MLAConfig, MLAInputs, RecurrentInputs, StepDeltas
from fnattn.checks import checked, fail
from fnattn.tp import all_reduce

from .common import (
    StackedExperts,
    SwiGLU,
    check_config_value,
    check_step_tokens,
    config_field,
    each_layer,
    grouped_topk,
    logit_rows,
    moe_sum,
    rms_norm,
    swiglu,
)
from .kda_layer import KDAWeights, kda_finish, kda_project
from .mla_layer import mla_shapes
from .norm_rope import row_linear
from .registry import Family, register_family

_WHERE = "kimi_linear config"
_LAYER_TYPES = ("linear_attention", "full_attention")
_MLP_TYPES = ("dense", "sparse")
_DTYPES = ("float32", "bfloat16", "float16")
# eps of q_a_layernorm / kv_a_layernorm: transformers builds them with the RMSNorm
# default, not config.rms_norm_eps.
_MLA_NORM_EPS = 1e-6


@dataclass(frozen=True)
class KimiLinearConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # per layer: "linear_attention" (KDA) or "full_attention" (MLA)
    mlp_types: tuple[str, ...]  # per layer: "dense" or "sparse"
    rms_eps: float
    # KDA
    kda_heads: int
    kda_head_dim: int  # key and value head size alike
    conv_kernel: int
    # MLA
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # may be 0
    v_head_dim: int
    attention_bias: bool
    # MLP / MoE
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    n_shared_experts: int
    dense_mlp_name: str = "mlp"  # "block_sparse_moe" in checkpoints written by transformers
    checkpoint_dtype: str | None = None  # config.json `dtype`, as stored; weights are cast on load
    dtype: torch.dtype = torch.float32  # the attention layers' dtype (LayerSpec.dtype)

    @property
    def cache_rope_dim(self) -> int:
        """Rope dims kept per cache row: at least one, zero-filled when the config has none."""
        return max(self.qk_rope_head_dim, 1)

    @property
    def specs(self) -> tuple[LayerSpec, ...]:
        kda = KDAConfig(num_heads=self.kda_heads, head_k_dim=self.kda_head_dim, head_v_dim=self.kda_head_dim,
                        conv_kernel=self.conv_kernel)
        mla = MLAConfig(num_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank,
                        qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.cache_rope_dim,
                        v_head_dim=self.v_head_dim, q_lora_rank=self.q_lora_rank,
                        scale=(self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5)
        return tuple(LayerSpec(index=i, config=kda if t == "linear_attention" else mla, dtype=self.dtype)
                     for i, t in enumerate(self.layer_types))


# --------------------------------------------------------------------------- config


def _get(config: dict, names: tuple[str, ...], default, *, prefix: str = ""):
    """A field under any of its names (the released checkpoint's or transformers')."""
    found = {n: config[n] for n in names if n in config}
    if len({repr(v) for v in found.values()}) > 1:
        fail(_WHERE, prefix + names[0], f"one value across its names {names}", found)
    return next(iter(found.values())) if found else default


def _int(config, names, default, *, minimum=1, prefix: str = ""):
    return check_config_value(_WHERE, prefix + names[0], _get(config, names, default, prefix=prefix), int,
                              minimum=minimum)


def _layer_schedule(config: dict, n: int) -> tuple[str, ...]:
    """``layer_types``, else ``linear_attn_config``'s 1-based lists, else transformers' default."""
    linear = config.get("linear_attn_config") or {}
    types = config.get("layer_types")
    if types is None and "full_attn_layers" in linear and "kda_layers" in linear:
        types = [None] * n
        for name, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for layer in linear[name]:
                if not isinstance(layer, int) or not 1 <= layer <= n:
                    fail(_WHERE, f"linear_attn_config.{name}", f"1-based layer numbers in 1..{n}", linear[name])
                types[layer - 1] = kind
    elif types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if not isinstance(types, (list, tuple)) or len(types) != n or any(t not in _LAYER_TYPES for t in types):
        fail(_WHERE, "layer_types", f"{n} entries from {_LAYER_TYPES} (every layer KDA or MLA)", types)
    return tuple(types)


def _mlp_schedule(config: dict, n: int) -> tuple[str, ...]:
    types = config.get("mlp_layer_types")
    if types is None:
        first_dense = _int(config, ("first_k_dense_replace",), 1, minimum=0)
        types = ["dense" if i < first_dense else "sparse" for i in range(n)]
    if not isinstance(types, (list, tuple)) or len(types) != n or any(t not in _MLP_TYPES for t in types):
        fail(_WHERE, "mlp_layer_types", f"{n} entries from {_MLP_TYPES}", types)
    return tuple(types)


def adapt(config: dict, *, dtype: torch.dtype = torch.float32) -> KimiLinearConfig:
    """A transformers / original ``config.json`` dict -> KimiLinearConfig.

    Missing fields take transformers' defaults. ``dtype`` is the attention layers'
    dtype; the step casts the layers' inputs to it, so weights of another dtype work.
    """
    if config.get("model_type") != "kimi_linear":
        fail(_WHERE, "model_type", "'kimi_linear'", config.get("model_type"))
    for name, value in (("hidden_act", config.get("hidden_act", "silu")),
                        ("moe_router_activation_func", config.get("moe_router_activation_func", "sigmoid"))):
        if value not in (("silu", "swish") if name == "hidden_act" else ("sigmoid",)):
            fail(_WHERE, name, "'silu'" if name == "hidden_act" else "'sigmoid' (the only router)", value)
    if config.get("moe_layer_freq", 1) != 1:
        # The release puts MoE on layers with index % freq == 0; transformers ignores
        # the field. Only 1 means the same model to both.
        fail(_WHERE, "moe_layer_freq", "1 (or absent)", config.get("moe_layer_freq"))
    if config.get("mla_use_nope", True) is not True:
        # transformers' Kimi Linear MLA has no rotary embedding at all.
        fail(_WHERE, "mla_use_nope", "true (rope on MLA layers is not part of Kimi Linear)",
             config.get("mla_use_nope"))
    n = _int(config, ("num_hidden_layers",), 27)
    heads = _int(config, ("num_attention_heads",), 32)
    kv_heads = _get(config, ("num_key_value_heads",), None)
    if kv_heads not in (None, heads):
        # The MLA expands keys per query head; fewer kv heads would not line up.
        fail(_WHERE, "num_key_value_heads", f"num_attention_heads={heads} (or null)", kv_heads)
    linear = config.get("linear_attn_config") or {}
    if not isinstance(linear, dict):
        fail(_WHERE, "linear_attn_config", "a dict", linear)
    q_lora = config.get("q_lora_rank")
    if q_lora is not None:
        q_lora = _int(config, ("q_lora_rank",), None)
    eps = config_field(config, _WHERE, "rms_norm_eps", float, 1e-5, minimum=0)
    scaling = config_field(config, _WHERE, "routed_scaling_factor", float, 2.446)
    norm_topk = _get(config, ("moe_renormalize", "norm_topk_prob"), True)
    if not isinstance(norm_topk, bool):
        fail(_WHERE, "moe_renormalize", "a bool", norm_topk)
    bias = config.get("attention_bias", False)
    if not isinstance(bias, bool):
        fail(_WHERE, "attention_bias", "a bool", bias)
    stored = config.get("dtype", config.get("torch_dtype"))
    if stored is not None and stored not in _DTYPES:
        fail(_WHERE, "dtype", f"one of {_DTYPES}", stored)
    sub = dict(prefix="linear_attn_config.")
    cfg = KimiLinearConfig(
        vocab_size=_int(config, ("vocab_size",), 163840),
        hidden_size=_int(config, ("hidden_size",), 2304),
        num_layers=n,
        layer_types=_layer_schedule(config, n),
        mlp_types=_mlp_schedule(config, n),
        rms_eps=float(eps),
        # linear_attn_config wins over the flat fields, as in transformers.
        kda_heads=_int(linear, ("num_heads",), _int(config, ("linear_num_heads",), 32), **sub),
        kda_head_dim=_int(linear, ("head_dim",), _int(config, ("linear_head_dim",), 128), **sub),
        conv_kernel=_int(linear, ("short_conv_kernel_size",), _int(config, ("linear_conv_kernel_dim",), 4, minimum=2),
                         minimum=2, **sub),
        num_heads=heads,
        q_lora_rank=q_lora,
        kv_lora_rank=_int(config, ("kv_lora_rank",), 512),
        qk_nope_head_dim=_int(config, ("qk_nope_head_dim",), 128),
        qk_rope_head_dim=_int(config, ("qk_rope_head_dim",), 64, minimum=0),
        v_head_dim=_int(config, ("v_head_dim",), 128),
        attention_bias=bias,
        intermediate_size=_int(config, ("intermediate_size",), 9216),
        moe_intermediate_size=_int(config, ("moe_intermediate_size",), 1024),
        num_experts=_int(config, ("num_experts", "num_local_experts"), 256),
        top_k=_int(config, ("num_experts_per_token", "num_experts_per_tok"), 8),
        n_group=_int(config, ("num_expert_group", "n_group"), 1),
        topk_group=_int(config, ("topk_group",), 1),
        norm_topk_prob=norm_topk,
        routed_scaling_factor=float(scaling),
        n_shared_experts=_int(config, ("num_shared_experts", "n_shared_experts"), 1, minimum=0),
        dense_mlp_name="block_sparse_moe" if "mlp_layer_types" in config else "mlp",
        checkpoint_dtype=stored,
        dtype=dtype,
    )
    E, G = cfg.num_experts, cfg.n_group
    if E % G or E // G < 2:
        # Each group is scored by its best two experts.
        fail(_WHERE, "num_expert_group", f"a divisor of num_experts={E} leaving >= 2 experts per group", G)
    if config.get("use_grouped_topk", True) is not True and G > 1:
        # transformers always routes by groups; the release would not with this flag.
        fail(_WHERE, "use_grouped_topk", f"true when num_expert_group={G} > 1", config.get("use_grouped_topk"))
    if cfg.topk_group > G:
        fail(_WHERE, "topk_group", f"<= num_expert_group={G}", cfg.topk_group)
    if cfg.top_k > cfg.topk_group * (E // G):
        fail(_WHERE, "num_experts_per_token", f"<= the {cfg.topk_group * (E // G)} experts of the kept groups",
             cfg.top_k)
    return cfg


# --------------------------------------------------------------------------- weights


def _layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def weight_shapes(cfg: KimiLinearConfig) -> dict[str, tuple[int, ...]]:
    D, V = cfg.hidden_size, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i, (attn, mlp) in enumerate(zip(cfg.layer_types, cfg.mlp_types)):
        p = _layer_prefix(i)
        shapes[p + "input_layernorm.weight"] = (D,)
        shapes[p + "post_attention_layernorm.weight"] = (D,)
        a = p + "self_attn."
        if attn == "linear_attention":
            H, K = cfg.kda_heads, cfg.kda_head_dim
            shapes.update({
                a + "q_proj.weight": (H * K, D), a + "k_proj.weight": (H * K, D), a + "v_proj.weight": (H * K, D),
                a + "q_conv1d.weight": (H * K, 1, cfg.conv_kernel), a + "k_conv1d.weight": (H * K, 1, cfg.conv_kernel),
                a + "v_conv1d.weight": (H * K, 1, cfg.conv_kernel),
                a + "f_a_proj.weight": (K, D), a + "f_b_proj.weight": (H * K, K),
                a + "A_log": (1, 1, H, 1), a + "dt_bias": (H * K,),
                a + "b_proj.weight": (H, D), a + "g_a_proj.weight": (K, D), a + "g_b_proj.weight": (H * K, K),
                a + "o_norm.weight": (K,), a + "o_proj.weight": (D, H * K),
            })
        else:
            shapes.update(mla_shapes(cfg, a))
        if mlp == "dense":
            shapes.update(SwiGLU.shapes(p + cfg.dense_mlp_name + ".", D, cfg.intermediate_size))
        else:
            m, n, E = p + "block_sparse_moe.", cfg.moe_intermediate_size, cfg.num_experts
            shapes.update({m + "gate.weight": (E, D), m + "gate.e_score_correction_bias": (E,)})
            for e in range(E):
                x = f"{m}experts.{e}."
                shapes.update({x + "w1.weight": (n, D), x + "w3.weight": (n, D), x + "w2.weight": (D, n)})
            if cfg.n_shared_experts:  # zero shared experts: zero-sized weights that add nothing
                shapes.update(SwiGLU.shapes(m + "shared_experts.", D, n * cfg.n_shared_experts))
    return shapes


@dataclass(frozen=True, eq=False)
class MLAParams:
    w_uk: Tensor  # [H, Dn, R] key half of kv_b_proj
    w_uv: Tensor  # [H, Dv, R] value half of kv_b_proj
    kv_a_proj: Tensor  # [R + Dr, D]
    kv_a_norm: Tensor  # [R]
    o_proj: Tensor  # [D, H * Dv]
    q_proj: Tensor | None  # [H * (Dn + Dr), D] without q_lora_rank
    q_a_proj: Tensor | None  # [Rq, D]
    q_a_norm: Tensor | None  # [Rq]
    q_b_proj: Tensor | None  # [H * (Dn + Dr), Rq]
    q_a_bias: Tensor | None
    kv_a_bias: Tensor | None
    o_bias: Tensor | None


@dataclass(frozen=True, eq=False)
class KDAParams:
    w: KDAWeights
    conv_weight: Tensor  # [3 H K, W] the q, k, v taps as one depthwise conv


@dataclass(frozen=True, eq=False)
class MoEParams:
    router: Tensor  # [E, D]
    bias: Tensor  # [E] e_score_correction_bias: moves the choice, not the weights
    experts: StackedExperts  # gate w1 | up w3 [E, 2I, D], down w2 [E, D, I]; experts[e]: expert e's SwiGLU
    shared: tuple[Tensor, Tensor, Tensor] | None  # gate [Is, D], up [Is, D], down [D, Is]


@dataclass(frozen=True, eq=False)
class Layer:
    input_norm: Tensor  # [D]
    post_norm: Tensor  # [D]
    attn: KDAParams | MLAParams
    mlp: tuple[Tensor, Tensor, Tensor] | MoEParams  # dense: gate [I, D], up [I, D], down [D, I]


@dataclass(frozen=True, eq=False)
class Params:
    config: KimiLinearConfig
    embed: Tensor  # [V, D]
    layers: tuple[Layer, ...]
    norm: Tensor  # [D]
    lm_head: Tensor  # [V, D]


def load(cfg: KimiLinearConfig, weights) -> Params:
    """Arrange checkpoint tensors (by their checkpoint names) into Params; views, but for the joined conv taps."""
    layers = []
    for i, (attn, mlp) in enumerate(zip(cfg.layer_types, cfg.mlp_types)):
        p = _layer_prefix(i)
        a = p + "self_attn."
        if attn == "linear_attention":
            w = KDAWeights.from_state_dict(weights, eps=cfg.rms_eps, activation="silu", prefix=a)
            # The checkpoint keeps three convs; the backend takes one. Joined once here
            # (a few KB per layer), not on every step.
            attn_params = KDAParams(w=w, conv_weight=w.conv_weight)
        else:
            H, Dn, Dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
            w_uk, w_uv = weights[a + "kv_b_proj.weight"].view(H, Dn + Dv, cfg.kv_lora_rank).split([Dn, Dv], dim=1)
            lora = cfg.q_lora_rank is not None
            attn_params = MLAParams(
                w_uk=w_uk, w_uv=w_uv, kv_a_proj=weights[a + "kv_a_proj_with_mqa.weight"],
                kv_a_norm=weights[a + "kv_a_layernorm.weight"], o_proj=weights[a + "o_proj.weight"],
                q_proj=None if lora else weights[a + "q_proj.weight"],
                q_a_proj=weights[a + "q_a_proj.weight"] if lora else None,
                q_a_norm=weights[a + "q_a_layernorm.weight"] if lora else None,
                q_b_proj=weights[a + "q_b_proj.weight"] if lora else None,
                q_a_bias=weights[a + "q_a_proj.bias"] if lora and cfg.attention_bias else None,
                kv_a_bias=weights[a + "kv_a_proj_with_mqa.bias"] if cfg.attention_bias else None,
                o_bias=weights[a + "o_proj.bias"] if cfg.attention_bias else None,
            )
        if mlp == "dense":
            m = p + cfg.dense_mlp_name + "."
            mlp_params = tuple(weights[m + f"{n}_proj.weight"] for n in ("gate", "up", "down"))
        else:
            m = p + "block_sparse_moe."
            shared = (tuple(weights[m + f"shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down"))
                      if cfg.n_shared_experts else None)
            mlp_params = MoEParams(
                router=weights[m + "gate.weight"], bias=weights[m + "gate.e_score_correction_bias"],
                experts=StackedExperts.stack([tuple(weights[f"{m}experts.{e}.{n}.weight"] for n in ("w1", "w3", "w2"))
                                              for e in range(cfg.num_experts)]),
                shared=shared)
        layers.append(Layer(input_norm=weights[p + "input_layernorm.weight"],
                            post_norm=weights[p + "post_attention_layernorm.weight"], attn=attn_params, mlp=mlp_params))
    return Params(config=cfg, embed=weights["model.embed_tokens.weight"], layers=tuple(layers),
                  norm=weights["model.norm.weight"], lm_head=weights["lm_head.weight"])


# --------------------------------------------------------------------------- step


def route(
    h: Float[Tensor, "T D"], moe: MoEParams, cfg: KimiLinearConfig
) -> tuple[Int[Tensor, "T k"], Float[Tensor, "T k"]]:
    """transformers' KimiLinearTopkRouter: sigmoid scores in fp32, biased grouped top-k."""
    scores = pointwise(torch.sigmoid, row_linear(h.float(), moe.router.float()))  # [T, E]
    return grouped_topk(scores, moe.bias.float(), cfg.top_k, n_group=cfg.n_group, topk_group=cfg.topk_group,
                        normalize=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor)


def _moe(h: Float[Tensor, "T D"], moe: MoEParams, cfg: KimiLinearConfig) -> Float[Tensor, "T D"]:
    ids, w = route(h, moe, cfg)  # [T, k], [T, k] fp32
    # Weighted in fp32 and rounded once, as transformers' experts do.
    out = moe_sum(h, ids, w, len(moe.experts), lambda e, xs: moe.experts[e](xs), lambda y, w: y * w,
                  stacked=moe.experts)
    return out if moe.shared is None else out + swiglu(h, *moe.shared)


def _mla_inputs(a: MLAParams, h: Float[Tensor, "T D"], cfg: KimiLinearConfig) -> MLAInputs:
    """Queries and cache rows as KimiLinearAttention computes them (no rope anywhere), in the spec dtype."""
    T, H, Dn, Dr, R = h.shape[0], cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if a.q_proj is not None:
        q = row_linear(h, a.q_proj)
    else:
        q = row_linear(rms_norm(row_linear(h, a.q_a_proj, a.q_a_bias), a.q_a_norm, _MLA_NORM_EPS), a.q_b_proj)
    q_nope, q_pe = q.view(T, H, Dn + Dr).split([Dn, Dr], dim=-1)  # [T, H, Dn], [T, H, Dr]
    c_kv, k_pe = row_linear(h, a.kv_a_proj, a.kv_a_bias).split([R, Dr], dim=-1)  # [T, R], [T, Dr]
    c_kv = rms_norm(c_kv, a.kv_a_norm, _MLA_NORM_EPS)
    if Dr == 0:
        q_pe, k_pe = h.new_zeros(T, H, 1), h.new_zeros(T, 1)
    dt = cfg.dtype
    return MLAInputs(q_nope=q_nope.to(dt), q_pe=q_pe.to(dt), latent=torch.cat([c_kv, k_pe], dim=-1).to(dt),
                     w_uk=a.w_uk.to(dt), w_uv=a.w_uv.to(dt))


@checked
def step(params: Params, session, tokens: Int[Tensor, " T"]) -> tuple[Float[Tensor, "Tl vocab"], StepDeltas]:
    """One step of any phase: ``(params, session, tokens) -> (logits, deltas)``.

    No layer reads positions: KDA is recurrent and the MLA has no rope.
    """
    cfg = params.config
    batch: Batch = session.batch
    check_step_tokens("kimi_linear.step", batch, tokens, cfg.vocab_size)
    T, dt = tokens.shape[0], cfg.dtype  # attention runs in the spec dtype, maybe not the weights'
    x = params.embed[tokens]  # [T, D]
    layer_deltas = []
    for i, layer in each_layer(params.layers):
        h = rms_norm(x, layer.input_norm, cfg.rms_eps)
        if isinstance(layer.attn, KDAParams):
            w = layer.attn.w
            conv_input, gate, g, beta = kda_project(w, h)  # [T, C], [T, H, V], [T, H, K], [T, H]
            inputs = RecurrentInputs(x=conv_input.to(dt), conv_weight=layer.attn.conv_weight.to(dt), g=g,
                                     beta=beta.to(dt))
            out, deltas = session.forward(i, inputs)
            attn = kda_finish(w, out.o, gate)  # back in h's dtype
        else:
            a = layer.attn
            out, deltas = session.forward(i, _mla_inputs(a, h, cfg))
            attn = row_linear(out.o.to(h.dtype).reshape(T, cfg.num_heads * cfg.v_head_dim), a.o_proj, a.o_bias)
        layer_deltas.append(deltas)
        x = x + all_reduce(attn)  # o_proj and the MLPs' down projections are row-parallel under TP
        h = rms_norm(x, layer.post_norm, cfg.rms_eps)
        x = x + all_reduce(_moe(h, layer.mlp, cfg) if isinstance(layer.mlp, MoEParams) else swiglu(h, *layer.mlp))
    logits = row_linear(rms_norm(logit_rows(batch, x), params.norm, cfg.rms_eps), params.lm_head)
    # The cursor advances once, after every layer has read the state.
    return logits.float(), StepDeltas.collect(batch, layer_deltas)


def tiny_config() -> dict:
    """KDA, MLA, KDA, MLA; a dense first MLP then MoE with grouped sigmoid routing."""
    return {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "linear_num_heads": 2, "linear_head_dim": 16, "linear_conv_kernel_dim": 4,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "attention_bias": False,
        "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_token": 3,
        "num_expert_group": 2, "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 2.446,
        "num_shared_experts": 1, "tie_word_embeddings": False,
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }


register_family(Family(name="kimi_linear", model_types=("kimi_linear",), adapt=adapt, weight_shapes=weight_shapes,
                       load=load, step=step, tiny_config=tiny_config))
