"""Pieces every model family shares: norms, rotary embeddings, MLPs, routed experts.

Plain functions of tensors; weights are passed in. fp32 statistics, results in
the activation dtype, matching the Hugging Face modules they stand in for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from fnattn.ops.mla import MLAWeights


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, *, offset: float = 0.0) -> Tensor:
    """RMSNorm; ``offset=1.0`` for checkpoints that store ``weight - 1`` (Qwen3-Next / Qwen3.5)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return y.to(x.dtype)
    if offset:
        return (y * (offset + weight.float())).to(x.dtype)
    return y.to(x.dtype) * weight


def rope_inv_freq(rotary_dim: int, theta: float, *, device=None) -> Tensor:
    return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim)


def rope_cos_sin(positions: Int[Tensor, " T"], inv_freq: Tensor, *, scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """cos, sin ``[T, rotary_dim]`` in the rotate-half layout (each frequency twice)."""
    ang = positions.float()[:, None] * inv_freq[None, :]  # [T, rotary_dim / 2]
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: Float[Tensor, "T H D"], cos: Tensor, sin: Tensor) -> Float[Tensor, "T H D"]:
    """Rotate-half rope on the first ``cos.shape[-1]`` dims of each head; the rest pass through."""
    r = cos.shape[-1]
    rot, rest = x[..., :r].float(), x[..., r:]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out.to(x.dtype), rest], dim=-1)


def swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """``down(silu(gate(x)) * up(x))`` with [out, in] weights."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


@dataclass(frozen=True, eq=False)
class SwiGLU:
    """A SwiGLU MLP's weights, as checkpoints name them under a prefix (``gate_proj``, ``up_proj``, ``down_proj``)."""

    gate: Tensor  # [I, D]
    up: Tensor  # [I, D]
    down: Tensor  # [D, I]

    @classmethod
    def take(cls, weights, prefix: str) -> SwiGLU:
        return cls(weights[prefix + "gate_proj.weight"], weights[prefix + "up_proj.weight"],
                   weights[prefix + "down_proj.weight"])

    @staticmethod
    def shapes(prefix: str, D: int, inner: int) -> dict[str, tuple[int, ...]]:
        return {prefix + "gate_proj.weight": (inner, D), prefix + "up_proj.weight": (inner, D),
                prefix + "down_proj.weight": (D, inner)}

    def __call__(self, x: Tensor) -> Tensor:
        return swiglu(x, self.gate, self.up, self.down)


def experts(
    x: Float[Tensor, "T D"],
    top_ids: Int[Tensor, "T k"],
    top_weights: Float[Tensor, "T k"],
    gate_up: Float[Tensor, "E I2 D"],
    down: Float[Tensor, "E D I"],
) -> Float[Tensor, "T D"]:
    """Routed experts with fused ``gate_up`` [E, 2I, D] and ``down`` [E, D, I] weights.

    Each token's chosen experts run on that token only; their outputs are
    weighted and summed (in the activation dtype, as the HF modules do).
    """
    out = torch.zeros_like(x)
    for e in top_ids.unique().tolist():
        tok, slot = torch.where(top_ids == e)
        g, u = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[e])
        out.index_add_(0, tok, y * top_weights[tok, slot, None].to(y.dtype))
    return out


def softmax_topk(logits: Float[Tensor, "T E"], k: int, *, normalize: bool) -> tuple[Tensor, Tensor]:
    """Qwen-style routing: softmax over experts, top-k, optionally renormalized."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w


def grouped_topk(
    scores: Float[Tensor, "T E"],
    bias: Float[Tensor, " E"] | None,
    k: int,
    *,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3 routing: pick ``topk_group`` of ``n_group`` expert groups by the sum
    of each group's best two biased scores, then the top-k experts inside them.
    Weights come from the unbiased scores."""
    T, E = scores.shape
    biased = scores if bias is None else scores + bias[None, :]
    group_scores = biased.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)  # [T, n_group]
    keep_groups = group_scores.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, keep_groups, 1.0)
    expert_mask = group_mask[:, :, None].expand(T, n_group, E // n_group).reshape(T, E)
    # -inf, not 0: a kept expert's biased score may be negative and must still beat
    # every expert of a dropped group (transformers' routers mask with -inf).
    ids = biased.masked_fill(expert_mask == 0, float("-inf")).topk(k, dim=-1).indices
    w = scores.gather(1, ids)
    if normalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, w * scaling


def mla_shapes(cfg, prefix: str) -> dict[str, tuple[int, ...]]:
    """MLA attention tensors under ``prefix``, for any config with DeepSeek's MLA fields."""
    return MLAWeights.state_dict_shapes(
        prefix=prefix, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, bias=cfg.attention_bias)
