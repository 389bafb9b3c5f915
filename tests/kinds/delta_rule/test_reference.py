"""Reference GDN / KDA backends through sessions and State: parity with transformers' layers
(project -> session -> finish), verify with per-token states, acceptance and replay, the chunked
form against the recurrence, purity, NaN-filled storage, dtypes, checkpoints and input errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import nan_state, phase_batch, recurrent_inputs, run, same_bits, snapshot, unchanged
from hf_recurrent import gdn_modules, kda_modules, layer_pair, run_hf

import fnattn as fa
from fnattn.kinds.delta_rule.reference import CHUNK_SIZE

TIGHT = dict(atol=1e-5, rtol=1e-5)
LOOSE = dict(atol=3e-2, rtol=3e-2)
KINDS = ("gdn", "kda")


# --------------------------------------------------------------------------- builders


def small_spec(kind, *, dtype=torch.float32, state_dtype=torch.float32, index=0):
    if kind == "gdn":
        cfg = fa.GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, state_dtype=state_dtype)
    else:
        cfg = fa.KDAConfig(num_heads=2, head_k_dim=8, head_v_dim=16, state_dtype=state_dtype)
    return fa.LayerSpec(index=index, config=cfg, dtype=dtype)


def take(inp, rows):
    """The inputs of some tokens (a slice or an index tensor)."""
    return dataclasses.replace(inp, x=inp.x[rows], g=inp.g[rows], beta=inp.beta[rows], meta=None)


def cat(*parts):
    return dataclasses.replace(parts[0], x=torch.cat([p.x for p in parts]), g=torch.cat([p.g for p in parts]),
                               beta=torch.cat([p.beta for p in parts]), meta=None)


def step(ma, st, batch, inp, *, inplace=True):
    """Run layer 0 for one step and apply; returns (output, layer deltas, new state)."""
    outs, deltas = run(ma, st, batch, {0: inp})
    return outs[0], deltas, st.apply(deltas, inplace=inplace)


def rows_of(st, rid):
    """The (ssm, conv) rows of a request's slot, copied."""
    v, slot = st.views(0), st.recurrent_row(rid)
    return v.ssm[slot].clone(), v.conv[slot].clone()


# --------------------------------------------------------------------------- transformers parity


@pytest.fixture(scope="module")
def hf_gdn():
    with gdn_modules() as families:
        yield families


@pytest.fixture(scope="module")
def hf_kda():
    with kda_modules() as kda:
        yield kda


def hf_layer(request, family, *, seed=7, dtype=torch.float32):
    modules = request.getfixturevalue("hf_kda" if family == "kimi" else "hf_gdn")
    return layer_pair(modules, family, seed=seed, dtype=dtype)


def ours(layer, schedule, xs):
    """Run ``schedule`` (a list of (phase, {request: new tokens})) over per-request hidden states.

    Every step projects the step's packed tokens, runs the session, applies the
    deltas and finishes. Returns ({request: [outputs per step]}, final state).
    """
    st = nan_state([layer.spec], num_pages=32).admit(0).admit(1)
    ma = fa.ModelAttention([layer.spec])
    done = {r: 0 for r in xs}
    outs = {r: [] for r in xs}
    for phase, counts in schedule:
        st = st.reserve(counts)
        batch = phase_batch(st, phase, counts)
        x = torch.cat([xs[r][done[r] : done[r] + n] for r, n in counts.items()])
        inp, gate = layer.project(x)
        with ma.session(st, batch) as s:
            out, deltas = s.forward(0, inp)
        st = st.apply(fa.StepDeltas.collect(batch, [deltas]))
        y = layer.finish(out.o, gate)
        for (r, n), lo in zip(counts.items(), batch.host_cu_seqlens):
            outs[r].append(y[lo : lo + n])
            done[r] += n
    return outs, st


def check_against_hf(layer, schedule, xs, tol):
    got, st = ours(layer, schedule, xs)
    for r, x in xs.items():
        chunks = list(x.split([c[r] for _, c in schedule if r in c]))
        want, window, state = run_hf(layer.module, layer.config, chunks)
        for a, b in zip(got[r], want):
            assert a.dtype == layer.spec.dtype
            torch.testing.assert_close(a, b, **tol)
        ssm, conv = rows_of(st, r)
        assert st.request(r).length == x.shape[0]
        torch.testing.assert_close(ssm, state.to(ssm.dtype), **tol)
        torch.testing.assert_close(conv, window, **tol)


