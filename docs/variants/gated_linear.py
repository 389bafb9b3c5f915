"""Gated linear attention (GLA-style) as a new fnattn kind, in one file.

Each request keeps, per head, a [K, V] state matrix. Every token decays it by
a per-head gate and adds its key-value outer product; the query reads it:

    S_t = exp(g_t) * S_{t-1} + k_t^T v_t        o_t = scale * q_t S_t

This file declares the config (with the storage `State` allocates for it),
the inputs, one reference backend per phase and a faster prefill; fnattn
itself is not edited. Every registration replaces the previous one, so the
file can run again, like a notebook cell.
"""

import dataclasses

import torch
from jaxtyping import Float
from torch import Tensor

import fnattn as fa


@fa.kind("gated_linear")
class GatedLinearConfig:
    num_heads: int
    head_k_dim: int
    head_v_dim: int

    def __post_init__(self):  # field types are already checked; the invariants are ours
        for name in ("num_heads", "head_k_dim", "head_v_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GatedLinearConfig: `{name}` must be positive, got {getattr(self, name)}")

    @property
    def scale(self) -> float:
        return self.head_k_dim**-0.5

    def storage(self, dtype):
        # One [H, K, V] state per request. It sums the whole history, so it stays fp32 whatever the layer dtype.
        return (fa.per_request("state", (self.num_heads, self.head_k_dim, self.head_v_dim), torch.float32),)


@fa.inputs("gated_linear")
class GatedLinearInputs:
    q: Float[Tensor, "T H K"]
    k: Float[Tensor, "T H K"]
    v: Float[Tensor, "T H V"]
    g: Float[Tensor, "T H"]  # log decay per token and head, <= 0 (e.g. logsigmoid of a projection)


def start(spec, views, batch, b: int) -> Tensor:
    """The [H, K, V] state request ``b`` starts from.

    A request with nothing cached is fresh: its slot may still hold a released
    request's state, so it is never read.
    """
    c = spec.config
    if batch.host_cache_lens[b] == 0:
        return views.state.new_zeros(c.num_heads, c.head_k_dim, c.head_v_dim)
    return views.state.index_select(0, batch.recurrent_slots[b : b + 1])[0]  # views.state: [N * ring, H, K, V]


def recurrent(spec, views, inputs) -> tuple[Tensor, Tensor]:
    """Token by token: ``-> (o [T, H, V], state after every token [T, H, K, V])``."""
    batch, scale = inputs.meta.batch, spec.config.scale
    cu = batch.host_cu_seqlens
    q, k, v = (x.float() for x in (inputs.q, inputs.k, inputs.v))  # [T, H, K], [T, H, K], [T, H, V]
    decay = inputs.g.float().exp()  # [T, H]
    outs, states = [], []
    for b in range(batch.num_requests):
        s = start(spec, views, batch, b)  # [H, K, V]
        # The same ops on the same shapes for every token, however many tokens the step has: the state
        # after a token is then bit-for-bit the same in prefill, decode, verify and replay.
        for t in range(cu[b], cu[b + 1]):
            s = decay[t, :, None, None] * s + k[t, :, :, None] * v[t, :, None, :]
            outs.append(torch.einsum("hk,hkv->hv", q[t] * scale, s))
            states.append(s)
    return torch.stack(outs).to(inputs.q.dtype), torch.stack(states)


def reference(spec, views, inputs) -> tuple[fa.Output, fa.Writes]:
    """Prefill and decode: one new state per request, the one after its last token."""
    o, states = recurrent(spec, views, inputs)
    last = torch.tensor(inputs.meta.batch.host_cu_seqlens[1:], device=o.device) - 1  # [B]
    return fa.Output(o=o), fa.writes(state=states.index_select(0, last))


@fa.register("gated_linear", "prefill", "reference", replace=True, invariant=True)
def prefill(spec: fa.LayerSpec, views: fa.Views, inputs: GatedLinearInputs) -> tuple[fa.Output, fa.Writes]:
    return reference(spec, views, inputs)


@fa.register("gated_linear", "decode", "reference", replace=True, invariant=True)
def decode(spec: fa.LayerSpec, views: fa.Views, inputs: GatedLinearInputs) -> tuple[fa.Output, fa.Writes]:
    return reference(spec, views, inputs)


@fa.register("gated_linear", "verify", "reference", replace=True, invariant=True)
def verify(spec: fa.LayerSpec, views: fa.Views, inputs: GatedLinearInputs) -> tuple[fa.Output, fa.Writes | None]:
    """The state after every token (native recovery keeps the accepted one's), and the inputs to
    replay the accepted tokens (replay recovery: then no state leaves this step)."""
    o, states = recurrent(spec, views, inputs)
    out = fa.Output(o=o, replay=dataclasses.replace(inputs, meta=None))
    return out, None if inputs.meta.batch.recovery == "replay" else fa.writes(state=states)


@fa.register("gated_linear", "prefill", "vectorized", replace=True)
def prefill_vectorized(spec: fa.LayerSpec, views: fa.Views,
                       inputs: GatedLinearInputs) -> tuple[fa.Output, fa.Writes]:
    """All tokens of a request at once (the parallel form), from cumulative log decays."""
    batch, scale = inputs.meta.batch, spec.config.scale
    cu = batch.host_cu_seqlens
    outs, finals = [], []
    for b in range(batch.num_requests):
        rows = slice(cu[b], cu[b + 1])
        q, k, v = (x[rows].float().transpose(0, 1) for x in (inputs.q, inputs.k, inputs.v))  # [H, n, K|V]
        G = inputs.g[rows].float().transpose(0, 1).cumsum(-1)  # [H, n]: log decay from the start to token t
        s0 = start(spec, views, batch, b)  # [H, K, V]
        n = G.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=G.device).tril()
        # Token j reaches token t >= j decayed by exp(G_t - G_j); masked before exp, so no inf * 0.
        w = (G[:, :, None] - G[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, n, n]
        o = (q @ k.transpose(1, 2) * w) @ v + (q * G.exp()[..., None]) @ s0  # [H, n, V]
        tail = (G[:, -1:] - G).exp()[..., None]  # [H, n, 1]: decay from token j to the last token
        final = G[:, -1, None, None].exp() * s0 + (k * tail).transpose(1, 2) @ v  # [H, K, V]
        outs.append(scale * o.transpose(0, 1))
        finals.append(final)
    return fa.Output(o=torch.cat(outs).to(inputs.q.dtype)), fa.writes(state=torch.stack(finals))
