"""Gated DeltaNet (Qwen3.5 / Qwen3-Next): the q/k/v split of the conv output.

A GDN layer's backend part is the causal conv over the ``[q | k | v]``
channels (``fnattn.ops.conv``), this split, and the gated delta rule
(``fnattn.ops.delta_rule``) with one scalar decay per value head. Queries and
keys have ``Hk`` heads that are l2-normalised and then repeated to the ``H``
value heads. The projections before it and the gated output norm after it are
the model's (``fnattn.models.gdn_layer``).
"""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor

from fnattn.ops._shapes import expect_shape
from fnattn.ops.l2norm import l2norm

__all__ = ["gdn_qkv"]


def gdn_qkv(
    mixed: Float[Tensor, "T C"], *, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int
) -> tuple[Float[Tensor, "T H K"], Float[Tensor, "T H K"], Float[Tensor, "T H V"]]:
    """Split the conv output into q, k, v; l2-normalize q and k (fp32); repeat them to the value heads."""
    T = mixed.shape[0]
    Hk, H, K, V = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    expect_shape("mixed", mixed, (None, 2 * Hk * K + H * V))
    q, k, v = mixed.split([Hk * K, Hk * K, H * V], dim=-1)
    q = l2norm(q.reshape(T, Hk, K), form="rsqrt")  # [T, Hk, K] fp32
    k = l2norm(k.reshape(T, Hk, K), form="rsqrt")
    # Each key head serves H / Hk consecutive value heads.
    q = q.repeat_interleave(H // Hk, dim=1)  # [T, H, K]
    k = k.repeat_interleave(H // Hk, dim=1)
    return q, k, v.reshape(T, H, V)
