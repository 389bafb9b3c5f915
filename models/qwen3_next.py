"""Qwen3-Next: the Qwen3.5 hybrid decoder with fused GDN projections and per-layer MoE choice.

Reproduces transformers' ``Qwen3NextForCausalLM``. The math is Qwen3.5's
(`models/qwen3_5.py`); what differs is the checkpoint: the GDN input
projections are stored fused and interleaved per key head (``in_proj_qkvz``,
``in_proj_ba``; `GDNWeights.from_state_dict` reorders them once), and a layer
is MoE unless it is listed in ``mlp_only_layers``, ``num_experts`` is 0 or
``(layer + 1) % decoder_sparse_step != 0``, in which case it is a dense SwiGLU
of ``intermediate_size``. ``norm_topk_prob`` decides whether the routing
weights are renormalized.
"""

from __future__ import annotations

from fnattn.checks import fail

from . import qwen3_5
from .qwen3_5 import FULL, LINEAR, QwenConfig, common_fields, mlp_fields, read
from .registry import Family, register_family


def adapt(raw: dict) -> QwenConfig:
    if not isinstance(raw, dict):
        fail("qwen3_next", "config", "a config.json dict", type(raw).__name__)
    where = "config.json"
    if raw.get("model_type") != "qwen3_next":
        fail(where, "model_type", '"qwen3_next"', raw.get("model_type"))
    common = common_fields(raw, raw, where)
    n = len(common["layer_types"])
    num_experts = read(raw, where, "num_experts", int, 0, minimum=0)
    sparse_step = read(raw, where, "decoder_sparse_step", int, 1, minimum=1)
    dense_only = raw.get("mlp_only_layers") or []
    if not isinstance(dense_only, (list, tuple)) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in dense_only):
        fail(where, "mlp_only_layers", f"a list of layer indices in [0, {n})", dense_only)
    moe_layers = tuple(num_experts > 0 and i not in dense_only and (i + 1) % sparse_step == 0 for i in range(n))
    mlp = mlp_fields(raw, where, moe_layers, norm_topk_prob=read(raw, where, "norm_topk_prob", bool, True))
    return QwenConfig(model_type="qwen3_next", gdn_layout="fused", weight_prefix="model.", **common, **mlp)


def tiny_config() -> dict:
    """A tiny Qwen3-Next: GDN and full attention, a dense first layer, then 4-expert top-2 MoE layers."""
    return {
        "model_type": "qwen3_next", "vocab_size": 192, "hidden_size": 64, "num_hidden_layers": 4,
        "layer_types": [LINEAR, LINEAR, LINEAR, FULL], "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "intermediate_size": 128, "mlp_only_layers": [0], "decoder_sparse_step": 1,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64, "norm_topk_prob": True, "tie_word_embeddings": False,
    }


register_family(Family(name="qwen3_next", model_types=("qwen3_next",), adapt=adapt,
                       weight_shapes=qwen3_5.weight_shapes, load=qwen3_5.load, step=qwen3_5.step,
                       tiny_config=tiny_config, step_hidden=qwen3_5.step_hidden, draft=qwen3_5.draft))
