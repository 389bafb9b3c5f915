"""The one pure-torch statement of the delta-rule math, for a single sequence, in fp32.

These are the references of the kernels beside them (the pooled `*_ref` functions of
gdn_conv / gdn_recurrent / gdn_chunk loop over requests and call these) and the
arithmetic behind `fnattn.kinds.delta_rule.conv` / `.math`. Plain tensors in and
out; nothing here checks shapes (the callers do) and no input is modified or
returned as an alias. Heads are already matched: q, k [T, H, K], v [T, H, V].

    causal_conv1d_seq         depthwise causal conv continuing from a window [C, W-1]
    delta_token               one token of the gated delta rule, any leading dims (one request or many)
    gated_delta_recurrent_seq the gated delta rule token by token (decode / verify)
    gated_delta_chunked_seq   the same recurrence chunk by chunk (prefill, WY / UT form)

Decay: g [T, H] (GDN, scalar per head) or [T, H, K] (KDA, per key channel), log space.
"""

import torch
import torch.nn.functional as F

from .invariant import pointwise


def activate(x, activation):
    """None / "identity": x; "silu" / "swish": F.silu; "sigmoid": torch.sigmoid."""
    if activation in (None, "identity"):
        return x
    # `pointwise`: in the invariant mode a row's bits do not follow how many rows share the call
    if activation in ("silu", "swish"):
        return pointwise(F.silu, x)
    if activation == "sigmoid":
        return pointwise(torch.sigmoid, x)
    raise ValueError(f"activation: expected None, 'identity', 'silu', 'swish' or 'sigmoid', got {activation!r}")


def causal_conv1d_seq(x, weight, bias, window, activation):
    """Depthwise causal conv of one sequence: x [T, C], weight [C, W], bias [C] or None,
    window [C, W-1] (the last W-1 inputs before x, oldest first).

    y[t, c] = act(bias[c] + sum_j weight[c, j] * u[c, t + j]) with u = window then x along
    time. Returns (y [T, C], windows [T, C, W-1]) in fp32: windows[t] is the window after
    token t (copies of inputs, so exact in any dtype that holds them).
    """
    T, C = x.shape
    W = weight.shape[1]
    if T == 0:
        return x.new_empty((0, C), dtype=torch.float32), x.new_empty((0, C, W - 1), dtype=torch.float32)
    u = torch.cat([window.float(), x.float().transpose(0, 1)], dim=1)  # [C, W-1+T]
    taps = u.unfold(1, W, 1)  # [C, T, W]: taps[c, t] = u[c, t : t + W]
    y = (taps * weight.float()[:, None, :]).sum(-1)  # [C, T]
    if bias is not None:
        y = y + bias.float()[:, None]
    y = activate(y, activation).transpose(0, 1).contiguous()
    if W == 1:
        return y, u.new_zeros((T, C, 0))
    # window after token t = u[:, t + 1 : t + W]
    return y, u.unfold(1, W - 1, 1)[:, 1:, :].permute(1, 0, 2).contiguous()


def _decay_of(g):
    """exp(g) shaped to broadcast over a state [H, K, V]: [T, H, 1, 1] or [T, H, K, 1]."""
    decay = pointwise(torch.exp, g.float())
    return decay[..., None] if g.dim() == 3 else decay[..., None, None]


def delta_token(q, k, v, beta, decay, S):
    """One token of the gated delta rule on states ``S [..., H, K, V]`` (fp32; ``q`` already scaled, ``decay``
    exp(g) shaped to broadcast over S): ``-> (o [..., H, V], S after)``. Leading dims are requests or none."""
    S = S * decay
    predicted = torch.einsum("...hk,...hkv->...hv", k, S)
    correction = beta[..., None] * (v - predicted)
    S = S + k[..., :, None] * correction[..., None, :]
    return torch.einsum("...hk,...hkv->...hv", q, S), S


def gated_delta_recurrent_seq(q, k, v, g, beta, state, *, scale, per_position_states=True):
    """The gated delta rule, one token after another, on a state S [H, K, V]::

        S   <- exp(g_t) S                          (diag(exp(g_t)) S for KDA)
        S   <- S + k_t^T (beta_t (v_t - k_t S))
        o_t  = (scale q_t) S

    Returns (o [T, H, V], states) in fp32: states [T, H, K, V], the state after every
    token, or with per_position_states=False the final state [H, K, V]. Every token runs
    the same ops on the same shapes, so the state after token t is bitwise the same
    whether the sequence stops at t or goes on.
    """
    q32 = q.float() * scale
    k32, v32, beta32 = k.float(), v.float(), beta.float()
    decay = _decay_of(g)
    S = state.float()
    outputs, states = [], []
    for t in range(q.shape[0]):
        o, S = delta_token(q32[t], k32[t], v32[t], beta32[t], decay[t], S)
        outputs.append(o)
        if per_position_states:
            states.append(S)
    H, V = v.shape[1], v.shape[2]
    o = torch.stack(outputs) if outputs else q32.new_empty((0, H, V))
    if not per_position_states:
        return o, S.clone() if S is state else S
    return o, torch.stack(states) if states else S.new_empty((0, *S.shape))


