"""The q/k/v split of the conv output, and the q/k l2 normalisation, of the delta-rule kinds.

GDN (Qwen3.5 / Qwen3-Next): queries and keys have ``Hk`` heads that are
l2-normalised and then repeated onto the ``H`` value heads. KDA (Kimi Linear):
q, k and v all have ``H`` heads. The projections before and the gated output
norm after are the model's (``fnattn.models.gdn_layer`` / ``kda_layer``).


Two formulas are in use, and which one a model needs depends on its
``transformers`` family, not on the kind: Qwen3.5 / Qwen3-Next (fla's
``l2norm``) multiply by ``rsqrt(sum(x^2) + eps)``, Kimi Linear divides by
``sqrt(sum(x^2) + eps)``. They agree to rounding; the parity tests against
``transformers`` hold each side to its own.
"""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

from ...checks import expect_shape

__all__ = ["L2NormForm", "gdn_qkv", "kda_qkv", "l2norm"]

L2NormForm = Literal["rsqrt", "sqrt"]


def l2norm(
    x: Float[Tensor, "*batch K"], *, eps: float = 1e-6, form: L2NormForm = "rsqrt"
) -> Float[Tensor, "*batch K"]:
    """``x`` over its last dimension scaled to unit length, in fp32.

    ``form="rsqrt"``: ``x * rsqrt(sum(x^2) + eps)`` (GDN). ``form="sqrt"``:
    ``x / sqrt(sum(x^2) + eps)`` (KDA).
    """
    x = x.float()
    if form == "rsqrt":  # the kernels' own normalisation, so the Triton path and this agree bit for bit
        from ...kernels.gdn_common import l2norm as rsqrt_l2norm

        return rsqrt_l2norm(x, eps)
    if form == "sqrt":
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)
    raise ValueError(f"form: expected 'rsqrt' or 'sqrt', got {form!r}")


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
