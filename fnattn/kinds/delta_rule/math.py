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

All math runs in fp32, in ``fnattn.kernels.gdn_naive`` (the one statement of it,
also the reference of the Triton kernels); this module checks the arguments.
Outputs are returned in ``q.dtype`` and states in ``state.dtype``. No input is
modified.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxtyping import Float
from torch import Tensor

from fnattn.checks import expect_float, expect_shape
from fnattn.kernels.gdn_naive import gated_delta_chunked_seq, gated_delta_recurrent_seq

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
    _check_inputs(q, k, v, g, beta, state)
    o, states = gated_delta_recurrent_seq(q, k, v, g, beta, state, scale=_check_scale(scale))
    return o.to(q.dtype), states.to(state.dtype)


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
    _check_inputs(q, k, v, g, beta, state)
    scale = _check_scale(scale)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")

    o, final = gated_delta_chunked_seq(q, k, v, g, beta, state, scale=scale, chunk_size=chunk_size)
    return o.to(q.dtype), final.to(state.dtype)