def _decayed_scores(a, b, gamma):
    """M[h, i, j] = sum_c a[h, i, c] b[h, j, c] exp(gamma[h, i, c] - gamma[h, j, c]) for j <= i, else 0.

    gamma is the cumulative log-decay inside the chunk, [H, L, K] or [H, L, 1] for a
    scalar decay. Masking happens before the exponential, so only non-positive
    exponents are evaluated.
    """
    L = a.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=a.device).tril()
    diff = gamma[:, :, None, :] - gamma[:, None, :, :]  # [H, L, L, K or 1]
    decay = diff.masked_fill(~causal[None, :, :, None], float("-inf")).exp()
    if gamma.shape[-1] == 1:
        return (a @ b.transpose(1, 2)) * decay[..., 0]
    return torch.einsum("hic,hjc,hijc->hij", a, b, decay)


def gated_delta_chunked_seq(q, k, v, g, beta, state, *, scale, chunk_size=64):
    """The recurrence of gated_delta_recurrent_seq, chunk by chunk; returns (o [T, H, V],
    final state [H, K, V]) in fp32.

    Inside a chunk of L tokens from state S0, with gamma_i the cumulative log-decay up to
    token i, the delta-rule corrections u_i solve a unit lower triangular system (the WY /
    UT transform)::

        u_i + beta_i sum_{j<i} <k_i, k_j e^(gamma_i - gamma_j)> u_j = beta_i (v_i - (k_i e^gamma_i) S0)
        o_i  = scale (q_i e^gamma_i) S0 + scale sum_{j<=i} <q_i, k_j e^(gamma_i - gamma_j)> u_j
        S_L  = e^gamma_L S0 + sum_j (k_j e^(gamma_L - gamma_j))^T u_j

    Pairwise decays are exact exponentials of differences (never of +gamma) and the
    system is solved by torch, so this shares no numerical trick with the Triton kernel.
    Any T works; the last chunk may be shorter than chunk_size.
    """
    T = q.shape[0]
    # Work head-major: [H, T, ...].
    q32 = (q.float() * scale).transpose(0, 1)
    k32 = k.float().transpose(0, 1)
    v32 = v.float().transpose(0, 1)
    beta32 = beta.float().transpose(0, 1)[:, :, None]  # [H, T, 1]
    g32 = (g.float() if g.dim() == 3 else g.float()[:, :, None]).transpose(0, 1)  # [H, T, K or 1]

    S = state.float()
    outputs = []
    for start in range(0, T, chunk_size):
        stop = min(start + chunk_size, T)
        qc, kc, vc = q32[:, start:stop], k32[:, start:stop], v32[:, start:stop]
        bc = beta32[:, start:stop]
        gamma = g32[:, start:stop].cumsum(1)  # [H, L, K or 1], non-increasing
        eye = torch.eye(stop - start, dtype=S.dtype, device=S.device)

        # Unit lower triangular system (I + strictly-lower(beta_i <k_i, k_j decay>)).
        system = eye + (bc * _decayed_scores(kc, kc, gamma)).tril(-1)
        decay_from_start = gamma.exp()  # e^gamma_i
        u_v = torch.linalg.solve_triangular(system, bc * vc, upper=False, unitriangular=True)
        u_k = torch.linalg.solve_triangular(system, bc * (kc * decay_from_start), upper=False, unitriangular=True)
        u = u_v - u_k @ S  # [H, L, V]

        scores = _decayed_scores(qc, kc, gamma)  # [H, L, L], causal incl. the diagonal
        outputs.append((qc * decay_from_start) @ S + scores @ u)

        decay_to_end = (gamma[:, -1:] - gamma).exp()  # e^(gamma_L - gamma_j)
        S = S * decay_from_start[:, -1, :, None] + (kc * decay_to_end).transpose(1, 2) @ u

    if T == 0:
        return q32.new_empty((0, v.shape[1], v.shape[2])), state.float().clone()
    return torch.cat(outputs, dim=1).transpose(0, 1).contiguous(), S
