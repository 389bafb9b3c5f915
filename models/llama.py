"""Dense GQA decoders: Llama (3.x), Qwen3 and Qwen2.

Reproduces transformers' ``LlamaForCausalLM``, ``Qwen3ForCausalLM`` and
``Qwen2ForCausalLM``: pre-norm decoder layers of GQA attention (rotate-half
rope over the whole head) and a SwiGLU MLP. The three differ only in

- Llama: optional biases on q/k/v/o (``attention_bias``), rope scaled by
  ``rope_type: "llama3"`` (Llama 3.1+) or ``"linear"``;
- Qwen3: RMSNorm over the head dim on q and k before rope (``q_norm`` /
  ``k_norm``), ``head_dim`` 128 unless given, optional ``attention_bias``;
- Qwen2: biases on q/k/v (always), none on o.

Every layer is full attention: sliding-window layers (Qwen2 / Qwen3 with
``use_sliding_window``) are refused, as are MLP biases.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from fnattn import FullAttentionConfig, FullAttentionInputs, LayerSpec, StepDeltas
from fnattn.checks import checked, fail
from fnattn.tp import all_reduce

from .common import (
    SwiGLU,
    apply_rope,
    check_step_tokens,
    config_field,
    each_layer,
    llama3_inv_freq,
    logit_rows,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
)
from .fused import linear
from .norm_rope import row_linear
from .registry import Family, register_family

MODEL_TYPES = ("llama", "qwen3", "qwen2")
_DTYPES = ("float32", "bfloat16", "float16")
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class DenseConfig:
    """A Llama / Qwen3 / Qwen2 decoder, read from config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: tuple[tuple[str, object], ...]  # rope parameters (rope_type, rope_theta, scaling fields), sorted
    qk_norm: bool  # Qwen3's q_norm / k_norm
    qkv_bias: bool
    o_bias: bool
    tie_word_embeddings: bool = False
    checkpoint_dtype: str | None = None  # config.json `dtype`, as stored; weights are cast on load
    dtype: torch.dtype = torch.float32  # the attention layers' dtype (LayerSpec.dtype)
    specs: tuple[LayerSpec, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        attn = FullAttentionConfig(num_q_heads=self.num_attention_heads, num_kv_heads=self.num_key_value_heads,
                                   head_dim=self.head_dim)
        object.__setattr__(self, "specs", tuple(LayerSpec(index=i, config=attn, dtype=self.dtype)
                                                for i in range(self.num_layers)))


def _rope(raw: dict, where: str) -> tuple[tuple[str, object], ...]:
    """``rope_parameters`` (transformers 5) or legacy ``rope_scaling`` + top-level ``rope_theta``."""
    src = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(src, dict):
        fail(where, "rope_parameters", "a dict", src)
    rope_type = src.get("rope_type", src.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        fail(where, "rope_parameters.rope_type", f"one of {_ROPE_TYPES}", rope_type)
    sub = where + " rope_parameters"
    theta = config_field(raw, where, "rope_theta", float, 10000.0, above=0)
    out = {"rope_type": rope_type, "rope_theta": config_field(src, sub, "rope_theta", float, theta, above=0)}
    if config_field(src, sub, "partial_rotary_factor", float, 1.0) != 1.0:
        fail(sub, "partial_rotary_factor", "1.0 (rope over the whole head)", src["partial_rotary_factor"])
    if rope_type != "default":
        out["factor"] = config_field(src, sub, "factor", float, above=0)
    if rope_type == "llama3":
        low = config_field(src, sub, "low_freq_factor", float, above=0)
        high = config_field(src, sub, "high_freq_factor", float, above=low)
        orig = config_field(src, sub, "original_max_position_embeddings", int, minimum=1)
        out.update(low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=orig)
    return tuple(sorted(out.items()))


def adapt(raw: dict) -> DenseConfig:
    if not isinstance(raw, dict):
        fail("llama", "config", "a config.json dict", type(raw).__name__)
    model_type, where = raw.get("model_type"), "config.json"
    if model_type not in MODEL_TYPES:
        fail(where, "model_type", f"one of {MODEL_TYPES}", model_type)
    if config_field(raw, where, "hidden_act", str, "silu") != "silu":
        fail(where, "hidden_act", '"silu"', raw["hidden_act"])
    if config_field(raw, where, "mlp_bias", bool, False):
        fail(where, "mlp_bias", "false (biased MLP projections are not supported)", True)
    n = config_field(raw, where, "num_hidden_layers", int, minimum=1)
    hidden = config_field(raw, where, "hidden_size", int, minimum=1)
    heads = config_field(raw, where, "num_attention_heads", int, minimum=1)
    kv_heads = config_field(raw, where, "num_key_value_heads", int, heads, minimum=1)
    if heads % kv_heads:
        fail(where, "num_attention_heads", f"a multiple of num_key_value_heads={kv_heads}", heads)
    head_dim = config_field(raw, where, "head_dim", int, 128 if model_type == "qwen3" else hidden // heads, minimum=2)
    if head_dim % 2:
        fail(where, "head_dim", "even (rope rotates pairs)", head_dim)
    sliding = model_type != "llama" and config_field(raw, where, "use_sliding_window", bool, False)
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, (list, tuple)) or len(layer_types) != n:
            fail(where, "layer_types", f"a list of {n} entries (num_hidden_layers)", layer_types)
        for i, t in enumerate(layer_types):
            if t != "full_attention":
                fail(where, f"layer_types[{i}]", '"full_attention" (sliding windows are not supported)', t)
    elif sliding and raw.get("sliding_window") is not None:
        if config_field(raw, where, "max_window_layers", int, 28, minimum=0) < n:
            fail(where, "use_sliding_window", "false (sliding windows are not supported)", True)
    bias = model_type == "qwen2" or config_field(raw, where, "attention_bias", bool, False)
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    if dtype is not None and dtype not in _DTYPES:
        fail(where, "dtype", f"one of {_DTYPES}", dtype)
    return DenseConfig(
        model_type=model_type,
        vocab_size=config_field(raw, where, "vocab_size", int, minimum=1),
        hidden_size=hidden,
        num_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=config_field(raw, where, "intermediate_size", int, minimum=1),
        rms_norm_eps=config_field(raw, where, "rms_norm_eps", float, 1e-6, minimum=0),
        rope=_rope(raw, where),
        qk_norm=model_type == "qwen3",
        qkv_bias=bias,
        o_bias=bias and model_type != "qwen2",
        tie_word_embeddings=config_field(raw, where, "tie_word_embeddings", bool, False),
        checkpoint_dtype=dtype,
    )


# --------------------------------------------------------------------------- weights


def weight_shapes(cfg: DenseConfig) -> dict[str, tuple[int, ...]]:
    D, V, Dh = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * Dh, cfg.num_key_value_heads * Dh
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i in range(cfg.num_layers):
        L, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        shapes.update({L + "input_layernorm.weight": (D,), L + "post_attention_layernorm.weight": (D,),
                       a + "q_proj.weight": (q, D), a + "k_proj.weight": (kv, D), a + "v_proj.weight": (kv, D),
                       a + "o_proj.weight": (D, q)})
        if cfg.qkv_bias:
            shapes.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)})
        if cfg.o_bias:
            shapes[a + "o_proj.bias"] = (D,)
        if cfg.qk_norm:
            shapes.update({a + "q_norm.weight": (Dh,), a + "k_norm.weight": (Dh,)})
        shapes.update(SwiGLU.shapes(L + "mlp.", D, cfg.intermediate_size))
    return shapes


