"""The Kimi Delta Attention layer from checkpoint weights: ``kda_layer``'s forms agree,
chunked prefill equals one shot, and it reproduces transformers'
``KimiLinearDeltaAttention`` (prefill, chunked prefill and cached decode)."""

from __future__ import annotations

import pytest
import torch
from fnattn.models.kda_layer import KDAWeights, kda_layer
from hf_recurrent import kda_module, kda_modules, run_hf

TIGHT = dict(atol=1e-5, rtol=1e-5)

def _random_weights(*, seed, D=64, H=2, K=16, V=16, W=4, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.1):
        return (s * torch.randn(*shape, generator=gen)).to(dtype)

    return KDAWeights(
        q_proj=r(H * K, D),
        k_proj=r(H * K, D),
        v_proj=r(H * V, D),
        q_conv_weight=r(H * K, W, s=0.5),
        k_conv_weight=r(H * K, W, s=0.5),
        v_conv_weight=r(H * V, W, s=0.5),
        f_a_proj=r(K, D),
        f_b_proj=r(H * K, K),
        A_log=torch.empty(H).uniform_(0.1, 1.0, generator=gen).log().to(dtype),
        dt_bias=r(H * K, s=1.0),
        b_proj=r(H, D),
        g_a_proj=r(V, D),
        g_b_proj=r(H * V, V),
        o_norm_weight=1 + r(V),
        o_proj=r(D, H * V),
        num_heads=H,
        head_k_dim=K,
        head_v_dim=V,
    )


def _zero_states(w: KDAWeights, dtype=torch.float32):
    return (
        torch.zeros(w.conv_dim, w.conv_kernel - 1, dtype=dtype),
        torch.zeros(w.num_heads, w.head_k_dim, w.head_v_dim),
    )


def _run_ours(w, chunks, *, chunked=True, chunk_size=64):
    window, state = _zero_states(w, chunks[0].dtype)
    outs = []
    for c in chunks:
        r = kda_layer(w, c, window, state, chunked=chunked and c.shape[0] > 1, chunk_size=chunk_size)
        outs.append(r.output)
        window, state = r.conv_window, r.state
    return outs, window, state


# --------------------------------------------------------------------------- layer


@pytest.mark.parametrize("V", [16, 32], ids=["K=V", "K!=V"])
def test_layer_forms_agree_and_per_position_states(V):
    w = _random_weights(seed=4, V=V)
    x = torch.randn(11, w.hidden_size, generator=torch.Generator().manual_seed(4))
    window, state = _zero_states(w)
    rec = kda_layer(w, x, window, state)
    chk = kda_layer(w, x, window, state, chunked=True, chunk_size=4)
    torch.testing.assert_close(chk.output, rec.output, **TIGHT)
    torch.testing.assert_close(chk.state, rec.state, **TIGHT)
    assert chk.states is None and rec.states.shape == (11, 2, 16, V)
    assert rec.conv_windows.shape == (11, 2 * 2 * 16 + 2 * V, 3)

    P = 5
    pre = kda_layer(w, x[:P], window, state, chunked=True)
    win, st = pre.conv_window, pre.state
    for i in range(P, 11):
        step = kda_layer(w, x[i : i + 1], win, st)
        win, st = step.conv_window, step.state
        torch.testing.assert_close(step.output[0], rec.output[i], **TIGHT)
        torch.testing.assert_close(st, rec.states[i], **TIGHT)
        torch.testing.assert_close(win, rec.conv_windows[i], **TIGHT)


def test_layer_two_chunk_prefill_equals_one_shot():
    w = _random_weights(seed=5)
    x = torch.randn(21, w.hidden_size, generator=torch.Generator().manual_seed(5))
    (one,), win1, st1 = _run_ours(w, [x], chunk_size=8)
    two, win2, st2 = _run_ours(w, [x[:9], x[9:]], chunk_size=8)
    torch.testing.assert_close(torch.cat(two), one, **TIGHT)
    torch.testing.assert_close(st2, st1, **TIGHT)
    torch.testing.assert_close(win2, win1, **TIGHT)


def test_inputs_are_not_mutated():
    w = _random_weights(seed=2)
    x = torch.randn(6, w.hidden_size)
    window = torch.randn(w.conv_dim, w.conv_kernel - 1)
    st = torch.randn(w.num_heads, w.head_k_dim, w.head_v_dim)
    params = {name: t.clone() for name, t in vars(w).items() if isinstance(t, torch.Tensor)}
    inputs = [t.clone() for t in (x, window, st)]
    for chunked in (False, True):
        kda_layer(w, x, window, st, chunked=chunked, chunk_size=4)
    for t, b in zip((x, window, st), inputs):
        torch.testing.assert_close(t, b, atol=0, rtol=0)
    for name, t in params.items():
        torch.testing.assert_close(getattr(w, name), t, atol=0, rtol=0)


