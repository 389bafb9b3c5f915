"""Kimi Delta Attention (Kimi Linear): the q/k/v split of the conv output.

A KDA layer's backend part is one depthwise causal conv over the ``[q | k |
v]`` channels (``fnattn.ops.conv``; the three short convs of the checkpoint
never mix channels, so they run as one), this split, and the gated delta rule
(``fnattn.ops.delta_rule``) with a per-channel decay. q, k and v all have
``H`` heads; q and k are l2-normalised in Kimi's ``x / sqrt(sum(x^2) + eps)``
form. The projections before it and the gated output norm after it are the
model's (``fnattn.models.kda_layer``).
"""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor

from fnattn.ops._shapes import expect_shape
from fnattn.ops.l2norm import l2norm

__all__ = ["kda_qkv"]


def kda_qkv(
    mixed: Float[Tensor, "T C"], *, num_heads: int, head_k_dim: int, head_v_dim: int
) -> tuple[Float[Tensor, "T H K"], Float[Tensor, "T H K"], Float[Tensor, "T H V"]]:
    """Split the conv output into q, k, v and l2-normalize q and k (fp32)."""
    T = mixed.shape[0]
    H, K, V = num_heads, head_k_dim, head_v_dim
    expect_shape("mixed", mixed, (None, 2 * H * K + H * V))
    q, k, v = mixed.split([H * K, H * K, H * V], dim=-1)
    q = l2norm(q.reshape(T, H, K), form="sqrt")  # [T, H, K] fp32
    k = l2norm(k.reshape(T, H, K), form="sqrt")
    return q, k, v.reshape(T, H, V)
