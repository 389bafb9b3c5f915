"""Full / GQA attention through sessions and State: the reference backend against a naive loop
(cached prefix + new tokens, sliding window, softcap, sinks), decode and verify against prefill,
purity and NaN-filled storage; then the tiny full-attention model end to end (incremental decode
against recomputation, chunked prefill and batching)."""

import math

import pytest
import torch
from helpers import full_inputs, full_spec, nan_state, phase_batch, run, same_bits

import fnattn as fa
from fnattn.driver import generate, prefill, run_step
from fnattn.models import tiny


def naive(q, k, v, *, scale, window=0, softcap=0.0, sinks=None):
    """Loop-by-loop attention of every query over all keys up to its own position."""
    T, Hq, _ = q.shape
    group = Hq // k.shape[1]
    out = torch.zeros(T, Hq, v.shape[-1], dtype=torch.float64)
    for h in range(Hq):
        for i in range(T):
            scores = []
            for j in range(i + 1):
                if window and i - j >= window:
                    continue
                s = float(q[i, h].double() @ k[j, h // group].double()) * scale
                if softcap:
                    s = softcap * math.tanh(s / softcap)
                scores.append((s, j))
            m = max(s for s, _ in scores)
            denom = sum(math.exp(s - m) for s, _ in scores)
            if sinks is not None:
                denom += math.exp(float(sinks[h]) - m)
            for s, j in scores:
                out[i, h] += math.exp(s - m) / denom * v[j, h // group].double()
    return out


def prefill_then(spec, total, cached, *, sinks=None, page_size=4, phase="prefill"):
    """Cache ``cached`` tokens through one step, then run the rest as ``phase``."""
    g = torch.Generator().manual_seed(1)
    inp = full_inputs(spec, total, gen=g, sinks=sinks)
    st = nan_state([spec], page_size=page_size).admit(0)
    ma = fa.ModelAttention([spec])
    if cached:
        st = st.reserve({0: cached})
        b = fa.Batch.prefill(st, {0: cached})
        part = fa.FullAttentionInputs(q=inp.q[:cached], k=inp.k[:cached], v=inp.v[:cached], sinks=sinks)
        _, d = run(ma, st, b, {0: part})
        st = st.apply(d)
    n = total - cached
    st = st.reserve({0: n})
    b = phase_batch(st, phase, {0: n})
    rest = fa.FullAttentionInputs(q=inp.q[cached:], k=inp.k[cached:], v=inp.v[cached:], sinks=sinks)
    outs, _ = run(ma, st, b, {0: rest})
    return inp, outs[0]


@pytest.mark.parametrize("cached", [0, 1, 5, 8])
@pytest.mark.parametrize("opts", [{}, {"sliding_window": 3}, {"softcap": 2.0}, {"sinks": True},
                                  {"sliding_window": 4, "softcap": 5.0, "sinks": True}])
def test_prefix_plus_new_equals_full_attention(cached, opts):
    spec = full_spec(0, hq=4, hkv=1, d=8, dv=6, **opts)
    sinks = torch.randn(4) if opts.get("sinks") else None
    inp, out = prefill_then(spec, 11, cached, sinks=sinks)
    want = naive(inp.q, inp.k, inp.v, scale=spec.config.scale, window=opts.get("sliding_window", 0),
                 softcap=opts.get("softcap", 0.0), sinks=sinks)[cached:]
    torch.testing.assert_close(out.o.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out.lse).all()


@pytest.mark.parametrize("phase, n", [("decode", 1), ("verify", 4)])
def test_decode_and_verify_equal_prefill_of_the_same_tokens(phase, n):
    spec = full_spec(0, hq=8, hkv=2, d=16)
    _, by_prefill = prefill_then(spec, 9 + n, 9)
    _, by_phase = prefill_then(spec, 9 + n, 9, phase=phase)
    torch.testing.assert_close(by_phase.o, by_prefill.o, atol=1e-6, rtol=1e-6)


def test_backends_leave_inputs_and_views_bit_identical():
    spec = full_spec(0, hq=4, hkv=2, d=8)
    st = nan_state([spec]).admit(0).admit(1)
    st = st.reserve({0: 6, 1: 3})
    b = fa.Batch.prefill(st, {0: 6, 1: 3})
    ma = fa.ModelAttention([spec])
    _, d = run(ma, st, b, {0: full_inputs(spec, 9)})
    st = st.apply(d)
    for phase in ("prefill", "decode", "verify"):
        st2 = st.reserve({0: 3, 1: 3})
        b = phase_batch(st2, phase, {"prefill": {0: 2, 1: 3}, "decode": {0: 1, 1: 1}, "verify": {0: 3, 1: 3}}[phase])
        inp = full_inputs(spec, b.num_tokens)
        inp_copy = {n: getattr(inp, n).clone() for n in ("q", "k", "v")}
        views = st2.views(0)
        view_copy = (views.k.clone(), views.v.clone())
        batch_copy = [t.clone() for t in (b.cu_seqlens, b.positions, b.block_table, b.slot_mapping)]
        run(ma, st2, b, {0: inp})
        assert all(same_bits(getattr(inp, n), inp_copy[n]) for n in inp_copy)
        assert same_bits(views.k, view_copy[0]) and same_bits(views.v, view_copy[1])
        assert all(torch.equal(a, c) for a, c in
                   zip((b.cu_seqlens, b.positions, b.block_table, b.slot_mapping), batch_copy))
        st = st2


def test_nan_in_unused_pages_and_slots_never_reaches_outputs():
    spec = full_spec(0, hq=4, hkv=2, d=8)
    st = nan_state([spec], num_pages=8, page_size=4)  # all storage starts as NaN
    st = st.admit(0).admit(1)
    st = st.reserve({0: 5, 1: 2})  # request 0's 2nd page has 3 unwritten (NaN) slots
    b = fa.Batch.prefill(st, {0: 5, 1: 2})
    ma = fa.ModelAttention([spec])
    _, d = run(ma, st, b, {0: full_inputs(spec, 7)})
    st = st.apply(d)
    assert torch.isnan(st.views(0).k).any()
    st = st.reserve({0: 1, 1: 1})
    outs, _ = run(ma, st, fa.Batch.decode(st, [0, 1]), {0: full_inputs(spec, 2)})
    assert torch.isfinite(outs[0].o).all() and torch.isfinite(outs[0].lse).all()


def tiny_setup(page_size=4):
    cfg = tiny.TinyConfig(hidden_size=32, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8,
                          intermediate_size=48)
    params = tiny.init_params(cfg, seed=3)
    specs = tiny.layer_specs(cfg)
    return params, specs, fa.ModelAttention(specs), nan_state(specs, num_pages=32, page_size=page_size)


def full_recompute_logits(params, specs, ma, tokens):
    st = nan_state(specs, num_pages=32)
    st, last = prefill(tiny.step, params, ma, st.admit(0), {0: tokens})
    return last[0]


def test_incremental_decode_equals_full_recompute():
    params, specs, ma, st = tiny_setup()
    prompt = [5, 17, 99, 3, 250, 8, 61]
    st = st.admit(0)
    st, last = prefill(tiny.step, params, ma, st, {0: prompt})
    seq = list(prompt)
    for _ in range(6):
        nxt = int(last[0].argmax())
        seq.append(nxt)
        st = st.reserve({0: 1})
        b = fa.Batch.decode(st, [0])
        st, logits = run_step(tiny.step, params, ma, st, b, torch.tensor([nxt]))
        want = full_recompute_logits(params, specs, ma, seq)
        torch.testing.assert_close(logits[0], want, atol=1e-5, rtol=1e-5)
        last = {0: logits[0]}


def test_chunked_prefill_and_batching_do_not_change_generation():
    params, specs, ma, st = tiny_setup(page_size=3)
    prompts = {0: [1, 2, 3, 4, 5, 6, 7, 8, 9], 1: [200, 100], 2: [42] * 13}
    st_a, one_shot = generate(tiny.step, params, ma, st, prompts, max_new_tokens=5)
    _, _, _, st = tiny_setup(page_size=5)
    st_b, chunked = generate(tiny.step, params, ma, st, prompts, max_new_tokens=5, chunk=4)
    assert one_shot == chunked
    for r, p in prompts.items():
        _, _, _, st = tiny_setup()
        _, alone = generate(tiny.step, params, ma, st, {r: p}, max_new_tokens=5)
        assert alone[r] == one_shot[r]
    assert st_a.free_pages == st_a.num_pages and st_b.free_slots == st_b.max_requests
