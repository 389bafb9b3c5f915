"""The gated delta rule, for one request: token-by-token and chunked forms.

Both Gated DeltaNet (GDN, scalar decay per head) and Kimi Delta Attention (KDA,
per-channel decay) run the same recurrence on a state ``S`` of shape
``[H, K, V]`` (key dimension first, see ``docs/layout.md``). For every token
``t`` and head ``h``::

    S   <- diag(exp(g_t)) S                          # decay (g_t <= 0, log space)
    S   <- S + k_t^T (beta_t * (v_t - k_t S))         # delta rule write
    o_t  = scale * q_t S                              # read

``g_t`` is a scalar per head ``[T, H]`` (GDN) or one value per key channel
``[T, H, K]`` (KDA). Heads are independent: for GDN's grouped heads the caller
repeats q/k heads to the ``H`` value heads beforehand.

All math runs in fp32. Outputs are returned in ``q.dtype`` and states in
``state.dtype``. No input is modified.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from fnattn.checks import expect_float, expect_shape

__all__ = ["RecurrentLayerOutput", "gated_delta_chunked", "gated_delta_recurrent"]


class RecurrentLayerOutput(NamedTuple):
    """What a GDN/KDA layer function returns for one request.

    ``conv_window`` and ``state`` are the states after the last token.
    ``conv_windows`` holds the conv window after every token. ``states`` holds
    the recurrent state after every token when the recurrent form ran, and is
    ``None`` for the chunked form.
    """

    output: Float[Tensor, "T Dmodel"]
    conv_window: Float[Tensor, "C W1"]
    state: Float[Tensor, "H K V"]
    conv_windows: Float[Tensor, "T C W1"]
    states: Float[Tensor, "T H K V"] | None


def _check_inputs(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[int, int, int, int, bool]:
    """Validate shapes; return ``(T, H, K, V, per_channel)``."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
        expect_float(name, x)
    expect_shape("q", q, (None, None, None))
    T, H, K = q.shape
    expect_shape("k", k, (T, H, K))
    expect_shape("v", v, (T, H, None))
    V = v.shape[2]
    if g.dim() == 3:
        expect_shape("g", g, (T, H, K))
    else:
        expect_shape("g", g, (T, H))
    expect_shape("beta", beta, (T, H))
    expect_shape("state", state, (H, K, V))
    return T, H, K, V, g.dim() == 3


def _check_scale(scale: float) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale: expected a float, got {type(scale).__name__}")
    return float(scale)


def gated_delta_recurrent(
    q: Float[Tensor, "T H K"],
    k: Float[Tensor, "T H K"],
    v: Float[Tensor, "T H V"],
    g: Float[Tensor, "T H"] | Float[Tensor, "T H K"],
    beta: Float[Tensor, "T H"],
    state: Float[Tensor, "H K V"],
    *,
    scale: float,
) -> tuple[Float[Tensor, "T H V"], Float[Tensor, "T H K V"]]:
    """Run the gated delta rule token by token.

    Returns ``(o, states)`` where ``states[t]`` is the recurrent state after
    token ``t`` (so ``states[-1]`` is the final state). Used for decode and for
    verifying drafts, where every intermediate state may be kept.
    """
    T, H, K, V, per_channel = _check_inputs(q, k, v, g, beta, state)
    scale = _check_scale(scale)

    q32 = q.float() * scale
    k32 = k.float()
    v32 = v.float()
    beta32 = beta.float()
    decay = g.float().exp()
    # Broadcast the decay over the state [H, K, V]: per head, or per key channel.
    decay = decay[:, :, :, None] if per_channel else decay[:, :, None, None]

    S = state.float()
    outputs = []
    states = []
    for t in range(T):
        S = S * decay[t]
        predicted = torch.einsum("hk,hkv->hv", k32[t], S)
        correction = beta32[t][:, None] * (v32[t] - predicted)
        S = S + k32[t][:, :, None] * correction[:, None, :]
        outputs.append(torch.einsum("hk,hkv->hv", q32[t], S))
        states.append(S)

    if T == 0:
        return q.new_empty((0, H, V)), state.new_empty((0, H, K, V))
    o = torch.stack(outputs).to(q.dtype)
    return o, torch.stack(states).to(state.dtype)


