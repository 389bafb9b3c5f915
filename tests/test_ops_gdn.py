"""Gated DeltaNet functional math: the recurrence forms agree with each other and with
fla's naive reference, and ``gdn_layer`` reproduces transformers' Qwen3.5 and Qwen3-Next
GatedDeltaNet modules (prefill, chunked prefill and cached decode)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hf_recurrent import gdn_module, gdn_modules, run_hf

from fnattn.ops.conv import causal_conv1d
from fnattn.ops.delta_rule import gated_delta_chunked, gated_delta_recurrent
from fnattn.ops.gdn import GDNWeights, gdn_layer

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

    w = _random_weights(seed=0)
    x = torch.randn(6, w.hidden_size)
    window = torch.randn(w.conv_dim, w.conv_kernel - 1)
    st = torch.randn(w.num_v_heads, w.head_k_dim, w.head_v_dim)
    params = {name: t.clone() for name, t in vars(w).items() if isinstance(t, torch.Tensor)}
    inputs = [t.clone() for t in (x, window, st)]
    for chunked in (False, True):
        gdn_layer(w, x, window, st, chunked=chunked, chunk_size=4)
    for t, b in zip((x, window, st), inputs):
        torch.testing.assert_close(t, b, atol=0, rtol=0)
    for name, t in params.items():
        torch.testing.assert_close(getattr(w, name), t, atol=0, rtol=0)


def test_annotations_are_valid_jaxtyping():
    beartype = pytest.importorskip("beartype").beartype
    from jaxtyping import jaxtyped

    q, k, v, g, beta, state = _recurrence_inputs(5, 2, 16, 8, seed=1)
    jaxtyped(typechecker=beartype)(gated_delta_recurrent)(q, k, v, g, beta, state, scale=0.25)
    jaxtyped(typechecker=beartype)(gated_delta_chunked)(q, k, v, g, beta, state, scale=0.25, chunk_size=2)
    jaxtyped(typechecker=beartype)(causal_conv1d)(
        torch.randn(3, 6), torch.randn(6, 4), None, torch.zeros(6, 3), activation="silu"
    )
    w = _random_weights(seed=1)
    jaxtyped(typechecker=beartype)(gdn_layer)(
        w,
        torch.randn(3, w.hidden_size),
        torch.zeros(w.conv_dim, w.conv_kernel - 1),
        torch.zeros(w.num_v_heads, w.head_k_dim, w.head_v_dim),
    )


# --------------------------------------------------------------------------- layer


def _random_weights(*, seed, D=64, Hk=2, HV=4, K=16, V=32, W=4, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.1):
        return (s * torch.randn(*shape, generator=gen)).to(dtype)

    C = 2 * Hk * K + HV * V
    return GDNWeights(
        in_proj_qkv=r(C, D),
        in_proj_z=r(HV * V, D),
        in_proj_b=r(HV, D),
        in_proj_a=r(HV, D),
        conv_weight=r(C, W, s=0.5),
        conv_bias=r(C),
        A_log=torch.empty(HV).uniform_(0.1, 1.0, generator=gen).log().to(dtype),
        dt_bias=r(HV, s=1.0),
        norm_weight=(1 + r(V)),
        out_proj=r(D, HV * V),
        num_k_heads=Hk,
        num_v_heads=HV,
        head_k_dim=K,
        head_v_dim=V,
    )


def _zero_states(w: GDNWeights, dtype=torch.float32):
    return (
        torch.zeros(w.conv_dim, w.conv_kernel - 1, dtype=dtype),
        torch.zeros(w.num_v_heads, w.head_k_dim, w.head_v_dim),
    )


def _run_ours(w, chunks, *, chunked=True, chunk_size=64):
    window, state = _zero_states(w, chunks[0].dtype)
    outs = []
    for c in chunks:
        r = gdn_layer(w, c, window, state, chunked=chunked and c.shape[0] > 1, chunk_size=chunk_size)
        outs.append(r.output)
        window, state = r.conv_window, r.state
    return outs, window, state


def test_layer_recurrent_and_chunked_forms_agree_and_per_position_states():
    w = _random_weights(seed=4)
    x = torch.randn(11, w.hidden_size, generator=torch.Generator().manual_seed(4))
    window, state = _zero_states(w)
    rec = gdn_layer(w, x, window, state)
    chk = gdn_layer(w, x, window, state, chunked=True, chunk_size=4)
    torch.testing.assert_close(chk.output, rec.output, **TIGHT)
    torch.testing.assert_close(chk.state, rec.state, **TIGHT)
    torch.testing.assert_close(chk.conv_window, rec.conv_window, atol=0, rtol=0)
    assert chk.states is None and rec.states.shape == (11, 4, 16, 32)
    assert rec.conv_windows.shape == (11, w.conv_dim, 3)

    # Decode step i after a prefill equals position i of the multi-token call.
    P = 6
    pre = gdn_layer(w, x[:P], window, state, chunked=True)
    win, st = pre.conv_window, pre.state
    for i in range(P, 11):
        step = gdn_layer(w, x[i : i + 1], win, st)
        win, st = step.conv_window, step.state
        torch.testing.assert_close(step.output[0], rec.output[i], **TIGHT)
        torch.testing.assert_close(st, rec.states[i], **TIGHT)
        torch.testing.assert_close(win, rec.conv_windows[i], **TIGHT)


def test_layer_two_chunk_prefill_equals_one_shot():
    w = _random_weights(seed=5)
    x = torch.randn(23, w.hidden_size, generator=torch.Generator().manual_seed(5))
    (one,), win1, st1 = _run_ours(w, [x], chunk_size=8)
    two, win2, st2 = _run_ours(w, [x[:10], x[10:]], chunk_size=8)
    torch.testing.assert_close(torch.cat(two), one, **TIGHT)
    torch.testing.assert_close(st2, st1, **TIGHT)
    torch.testing.assert_close(win2, win1, **TIGHT)


def test_layer_bad_shapes():
    w = _random_weights(seed=6)
    window, state = _zero_states(w)
    with pytest.raises(ValueError, match=r"x: expected shape \[\*, 64\], got \[3, 63\]"):
        gdn_layer(w, torch.randn(3, 63), window, state)
    with pytest.raises(ValueError, match=r"conv_window: expected shape \[192, 3\]"):
        gdn_layer(w, torch.randn(3, 64), window[:, :2], state)
    with pytest.raises(ValueError, match=r"state: expected shape \[4, 16, 32\]"):
        gdn_layer(w, torch.randn(3, 64), window, state[:2])
    with pytest.raises(ValueError, match="in_proj_z"):
        GDNWeights(**{**vars(w), "in_proj_z": w.in_proj_z[:-1]})
    with pytest.raises(ValueError, match="num_v_heads"):
        GDNWeights(**{**vars(w), "num_k_heads": 3})


# --------------------------------------------------------------------------- transformers parity

@pytest.fixture(scope="module")
def hf():
    """transformers' modules for both families, forced onto their pure-torch code path."""
    with gdn_modules() as families:
        yield families


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize(
    "split", [(9, 1, 1, 1, 1), (2, 7, 1, 1), (5, 6, 1)], ids=["prefill+decode", "short-prefill", "2-chunk"]
)
def test_layer_matches_transformers(hf, family, split):
    m, config = gdn_module(hf, family, seed=7)
    w = GDNWeights.from_state_dict(
        m.state_dict(), num_k_heads=config.linear_num_key_heads, eps=config.rms_norm_eps, activation=config.hidden_act
    )
    x = torch.randn(sum(split), config.hidden_size, generator=torch.Generator().manual_seed(8))
    chunks = list(x.split(list(split)))
    hf_outs, hf_window, hf_state = run_hf(m, config, chunks)
    outs, window, state = _run_ours(w, chunks)
    for ours, ref in zip(outs, hf_outs):
        torch.testing.assert_close(ours, ref, **TIGHT)
    torch.testing.assert_close(state, hf_state, **TIGHT)
    torch.testing.assert_close(window, hf_window, **TIGHT)
    # The token-by-token form reproduces it too.
    rec_outs, _, rec_state = _run_ours(w, chunks, chunked=False)
    torch.testing.assert_close(torch.cat(rec_outs), torch.cat(hf_outs), **TIGHT)
    torch.testing.assert_close(rec_state, hf_state, **TIGHT)


