"""Outputs that more than one kind returns.

A backend returns ``(outputs, writes)``: the writes are `fnattn.deltas`'s business, the outputs
are each kind's. The attention kinds over a key cache (``full``, ``mla``, and ``sparse_mla``'s
output built from it) share one: the attention output and its log-sum-exp. A kind with more to
return defines its own (`fnattn.kinds.sparse_mla.SparseAttentionOutput`, `fnattn.kinds.dsv4.DSV4Output`);
a kind with nothing more may return the generic `fnattn.deltas.Output`.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxtyping import Float
from torch import Tensor

from .declare import tensor_pytree


@tensor_pytree
@dataclass(frozen=True)
class AttentionOutput:
    """The attention of every new token of a step over the keys it sees, and its log-sum-exp."""

    o: Float[Tensor, "T Hq Dv"]  # [T, Hq, Dv] in the layer dtype
    lse: Float[Tensor, "T Hq"] | None = None  # [T, Hq] fp32 natural-log LSE, without sinks