def _decayed_scores(a: Tensor, b: Tensor, gamma: Tensor) -> Tensor:
    """``M[h, i, j] = sum_c a[h, i, c] b[h, j, c] exp(gamma[h, i, c] - gamma[h, j, c])`` for ``j <= i``, else 0.

    ``gamma`` is the cumulative log-decay inside the chunk, ``[H, L, K]`` or
    ``[H, L, 1]`` for a scalar decay. Masking happens before the exponential, so
    only non-positive exponents are evaluated.
    """
    L = a.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=a.device).tril()
    diff = gamma[:, :, None, :] - gamma[:, None, :, :]  # [H, L, L, K or 1]
    decay = diff.masked_fill(~causal[None, :, :, None], float("-inf")).exp()
    if gamma.shape[-1] == 1:
        return (a @ b.transpose(1, 2)) * decay[..., 0]
    return torch.einsum("hic,hjc,hijc->hij", a, b, decay)


def gated_delta_chunked(
    q: Float[Tensor, "T H K"],
    k: Float[Tensor, "T H K"],
    v: Float[Tensor, "T H V"],
    g: Float[Tensor, "T H"] | Float[Tensor, "T H K"],
    beta: Float[Tensor, "T H"],
    state: Float[Tensor, "H K V"],
    *,
    scale: float,
    chunk_size: int = 64,
) -> tuple[Float[Tensor, "T H V"], Float[Tensor, "H K V"]]:
    """Run the same recurrence as ``gated_delta_recurrent`` chunk by chunk.

    Returns ``(o, final_state)``. Inside a chunk of ``L`` tokens starting from
    state ``S0``, with ``gamma_i`` the cumulative log-decay up to token ``i``,
    the state writes ``u_i`` (the delta rule corrections) solve a unit lower
    triangular system (the WY / UT transform)::

        u_i + beta_i sum_{j<i} <k_i, k_j e^(gamma_i - gamma_j)> u_j
            = beta_i (v_i - (k_i e^gamma_i) S0)
        o_i  = scale (q_i e^gamma_i) S0 + scale sum_{j<=i} <q_i, k_j e^(gamma_i - gamma_j)> u_j
        S_L  = e^gamma_L S0 + sum_j (k_j e^(gamma_L - gamma_j))^T u_j

    Any ``T`` works; the last chunk may be shorter than ``chunk_size``.
    """
    T, H, K, V, per_channel = _check_inputs(q, k, v, g, beta, state)
    scale = _check_scale(scale)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")

    # Work head-major: [H, T, ...].
    q32 = (q.float() * scale).transpose(0, 1)
    k32 = k.float().transpose(0, 1)
    v32 = v.float().transpose(0, 1)
    beta32 = beta.float().transpose(0, 1)[:, :, None]  # [H, T, 1]
    g32 = g.float() if per_channel else g.float()[:, :, None]
    g32 = g32.transpose(0, 1)  # [H, T, K or 1]

    S = state.float()
    outputs = []
    for start in range(0, T, chunk_size):
        stop = min(start + chunk_size, T)
        qc, kc, vc = q32[:, start:stop], k32[:, start:stop], v32[:, start:stop]
        bc = beta32[:, start:stop]
        gamma = g32[:, start:stop].cumsum(1)  # [H, L, K or 1], non-increasing
        L = stop - start
        eye = torch.eye(L, dtype=S.dtype, device=S.device)

        # Unit lower triangular system (I + strictly-lower(beta_i <k_i, k_j decay>)).
        system = eye + (bc * _decayed_scores(kc, kc, gamma)).tril(-1)
        decay_from_start = gamma.exp()  # e^gamma_i
        rhs_v = bc * vc  # [H, L, V]
        rhs_k = bc * (kc * decay_from_start)  # [H, L, K]
        u_v = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
        u_k = torch.linalg.solve_triangular(system, rhs_k, upper=False, unitriangular=True)
        u = u_v - u_k @ S  # [H, L, V]

        scores = _decayed_scores(qc, kc, gamma)  # [H, L, L], causal incl. the diagonal
        outputs.append((qc * decay_from_start) @ S + scores @ u)

        decay_to_end = (gamma[:, -1:] - gamma).exp()  # e^(gamma_L - gamma_j)
        S = S * decay_from_start[:, -1, :, None] + (kc * decay_to_end).transpose(1, 2) @ u

    if T == 0:
        return q.new_empty((0, H, V)), state.clone()
    o = torch.cat(outputs, dim=1).transpose(0, 1).contiguous().to(q.dtype)
    return o, S.to(state.dtype)