@dataclass(frozen=True, eq=False)
class Layer:
    input_norm: Tensor  # [D]
    q: tuple[Tensor, Tensor | None]  # (weight [Hq Dh, D], bias [Hq Dh] | None)
    k: tuple[Tensor, Tensor | None]
    v: tuple[Tensor, Tensor | None]
    o: tuple[Tensor, Tensor | None]
    q_norm: Tensor | None  # [Dh] (Qwen3)
    k_norm: Tensor | None
    post_norm: Tensor  # [D]
    mlp: SwiGLU


@dataclass(frozen=True, eq=False)
class Params:
    config: DenseConfig
    embed: Tensor  # [V, D]
    layers: tuple[Layer, ...]
    norm: Tensor  # [D]
    lm_head: Tensor  # [V, D]; embed itself when tied
    inv_freq: Tensor  # [head_dim / 2] fp32


def inv_freq(cfg: DenseConfig, device=None) -> Tensor:
    """The rope frequencies of ``cfg.rope``, as transformers' rope init computes them."""
    rope = dict(cfg.rope)
    base = rope_inv_freq(cfg.head_dim, rope["rope_theta"], device=device)
    if rope["rope_type"] == "linear":
        return base / rope["factor"]
    if rope["rope_type"] == "llama3":
        return llama3_inv_freq(base, factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
                               high_freq_factor=rope["high_freq_factor"],
                               original_max_position_embeddings=rope["original_max_position_embeddings"])
    return base