FAMILIES = ("qwen3_5", "qwen3_next", "kimi")


def hidden(layer, *lens, seed=8):
    gen = torch.Generator().manual_seed(seed)
    return {r: torch.randn(n, layer.config.hidden_size, generator=gen).to(layer.spec.dtype)
            for r, n in enumerate(lens)}


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_decode_matches_transformers(request, family):
    layer = hf_layer(request, family)
    xs = hidden(layer, 11)
    check_against_hf(layer, [("prefill", {0: 7})] + [("decode", {0: 1})] * 4, xs, TIGHT)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_requests_of_different_lengths_in_one_batch(request, family):
    layer = hf_layer(request, family, seed=9)
    xs = hidden(layer, 9, 4, seed=9)
    schedule = [("prefill", {0: 7, 1: 2}), ("decode", {0: 1, 1: 1}), ("decode", {1: 1, 0: 1})]
    check_against_hf(layer, schedule, xs, TIGHT)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_over_two_steps_equals_one_shot(request, family):
    layer = hf_layer(request, family, seed=10)
    xs = hidden(layer, 11, seed=10)
    two, st2 = ours(layer, [("prefill", {0: 5}), ("prefill", {0: 6})], xs)
    one, st1 = ours(layer, [("prefill", {0: 11})], xs)
    torch.testing.assert_close(torch.cat(two[0]), one[0][0], **TIGHT)
    for a, b in zip(rows_of(st2, 0), rows_of(st1, 0)):
        torch.testing.assert_close(a, b, **TIGHT)
    check_against_hf(layer, [("prefill", {0: 5}), ("prefill", {0: 6})], xs, TIGHT)


def test_bf16_activations_with_fp32_state_match_transformers_loosely(request):
    layer = hf_layer(request, "qwen3_5", seed=11, dtype=torch.bfloat16)
    assert layer.spec.config.state_dtype == torch.float32
    xs = hidden(layer, 12, seed=11)
    check_against_hf(layer, [("prefill", {0: 9})] + [("decode", {0: 1})] * 3, xs, LOOSE)


# --------------------------------------------------------------------------- verify, accept, replay

K_DRAFT = 3


def decode_trace(ma, st, inp_of, n):
    """Decode ``n`` tokens for every request from ``st`` (kept live): outputs and rows after each token."""
    ids = list(inp_of)
    outs = {r: [] for r in ids}
    rows = {r: [] for r in ids}
    first = True
    for i in range(n):
        batch = fa.Batch.decode(st, ids)
        out, _, st = step(ma, st, batch, cat(*(take(inp_of[r], slice(i, i + 1)) for r in ids)), inplace=not first)
        first = False
        for b, r in enumerate(ids):
            outs[r].append(out.o[b])
            rows[r].append(rows_of(st, r))
    return outs, rows


