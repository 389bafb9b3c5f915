"""Reference Gated DeltaNet / Kimi Delta Attention: the part shared by both kinds.

A backend receives the conv input ``x`` (q | k | v channels), the conv taps and
the per-token gates, and owns everything between the model's projections and
its output norm: the causal conv continuing from the request's conv window,
silu, the q/k/v split with l2-normalized q and k, and the gated delta rule
continuing from the request's recurrent state. The new states leave as the
layer's writes (``ssm`` and ``conv``):

* prefill (chunked form) and decode (token by token): one row per request,
  the states after its last token;
* verify (token by token): one row per token, the states after every token,
  so the apply can keep the row of the last accepted token.

Where the rows go is the batch's business (`Batch.state_rows`): spare rows of
the request's ring (the apply then moves its ring position), or without a ring
its current row.

Requests loop on the host; the math is `.conv`, `.qkv` and `.math` beside this file.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ...checks import fail
from ...deltas import Writes, writes
from ...kernels.invariant import invariant_on
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from .config import RecurrentInputs, RecurrentOutput
from .conv import causal_conv1d
from .math import gated_delta_chunked, gated_delta_recurrent

#: Tokens per chunk of the chunked (prefill) form.
CHUNK_SIZE = 64


def check_inputs(spec: LayerSpec, inputs: RecurrentInputs) -> None:
    """What `RecurrentInputs.validate` leaves open: beta's dtype."""
    where = f"layer {spec.index} inputs"
    # An integer or fp64 beta is a wiring mistake, not a value to cast silently.
    allowed = tuple(dict.fromkeys((spec.dtype, torch.float32)))
    if inputs.beta.dtype not in allowed:
        fail(where, "beta", f"dtype {' or '.join(map(str, allowed))}", inputs.beta.dtype)


def start_states(spec: LayerSpec, views: Views, batch, b: int) -> tuple[Tensor, Tensor]:
    """The conv window ``[C, W - 1]`` and recurrent state ``[H, K, V]`` request ``b`` starts from.

    A request with nothing cached is fresh: its slot may hold a previous
    request's state (slots are reused), so it is never read.
    """
    c = spec.config
    device = views.ssm.device
    if batch.host_cache_lens[b] == 0:
        window = torch.zeros(c.conv_dim, c.conv_kernel - 1, dtype=spec.dtype, device=device)
        state = torch.zeros(c.num_state_heads, c.head_k_dim, c.head_v_dim, dtype=c.state_dtype, device=device)
        return window, state
    slot = batch.recurrent_slots[b : b + 1]  # [1]: index_select keeps the slot on the device
    return views.conv.index_select(0, slot)[0], views.ssm.index_select(0, slot)[0]


def run(spec: LayerSpec, views: Views, inputs: RecurrentInputs, *, per_token: bool):
    """Every request of the step: ``-> (o [T, H, V], states, windows)``.

    ``per_token=False``: chunked form; ``states`` [B, H, K, V] and ``windows``
    [B, C, W - 1] hold each request's final states. ``per_token=True``: the
    token-by-token form; ``states`` [T, H, K, V] and ``windows`` [T, C, W - 1]
    hold the states after every token.
    """
    check_inputs(spec, inputs)
    batch = inputs.meta.batch
    cu = batch.host_cu_seqlens
    outs, states, windows = [], [], []
    for b in range(batch.num_requests):
        window, state = start_states(spec, views, batch, b)
        if per_token:
            # One token at a time, every op on the same shapes whatever the request's
            # length: the state after token i is then bit-for-bit the same whether i
            # was the last token of a step or not (native vs replay recovery).
            for t in range(cu[b], cu[b + 1]):
                o, window, state = _advance(spec, inputs, slice(t, t + 1), window, state, chunked=False)
                outs.append(o)
                states.append(state[None])
                windows.append(window[None])
        else:
            o, window, state = _advance(spec, inputs, slice(cu[b], cu[b + 1]), window, state, chunked=True)
            outs.append(o)
            states.append(state[None])
            windows.append(window[None])
    o = torch.cat(outs).to(spec.dtype)  # [T, H, V]
    return o, torch.cat(states), torch.cat(windows)


def _advance(spec: LayerSpec, inputs: RecurrentInputs, rows: slice, window: Tensor, state: Tensor, *,
             chunked: bool):
    """Run ``rows`` of one request: ``-> (o [n, H, V], window after, state after)``."""
    c = spec.config
    mixed, conv_after = causal_conv1d(inputs.x[rows], inputs.conv_weight, inputs.conv_bias, window,
                                      activation="silu")  # [n, C], [n, C, W - 1]
    q, k, v = c.split_qkv(mixed)
    g, beta = inputs.g[rows], inputs.beta[rows]  # [n, H] or [n, H, K]; [n, H]
    if chunked:
        o, final = gated_delta_chunked(q, k, v, g, beta, state, scale=c.scale, chunk_size=CHUNK_SIZE)
    else:
        o, after = gated_delta_recurrent(q, k, v, g, beta, state, scale=c.scale)
        final = after[-1]
    return o, conv_after[-1], final


def per_request(spec: LayerSpec, views: Views, inputs: RecurrentInputs, *, chunked: bool):
    """Prefill (chunked) and decode (token by token): one state row per request. In the invariant mode
    (`fnattn.kernels.invariant`) prefill runs token by token too, so a token's output and state are decode's
    bits whatever the chunks a prompt was prefilled in (a shared-prefix hit resumes as a cold prefill would)."""
    batch = inputs.meta.batch
    if chunked and not invariant_on():
        o, states, windows = run(spec, views, inputs, per_token=False)
    else:
        o, states, windows = run(spec, views, inputs, per_token=True)
        last = torch.tensor(batch.host_cu_seqlens[1:], device=o.device) - 1  # [B] each request's last row
        states, windows = states.index_select(0, last), windows.index_select(0, last)
    return RecurrentOutput(o=o), writes(ssm=states, conv=windows)


def per_token(spec: LayerSpec, views: Views, inputs: RecurrentInputs):
    """Verify: the states after every token, and the inputs to replay accepted tokens.

    With ``batch.recovery == "replay"`` no state leaves the step: the accepted
    tokens are replayed later (`Batch.replay`) from the same pre-step state.
    """
    batch = inputs.meta.batch
    o, states, windows = run(spec, views, inputs, per_token=True)  # [T, H, V], [T, H, K, V], [T, C, W - 1]
    if batch.recovery == "replay":
        return RecurrentOutput(o=o, replay=replace(inputs, meta=None)), None
    return RecurrentOutput(o=o, replay=replace(inputs, meta=None)), writes(ssm=states, conv=windows)


for _kind in ("gdn", "kda"):
    @register(_kind, "prefill", "reference", invariant=True)
    def prefill(spec: LayerSpec, views: Views, inputs: RecurrentInputs) -> tuple[RecurrentOutput, Writes]:
        return per_request(spec, views, inputs, chunked=True)

    @register(_kind, "decode", "reference", invariant=True)
    def decode(spec: LayerSpec, views: Views, inputs: RecurrentInputs) -> tuple[RecurrentOutput, Writes]:
        return per_request(spec, views, inputs, chunked=False)

    @register(_kind, "verify", "reference", invariant=True)
    def verify(spec: LayerSpec, views: Views, inputs: RecurrentInputs) -> tuple[RecurrentOutput, Writes | None]:
        return per_token(spec, views, inputs)