def load(cfg: DenseConfig, weights) -> Params:
    """Arrange checkpoint tensors (by their checkpoint names) into `Params`; tensors are used as given."""

    def proj(a: str, name: str, bias: bool):
        return weights[f"{a}{name}.weight"], weights[f"{a}{name}.bias"] if bias else None

    layers = []
    for i in range(cfg.num_layers):
        L, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        layers.append(Layer(
            input_norm=weights[L + "input_layernorm.weight"], q=proj(a, "q_proj", cfg.qkv_bias),
            k=proj(a, "k_proj", cfg.qkv_bias), v=proj(a, "v_proj", cfg.qkv_bias), o=proj(a, "o_proj", cfg.o_bias),
            q_norm=weights[a + "q_norm.weight"] if cfg.qk_norm else None,
            k_norm=weights[a + "k_norm.weight"] if cfg.qk_norm else None,
            post_norm=weights[L + "post_attention_layernorm.weight"], mlp=SwiGLU.take(weights, L + "mlp.")))
    embed = weights["model.embed_tokens.weight"]
    return Params(config=cfg, embed=embed, layers=tuple(layers), norm=weights["model.norm.weight"],
                  lm_head=embed if cfg.tie_word_embeddings else weights["lm_head.weight"],
                  inv_freq=inv_freq(cfg, device=embed.device))


# --------------------------------------------------------------------------- step


def attention(session, i: int, w: Layer, h: Float[Tensor, "T D"], cos: Tensor, sin: Tensor, cfg: DenseConfig):
    """``-> (output [T, D], layer deltas)``."""
    T, Hq, Hkv, Dh, eps = h.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    q = linear(h, *w.q).view(T, Hq, Dh)
    k = linear(h, *w.k).view(T, Hkv, Dh)
    v = linear(h, *w.v).view(T, Hkv, Dh)
    if cfg.qk_norm:
        q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    dt = cfg.dtype  # attention runs in the spec's dtype, which may differ from the weights'
    out, deltas = session.forward(i, FullAttentionInputs(q=q.to(dt), k=k.to(dt), v=v.to(dt)))
    return linear(out.o.to(h.dtype).reshape(T, Hq * Dh), *w.o), deltas


@checked
def step_hidden(params: Params, session, tokens: Int[Tensor, " T"]
                ) -> tuple[Float[Tensor, "Tl vocab"], Float[Tensor, "T D"], StepDeltas]:
    """`step` that also returns the final norm's output (lm_head's input)."""
    cfg, batch = params.config, session.batch
    check_step_tokens(f"{cfg.model_type}.step", batch, tokens, cfg.vocab_size)
    cos, sin = rope_cos_sin(batch.positions, params.inv_freq)  # [T, head_dim] fp32
    x = F.embedding(tokens, params.embed)  # [T, D]
    layer_deltas = []
    for i, layer in each_layer(params.layers):
        y, deltas = attention(session, i, layer, rms_norm(x, layer.input_norm, cfg.rms_norm_eps), cos, sin, cfg)
        layer_deltas.append(deltas)
        x = x + all_reduce(y)  # o_proj and down_proj are row-parallel under TP (models/tp.py)
        x = x + all_reduce(layer.mlp(rms_norm(x, layer.post_norm, cfg.rms_norm_eps)))
    hidden = rms_norm(x, params.norm, cfg.rms_norm_eps)
    # The cursor advances once, after every layer has read the state.
    logits = row_linear(logit_rows(batch, hidden), params.lm_head).float()
    return logits, hidden, StepDeltas.collect(batch, layer_deltas)


@checked
def step(params: Params, session, tokens: Int[Tensor, " T"]) -> tuple[Float[Tensor, "Tl vocab"], StepDeltas]:
    """One step of any phase: ``(params, session, tokens) -> (logits, deltas)``."""
    logits, _, deltas = step_hidden(params, session, tokens)
    return logits, deltas


def tiny_config(model_type: str = "llama") -> dict:
    """A tiny config of ``model_type``: two GQA layers (Llama with llama3 rope scaling)."""
    raw = {"model_type": model_type, "vocab_size": 160, "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
           "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
           "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    if model_type == "llama":
        raw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 64}
    return raw


for _name in MODEL_TYPES:
    register_family(Family(name=_name, model_types=(_name,), adapt=adapt, weight_shapes=weight_shapes, load=load,
                           step=step, tiny_config=lambda t=_name: tiny_config(t), step_hidden=step_hidden))
