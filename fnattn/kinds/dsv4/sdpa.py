"""CPU backend for DeepSeek-V4 attention prefill and decode (backend ``sdpa``): the reference's layout, then
the attention through torch's fused SDPA kernel.

The reference (`.reference.run`) builds, per request, the K=V rows of each token's window and the compressed
entries it may see, with an additive mask; its `attend_sinks` then forms every ``[H, n, K]`` logit and a
softmax with the sink logit appended. Here the same keys and mask go to the kernel
``F.scaled_dot_product_attention`` dispatches to on a CPU (shared K = V: one KV head, the heads folded into
the query axis), which returns the log-sum-exp too; the sinks then scale the output by
``sigmoid(lse - sink)``, the share of the denominator the keys hold. Verify stays the reference's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...deltas import Writes
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from .config import DSV4Inputs, DSV4Output
from .reference import _writes, run

NAME = "sdpa"
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def supports(spec, device) -> list[str]:
    reasons = []
    if device.type != "cpu":
        reasons.append(f"runs on CPU, the model runs on {device.type}")
    if spec.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        reasons.append(f"dtype {spec.dtype} not in (float32, bfloat16, float16)")
    return reasons


def attend_sinks_sdpa(q: Tensor, keys: Tensor, bias: Tensor, sinks: Tensor | None, *, scale: float) -> Tensor:
    """`attend_sinks`'s result: ``q [n, H, D]`` over shared K = V ``keys [K, D]``, ``bias [n, K]`` (0 or
    -inf), per-head ``sinks [H]`` -> ``[n, H, D]`` in ``keys.dtype``; the math in fp32."""
    n, H, D = q.shape
    f32 = torch.float32
    rows = q.to(f32).permute(1, 0, 2).reshape(1, 1, H * n, D)  # query row h * n + t
    kv = keys.to(f32)[None, None]  # [1, 1, K, D]
    mask = bias.to(f32).repeat(H, 1)[None, None]  # [1, 1, H n, K]
    o, lse = _flash(rows, kv, kv, attn_mask=mask, scale=scale)[:2]
    o, lse = o.view(H, n, D).transpose(0, 1), lse.view(H, n).transpose(0, 1)  # [n, H, D], [n, H]
    if sinks is not None:
        o = o * torch.sigmoid(lse - sinks.float()[None, :])[..., None]
    return o.to(keys.dtype)


@register("dsv4", "prefill", NAME, supports=supports)
def prefill(spec: LayerSpec, views: Views, inputs: DSV4Inputs) -> tuple[DSV4Output, Writes]:
    out, values = run(spec, views, inputs, per_token_states=False, attend=attend_sinks_sdpa)
    return out, _writes(spec, values, states=True)


@register("dsv4", "decode", NAME, supports=supports)
def decode(spec: LayerSpec, views: Views, inputs: DSV4Inputs) -> tuple[DSV4Output, Writes]:
    out, values = run(spec, views, inputs, per_token_states=False, attend=attend_sinks_sdpa)
    return out, _writes(spec, values, states=True)
