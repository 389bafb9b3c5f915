"""Qwen3.5 text models, dense and MoE: hybrid Gated DeltaNet / gated full attention.

Reproduces transformers' ``Qwen3_5ForCausalLM`` and ``Qwen3_5MoeForCausalLM``.
``layer_types`` picks each decoder layer's token mixer:

- "linear_attention": Gated DeltaNet. The projections and the gated output
  norm run here (`models/gdn_layer.py`); the conv, q/k/v split and recurrence run
  in the backend through `RecurrentInputs`.
- "full_attention": GQA whose ``q_proj`` yields, per head, the query and a
  sigmoid output gate; q/k RMSNorm over the head dim, rope on the first
  ``partial_rotary_factor`` of each head, and the gate applied here after the
  backend (``FullAttentionConfig.output_gate``).

Every RMSNorm outside the GDN output norm stores ``weight - 1``
(``offset=1.0``). MoE layers route by softmax top-k (renormalized) and add a
shared expert scaled by a sigmoid gate. Qwen3-Next (`models/qwen3_next.py`)
reuses all of this with its fused GDN projections.

Checkpoints: text configs (``qwen3_5_text``, ``qwen3_5_moe_text``) keep the
decoder under ``model.``; the multimodal wrappers (``qwen3_5``,
``qwen3_5_moe``) hold the text config in ``text_config`` and the decoder under
``model.language_model.``. Vision weights are not read; the MTP module (``mtp.*``) is a
draft model of its own (`models/qwen3_5_mtp.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from fnattn.kernels.invariant import pointwise
from jaxtyping import Float, Int
from torch import Tensor

from fnattn import FullAttentionConfig, FullAttentionInputs, GDNConfig, LayerSpec, RecurrentInputs, StepDeltas
from fnattn.checks import checked, fail
from fnattn.tp import all_reduce

from .common import (
    REQUIRED,
    StackedExperts,
    SwiGLU,
    check_step_tokens,
    config_field,
    each_layer,
    logit_rows,
    moe_sum,
    rope_cos_sin,
    rope_inv_freq,
    softmax_topk,
)
from .fused import (
    add_rms_norm_offset_,
    gate_up_silu,
    gated_projection,
    linear,
    project_add_norm,
    qk_norm_rope,
    rms_norm_offset,
    step_rope_table,
)
from .gdn_layer import GDNWeights, gdn_finish, gdn_project
from .mtp import DraftHook
from .norm_rope import row_linear
from .registry import Family, register_family

LINEAR, FULL = "linear_attention", "full_attention"
_DTYPES = ("float32", "bfloat16", "float16")


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class QwenConfig:
    """A Qwen3.5 / Qwen3-Next text decoder, read from config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # per decoder layer: "linear_attention" | "full_attention"
    rms_norm_eps: float
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int  # int(head_dim * partial_rotary_factor): rope on the first rotary_dim dims of each head
    rope_theta: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    gdn_layout: str  # "split": in_proj_qkv/z/b/a (Qwen3.5); "fused": in_proj_qkvz/ba (Qwen3-Next)
    # MLPs: a dense SwiGLU, or routed experts plus an optional gated shared expert
    moe_layers: tuple[bool, ...]  # per decoder layer
    intermediate_size: int  # dense layers (0 when every layer is MoE)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    norm_topk_prob: bool = True
    mtp_num_hidden_layers: int = 0  # decoder layers of the MTP draft module (0: none in the checkpoint)
    # checkpoint
    weight_prefix: str = "model."  # where the decoder's tensors live
    tie_word_embeddings: bool = False  # lm_head reuses embed_tokens (no lm_head.weight stored)
    checkpoint_dtype: str | None = None  # config.json `dtype`, as stored; weights are cast on load
    dtype: torch.dtype = torch.float32  # the attention layers' dtype (LayerSpec.dtype)
    specs: tuple[LayerSpec, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "specs", tuple(_layer_spec(self, i) for i in range(len(self.layer_types))))

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)


