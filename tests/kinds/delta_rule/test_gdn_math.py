"""Gated DeltaNet kind math: the recurrence forms agree with each other, with fla's naive
reference and with an elementwise loop; the causal conv; the q/k/v split and its l2 norm.

``gdn_layer`` (the Qwen3.5 / Qwen3-Next layer from checkpoint weights) and its parity
with transformers are tested in ``tests/test_model_gdn_layer.py``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fnattn.kinds.delta_rule.conv import causal_conv1d
from fnattn.kinds.delta_rule.math import gated_delta_chunked, gated_delta_recurrent
from fnattn.kinds.delta_rule.qkv import gdn_qkv, l2norm

TIGHT = dict(atol=1e-5, rtol=1e-5)


def _recurrence_inputs(T, H, K, V, *, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, K, generator=gen)
    k = F.normalize(torch.randn(T, H, K, generator=gen), dim=-1)
    v = torch.randn(T, H, V, generator=gen)
    g = -0.7 * torch.rand(T, H, generator=gen) - 0.01
    beta = torch.rand(T, H, generator=gen)
    state = 0.5 * torch.randn(H, K, V, generator=gen)
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    return q, k, v, g, beta, state


# --------------------------------------------------------------------------- recurrence


@pytest.mark.parametrize("T", [1, 7, 64, 100])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_recurrent_matches_chunked(T, chunk_size):
    q, k, v, g, beta, state = _recurrence_inputs(T, 3, 16, 32, seed=T)
    o_rec, states = gated_delta_recurrent(q, k, v, g, beta, state, scale=16**-0.5)
    o_chk, final = gated_delta_chunked(q, k, v, g, beta, state, scale=16**-0.5, chunk_size=chunk_size)
    assert o_rec.shape == (T, 3, 32) and states.shape == (T, 3, 16, 32) and final.shape == (3, 16, 32)
    torch.testing.assert_close(o_chk, o_rec, **TIGHT)
    torch.testing.assert_close(final, states[-1], **TIGHT)


def test_recurrence_matches_fla_naive():
    pytest.importorskip("fla")
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    T, H, K, V = 37, 2, 16, 24
    q, k, v, g, beta, state = _recurrence_inputs(T, H, K, V, seed=5)
    # fla takes [B, T, H, *] with beta before g.
    o_ref, s_ref = naive_recurrent_gated_delta_rule(
        q[None], k[None], v[None], beta[None], g[None], scale=0.3, initial_state=state[None], output_final_state=True
    )
    o, states = gated_delta_recurrent(q, k, v, g, beta, state, scale=0.3)
    torch.testing.assert_close(o, o_ref[0], **TIGHT)
    torch.testing.assert_close(states[-1], s_ref[0], **TIGHT)
    o_chk, final = gated_delta_chunked(q, k, v, g, beta, state, scale=0.3, chunk_size=16)
    torch.testing.assert_close(o_chk, o_ref[0], **TIGHT)
    torch.testing.assert_close(final, s_ref[0], **TIGHT)


def test_states_per_position_match_decode_steps():
    T, P = 12, 5
    q, k, v, g, beta, state = _recurrence_inputs(T, 2, 16, 16, seed=11)
    o_all, states = gated_delta_recurrent(q, k, v, g, beta, state, scale=0.25)
    o_pre, s = gated_delta_chunked(q[:P], k[:P], v[:P], g[:P], beta[:P], state, scale=0.25, chunk_size=4)
    torch.testing.assert_close(o_pre, o_all[:P], **TIGHT)
    torch.testing.assert_close(s, states[P - 1], **TIGHT)
    for i in range(P, T):
        o_i, s_i = gated_delta_recurrent(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], s, scale=0.25
        )
        s = s_i[0]
        torch.testing.assert_close(o_i[0], o_all[i], **TIGHT)
        torch.testing.assert_close(s, states[i], **TIGHT)


def test_recurrence_dtypes_and_empty():
    q, k, v, g, beta, state = _recurrence_inputs(9, 2, 16, 16, seed=2, dtype=torch.bfloat16)
    o, states = gated_delta_recurrent(q, k, v, g, beta, state, scale=0.25)
    assert o.dtype == torch.bfloat16 and states.dtype == torch.float32
    o_c, final = gated_delta_chunked(q, k, v, g, beta, state, scale=0.25, chunk_size=4)
    assert o_c.dtype == torch.bfloat16 and final.dtype == torch.float32
    torch.testing.assert_close(final, states[-1], **TIGHT)

    e = [x[:0] for x in (q, k, v, g, beta)]
    o, states = gated_delta_recurrent(*e, state, scale=0.25)
    assert o.shape == (0, 2, 16) and states.shape == (0, 2, 16, 16)
    o, final = gated_delta_chunked(*e, state, scale=0.25)
    assert o.shape == (0, 2, 16)
    torch.testing.assert_close(final, state, atol=0, rtol=0)


# --------------------------------------------------------------------------- conv


def test_causal_conv1d_matches_torch_conv_and_windows():
    gen = torch.Generator().manual_seed(0)
    T, C, W = 10, 6, 4
    x = torch.randn(T, C, generator=gen)
    weight = torch.randn(C, W, generator=gen)
    bias = torch.randn(C, generator=gen)
    window = torch.randn(C, W - 1, generator=gen)
    y, after = causal_conv1d(x, weight, bias, window, activation="silu")
    full = torch.cat([window, x.T], dim=1)[None]  # [1, C, W - 1 + T]
    ref = F.silu(F.conv1d(full, weight[:, None, :], bias, groups=C))[0].T
    torch.testing.assert_close(y, ref, **TIGHT)
    assert after.shape == (T, C, W - 1)
    for t in range(T):
        torch.testing.assert_close(after[t], full[0, :, t + 1 : t + W], atol=0, rtol=0)

    # Token by token from the same window gives the same outputs and windows.
    w_ = window
    for t in range(T):
        y_t, a_t = causal_conv1d(x[t : t + 1], weight, bias, w_, activation="silu")
        torch.testing.assert_close(y_t[0], y[t], **TIGHT)
        torch.testing.assert_close(a_t[0], after[t], atol=0, rtol=0)
        w_ = a_t[0]

    # Zero window == zero left padding; no activation.
    y0, _ = causal_conv1d(x, weight, None, torch.zeros(C, W - 1), activation=None)
    ref0 = F.conv1d(x.T[None], weight[:, None, :], None, padding=W - 1, groups=C)[0, :, :T].T
    torch.testing.assert_close(y0, ref0, **TIGHT)


# --------------------------------------------------------------------------- q/k/v split


def test_gdn_qkv_splits_normalizes_and_repeats_key_heads():
    T, Hk, H, K, V = 3, 2, 4, 16, 8
    mixed = torch.randn(T, 2 * Hk * K + H * V, generator=torch.Generator().manual_seed(0))
    q, k, v = gdn_qkv(mixed, num_k_heads=Hk, num_v_heads=H, head_k_dim=K, head_v_dim=V)
    raw_q, raw_k, raw_v = mixed.split([Hk * K, Hk * K, H * V], dim=-1)
    want_q = raw_q.reshape(T, Hk, K) * torch.rsqrt((raw_q.reshape(T, Hk, K) ** 2).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(q, want_q.repeat_interleave(H // Hk, dim=1), atol=0, rtol=0)
    torch.testing.assert_close(k[:, 1::2], k[:, 0::2], atol=0, rtol=0)  # value heads 2j, 2j+1 share key head j
    torch.testing.assert_close(k.norm(dim=-1), torch.ones(T, H), **TIGHT)
    torch.testing.assert_close(v, raw_v.reshape(T, H, V), atol=0, rtol=0)


def test_l2norm_forms():
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    xf = x.float()
    sum_sq = (xf * xf).sum(-1, keepdim=True)
    rsqrt, sqrt = l2norm(x, form="rsqrt"), l2norm(x, form="sqrt", eps=1e-5)
    assert rsqrt.dtype == sqrt.dtype == torch.float32
    torch.testing.assert_close(rsqrt, xf * torch.rsqrt(sum_sq + 1e-6), atol=0, rtol=0)
    torch.testing.assert_close(sqrt, xf / torch.sqrt(sum_sq + 1e-5), atol=0, rtol=0)
    torch.testing.assert_close(rsqrt, sqrt, **TIGHT)
    with pytest.raises(ValueError, match="form"):
        l2norm(x, form="norm")


# --------------------------------------------------------------------------- errors, purity


def test_bad_shapes_raise_value_error_naming_the_argument():
    q, k, v, g, beta, state = _recurrence_inputs(4, 2, 16, 8, seed=0)
    with pytest.raises(ValueError, match=r"k: expected shape \[4, 2, 16\], got \[4, 2, 15\]"):
        gated_delta_recurrent(q, k[..., :15], v, g, beta, state, scale=0.25)
    with pytest.raises(ValueError, match=r"state: expected shape \[2, 16, 8\], got \[2, 8, 16\]"):
        gated_delta_chunked(q, k, v, g, beta, state.transpose(1, 2), scale=0.25)
    with pytest.raises(ValueError, match=r"g: expected shape \[4, 2\], got \[4, 3\]"):
        gated_delta_recurrent(q, k, v, g[:, [0, 1, 0]], beta, state, scale=0.25)
    with pytest.raises(ValueError, match=r"g: expected shape \[4, 2, 16\]"):
        gated_delta_recurrent(q, k, v, g[..., None].expand(4, 2, 8), beta, state, scale=0.25)
    with pytest.raises(ValueError, match="chunk_size"):
        gated_delta_chunked(q, k, v, g, beta, state, scale=0.25, chunk_size=0)
    with pytest.raises(ValueError, match=r"window: expected shape \[6, 3\], got \[6, 4\]"):
        causal_conv1d(torch.randn(3, 6), torch.randn(6, 4), None, torch.zeros(6, 4), activation=None)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(torch.randn(3, 6), torch.randn(6, 4), None, torch.zeros(6, 3), activation="gelu")


def test_inputs_are_not_mutated():
    q, k, v, g, beta, state = _recurrence_inputs(20, 2, 16, 8, seed=3)
    args = (q, k, v, g, beta, state)
    before = [a.clone() for a in args]
    gated_delta_recurrent(*args, scale=0.25)
    gated_delta_chunked(*args, scale=0.25, chunk_size=8)
    for a, b in zip(args, before):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_annotations_are_valid_jaxtyping():
    beartype = pytest.importorskip("beartype").beartype
    from jaxtyping import jaxtyped

    q, k, v, g, beta, state = _recurrence_inputs(5, 2, 16, 8, seed=1)
    jaxtyped(typechecker=beartype)(gated_delta_recurrent)(q, k, v, g, beta, state, scale=0.25)
    jaxtyped(typechecker=beartype)(gated_delta_chunked)(q, k, v, g, beta, state, scale=0.25, chunk_size=2)
    jaxtyped(typechecker=beartype)(causal_conv1d)(
        torch.randn(3, 6), torch.randn(6, 4), None, torch.zeros(6, 3), activation="silu"
    )


@pytest.mark.parametrize("per_channel", [False, True])
def test_chunked_form_equals_an_elementwise_recurrence(per_channel):
    """A scalar loop, written here independently: S = S*a; S += k (beta (v - k S)); o = scale q S."""
    T, H, K, V = 11, 2, 3, 2
    g_ = torch.Generator().manual_seed(5)
    q, k = torch.randn(T, H, K, generator=g_), torch.randn(T, H, K, generator=g_)
    v, beta = torch.randn(T, H, V, generator=g_), torch.rand(T, H, generator=g_)
    g = -torch.rand(T, H, K, generator=g_) if per_channel else -torch.rand(T, H, generator=g_)
    S0 = torch.randn(H, K, V, generator=g_)
    S = [[[float(S0[h, i, j]) for j in range(V)] for i in range(K)] for h in range(H)]
    want = torch.zeros(T, H, V, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            for i in range(K):
                a = math.exp(float(g[t, h, i] if per_channel else g[t, h]))
                for j in range(V):
                    S[h][i][j] *= a
            for j in range(V):
                pred = sum(float(k[t, h, i]) * S[h][i][j] for i in range(K))
                err = float(beta[t, h]) * (float(v[t, h, j]) - pred)
                for i in range(K):
                    S[h][i][j] += float(k[t, h, i]) * err
            for j in range(V):
                want[t, h, j] = 0.5 * sum(float(q[t, h, i]) * S[h][i][j] for i in range(K))
    o, final = gated_delta_chunked(q, k, v, g, beta, S0, scale=0.5, chunk_size=4)
    torch.testing.assert_close(o.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final.double(), torch.tensor(S, dtype=torch.float64), atol=1e-5, rtol=1e-5)
