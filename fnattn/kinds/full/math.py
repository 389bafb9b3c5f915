"""Masked softmax attention with log-sum-exp, and the merge of partial results.

Plain tensors, one request at a time, fp32 math: this is the ground truth the
paged backends and kernels are checked against (docs/layout.md states the
semantics: causal by absolute position, sliding window, softcap, sinks). The
arithmetic is `fnattn.kernels.attention_naive`'s, the one statement of it that
the kernels' references share; these wrappers add the shape checks.
"""

from __future__ import annotations

from jaxtyping import Float, Int
from torch import Tensor

from fnattn.kernels import attention_naive

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
    return attention_naive.attention(q, k, v, q_pos, k_pos, scale=scale, softcap=softcap,
                                     sliding_window=sliding_window)


@checked
def attend_fixed_order(
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
    """`attend` in the invariant mode's order: every query over the same key tiles, whatever the step."""
    return attention_naive.attention_fixed_order(q, k, v, q_pos, k_pos, scale=scale, softcap=softcap,
                                                 sliding_window=sliding_window)


@checked
def merge(
    o1: Float[Tensor, "n H Dv"],
    lse1: Float[Tensor, "n H"],
    o2: Float[Tensor, "n H Dv"],
    lse2: Float[Tensor, "n H"],
) -> tuple[Float[Tensor, "n H Dv"], Float[Tensor, "n H"]]:
    """Combine attention over two disjoint key sets into attention over their union."""
    return attention_naive.merge_states(o1, lse1, o2, lse2)


@checked
def apply_sinks(
    o: Float[Tensor, "n Hq Dv"], lse: Float[Tensor, "n Hq"], sinks: Float[Tensor, " Hq"]
) -> Float[Tensor, "n Hq Dv"]:
    """Add one value-less logit per head to the softmax denominator."""
    return attention_naive.apply_sinks(o, lse, sinks)