def _layer_spec(cfg: QwenConfig, i: int) -> LayerSpec:
    if cfg.layer_types[i] == LINEAR:
        kind = GDNConfig(num_k_heads=cfg.linear_num_key_heads, num_v_heads=cfg.linear_num_value_heads,
                         head_k_dim=cfg.linear_key_head_dim, head_v_dim=cfg.linear_value_head_dim,
                         conv_kernel=cfg.linear_conv_kernel_dim)
    else:
        kind = FullAttentionConfig(num_q_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                                   head_dim=cfg.head_dim, output_gate=True)
    return LayerSpec(index=i, config=kind, dtype=cfg.dtype)


def read(d: dict, where: str, name: str, kind: type, default=REQUIRED, *, minimum=None, above=None):
    """``d[name]`` checked by the shared `config_field` (type, finite, range); errors name ``where`` and the field."""
    return config_field(d, where, name, kind, default, minimum=minimum, above=above)


def text_part(raw: dict, wrappers: dict[str, str]) -> tuple[dict, str, str, str]:
    """``-> (text config, where, text model_type, weight prefix)``; ``wrappers`` maps a
    multimodal wrapper's model_type to the model_type of its ``text_config``."""
    model_type = raw.get("model_type")
    if model_type not in wrappers:
        return raw, "config.json", model_type, "model."
    text = raw.get("text_config")
    if not isinstance(text, dict):
        fail("config.json", "text_config", f"a dict (model_type {model_type!r} keeps the text model there)", text)
    want = wrappers[model_type]
    if text.get("model_type", want) != want:
        fail("config.json", "text_config.model_type", repr(want), text.get("model_type"))
    return text, "config.json text_config", want, "model.language_model."