@pytest.mark.parametrize("ring", [2, 2 + K_DRAFT], ids=["copy", "ring"])
@pytest.mark.parametrize("kind", KINDS)
def test_verify_accept_and_replay(kind, ring):
    spec = small_spec(kind)
    ma = fa.ModelAttention([spec])
    prompts = {0: 5, 1: 3}
    n_new = 1 + K_DRAFT
    inp = {r: recurrent_inputs(spec, n + n_new, seed=r + 1) for r, n in prompts.items()}
    st = nan_state([spec], recurrent_ring=ring).admit(0).admit(1).reserve(prompts)
    prompt_in = cat(*(take(inp[r], slice(0, n)) for r, n in prompts.items()))
    _, _, st = step(ma, st, fa.Batch.prefill(st, prompts), prompt_in)
    st = st.reserve({r: n_new for r in prompts})
    new = {r: take(inp[r], slice(n, n + n_new)) for r, n in prompts.items()}
    dec_out, dec_rows = decode_trace(ma, st, new, n_new)

    batch = fa.Batch.verify(st, [0, 1], num_draft=K_DRAFT)
    verify_in = cat(new[0], new[1])
    outs, deltas = run(ma, st, batch, {0: verify_in})
    out, (write,) = outs[0], deltas.writes
    if ring > n_new:  # every token's state in a spare row of the ring, in order after the current one
        pos = [st.request(r).ring_pos for r in (0, 1)]
        want = [st.recurrent_row(r, (pos[b] + 1 + i) % ring) for b, r in enumerate((0, 1)) for i in range(n_new)]
        assert batch.ring == ring
    else:  # no room: only the last token's state, into the current row
        slots = [st.recurrent_row(r) for r in (0, 1)]
        want = [-1] * K_DRAFT + [slots[0]] + [-1] * K_DRAFT + [slots[1]]
        assert batch.ring == 0
    assert batch.recurrent_write_rows.tolist() == batch.state_rows().tolist() == want
    # the reference returns every token's state as values (it writes no ring row in place)
    assert set(write.values) == {"ssm", "conv"}
    assert write["ssm"].shape[0] == write["conv"].shape[0] == 2 * n_new

    # Verify position i equals decode after i tokens: outputs and states.
    for b, r in enumerate((0, 1)):
        for i in range(n_new):
            t = b * n_new + i
            torch.testing.assert_close(out.o[t], dec_out[r][i], **TIGHT)
            torch.testing.assert_close(write["ssm"][t], dec_rows[r][i][0], **TIGHT)
            torch.testing.assert_close(write["conv"][t], dec_rows[r][i][1], **TIGHT)

    # The replay inputs are this step's own inputs, without the step's metadata.
    assert isinstance(out, fa.RecurrentOutput) and out.replay.meta is None
    assert all(getattr(out.replay, f) is getattr(verify_in, f) for f in ("x", "conv_weight", "g", "beta"))

    for n0 in range(1, n_new + 1):
        accepted = {0: n0, 1: n_new + 1 - n0}
        rows = batch.state_rows((accepted[0], accepted[1]))
        if batch.ring:  # every state goes to its spare row; the ring then points at the last accepted one
            assert rows.tolist() == want
        else:  # only the state after each request's last accepted token, into its current row
            assert rows.tolist() == [slots[b] if i == accepted[r] - 1 else -1
                                     for b, r in enumerate((0, 1)) for i in range(n_new)]
        native = st.apply(deltas.accept(batch, accepted), inplace=False)
        for b, (r, n) in enumerate(accepted.items()):
            assert native.request(r).length == prompts[r] + n
            ssm, conv = rows_of(native, r)
            # Exactly the verify row of the last accepted token, which is the state decoding leaves.
            last = b * n_new + n - 1
            assert same_bits(ssm, write["ssm"][last]) and same_bits(conv, write["conv"][last])
            if batch.ring:
                assert native.recurrent_row(r) == want[last]
            torch.testing.assert_close(ssm, dec_rows[r][n - 1][0], **TIGHT)
            torch.testing.assert_close(conv, dec_rows[r][n - 1][1], **TIGHT)
        # Replay: the accepted tokens' inputs through a prefill from the pre-verify state.
        replay_batch = fa.Batch.prefill(st, accepted)
        keep = torch.cat([torch.arange(n) + b * n_new for b, n in enumerate(accepted.values())])
        _, _, replayed = step(ma, st, replay_batch, take(out.replay, keep), inplace=False)
        for r in accepted:
            assert replayed.request(r).length == native.request(r).length
            for a, b in zip(rows_of(replayed, r), rows_of(native, r)):
                torch.testing.assert_close(a, b, **TIGHT)


@pytest.mark.parametrize("kind", KINDS)
def test_verify_deltas_applied_without_accept_keep_every_token(kind):
    spec = small_spec(kind)
    ma = fa.ModelAttention([spec])
    st = nan_state([spec]).admit(0).reserve({0: 1 + K_DRAFT})
    inp = recurrent_inputs(spec, 1 + K_DRAFT, seed=3)
    _, deltas, after = step(ma, st, fa.Batch.verify(st, [0], num_draft=K_DRAFT), inp)
    assert after.request(0).length == 1 + K_DRAFT
    ssm, conv = rows_of(after, 0)
    (write,) = deltas.writes
    assert same_bits(ssm, write["ssm"][-1]) and same_bits(conv, write["conv"][-1])


# --------------------------------------------------------------------------- chunked form vs recurrence


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_equals_decoding_token_by_token(kind):
    spec = small_spec(kind)
    ma = fa.ModelAttention([spec])
    P, T = 3, CHUNK_SIZE + 6  # a cached prefix, then more than one chunk
    inp = recurrent_inputs(spec, P + T, seed=4)
    st = nan_state([spec], num_pages=32).admit(0).reserve({0: P + T})
    _, _, st = step(ma, st, fa.Batch.prefill(st, {0: P}), take(inp, slice(0, P)))
    chunked, _, by_prefill = step(ma, st, fa.Batch.prefill(st, {0: T}), take(inp, slice(P, P + T)), inplace=False)
    outs, rows = decode_trace(ma, st, {0: take(inp, slice(P, P + T))}, T)
    torch.testing.assert_close(chunked.o, torch.stack(outs[0]), **TIGHT)
    for a, b in zip(rows_of(by_prefill, 0), rows[0][-1]):
        torch.testing.assert_close(a, b, **TIGHT)


