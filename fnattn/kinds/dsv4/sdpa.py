"""CPU backend for DeepSeek-V4 attention prefill and decode (backend ``sdpa``): the reference's layout, then
the attention through torch's fused SDPA kernel.

The reference (`.reference.run`) builds, per request, the K=V rows of each token's window and the compressed
entries it may see, with an additive mask; its `attend_sinks` then forms every ``[H, n, K]`` logit and a
softmax with the sink logit appended. Here the same keys and mask go to the kernel
``F.scaled_dot_product_attention`` dispatches to on a CPU (shared K = V: one KV head, the heads folded into
the query axis), which returns the log-sum-exp too; the sinks then scale the output by
``sigmoid(lse - sink)``, the share of the denominator the keys hold. Verify stays the reference's.

Decode stays request by request, as the reference lays it out: a request's bits must not depend on the
batch around it or on its page size (a request moved into a State of another page size decodes the same
logits, tests/test_model_deepseek_v4.py). The whole batch at once through the GPU path's row lists
(`.flashmla.sparse_step` with torch's kernel over the gathered rows) was tried: it rounds differently as the
block table's width changes (the padded entry lists), so it is not used here.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from ...deltas import Writes
from ...kernels.attention_naive import apply_sinks
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ..cpu_sdpa import flash, fold_heads, supports, unfold_heads
from .config import DSV4Inputs, DSV4Output
from .reference import _writes, run

NAME = "sdpa"


def attend_sinks_sdpa(q: Float[Tensor, "n H D"], keys: Float[Tensor, "K D"], bias: Float[Tensor, "n K"],
                      sinks: Float[Tensor, " H"] | None, *, scale: float) -> Float[Tensor, "n H D"]:
    """`attend_sinks`'s result: ``q [n, H, D]`` over shared K = V ``keys [K, D]``, ``bias [n, K]`` (0 or
    -inf), per-head ``sinks [H]`` -> ``[n, H, D]`` in ``keys.dtype``; the math in fp32."""
    n, H, _ = q.shape
    f32 = torch.float32
    kv = keys.to(f32)[None, None]  # [1, 1, K, D]: one K = V head for every query head
    mask = bias.to(f32).repeat(H, 1)[None, None]  # the rows of the folded heads
    o, lse = flash(fold_heads(q.to(f32), H), kv, kv, attn_mask=mask, scale=scale)[:2]
    o, lse = unfold_heads(o, lse, n, H)  # [n, H, D], [n, H]
    if sinks is not None:
        o = apply_sinks(o, lse, sinks)
    return o.to(keys.dtype)


@register("dsv4", "prefill", NAME, supports=supports, invariant=True)
def prefill(spec: LayerSpec, views: Views, inputs: DSV4Inputs) -> tuple[DSV4Output, Writes]:
    out, values = run(spec, views, inputs, per_token_states=False, attend=attend_sinks_sdpa)
    return out, _writes(spec, values, states=True)


@register("dsv4", "decode", NAME, supports=supports, invariant=True)
def decode(spec: LayerSpec, views: Views, inputs: DSV4Inputs) -> tuple[DSV4Output, Writes]:
    out, values = run(spec, views, inputs, per_token_states=False, attend=attend_sinks_sdpa)
    return out, _writes(spec, values, states=True)