def common_fields(raw: dict, text: dict, where: str) -> dict:
    """The QwenConfig fields every Qwen3.5 / Qwen3-Next config spells the same way."""
    if read(text, where, "hidden_act", str, "silu") != "silu":
        # The GDN conv activation and every MLP use it; the backends implement silu only.
        fail(where, "hidden_act", '"silu"', text["hidden_act"])
    if read(text, where, "attention_bias", bool, False):
        fail(where, "attention_bias", "false (biased q/k/v/o projections are not supported)", True)
    n = read(text, where, "num_hidden_layers", int, minimum=1)
    layer_types = text.get("layer_types")
    if layer_types is None:  # transformers' default: every `full_attention_interval`-th layer is full attention
        every = read(text, where, "full_attention_interval", int, 4, minimum=1)
        layer_types = [LINEAR if (i + 1) % every else FULL for i in range(n)]
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != n:
        fail(where, "layer_types", f"a list of {n} entries (num_hidden_layers)", layer_types)
    for i, t in enumerate(layer_types):
        if t not in (LINEAR, FULL):
            fail(where, f"layer_types[{i}]", f"{LINEAR!r} or {FULL!r}", t)

    hidden = read(text, where, "hidden_size", int, minimum=1)
    heads = read(text, where, "num_attention_heads", int, minimum=1)
    kv_heads = read(text, where, "num_key_value_heads", int, minimum=1)
    if heads % kv_heads:
        fail(where, "num_attention_heads", f"a multiple of num_key_value_heads={kv_heads}", heads)
    head_dim = read(text, where, "head_dim", int, hidden // heads, minimum=1)
    k_heads = read(text, where, "linear_num_key_heads", int, minimum=1)
    v_heads = read(text, where, "linear_num_value_heads", int, minimum=1)
    if v_heads % k_heads:
        fail(where, "linear_num_value_heads", f"a multiple of linear_num_key_heads={k_heads}", v_heads)

    # Legacy configs keep rope_theta / partial_rotary_factor at the top level or under rope_scaling.
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        fail(where, "rope_parameters", "a dict", rope)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        fail(where, "rope_parameters.rope_type", '"default" (scaled rope is not supported)', rope_type)
    theta = read(rope, where + " rope_parameters", "rope_theta", float,
                 read(text, where, "rope_theta", float, 10000.0, above=0), above=0)
    factor = read(rope, where + " rope_parameters", "partial_rotary_factor", float,
                  read(text, where, "partial_rotary_factor", float, 0.25))
    rotary_dim = int(head_dim * factor)
    if not (0 < factor <= 1) or rotary_dim < 2 or rotary_dim % 2:
        fail(where, "rope_parameters.partial_rotary_factor",
             f"in (0, 1] with head_dim * factor a positive even int (head_dim={head_dim})", factor)
    # mrope_section / mrope_interleaved split rope between time, height and width positions; for
    # text all three positions are the token position, which makes mrope plain rope.

    dtype = raw.get("dtype", raw.get("torch_dtype", text.get("dtype", text.get("torch_dtype"))))
    if dtype is not None and dtype not in _DTYPES:
        fail("config.json", "dtype", f"one of {_DTYPES}", dtype)
    tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    if not isinstance(tie, bool):
        fail("config.json", "tie_word_embeddings", "a bool", tie)
    return dict(
        vocab_size=read(text, where, "vocab_size", int, minimum=1),
        hidden_size=hidden,
        layer_types=tuple(layer_types),
        rms_norm_eps=read(text, where, "rms_norm_eps", float, 1e-6, minimum=0),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        linear_key_head_dim=read(text, where, "linear_key_head_dim", int, minimum=1),
        linear_value_head_dim=read(text, where, "linear_value_head_dim", int, minimum=1),
        linear_conv_kernel_dim=read(text, where, "linear_conv_kernel_dim", int, 4, minimum=2),
        tie_word_embeddings=tie,
        checkpoint_dtype=dtype,
        mtp_num_hidden_layers=read(text, where, "mtp_num_hidden_layers", int, 0, minimum=0),
    )


def mlp_fields(text: dict, where: str, moe_layers: tuple[bool, ...], *, norm_topk_prob: bool) -> dict:
    """Dense and MoE sizes; only the ones some layer uses are required."""
    out = dict(moe_layers=moe_layers, norm_topk_prob=norm_topk_prob,
               intermediate_size=read(text, where, "intermediate_size", int, minimum=1)
               if not all(moe_layers) else 0)
    if any(moe_layers):
        e = read(text, where, "num_experts", int, minimum=1)
        k = read(text, where, "num_experts_per_tok", int, minimum=1)
        if k > e:
            fail(where, "num_experts_per_tok", f"<= num_experts={e}", k)
        out.update(num_experts=e, num_experts_per_tok=k,
                   moe_intermediate_size=read(text, where, "moe_intermediate_size", int, minimum=1),
                   shared_expert_intermediate_size=read(text, where, "shared_expert_intermediate_size", int, 0,
                                                        minimum=0))
    return out


_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def adapt(raw: dict) -> QwenConfig:
    if not isinstance(raw, dict):
        fail("qwen3_5", "config", "a config.json dict", type(raw).__name__)
    text, where, model_type, prefix = text_part(raw, _WRAPPERS)
    if model_type not in ("qwen3_5_text", "qwen3_5_moe_text"):
        fail("config.json", "model_type", "one of qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text", model_type)
    common = common_fields(raw, text, where)
    moe = model_type == "qwen3_5_moe_text"  # every Qwen3.5 MoE layer is sparse and renormalizes its top-k
    mlp = mlp_fields(text, where, (moe,) * len(common["layer_types"]), norm_topk_prob=True)
    return QwenConfig(model_type=model_type, gdn_layout="split", weight_prefix=prefix, **common, **mlp)


# --------------------------------------------------------------------------- weights


def weight_shapes(cfg: QwenConfig) -> dict[str, tuple[int, ...]]:
    P, D, V = cfg.weight_prefix, cfg.hidden_size, cfg.vocab_size
    shapes = {P + "embed_tokens.weight": (V, D), P + "norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i in range(cfg.num_layers):
        shapes.update(layer_shapes(cfg, i, f"{P}layers.{i}."))
    return shapes


def layer_shapes(cfg: QwenConfig, i: int, L: str) -> dict[str, tuple[int, ...]]:
    """Decoder layer ``i``'s tensors under the prefix ``L`` (e.g. "model.layers.3.")."""
    D = cfg.hidden_size
    shapes = {L + "input_layernorm.weight": (D,), L + "post_attention_layernorm.weight": (D,)}
    shapes.update(_gdn_shapes(cfg, L + "linear_attn.") if cfg.layer_types[i] == LINEAR
                  else _attn_shapes(cfg, L + "self_attn."))
    shapes.update(_mlp_shapes(cfg, i, L + "mlp."))
    return shapes


def _gdn_shapes(cfg: QwenConfig, p: str) -> dict:
    D, H, W = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim
    key, value = cfg.linear_num_key_heads * cfg.linear_key_head_dim, H * cfg.linear_value_head_dim
    conv = 2 * key + value
    if cfg.gdn_layout == "split":
        proj = {"in_proj_qkv.weight": (conv, D), "in_proj_z.weight": (value, D),
                "in_proj_b.weight": (H, D), "in_proj_a.weight": (H, D)}
    else:
        proj = {"in_proj_qkvz.weight": (2 * key + 2 * value, D), "in_proj_ba.weight": (2 * H, D)}
    return {p + n: s for n, s in {**proj, "conv1d.weight": (conv, 1, W), "dt_bias": (H,), "A_log": (H,),
                                  "norm.weight": (cfg.linear_value_head_dim,), "out_proj.weight": (D, value)}.items()}


def _attn_shapes(cfg: QwenConfig, p: str) -> dict:
    D, Dh = cfg.hidden_size, cfg.head_dim
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    return {p + "q_proj.weight": (2 * Hq * Dh, D), p + "k_proj.weight": (Hkv * Dh, D),
            p + "v_proj.weight": (Hkv * Dh, D), p + "o_proj.weight": (D, Hq * Dh),
            p + "q_norm.weight": (Dh,), p + "k_norm.weight": (Dh,)}


def _mlp_shapes(cfg: QwenConfig, i: int, p: str) -> dict:
    D = cfg.hidden_size
    if not cfg.moe_layers[i]:
        return SwiGLU.shapes(p, D, cfg.intermediate_size)
    shapes = {p + "gate.weight": (cfg.num_experts, D)}
    for e in range(cfg.num_experts):
        shapes.update(SwiGLU.shapes(f"{p}experts.{e}.", D, cfg.moe_intermediate_size))
    if cfg.shared_expert_intermediate_size:
        shapes.update(SwiGLU.shapes(p + "shared_expert.", D, cfg.shared_expert_intermediate_size))
        shapes[p + "shared_expert_gate.weight"] = (1, D)
    return shapes


@dataclass(frozen=True, eq=False)
class MoE:
    router: Tensor  # [E, D]
    experts: StackedExperts  # [E, 2I, D] / [E, D, I]; experts[e] is expert e's SwiGLU (views)
    shared: DenseMLP | None
    shared_gate: Tensor | None  # [1, D]


@dataclass(frozen=True, eq=False)
class Attention:
    qkv: Tensor  # [2 Hq Dh + 2 Hkv Dh, D]: q_proj (per head, Dh query rows then Dh gate rows), k_proj, v_proj
    o_proj: Tensor  # [D, Hq Dh]
    q_norm: Tensor  # [Dh], stored as weight - 1
    k_norm: Tensor  # [Dh], stored as weight - 1
    kv_rows: int  # Hkv Dh: rows of k_proj (and of v_proj) in qkv

    @classmethod
    def fused(cls, q_proj: Tensor, k_proj: Tensor, v_proj: Tensor, o_proj: Tensor, q_norm: Tensor,
              k_norm: Tensor) -> Attention:
        """The checkpoint's projections concatenated once at load: one GEMM per step instead of three."""
        if k_proj.shape != v_proj.shape:
            fail("qwen3_5 attention", "v_proj", f"the shape of k_proj {tuple(k_proj.shape)}", tuple(v_proj.shape))
        return cls(torch.cat([q_proj, k_proj, v_proj]), o_proj, q_norm, k_norm, k_proj.shape[0])


@dataclass(frozen=True, eq=False)
class DenseMLP:
    """A SwiGLU MLP with gate and up concatenated at load: one GEMM and `silu_and_mul` (`fused.gate_up_silu`:
    at decode sizes on CUDA under `fused.swiglu_epilogue`, one launch), then down."""

    gate_up: Tensor  # [2 I, D]: gate_proj rows, then up_proj rows
    down: Tensor  # [D, I]

    @classmethod
    def take(cls, weights, prefix: str) -> DenseMLP:
        w = SwiGLU.take(weights, prefix)
        return cls(torch.cat([w.gate, w.up]), w.down)

    def __call__(self, x: Tensor, project=linear):
        """``project(x, weight)``: the down projection (`step_hidden` folds the residual add and the next
        norm into it)."""
        return project(gate_up_silu(x, self.gate_up), self.down)


@dataclass(frozen=True, eq=False)
class Layer:
    input_norm: Tensor  # [D], stored as weight - 1
    attn: GDNWeights | Attention
    post_norm: Tensor  # [D], stored as weight - 1
    mlp: DenseMLP | MoE


@dataclass(frozen=True, eq=False)
class Params:
    config: QwenConfig
    embed: Tensor  # [V, D]
    layers: tuple[Layer, ...]
    norm: Tensor  # [D], stored as weight - 1
    lm_head: Tensor  # [V, D]; embed itself when tied
    inv_freq: Tensor  # [rotary_dim / 2] fp32


def load(cfg: QwenConfig, weights) -> Params:
    """Arrange checkpoint tensors (by their checkpoint names) into `Params`.

    Tensors are used as given; only Qwen3-Next's fused GDN projections are
    reordered (once) into the Qwen3.5 layout by `GDNWeights.from_state_dict`.
    """
    P = cfg.weight_prefix
    layers = tuple(load_layer(cfg, weights, i, f"{P}layers.{i}.") for i in range(cfg.num_layers))
    embed = weights[P + "embed_tokens.weight"]
    return Params(config=cfg, embed=embed, layers=layers, norm=weights[P + "norm.weight"],
                  lm_head=embed if cfg.tie_word_embeddings else weights["lm_head.weight"],
                  inv_freq=rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, device=embed.device))


def load_layer(cfg: QwenConfig, weights, i: int, L: str) -> Layer:
    """Decoder layer ``i`` from the tensors under the prefix ``L`` (e.g. "model.layers.3.")."""
    if cfg.layer_types[i] == LINEAR:
        attn = GDNWeights.from_state_dict(weights, num_k_heads=cfg.linear_num_key_heads, eps=cfg.rms_norm_eps,
                                          prefix=L + "linear_attn.")
    else:
        a = L + "self_attn."
        attn = Attention.fused(**{n: weights[f"{a}{n}.weight"] for n in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                          "q_norm", "k_norm")})
    m = L + "mlp."
    if cfg.moe_layers[i]:
        shared = cfg.shared_expert_intermediate_size > 0
        mlp = MoE(router=weights[m + "gate.weight"],
                  experts=StackedExperts.take(weights, m + "experts.", cfg.num_experts),
                  shared=DenseMLP.take(weights, m + "shared_expert.") if shared else None,
                  shared_gate=weights[m + "shared_expert_gate.weight"] if shared else None)
    else:
        mlp = DenseMLP.take(weights, m)
    return Layer(weights[L + "input_layernorm.weight"], attn, weights[L + "post_attention_layernorm.weight"], mlp)