def test_from_state_dict_prefix_and_qwen3_next_reorder(hf):
    m35, config = gdn_module(hf, "qwen3_5", seed=9)
    mnext, _ = gdn_module(hf, "qwen3_next", seed=9)
    sd = {"model.layers.3.linear_attn." + k: t for k, t in m35.state_dict().items()}
    w = GDNWeights.from_state_dict(sd, num_k_heads=2, eps=1e-6, prefix="model.layers.3.linear_attn.")
    assert (w.num_k_heads, w.num_v_heads, w.head_k_dim, w.head_v_dim, w.conv_kernel) == (2, 4, 16, 32, 4)

    # Build a Qwen3-Next state_dict holding the Qwen3.5 weights in its interleaved layout.
    r, K, V = 2, 16, 32
    q, k, v = w.in_proj_qkv.split([2 * K, 2 * K, 4 * V])
    qkvz = torch.cat(
        [
            torch.cat(
                [
                    q[h * K : (h + 1) * K],
                    k[h * K : (h + 1) * K],
                    v[h * r * V : (h + 1) * r * V],
                    w.in_proj_z[h * r * V : (h + 1) * r * V],
                ]
            )
            for h in range(2)
        ]
    )
    ba = torch.cat([torch.cat([w.in_proj_b[h * r : (h + 1) * r], w.in_proj_a[h * r : (h + 1) * r]]) for h in range(2)])
    sd_next = {k_: t for k_, t in m35.state_dict().items() if not k_.startswith("in_proj")}
    sd_next.update({"in_proj_qkvz.weight": qkvz, "in_proj_ba.weight": ba})
    assert set(sd_next) == set(mnext.state_dict())
    w_next = GDNWeights.from_state_dict(sd_next, num_k_heads=2, eps=1e-6)
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
        torch.testing.assert_close(getattr(w_next, name), getattr(w, name), atol=0, rtol=0)

    with pytest.raises(ValueError, match="missing key"):
        GDNWeights.from_state_dict({}, num_k_heads=2, eps=1e-6)
    with pytest.raises(ValueError, match="num_k_heads"):
        GDNWeights.from_state_dict(m35.state_dict(), num_k_heads=5, eps=1e-6)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_layer_matches_transformers_bf16(hf, family):
    m, config = gdn_module(hf, family, seed=10, dtype=torch.bfloat16)
    w = GDNWeights.from_state_dict(m.state_dict(), num_k_heads=2, eps=config.rms_norm_eps)
    x = torch.randn(12, config.hidden_size, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    chunks = list(x.split([9, 1, 1, 1]))
    hf_outs, hf_window, hf_state = run_hf(m, config, chunks)
    outs, window, state = _run_ours(w, chunks)
    for ours, ref in zip(outs, hf_outs):
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours, ref, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(state, hf_state.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(window, hf_window, atol=3e-2, rtol=3e-2)


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
