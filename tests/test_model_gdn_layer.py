"""The Gated DeltaNet layer from checkpoint weights: ``gdn_layer``'s forms agree, chunked
prefill equals one shot, and it reproduces transformers' Qwen3.5 and Qwen3-Next
GatedDeltaNet modules (prefill, chunked prefill and cached decode)."""

from __future__ import annotations

import pytest
import torch
from fnattn.models.gdn_layer import GDNWeights, gdn_layer
from hf_recurrent import gdn_module, gdn_modules, run_hf

TIGHT = dict(atol=1e-5, rtol=1e-5)

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


# --------------------------------------------------------------------------- layer


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


def test_layer_inputs_are_not_mutated():
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


def test_layer_annotations_are_valid_jaxtyping():
    beartype = pytest.importorskip("beartype").beartype
    from jaxtyping import jaxtyped

    w = _random_weights(seed=1)
    jaxtyped(typechecker=beartype)(gdn_layer)(
        w,
        torch.randn(3, w.hidden_size),
        torch.zeros(w.conv_dim, w.conv_kernel - 1),
        torch.zeros(w.num_v_heads, w.head_k_dim, w.head_v_dim),
    )


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
