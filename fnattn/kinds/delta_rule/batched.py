"""GDN / KDA decode and prefill on the CPU as torch math (backend ``torch``).

The reference runs request by request and, in prefill, chunk by chunk, each step a few small ops
(`.reference`): the truth, but at batch 8 a Qwen3.5 tiny decode step took 3x transformers', and a
512-token prefill spent half its time in the chunk loop. Here, with the reference's arithmetic (fp32):

Decode has exactly one new token per request, so the conv step and the one-token delta rule are the same
ops on every row: they run once over ``[B, ...]`` tensors, in the reference's op order:

    u       = [window, x]                        [B, C, W]  (window: the request's conv row)
    y       = act(bias + sum_w weight u)         in x.dtype, like the conv output
    q, k, v = split(y)                           q, k l2-normalized (the kind's `split_qkv`)
    S       = decay S + k^T (beta (v - k S));  o = scale q S

Prefill runs each request's chunked form (`fnattn.kernels.gdn_naive.gated_delta_chunked_seq`, the same
formulas and chunks) building each chunk's pairwise decays once and solving its triangular system once
(`chunked_delta`). Requests stay apart (a request's bits do not depend on the others in the step); the conv
is the reference's.

A request with nothing cached starts from zeros (its slot may hold a released
request's rows; pad lanes read the null slot). The new states and windows leave
as the layer's writes, one row per request, as the reference's do.

In the invariant mode (`fnattn.kernels.invariant`) both phases hand the step to the reference's token-by-token
form, request by request. Verify stays the reference's: a native verify and the replay of its accepted
tokens must leave the same bits, and batched CPU kernels round a row by the
shape of the batch around it (one ulp, measured on KDA), which a replay's
per-request counts change.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from ...deltas import Writes, writes
from ...kernels.invariant import invariant_on, pointwise
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from .config import RecurrentInputs, RecurrentOutput
from .conv import causal_conv1d
from .reference import CHUNK_SIZE, check_inputs, per_request

NAME = "torch"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supports(spec, device) -> list[str]:
    reasons = []
    if device.type != "cpu":
        reasons.append(f"runs on CPU, the model runs on {device.type} (the Triton kernels serve the GPU)")
    if spec.dtype not in _DTYPES:
        reasons.append(f"dtype {spec.dtype} not in (float32, bfloat16, float16)")
    return reasons


def start_rows(spec: LayerSpec, views: Views, batch) -> tuple[Float[Tensor, "B C W1"], Float[Tensor, "B H K V"]]:
    """Every request's conv window ``[B, C, W - 1]`` and state ``[B, H, K, V]``: its rows, or zeros when it
    has nothing cached."""
    c = spec.config
    windows = views.conv.index_select(0, batch.recurrent_slots)
    states = views.ssm.index_select(0, batch.recurrent_slots)
    fresh = [b for b, n in enumerate(batch.host_cache_lens) if n == 0]
    if fresh:  # never read: zeros of the reference's dtypes
        rows = torch.tensor(fresh, device=windows.device)
        windows = windows.index_fill(0, rows, 0)
        states = states.index_fill(0, rows, 0)
    return windows.to(spec.dtype), states.to(c.state_dtype)


def conv_step(x: Float[Tensor, "B C"], weight: Float[Tensor, "C W"], bias: Float[Tensor, " C"] | None,
              windows: Float[Tensor, "B C W1"]) -> tuple[Float[Tensor, "B C"], Float[Tensor, "B C W1"]]:
    """One token per row: ``x [B, C]`` after ``windows [B, C, W - 1]`` -> (silu(conv) [B, C] in x.dtype,
    new windows [B, C, W - 1] in x.dtype)."""
    u = torch.cat([windows.to(x.dtype).float(), x.float()[:, :, None]], dim=2)  # [B, C, W]
    y = (u * weight.float()[None]).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return pointwise(torch.nn.functional.silu, y).to(x.dtype), u[:, :, 1:].to(x.dtype)


def delta_step(q: Float[Tensor, "B H K"], k: Float[Tensor, "B H K"], v: Float[Tensor, "B H V"],
               g: Float[Tensor, "B H"] | Float[Tensor, "B H K"], beta: Float[Tensor, "B H"],
               states: Float[Tensor, "B H K V"], *, scale: float
               ) -> tuple[Float[Tensor, "B H V"], Float[Tensor, "B H K V"]]:
    """The one-token gated delta rule over rows: q, k [B, H, K], v [B, H, V], g [B, H] or [B, H, K],
    beta [B, H], states [B, H, K, V] -> (o [B, H, V], new states), fp32."""
    from ...kernels.gdn_naive import delta_token

    decay = pointwise(torch.exp, g.float())
    decay = decay[..., None] if g.dim() == 3 else decay[..., None, None]
    return delta_token(q.float() * scale, k.float(), v.float(), beta.float(), decay, states.float())


def _decode(spec: LayerSpec, views: Views, inputs: RecurrentInputs) -> tuple[RecurrentOutput, Writes]:
    if invariant_on():  # a row's bits would follow the batch's shape: the reference's request-by-request steps
        return per_request(spec, views, inputs, chunked=False)
    check_inputs(spec, inputs)
    c, batch = spec.config, inputs.meta.batch
    windows, states = start_rows(spec, views, batch)
    mixed, new_windows = conv_step(inputs.x, inputs.conv_weight, inputs.conv_bias, windows)
    q, k, v = c.split_qkv(mixed)
    o, new_states = delta_step(q, k, v, inputs.g, inputs.beta, states, scale=c.scale)
    out = RecurrentOutput(o=o.to(spec.dtype))
    return out, writes(ssm=new_states.to(c.state_dtype), conv=new_windows.to(views.conv.dtype))


def chunked_delta(q: Float[Tensor, "T H K"], k: Float[Tensor, "T H K"], v: Float[Tensor, "T H V"],
                  g: Float[Tensor, "T H"] | Float[Tensor, "T H K"], beta: Float[Tensor, "T H"],
                  state: Float[Tensor, "H K V"], *, scale: float, chunk_size: int = CHUNK_SIZE
                  ) -> tuple[Float[Tensor, "T H V"], Float[Tensor, "H K V"]]:
    """One request's gated delta rule in the chunked form: ``-> (o [T, H, V], final state [H, K, V])``, fp32.
    The formulas and the chunking are `gated_delta_chunked_seq`'s; each chunk builds its pairwise decays
    once for both the ``k k^T`` and the ``q k^T`` scores and solves its triangular system once for both
    right-hand sides (the reference, a plain statement of the math, does each twice). Chunk by chunk, not
    all chunks at once: a chunk's ``[H, L, L]`` tiles stay in the CPU's caches, all of them do not."""
    T, H, K = k.shape
    V = v.shape[2]
    S = state.float()
    if T == 0:
        return q.new_zeros((0, H, V), dtype=torch.float32), S.clone()
    q32 = (q.float() * scale).transpose(0, 1)  # [H, T, K]
    k32, v32 = k.float().transpose(0, 1), v.float().transpose(0, 1)
    beta32 = beta.float().transpose(0, 1)[:, :, None]  # [H, T, 1]
    g32 = (g.float() if g.dim() == 3 else g.float()[:, :, None]).transpose(0, 1)  # [H, T, K or 1]
    outs = []
    for start in range(0, T, chunk_size):
        stop = min(start + chunk_size, T)
        L = stop - start
        qc, kc, vc, bc = q32[:, start:stop], k32[:, start:stop], v32[:, start:stop], beta32[:, start:stop]
        gamma = g32[:, start:stop].cumsum(1)  # [H, L, K or 1], non-increasing
        causal = torch.ones(L, L, dtype=torch.bool, device=S.device).tril()
        decay = (gamma[:, :, None, :] - gamma[:, None, :, :]).masked_fill(~causal[None, :, :, None],
                                                                           float("-inf")).exp()
        if gamma.shape[-1] == 1:
            kk = (kc @ kc.transpose(1, 2)) * decay[..., 0]
            qk = (qc @ kc.transpose(1, 2)) * decay[..., 0]
        else:
            kk = torch.einsum("hic,hjc,hijc->hij", kc, kc, decay)
            qk = torch.einsum("hic,hjc,hijc->hij", qc, kc, decay)
        system = torch.eye(L, dtype=S.dtype, device=S.device) + (bc * kk).tril(-1)
        from_start = gamma.exp()  # e^gamma_i
        both = torch.linalg.solve_triangular(system, torch.cat([bc * vc, bc * (kc * from_start)], dim=2),
                                             upper=False, unitriangular=True)
        u = both[..., :V] - both[..., V:] @ S  # [H, L, V]
        outs.append((qc * from_start) @ S + qk @ u)
        S = S * from_start[:, -1, :, None] + (kc * (gamma[:, -1:] - gamma).exp()).transpose(1, 2) @ u
    return torch.cat(outs, dim=1).transpose(0, 1).contiguous(), S


def _prefill(spec: LayerSpec, views: Views, inputs: RecurrentInputs) -> tuple[RecurrentOutput, Writes]:
    if invariant_on():  # token by token, as decode: the chunks a prompt comes in do not move its bits
        return per_request(spec, views, inputs, chunked=False)
    check_inputs(spec, inputs)
    c, batch = spec.config, inputs.meta.batch
    windows, states = start_rows(spec, views, batch)
    cu = batch.host_cu_seqlens
    outs, finals, after = [], [], []
    for b in range(batch.num_requests):
        rows = slice(cu[b], cu[b + 1])
        mixed, conv_after = causal_conv1d(inputs.x[rows], inputs.conv_weight, inputs.conv_bias, windows[b],
                                          activation="silu")
        q, k, v = c.split_qkv(mixed)
        o, final = chunked_delta(q, k, v, inputs.g[rows], inputs.beta[rows], states[b], scale=c.scale)
        outs.append(o)
        finals.append(final.to(c.state_dtype))
        after.append(conv_after[-1])
    out = RecurrentOutput(o=torch.cat(outs).to(spec.dtype))
    return out, writes(ssm=torch.stack(finals), conv=torch.stack(after).to(views.conv.dtype))


_guards = [register(kind, "decode", NAME, supports=supports, invariant=True)(_decode) for kind in ("gdn", "kda")]
_decode = _guards[0]
_prefill_guards = [register(kind, "prefill", NAME, supports=supports, invariant=True)(_prefill)
                   for kind in ("gdn", "kda")]
_prefill = _prefill_guards[0]