# --------------------------------------------------------------------------- step


def gated_attention(session, layer: int, w: Attention, h: Float[Tensor, "T D"], cos: Tensor, sin: Tensor,
                    cfg: QwenConfig, table: Tensor | None = None, project=linear):
    """``-> (output [T, D], layer deltas)``; ``table``: the step's `rope_table` (FlashInfer's rope on CUDA);
    ``project(x, weight)``: o_proj (`step_hidden` folds the residual add and the next norm into it)."""
    T, Dh = h.shape[0], cfg.head_dim
    qg, k, v = linear(h, w.qkv).split([w.qkv.shape[0] - 2 * w.kv_rows, w.kv_rows, w.kv_rows], dim=-1)
    q, gate = qg.view(T, -1, 2 * Dh).chunk(2, dim=-1)  # [T, Hq, Dh] each (Hq of this rank under TP)
    q, k, v = qk_norm_rope(q, k.view(T, -1, Dh), v.view(T, -1, Dh), w.q_norm, w.k_norm, cfg.rms_norm_eps, cos, sin,
                           table)  # contiguous [T, H, Dh]: q / k normalized and rotated
    # Attention runs in the spec's dtype, which may differ from the weights' (e.g. bf16 weights, fp32 specs);
    # when they agree (the served case) these casts are no-ops.
    dt = cfg.dtype
    out, deltas = session.forward(layer, FullAttentionInputs(q=q.to(dt), k=k.to(dt), v=v.to(dt)))
    return gated_projection(out.o.to(h.dtype), ("sigmoid", gate), w.o_proj, project), deltas


