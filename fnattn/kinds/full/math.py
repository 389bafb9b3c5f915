"""Masked softmax attention with log-sum-exp, and the merge of partial results.

Plain tensors, one request at a time, fp32 math: this is the ground truth the
paged backends and kernels are checked against (docs/layout.md states the
semantics: causal by absolute position, sliding window, softcap, sinks).
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ...checks import checked


@checked
def attend(
    q: Float[Tensor, "n Hq D"],
    k: Float[Tensor, "m Hkv D"],
    v: Float[Tensor, "m Hkv Dv"],
    *,
    q_pos: Int[Tensor, " n"],
    k_pos: Int[Tensor, " m"],
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> tuple[Float[Tensor, "n Hq Dv"], Float[Tensor, "n Hq"]]:
    """Query at position p sees key at position j iff j <= p (and p - j < window)."""
    hq, hkv = q.shape[1], k.shape[1]
    kf = k.float().repeat_interleave(hq // hkv, dim=1)  # [m, Hq, D]
    vf = v.float().repeat_interleave(hq // hkv, dim=1)  # [m, Hq, Dv]
    s = torch.einsum("nhd,mhd->hnm", q.float(), kf) * scale  # [Hq, n, m]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    visible = k_pos[None, :] <= q_pos[:, None]  # [n, m]
    if sliding_window > 0:
        visible &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, n]; -inf where nothing is visible
    p = torch.exp(s - lse[..., None]).nan_to_num(nan=0.0)  # rows with lse=-inf give 0
    o = torch.einsum("hnm,mhd->nhd", p, vf)
    return o, lse.transpose(0, 1).contiguous()


@checked
def merge(
    o1: Float[Tensor, "n H Dv"],
    lse1: Float[Tensor, "n H"],
    o2: Float[Tensor, "n H Dv"],
    lse2: Float[Tensor, "n H"],
) -> tuple[Float[Tensor, "n H Dv"], Float[Tensor, "n H"]]:
    """Combine attention over two disjoint key sets into attention over their union."""
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w1 = torch.exp(lse1 - safe)[..., None]
    w2 = torch.exp(lse2 - safe)[..., None]
    return o1.float() * w1 + o2.float() * w2, lse


@checked
def apply_sinks(
    o: Float[Tensor, "n Hq Dv"], lse: Float[Tensor, "n Hq"], sinks: Float[Tensor, " Hq"]
) -> Float[Tensor, "n Hq Dv"]:
    """Add one value-less logit per head to the softmax denominator."""
    return o * torch.sigmoid(lse - sinks.float()[None, :])[..., None]
