"""Kimi Delta Attention kind math: the per-channel recurrence forms agree with each other
and with fla's naive reference; the q/k/v split and Kimi's form of the l2 norm.

``kda_layer`` (the Kimi Linear layer from checkpoint weights) and its parity with
transformers' ``KimiLinearDeltaAttention`` are tested in ``tests/test_model_kda_layer.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fnattn.kinds.delta_rule.math import gated_delta_chunked, gated_delta_recurrent
from fnattn.kinds.delta_rule.qkv import kda_qkv

TIGHT = dict(atol=1e-5, rtol=1e-5)


def _recurrence_inputs(T, H, K, V, *, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, K, generator=gen)
    k = F.normalize(torch.randn(T, H, K, generator=gen), dim=-1)
    v = torch.randn(T, H, V, generator=gen)
    g = -0.7 * torch.rand(T, H, K, generator=gen) - 0.01  # per-channel log-decay
    beta = torch.rand(T, H, generator=gen)
    state = 0.5 * torch.randn(H, K, V, generator=gen)
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    return q, k, v, g, beta, state


# --------------------------------------------------------------------------- recurrence


@pytest.mark.parametrize("T", [1, 7, 64, 100])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_recurrent_matches_chunked_per_channel(T, chunk_size):
    q, k, v, g, beta, state = _recurrence_inputs(T, 2, 16, 24, seed=T)
    o_rec, states = gated_delta_recurrent(q, k, v, g, beta, state, scale=16**-0.5)
    o_chk, final = gated_delta_chunked(q, k, v, g, beta, state, scale=16**-0.5, chunk_size=chunk_size)
    assert o_rec.shape == (T, 2, 24) and states.shape == (T, 2, 16, 24)
    torch.testing.assert_close(o_chk, o_rec, **TIGHT)
    torch.testing.assert_close(final, states[-1], **TIGHT)


def test_scalar_decay_equals_constant_per_channel_decay():
    q, k, v, g, beta, state = _recurrence_inputs(13, 2, 16, 16, seed=3)
    g_scalar = g[..., 0]
    g_channels = g_scalar[..., None].expand(13, 2, 16)
    for fn, kw in ((gated_delta_recurrent, {}), (gated_delta_chunked, {"chunk_size": 4})):
        a = fn(q, k, v, g_scalar, beta, state, scale=0.3, **kw)
        b = fn(q, k, v, g_channels, beta, state, scale=0.3, **kw)
        torch.testing.assert_close(a[0], b[0], **TIGHT)
        torch.testing.assert_close(a[1], b[1], **TIGHT)


def test_recurrence_matches_fla_naive_kda():
    pytest.importorskip("fla")
    from fla.ops.kda.naive import naive_recurrent_kda

    T, H, K, V = 29, 2, 16, 32
    q, k, v, g, beta, state = _recurrence_inputs(T, H, K, V, seed=6)
    # fla takes [B, T, H, *].
    o_ref, s_ref = naive_recurrent_kda(
        q[None], k[None], v[None], g[None], beta[None], scale=0.2, initial_state=state[None], output_final_state=True
    )
    o, states = gated_delta_recurrent(q, k, v, g, beta, state, scale=0.2)
    torch.testing.assert_close(o, o_ref[0], **TIGHT)
    torch.testing.assert_close(states[-1], s_ref[0], **TIGHT)
    o_chk, final = gated_delta_chunked(q, k, v, g, beta, state, scale=0.2, chunk_size=8)
    torch.testing.assert_close(o_chk, o_ref[0], **TIGHT)
    torch.testing.assert_close(final, s_ref[0], **TIGHT)


def test_strong_decay_stays_finite():
    # Large per-channel decays underflow to zero instead of overflowing.
    q, k, v, g, beta, state = _recurrence_inputs(70, 2, 16, 16, seed=4)
    g = g * 60.0
    o_rec, states = gated_delta_recurrent(q, k, v, g, beta, state, scale=0.25)
    o_chk, final = gated_delta_chunked(q, k, v, g, beta, state, scale=0.25, chunk_size=64)
    assert torch.isfinite(o_chk).all() and torch.isfinite(final).all()
    torch.testing.assert_close(o_chk, o_rec, **TIGHT)
    torch.testing.assert_close(final, states[-1], **TIGHT)


def test_states_per_position_match_decode_steps():
    T, P = 10, 4
    q, k, v, g, beta, state = _recurrence_inputs(T, 2, 16, 8, seed=12)
    o_all, states = gated_delta_recurrent(q, k, v, g, beta, state, scale=0.25)
    _, s = gated_delta_chunked(q[:P], k[:P], v[:P], g[:P], beta[:P], state, scale=0.25)
    for i in range(P, T):
        o_i, s_i = gated_delta_recurrent(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], s, scale=0.25
        )
        s = s_i[0]
        torch.testing.assert_close(o_i[0], o_all[i], **TIGHT)
        torch.testing.assert_close(s, states[i], **TIGHT)


# --------------------------------------------------------------------------- q/k/v split


def test_kda_qkv_splits_and_normalizes_with_sqrt():
    T, H, K, V = 3, 2, 16, 8
    mixed = torch.randn(T, 2 * H * K + H * V, generator=torch.Generator().manual_seed(0))
    q, k, v = kda_qkv(mixed, num_heads=H, head_k_dim=K, head_v_dim=V)
    raw_q, raw_k, raw_v = (t.reshape(T, H, -1) for t in mixed.split([H * K, H * K, H * V], dim=-1))
    torch.testing.assert_close(q, raw_q / torch.sqrt((raw_q**2).sum(-1, keepdim=True) + 1e-6), atol=0, rtol=0)
    torch.testing.assert_close(k, raw_k / torch.sqrt((raw_k**2).sum(-1, keepdim=True) + 1e-6), atol=0, rtol=0)
    torch.testing.assert_close(v, raw_v, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"mixed: expected shape \[\*, 80\], got \[3, 79\]"):
        kda_qkv(mixed[:, :-1], num_heads=H, head_k_dim=K, head_v_dim=V)