def linear_attention(session, layer: int, w: GDNWeights, h: Float[Tensor, "T D"], cfg: QwenConfig,
                     project=linear):
    """``-> (output [T, D], layer deltas)``; ``project`` as in `gated_attention` (out_proj)."""
    conv_input, z, g, beta = gdn_project(w, h)  # [T, C], [T, H, V], [T, H] fp32, [T, H]
    dt = cfg.dtype
    inputs = RecurrentInputs(x=conv_input.to(dt), conv_weight=w.conv_weight.to(dt),
                             conv_bias=None if w.conv_bias is None else w.conv_bias.to(dt), g=g, beta=beta.to(dt))
    out, deltas = session.forward(layer, inputs)
    return gdn_finish(w, out.o, z, project), deltas


def moe(h: Float[Tensor, "T D"], m: MoE, cfg: QwenConfig) -> Float[Tensor, "T D"]:
    """Softmax top-k routed experts plus the sigmoid-gated shared expert."""
    ids, weights = softmax_topk(row_linear(h, m.router), cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob)
    weights = weights.to(h.dtype)  # [T, k], as the HF router hands them to the experts
    out = moe_sum(h, ids, weights, len(m.experts), lambda e, xs: m.experts[e](xs), lambda y, w: y * w,
                  stacked=m.experts)
    if m.shared is not None:
        out = out + pointwise(torch.sigmoid, row_linear(h, m.shared_gate)) * m.shared(h)
    return out