def test_layer_bad_shapes():
    w = _random_weights(seed=6)
    window, state = _zero_states(w)
    with pytest.raises(ValueError, match=r"x: expected shape \[\*, 64\], got \[3, 65\]"):
        kda_layer(w, torch.randn(3, 65), window, state)
    with pytest.raises(ValueError, match=r"conv_window: expected shape \[96, 3\], got \[95, 3\]"):
        kda_layer(w, torch.randn(3, 64), window[:-1], state)
    with pytest.raises(ValueError, match=r"state: expected shape \[2, 16, 16\]"):
        kda_layer(w, torch.randn(3, 64), window, state[:, :8])
    with pytest.raises(ValueError, match="dt_bias"):
        KDAWeights(**{**vars(w), "dt_bias": w.dt_bias[:-1]})


def test_annotations_are_valid_jaxtyping():
    beartype = pytest.importorskip("beartype").beartype
    from jaxtyping import jaxtyped

    w = _random_weights(seed=1, V=32)
    window, state = _zero_states(w)
    jaxtyped(typechecker=beartype)(kda_layer)(w, torch.randn(3, w.hidden_size), window, state, chunked=True)


# --------------------------------------------------------------------------- transformers parity


@pytest.fixture(scope="module")
def hf():
    """transformers' Kimi Linear module, forced onto its pure-torch code path."""
    with kda_modules() as kda:
        yield kda


@pytest.mark.parametrize(
    "split", [(9, 1, 1, 1, 1), (2, 7, 1, 1), (5, 6, 1)], ids=["prefill+decode", "short-prefill", "2-chunk"]
)
def test_layer_matches_transformers(hf, split):
    m, config = kda_module(hf, seed=7)
    w = KDAWeights.from_state_dict(m.state_dict(), eps=config.rms_norm_eps, activation=config.hidden_act)
    assert (w.num_heads, w.head_k_dim, w.head_v_dim, w.conv_kernel) == (2, 32, 32, 4)
    x = torch.randn(sum(split), config.hidden_size, generator=torch.Generator().manual_seed(8))
    chunks = list(x.split(list(split)))
    hf_outs, hf_window, hf_state = run_hf(m, config, chunks)
    outs, window, state = _run_ours(w, chunks)
    for ours, ref in zip(outs, hf_outs):
        torch.testing.assert_close(ours, ref, **TIGHT)
    torch.testing.assert_close(state, hf_state, **TIGHT)
    torch.testing.assert_close(window, hf_window, **TIGHT)
    rec_outs, _, rec_state = _run_ours(w, chunks, chunked=False)
    torch.testing.assert_close(torch.cat(rec_outs), torch.cat(hf_outs), **TIGHT)
    torch.testing.assert_close(rec_state, hf_state, **TIGHT)


def test_from_state_dict_original_checkpoint_names(hf):
    m, config = kda_module(hf, seed=3)
    sd = m.state_dict()
    w = KDAWeights.from_state_dict(sd, eps=config.rms_norm_eps)
    # The released checkpoint keeps separate q/k/v convs and the gate weights on the attention module.
    q_conv, k_conv, v_conv = sd["conv1d.weight"].split(64)
    original = {k_.replace("forget_gate.", ""): t for k_, t in sd.items() if k_ != "conv1d.weight"} | {
        "q_conv1d.weight": q_conv,
        "k_conv1d.weight": k_conv,
        "v_conv1d.weight": v_conv,
    }
    prefix = "model.layers.0.self_attn."
    w2 = KDAWeights.from_state_dict(
        {prefix + k_: t for k_, t in original.items()}, eps=config.rms_norm_eps, prefix=prefix
    )
    for name, t in vars(w).items():
        if isinstance(t, torch.Tensor):
            torch.testing.assert_close(getattr(w2, name), t, atol=0, rtol=0)
    with pytest.raises(ValueError, match="missing key 'b_proj.weight'"):
        KDAWeights.from_state_dict({k_: t for k_, t in sd.items() if k_ != "b_proj.weight"}, eps=1e-5)


def test_layer_matches_transformers_bf16(hf):
    m, config = kda_module(hf, seed=10, dtype=torch.bfloat16)
    w = KDAWeights.from_state_dict(m.state_dict(), eps=config.rms_norm_eps)
    x = torch.randn(12, config.hidden_size, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    chunks = list(x.split([9, 1, 1, 1]))
    hf_outs, hf_window, hf_state = run_hf(m, config, chunks)
    outs, window, state = _run_ours(w, chunks)
    for ours, ref in zip(outs, hf_outs):
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours, ref, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(state, hf_state, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(window, hf_window, atol=3e-2, rtol=3e-2)