# --------------------------------------------------------------------------- purity, NaN, dtypes


@pytest.mark.parametrize("kind", KINDS)
def test_backends_leave_inputs_and_views_bit_identical(kind):
    spec = small_spec(kind)
    ma = fa.ModelAttention([spec])
    st = nan_state([spec]).admit(0).reserve({0: 4})
    _, _, st = step(ma, st, fa.Batch.prefill(st, {0: 4}), recurrent_inputs(spec, 4))
    st = st.admit(1)  # fresh: its slot still holds NaN
    for phase, counts in (("prefill", {0: 3, 1: 2}), ("decode", {0: 1, 1: 1}), ("verify", {0: 3, 1: 3})):
        st = st.reserve(counts)
        batch = phase_batch(st, phase, counts)
        inp = recurrent_inputs(spec, batch.num_tokens, seed=5)
        fields = {f: getattr(inp, f).clone() for f in ("x", "conv_weight", "g", "beta")}
        snap = snapshot(st)
        batch_copy = [t.clone() for t in (batch.cu_seqlens, batch.recurrent_slots, batch.positions)]
        with ma.session(st, batch) as s:
            out, write = s.forward(0, inp)
        with ma.session(st, batch) as s:  # each layer runs once per session: a re-run is a session of its own
            out2, write2 = s.forward(0, inp)  # and reads the same state
        assert all(same_bits(getattr(inp, f), c) for f, c in fields.items())
        assert unchanged(st, snap)
        assert all(torch.equal(a, b) for a, b in zip((batch.cu_seqlens, batch.recurrent_slots, batch.positions),
                                                    batch_copy))
        assert same_bits(out.o, out2.o) and same_bits(write["ssm"], write2["ssm"])
        assert torch.isfinite(out.o).all() and torch.isfinite(write["ssm"]).all()
        assert torch.isfinite(write["conv"]).all()
        st = st.apply(fa.StepDeltas.collect(batch, [write]))


@pytest.mark.parametrize("kind", KINDS)
def test_nan_and_stale_state_in_slots_never_reach_outputs(kind):
    spec = small_spec(kind)
    ma = fa.ModelAttention([spec])
    inp = recurrent_inputs(spec, 6, seed=6)
    zero = fa.State([spec], num_pages=8, page_size=4).admit(9).reserve({9: 6})
    clean, _, _ = step(ma, zero, fa.Batch.prefill(zero, {9: 6}), inp)

    st = nan_state([spec]).admit(0).admit(1).reserve({0: 6, 1: 6})
    out, _, st = step(ma, st, fa.Batch.prefill(st, {0: 6, 1: 6}), cat(inp, recurrent_inputs(spec, 6, seed=7)))
    used = [st.recurrent_row(r) for r in (0, 1)]
    unused = [i for i in range(st.views(0).ssm.shape[0]) if i not in used]
    assert torch.isfinite(out.o).all() and torch.isnan(st.views(0).ssm[unused]).all()  # unused rows stay NaN
    slot, row = st.request(0).slot, st.recurrent_row(0)
    st = st.release(0).admit(5).reserve({5: 6})  # request 5 reuses request 0's slot, which holds its old state
    assert st.request(5).slot == slot and torch.isfinite(st.views(0).ssm[row]).all()
    again, _, st = step(ma, st, fa.Batch.prefill(st, {5: 6}), inp)
    assert same_bits(again.o, clean.o)
    # Poison the reused slot too: a fresh request still never reads it.
    pool = next(p for p in st.pools.values() if "ssm" in p.tensors)
    st = st.release(5).admit(6).reserve({6: 6})
    assert st.request(6).slot == slot
    ring_rows = slice(slot, None, st.max_requests)  # every row of the slot's ring
    pool.tensors["ssm"][:, ring_rows] = float("nan")
    pool.tensors["conv"][:, ring_rows] = float("nan")
    fresh, _, _ = step(ma, st, fa.Batch.prefill(st, {6: 6}), inp)
    assert same_bits(fresh.o, clean.o)


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_state_with_bf16_activations_round_trips_and_wrong_dtype_is_refused(kind):
    spec = small_spec(kind, dtype=torch.bfloat16, state_dtype=torch.float32)
    ma = fa.ModelAttention([spec])
    st = nan_state([spec]).admit(0).reserve({0: 6})
    out, deltas, st = step(ma, st, fa.Batch.prefill(st, {0: 5}), recurrent_inputs(spec, 5))
    (write,) = deltas.writes
    assert out.o.dtype == torch.bfloat16 and write["ssm"].dtype == torch.float32
    assert write["conv"].dtype == torch.bfloat16
    v = st.views(0)
    assert v.ssm.dtype == torch.float32 and v.conv.dtype == torch.bfloat16
    ssm, conv = rows_of(st, 0)
    assert same_bits(ssm, write["ssm"][0]) and same_bits(conv, write["conv"][0])

    batch = fa.Batch.decode(st, [0])
    _, good = run(ma, st, batch, {0: recurrent_inputs(spec, 1, seed=1)})
    (w,) = good.writes
    snap = snapshot(st)
    for bad in (dataclasses.replace(w, values={**w.values, "ssm": w["ssm"].to(torch.bfloat16)}),
                dataclasses.replace(w, values={**w.values, "conv": w["conv"].float()})):
        with pytest.raises(ValueError, match="no silent casts"):
            st.apply(dataclasses.replace(good, writes=(bad,)))
        assert st.is_live and unchanged(st, snap) and st.request(0).length == 5
    st = st.apply(good)
    assert st.views(0).ssm.dtype == torch.float32 and st.request(0).length == 6