def _mixer(session, i: int, layer: Layer, h: Tensor, cos: Tensor, sin: Tensor, cfg: QwenConfig,
           table: Tensor | None, project):
    """Layer ``i``'s token mixer from its input norm ``h``, ``project`` its output projection:
    ``-> (what project returned, layer deltas)``."""
    if isinstance(layer.attn, GDNWeights):
        return linear_attention(session, i, layer.attn, h, cfg, project)
    return gated_attention(session, i, layer.attn, h, cos, sin, cfg, table, project)


def _mixer_and_post_norm(session, i: int, layer: Layer, x: Tensor, h: Tensor, cos: Tensor, sin: Tensor,
                         cfg: QwenConfig, table: Tensor | None):
    """Layer ``i`` up to the MLP: ``-> (x + attention, its post-attention norm, layer deltas)``, the residual
    add and the norm with the output projection (`fused.project_add_norm`, which all-reduces a row-parallel
    projection under TP). ``x`` must be the step's own tensor: on CUDA the fused residual add writes into it.
    A dense MLP's projection may finish the norm (`fused.split_norm`); ``h`` may be such a norm (`fused.SplitNorm`)."""
    eps, split = cfg.rms_norm_eps, not isinstance(layer.mlp, MoE)
    (x, h), deltas = _mixer(session, i, layer, h, cos, sin, cfg, table,
                            lambda o, w: project_add_norm(o, w, x, layer.post_norm, eps, split=split))
    return x, h, deltas


def decoder_layer(session, i: int, layer: Layer, x: Float[Tensor, "T D"], cos: Tensor, sin: Tensor,
                  cfg: QwenConfig):
    """Decoder layer ``i`` (attention through the session, then the MLP): ``-> (x [T, D], layer deltas)``.

    Leaves ``x`` as it was (`step_hidden` instead chains the layers through fused residual adds)."""
    h = rms_norm_offset(x, layer.input_norm, cfg.rms_norm_eps)
    x, h, deltas = _mixer_and_post_norm(session, i, layer, x.clone() if x.is_cuda else x, h, cos, sin, cfg, None)
    y = all_reduce(moe(h, layer.mlp, cfg) if isinstance(layer.mlp, MoE) else layer.mlp(h))  # down: row-parallel
    return x + y, deltas


