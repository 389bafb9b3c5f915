"""DeepSeek-V4 math on plain tensors: the interleaved tail rope, the compressor, the indexer, attention with sinks.

Each function follows the op order of transformers' DeepSeek-V4 modules (fp32
softmaxes and norms, results in the activation dtype), so the reference
matches them to rounding.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from ...kernels.attention_naive import attention_fixed_order
from ...kernels.invariant import invariant_on, pointwise


def rope_cos_sin(positions: Tensor, inv_freq: Float[Tensor, " R2"], dtype: torch.dtype
                 ) -> tuple[Float[Tensor, "n R2"], Float[Tensor, "n R2"]]:
    """Half-size ``(cos, sin)`` (one entry per rotated pair) at ``positions``, rounded to ``dtype``."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    cos, sin = pointwise(lambda f: (f.cos(), f.sin()), freqs)
    return cos.to(dtype), sin.to(dtype)


def rope_tail(x: Float[Tensor, "n *H D"], cos: Float[Tensor, "n R2"], sin: Float[Tensor, "n R2"]
              ) -> Float[Tensor, "n *H D"]:
    """Rotate the trailing ``2 * R2`` dims of ``x`` in adjacent pairs ``(x[2j], x[2j+1])``, layout kept.

    DeepSeek-V4 lays each head out as ``[nope | rope]``; ``sin`` negated is
    the inverse rotation (the model applies it to the attention output).
    """
    Dr = 2 * cos.shape[-1]
    c, s = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)  # [n, Dr]
    if x.dim() == 3:
        c, s = c[:, None], s[:, None]
    nope, rope = x[..., :-Dr], x[..., -Dr:]
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    out = (rope.float() * c + rotated.float() * s).to(x.dtype)
    return torch.cat((nope, out), dim=-1)


def rms_norm_fp32w(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' DeepseekV4RMSNorm: fp32 statistics and an fp32 weight, one rounding at the end."""
    h = x.float()
    h = h * torch.rsqrt(mean_squares(h) + eps)
    return (weight.float() * h).to(x.dtype)


def mean_squares(h: Float[Tensor, "*B C"]) -> Float[Tensor, "*B 1"]:
    """Each row's mean square, fp32. In the invariant mode on CUDA through the fixed-tile GEMM (a product with
    a ones column): torch's CUDA mean lays its threads out by the number of rows, and a compressed entry is
    pooled with one row a closing token, however many close in the step."""
    if not (invariant_on() and h.is_cuda):
        return h.pow(2).mean(-1, keepdim=True)
    from ...kernels.invariant_linear import invariant_linear

    C = h.shape[-1]
    ones = torch.ones(1, C, dtype=torch.float32, device=h.device)
    return (invariant_linear(h.pow(2).reshape(-1, C), ones) / C).reshape(*h.shape[:-1], 1)


def pool_windows(kv: Float[Tensor, "L CD"], gate: Float[Tensor, "L CD"], *, ratio: int, overlap: int,
                 first: int, count: int) -> Float[Tensor, "count D"]:
    """The pre-norm entries of ``count`` consecutive windows starting at window ``first``.

    ``kv`` / ``gate`` hold the raw rows of positions ``(first - overlap + 1) *
    ratio ...`` onwards (gate with its position bias; rows of positions before
    0 are kv 0, gate -inf). HCA (``overlap`` 1): a per-channel softmax over
    the window's ``ratio`` rows. CSA (2): over ``2 * ratio`` slots, the first
    half of the previous window's rows then the second half of the window's.
    """
    D = kv.shape[-1] // overlap
    span = (count + overlap - 1) * ratio
    kv, gate = kv[:span].view(-1, ratio, overlap * D), gate[:span].view(-1, ratio, overlap * D)
    if overlap == 1:
        w_kv, w_gate = kv, gate  # [count, m, D]
    else:
        w_kv = torch.cat((kv[:-1, :, :D], kv[1:, :, D:]), dim=1)  # [count, 2m, D]
        w_gate = torch.cat((gate[:-1, :, :D], gate[1:, :, D:]), dim=1)
    weights = w_gate.softmax(dim=1, dtype=torch.float32).to(w_kv.dtype)
    return (w_kv * weights).sum(dim=1)


def indexer_scores(q: Float[Tensor, "n Hi Di"], w: Float[Tensor, "n Hi"], keys: Float[Tensor, "E Di"], *,
                   scale: float) -> Float[Tensor, "n E"]:
    """``sum_h w[t, h] * relu(q[t, h] . k[s]) * scale``, fp32."""
    s = torch.einsum("nhd,ed->nhe", q.float(), keys.float())
    s = torch.relu(s) * scale
    return (s * w.float()[:, :, None]).sum(dim=1)


def attend_sinks(q: Float[Tensor, "n H D"], keys: Float[Tensor, "K D"], bias: Float[Tensor, "n K"],
                 sinks: Float[Tensor, " H"] | None, *, scale: float) -> Float[Tensor, "n H D"]:
    """Shared-KV MQA (K = V) with an additive mask and per-head sink logits in the denominator.

    Not `fnattn.kernels.attention_naive.attention` (fp32 throughout): this one rounds as transformers' eager
    DeepSeek-V4 attention does (logits in the activation dtype, the sink as one more softmax column), which the
    model tests compare against."""
    logits = torch.einsum("nhd,kd->hnk", q, keys) * scale + bias[None].to(q.dtype)  # [H, n, K]
    if sinks is not None:
        # fp32 sinks promote the softmax to fp32, as transformers' eager attention does.
        sink = sinks[:, None, None].expand(-1, logits.shape[1], 1)
        logits = torch.cat((logits, sink), dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., : keys.shape[0]]
    return torch.einsum("hnk,kd->nhd", probs.to(keys.dtype), keys)


def attend_sinks_fixed_order(q: Float[Tensor, "n H D"], keys: Float[Tensor, "K D"], bias: Float[Tensor, "n K"],
                             sinks: Float[Tensor, " H"] | None, *, scale: float) -> Float[Tensor, "n H D"]:
    """`attend_sinks`'s contract in the invariant mode (`fnattn.kernels.invariant`): each query over exactly
    the keys it sees (its unmasked columns, in their order: its window by position, then the compressed
    entries), through `attention_fixed_order`, so neither the step's other tokens nor the keys laid out for
    them move its reduction. fp32 math (not transformers' rounding), the result in ``keys.dtype``."""
    outs = []
    for i in range(q.shape[0]):
        seen = keys[bias[i] == 0]  # [m, D]
        m = seen.shape[0]
        o, _ = attention_fixed_order(q[i : i + 1], seen[:, None], seen[:, None],
                                     torch.full((1,), m - 1, device=q.device), torch.arange(m, device=q.device),
                                     scale=scale, sinks=sinks)
        outs.append(o)
    return torch.cat(outs).to(keys.dtype)
