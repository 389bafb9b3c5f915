"""The q/k l2 normalisation of the delta-rule kinds (GDN, KDA), in fp32.

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

__all__ = ["L2NormForm", "l2norm"]

L2NormForm = Literal["rsqrt", "sqrt"]


def l2norm(
    x: Float[Tensor, "*batch K"], *, eps: float = 1e-6, form: L2NormForm = "rsqrt"
) -> Float[Tensor, "*batch K"]:
    """``x`` over its last dimension scaled to unit length, in fp32.

    ``form="rsqrt"``: ``x * rsqrt(sum(x^2) + eps)`` (GDN). ``form="sqrt"``:
    ``x / sqrt(sum(x^2) + eps)`` (KDA).
    """
    x = x.float()
    sum_sq = (x * x).sum(-1, keepdim=True)  # [*batch, 1]
    if form == "rsqrt":
        return x * torch.rsqrt(sum_sq + eps)
    if form == "sqrt":
        return x / torch.sqrt(sum_sq + eps)
    raise ValueError(f"form: expected 'rsqrt' or 'sqrt', got {form!r}")