def _chained_layer(session, i: int, layer: Layer, x: Tensor, h: Tensor, next_norm: Tensor, cos: Tensor,
                   sin: Tensor, cfg: QwenConfig, table: Tensor | None, split_next: bool = False):
    """Layer ``i`` from its input norm ``h`` to the next norm's: ``-> (x, next_norm's output, layer deltas)``;
    ``split_next``: the next norm goes to a projection that can finish it (the next layer's mixer's), so
    under `fused.split_norm` it may come back as a `fused.SplitNorm`.

    Each residual add and the norm after it go with the projection before them (`fused.project_add_norm`:
    on CUDA an add + RMSNorm launch after the GEMV, or its halves in the GEMVs around it under
    `fused.split_norm`; under TP the row-parallel projection's output all-reduced first).
    """
    eps = cfg.rms_norm_eps
    x, h, deltas = _mixer_and_post_norm(session, i, layer, x, h, cos, sin, cfg, table)
    if isinstance(layer.mlp, MoE):
        x, h = add_rms_norm_offset_(all_reduce(moe(h, layer.mlp, cfg)), x, next_norm, eps)
    else:
        x, h = layer.mlp(h, lambda a, w: project_add_norm(a, w, x, next_norm, eps, split=split_next))
    return x, h, deltas


@checked
def step_hidden(params: Params, session, tokens: Int[Tensor, " T"]
                ) -> tuple[Float[Tensor, "Tl vocab"], Float[Tensor, "T D"], StepDeltas]:
    """`step` that also returns the final norm's output (lm_head's input), which MTP drafts read.

    Each layer's residual adds and the norms after them go with its output projections
    (`_chained_layer`); the last layer's MLP output meets the final norm.
    """
    cfg, batch = params.config, session.batch
    check_step_tokens(f"{cfg.model_type}.step", batch, tokens, cfg.vocab_size)
    cos, sin = rope_cos_sin(batch.positions, params.inv_freq)  # [T, rotary_dim] fp32, once per step
    x = F.embedding(tokens, params.embed)  # [T, D]; the residual stream, this step's own tensor
    table = step_rope_table(cos, sin, x)
    eps, layers, layer_deltas = cfg.rms_norm_eps, params.layers, []
    h = rms_norm_offset(x, layers[0].input_norm, eps)
    for i, layer in each_layer(layers):
        next_norm = layers[i + 1].input_norm if i + 1 < len(layers) else params.norm
        x, h, deltas = _chained_layer(session, i, layer, x, h, next_norm, cos, sin, cfg, table,
                                      split_next=i + 1 < len(layers))
        layer_deltas.append(deltas)
    hidden = h  # [T, D], the final norm's output
    # The cursor advances once, after every layer has read the state.
    logits = linear(logit_rows(batch, hidden), params.lm_head, widen=True)  # [Tl, vocab] fp32
    return logits, hidden, StepDeltas.collect(batch, layer_deltas)


@checked
def step(params: Params, session, tokens: Int[Tensor, " T"]) -> tuple[Float[Tensor, "Tl vocab"], StepDeltas]:
    """One step of any phase: ``(params, session, tokens) -> (logits, deltas)``."""
    logits, _, deltas = step_hidden(params, session, tokens)
    return logits, deltas


def tiny_config() -> dict:
    """A tiny dense Qwen3.5 text config: three GDN layers, then one gated full-attention layer."""
    return {
        "model_type": "qwen3_5_text", "vocab_size": 192, "hidden_size": 64, "num_hidden_layers": 4,
        "layer_types": [LINEAR, LINEAR, LINEAR, FULL], "intermediate_size": 128, "hidden_act": "silu",
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False,
    }


# The MTP draft model: `models/qwen3_5_mtp.py` builds on this module and registers itself here.
draft = DraftHook("models/qwen3_5_mtp.py")


register_family(Family(name="qwen3_5", model_types=("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
                       adapt=adapt, weight_shapes=weight_shapes, load=load, step=step, tiny_config=tiny_config,
                       step_hidden=step_hidden, draft=draft))
