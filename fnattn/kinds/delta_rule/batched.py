"""GDN / KDA decode on the CPU as batched torch math (backend ``torch``): every request at once.

The reference decodes request by request on the host (`.reference`), which is
the truth but costs a loop of small ops per request and layer: at batch 8 a
Qwen3.5 tiny decode step took 3x transformers'. Decode has exactly one new token
per request, so the conv step and the one-token delta rule are the same ops on
every row: here they run once over ``[B, ...]`` tensors, with the reference's
arithmetic (fp32, the same op order) and its reads and writes:

    u       = [window, x]                        [B, C, W]  (window: the request's conv row)
    y       = act(bias + sum_w weight u)         in x.dtype, like the conv output
    q, k, v = split(y)                           q, k l2-normalized (the kind's `split_qkv`)
    S       = decay S + k^T (beta (v - k S));  o = scale q S

A request with nothing cached starts from zeros (its slot may hold a released
request's rows; pad lanes read the null slot). The new states and windows leave
as the layer's writes, one row per request, as the reference's do.

Verify stays the reference's: a native verify and the replay of its accepted
tokens must leave the same bits, and batched CPU kernels round a row by the
shape of the batch around it (one ulp, measured on KDA), which a replay's
per-request counts change.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from ...deltas import Writes, writes
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from .config import RecurrentInputs, RecurrentOutput
from .reference import check_inputs

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
    return torch.nn.functional.silu(y).to(x.dtype), u[:, :, 1:].to(x.dtype)


def delta_step(q: Float[Tensor, "B H K"], k: Float[Tensor, "B H K"], v: Float[Tensor, "B H V"],
               g: Float[Tensor, "B H"] | Float[Tensor, "B H K"], beta: Float[Tensor, "B H"],
               states: Float[Tensor, "B H K V"], *, scale: float
               ) -> tuple[Float[Tensor, "B H V"], Float[Tensor, "B H K V"]]:
    """The one-token gated delta rule over rows: q, k [B, H, K], v [B, H, V], g [B, H] or [B, H, K],
    beta [B, H], states [B, H, K, V] -> (o [B, H, V], new states), fp32."""
    from ...kernels.gdn_naive import delta_token

    decay = g.float().exp()
    decay = decay[..., None] if g.dim() == 3 else decay[..., None, None]
    return delta_token(q.float() * scale, k.float(), v.float(), beta.float(), decay, states.float())


def _decode(spec: LayerSpec, views: Views, inputs: RecurrentInputs) -> tuple[RecurrentOutput, Writes]:
    check_inputs(spec, inputs)
    c, batch = spec.config, inputs.meta.batch
    windows, states = start_rows(spec, views, batch)
    mixed, new_windows = conv_step(inputs.x, inputs.conv_weight, inputs.conv_bias, windows)
    q, k, v = c.split_qkv(mixed)
    o, new_states = delta_step(q, k, v, inputs.g, inputs.beta, states, scale=c.scale)
    out = RecurrentOutput(o=o.to(spec.dtype))
    return out, writes(ssm=new_states.to(c.state_dtype), conv=new_windows.to(views.conv.dtype))


_guards = [register(kind, "decode", NAME, supports=supports)(_decode) for kind in ("gdn", "kda")]
_decode = _guards[0]