# --------------------------------------------------------------------------- checkpoints, errors, explain


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_restore_of_a_recurrent_request(kind):
    spec = small_spec(kind)
    ma = fa.ModelAttention([spec])
    st = nan_state([spec]).admit(0).admit(1).reserve({0: 8, 1: 8})
    _, _, st = step(ma, st, fa.Batch.prefill(st, {0: 4, 1: 2}), recurrent_inputs(spec, 6))
    before = rows_of(st, 0), st.request(0).length
    ckpt = st.checkpoint([0])
    nxt = recurrent_inputs(spec, 2, seed=2)
    first, _, st = step(ma, st, fa.Batch.decode(st, [0, 1]), nxt)
    assert not same_bits(rows_of(st, 0)[0], before[0][0])
    other = rows_of(st, 1)
    st = st.restore(ckpt)
    assert st.request(0).length == before[1] and st.request(1).length == 3
    assert all(same_bits(a, b) for a, b in zip(rows_of(st, 0), before[0]))
    assert all(same_bits(a, b) for a, b in zip(rows_of(st, 1), other))  # not in the checkpoint: untouched
    again, _, _ = step(ma, st, fa.Batch.decode(st, [0]), take(nxt, slice(0, 1)))
    assert same_bits(again.o[0], first.o[0])


@pytest.mark.parametrize("kind", KINDS)
def test_bad_inputs_raise_value_error_naming_the_field(kind):
    spec = small_spec(kind)
    ma = fa.ModelAttention([spec])
    st = nan_state([spec]).admit(0).reserve({0: 3})
    batch = fa.Batch.prefill(st, {0: 3})
    good = recurrent_inputs(spec, 3)
    H, T = spec.config.num_state_heads, 3
    wrong_g = torch.zeros(T, H, spec.config.head_k_dim) if kind == "gdn" else torch.zeros(T, H)
    bad = {
        "x": [good.x[:, :-1], good.x[:2], good.x.to(torch.bfloat16)],
        "g": [wrong_g, good.g.to(torch.bfloat16), good.g[:2]],
        "beta": [good.beta[:, :-1], good.beta.double(), (good.beta > 0.5).long()],
        "conv_weight": [good.conv_weight[:, :-1], good.conv_weight.double()],
    }
    with ma.session(st, batch) as s:
        for field, values in bad.items():
            for value in values:
                with pytest.raises(ValueError, match=f"layer 0 inputs: `{field}`"):
                    s.forward(0, dataclasses.replace(good, **{field: value}))
        s.forward(0, good)


def test_explain_shows_a_reference_backend_for_every_phase():
    specs = [small_spec("gdn", index=0), small_spec("kda", index=1)]
    ma = fa.ModelAttention(specs, prefer=("reference",))
    for (layer, phase), choice in ma.choices.items():
        assert choice.backend is not None and choice.backend.name == "reference", (layer, phase)
    assert ma.explain().count("reference") == 6
