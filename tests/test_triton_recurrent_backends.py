"""Triton GDN / KDA backends against the reference backends, on the CPU.

The kernels run under TRITON_INTERPRET=1 (set by conftest without CUDA) in fp32 on
tiny shapes with 16-token chunks. `supports` refuses a CPU, so each backend is
called through the registry with the meta a session would give it (its plan
built once per step); the CUDA path through sessions is covered by
tests/gpu/test_recurrent_backends_gpu.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import nan_state, recurrent_inputs, same_bits

import fnattn as fa
from fnattn.backends import triton_recurrent
from fnattn.inputs import RecurrentOutput, StepMeta
from fnattn.registry import backend_names, lookup

pytest.importorskip("triton")

TOL = dict(atol=3e-5, rtol=3e-5)
KINDS = ("gdn", "kda")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    # The interpreter runs every program in Python: 16-token chunks keep it quick, and
    # the test lengths still span several chunks.
    monkeypatch.setattr(triton_recurrent, "CHUNK_SIZE", 16)


def spec_of(kind, *, index=0, dtype=torch.float32, state_dtype=torch.float32):
    if kind == "gdn":  # fewer key heads than value heads: the kernels read them unrepeated
        cfg = fa.GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, state_dtype=state_dtype)
    else:
        cfg = fa.KDAConfig(num_heads=2, head_k_dim=16, head_v_dim=16, state_dtype=state_dtype)
    return fa.LayerSpec(index=index, config=cfg, dtype=dtype)




def forward(name, spec, st, batch, inp, plan=None):
    """One layer through backend ``name`` with a session's meta; the plan is built here unless given."""
    backend = lookup(spec.kind, batch.phase, name)
    inp.validate(spec, batch, st.device)
    if plan is None and backend.plan is not None:
        plan = backend.plan((spec,), batch, None)
    meta = StepMeta(batch=batch, plan=plan)
    return backend.fn(spec, st.views(spec.index), dataclasses.replace(inp, meta=meta))


def states_of(w, st):
    """The new states of a write: its values, or the spare ring rows the backend filled in place."""
    if not w.in_place:
        return w.state
    assert w.ring_step is not None and (w.slots >= 0).all()
    return st.views(w.layer).ssm.index_select(0, w.slots)


def assert_matches(got, want, st):
    (out, (w,)), (ref_out, (ref_w,)) = got, want
    assert isinstance(out, RecurrentOutput) and out.o.dtype == ref_out.o.dtype
    torch.testing.assert_close(out.o, ref_out.o, **TOL)
    assert torch.equal(w.slots, ref_w.slots) and w.layer == ref_w.layer and w.ring_step == ref_w.ring_step
    for a, b in ((states_of(w, st), ref_w.state), (w.conv, ref_w.conv)):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **TOL)


def both(spec, st, batch, inp):
    """(triton, reference) results of one layer; the state is read by both, written by neither."""
    return forward("triton", spec, st, batch, inp), forward("reference", spec, st, batch, inp)


def prefilled(spec, prompts, *, seed=1, max_requests=4, ring=2):
    """Requests with ``prompts`` tokens prefilled by the reference; unused slots stay NaN."""
    st = nan_state([spec], num_pages=64, max_requests=max_requests, recurrent_ring=ring)
    for r in prompts:
        st = st.admit(r)
    st = st.reserve(prompts)
    batch = fa.Batch.prefill(st, prompts)
    _, deltas = forward("reference", spec, st, batch, recurrent_inputs(spec, batch.num_tokens, seed=seed))
    return st.apply(fa.StepDeltas.collect(batch, [deltas]))


# --------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_without_prefix_matches_reference(kind):
    spec = spec_of(kind)
    counts = {0: 1, 1: 20, 2: 37}  # one token, a chunk and a bit, more than two chunks
    st = nan_state([spec], num_pages=64)
    for r in counts:
        st = st.admit(r)
    st = st.reserve(counts)
    batch = fa.Batch.prefill(st, counts)
    got, want = both(spec, st, batch, recurrent_inputs(spec, batch.num_tokens))
    assert_matches(got, want, st)
    assert torch.isfinite(got[0].o).all()


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_after_a_cached_prefix_matches_reference(kind):
    spec = spec_of(kind)
    st = prefilled(spec, {0: 5, 1: 3})
    # Request 2 reuses request 1's slot, which still holds request 1's state; request 3's slot is NaN.
    slot, row = st.request(1).slot, st.recurrent_row(1)
    st = st.release(1).admit(2).admit(3)
    assert st.request(2).slot == slot and torch.isfinite(st.views(0).ssm[row]).all()
    assert torch.isnan(st.views(0).ssm[st.request(3).slot :: st.max_requests]).all()
    counts = {0: 18, 2: 1, 3: 9}
    st = st.reserve(counts)
    batch = fa.Batch.prefill(st, counts)
    got, want = both(spec, st, batch, recurrent_inputs(spec, batch.num_tokens, seed=2))
    assert_matches(got, want, st)
    assert torch.isfinite(got[0].o).all() and torch.isfinite(got[1][0].state).all()
    assert got[0].replay is None


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("ring", [1, 2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_decode_steps_match_reference(kind, ring):
    spec = spec_of(kind)
    st = prefilled(spec, {0: 6, 1: 2, 2: 1}, ring=ring)
    ref = st.apply(fa.StepDeltas(step_id=-1, state_version=st.version, writes=()), inplace=False)
    for i in range(4):
        st, ref = st.reserve({0: 1, 1: 1, 2: 1}), ref.reserve({0: 1, 1: 1, 2: 1})
        batch, ref_batch = fa.Batch.decode(st, [2, 0, 1]), fa.Batch.decode(ref, [2, 0, 1])
        inp = recurrent_inputs(spec, 3, seed=10 + i)
        got = forward("triton", spec, st, batch, inp)
        (w,) = got[1]
        assert w.in_place == (ring > 1) and batch.ring == (ring if ring > 1 else 0)
        assert_matches(got, forward("reference", spec, st, batch, inp), st)
        st = st.apply(fa.StepDeltas.collect(batch, [got[1]]))
        ref = ref.apply(fa.StepDeltas.collect(ref_batch, [forward("reference", spec, ref, ref_batch, inp)[1]]))
        for r in (0, 1, 2):  # the in-place chain of steps keeps the states the reference copies
            assert st.request(r).ring_pos == (i + 2) % ring  # prefill moved it once already
            for name in ("ssm", "conv"):
                torch.testing.assert_close(getattr(st.views(0), name)[st.recurrent_row(r)],
                                           getattr(ref.views(0), name)[ref.recurrent_row(r)], **TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_keeps_the_pool_dtype_for_states(kind):
    """Deltas carry the state in the pool's dtype (fp16 here) and the conv window in the layer's."""
    spec = spec_of(kind, state_dtype=torch.float16)
    st = prefilled(spec, {0: 4, 1: 7})
    st = st.reserve({0: 1, 1: 1})
    batch = fa.Batch.decode(st, [0, 1])
    got, want = both(spec, st, batch, recurrent_inputs(spec, 2, seed=3))
    (w,) = got[1]
    assert states_of(w, st).dtype == torch.float16 and w.conv.dtype == torch.float32
    torch.testing.assert_close(got[0].o, want[0].o, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(states_of(w, st), want[1][0].state, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(w.conv, want[1][0].conv, **TOL)


# --------------------------------------------------------------------------- verify


@pytest.mark.parametrize("ring", [2, 5], ids=["copy", "ring"])
@pytest.mark.parametrize("kind", KINDS)
def test_verify_and_accept_match_reference(kind, ring):
    spec = spec_of(kind)
    k = 3
    st = prefilled(spec, {0: 5, 1: 2}, ring=ring)
    st = st.reserve({0: 1 + k, 1: 1 + k})
    batch = fa.Batch.verify(st, [1, 0], num_draft=k)
    inp = recurrent_inputs(spec, batch.num_tokens, seed=4)
    got, want = both(spec, st, batch, inp)
    assert_matches(got, want, st)
    out, (w,) = got
    if ring > 1 + k:  # 1 + k spare rows: every position's state in place
        assert w.in_place and batch.ring == ring
        assert w.slots.tolist() == [st.recurrent_row(r, (st.request(r).ring_pos + 1 + i) % ring)
                                    for r in (1, 0) for i in range(1 + k)]
    else:
        slots = [st.recurrent_row(r) for r in (1, 0)]
        assert w.slots.tolist() == [-1] * k + [slots[0]] + [-1] * k + [slots[1]]
    assert states_of(w, st).shape[0] == w.conv.shape[0] == batch.num_tokens
    assert out.replay.meta is None
    assert all(getattr(out.replay, f) is getattr(inp, f) for f in ("x", "conv_weight", "conv_bias", "g", "beta"))

    for accepted in ({0: 1, 1: 4}, {0: 3, 1: 2}):
        ours = st.apply(fa.StepDeltas.collect(batch, [got[1]]).accept(batch, accepted), inplace=False)
        ref = st.apply(fa.StepDeltas.collect(batch, [want[1]]).accept(batch, accepted), inplace=False)
        for r, n in accepted.items():
            assert ours.request(r).length == ref.request(r).length == st.request(r).length + n
            assert ours.recurrent_row(r) == ref.recurrent_row(r)
            for name in ("ssm", "conv"):
                torch.testing.assert_close(getattr(ours.views(0), name)[ours.recurrent_row(r)],
                                           getattr(ref.views(0), name)[ref.recurrent_row(r)], **TOL)
        # Slots no request holds keep their NaN.
        for slot in range(2, st.max_requests):
            assert torch.isnan(ours.views(0).ssm[slot :: st.max_requests]).all()


# --------------------------------------------------------------------------- plan, registry


def test_one_plan_serves_every_layer_of_a_group():
    specs = [spec_of("gdn", index=i) for i in range(2)]
    st = nan_state(specs, num_pages=64).admit(0).admit(1).reserve({0: 3})
    first = fa.Batch.prefill(st, {0: 3})
    layer_deltas = [forward("reference", s, st, first, recurrent_inputs(s, 3, seed=s.index))[1] for s in specs]
    st = st.apply(fa.StepDeltas.collect(first, layer_deltas))
    counts = {0: 17, 1: 2}  # request 1 is fresh
    st = st.reserve(counts)
    batch = fa.Batch.prefill(st, counts)
    plan = lookup("gdn", "prefill", "triton").plan(tuple(specs), batch, None)
    assert plan.read_slots.tolist() == [st.recurrent_row(0), -1]
    assert plan.write_slots.tolist() == [st.recurrent_row(0, 0), st.recurrent_row(1, 1)]  # the next ring rows
    assert [t.tolist() for t in plan.chunks] == [[0, 0, 1], [0, 1, 0]] and plan.chunk_size == 16
    for spec in specs:
        inp = recurrent_inputs(spec, batch.num_tokens, seed=6 + spec.index)
        assert_matches(forward("triton", spec, st, batch, inp, plan=plan), forward("reference", spec, st, batch, inp),
                       st)


@pytest.mark.parametrize("ring", [2, 4], ids=["copy", "ring"])
def test_verify_plan_rows(ring):
    spec = spec_of("kda")
    st = prefilled(spec, {0: 2, 1: 2}, ring=ring).reserve({0: 3, 1: 3})
    batch = fa.Batch.verify(st, [0, 1], num_draft=2)
    plan = lookup("kda", "verify", "triton").plan((spec,), batch, None)
    s0, s1 = st.recurrent_row(0), st.recurrent_row(1)
    assert plan.read_slots.tolist() == [s0, s1] and plan.chunks is None
    if ring == 4:  # positions 1, 2, 3 after the current (1): rows of ring positions 2, 3, 0
        assert plan.write_slots.tolist() == [st.recurrent_row(r, p) for r in (0, 1) for p in (2, 3, 0)]
        assert plan.ring_step == batch.step_id
    else:  # only each request's last row, into its current row
        assert plan.write_slots.tolist() == [-1, -1, s0, -1, -1, s1] and plan.ring_step is None


@pytest.mark.parametrize("kind", KINDS)
def test_registered_for_every_phase_and_refused_on_a_cpu_with_reasons(kind):
    assert "triton" in backend_names(kind, "prefill") and "fla" in backend_names(kind, "prefill")
    for phase in ("decode", "verify"):
        assert "triton" in backend_names(kind, phase) and "fla" not in backend_names(kind, phase)
    spec = spec_of(kind)
    for name in ("triton", "fla"):
        reasons = lookup(kind, "prefill", name).supports(spec, torch.device("cpu"))
        assert any("CUDA" in r for r in reasons), reasons
    ma = fa.ModelAttention([spec])
    assert all(c.backend.name == "reference" for c in ma.choices.values())
    assert "triton (needs a CUDA device" in ma.explain()


def test_supports_names_head_dims_and_dtype():
    big = fa.LayerSpec(index=0, config=fa.KDAConfig(num_heads=1, head_k_dim=512, head_v_dim=1024),
                       dtype=torch.float32)
    reasons = triton_recurrent.supports(big, torch.device("cpu"))
    assert any("head_k_dim=512" in r for r in reasons) and any("head_v_dim=1024" in r for r in reasons)
    assert any("K=512" in r for r in triton_recurrent.fla_supports(big, torch.device("cpu")))
    ok = spec_of("gdn", dtype=torch.bfloat16)
    assert not any("dtype" in r for r in triton_recurrent.supports(ok, torch.device("cpu")))


def test_wrong_inputs_type_is_refused_naming_the_argument():
    spec = spec_of("gdn")
    st = nan_state([spec]).admit(0).reserve({0: 1})
    batch = fa.Batch.prefill(st, {0: 1})
    meta = StepMeta(batch=batch, plan=None)
    bad = fa.FullAttentionInputs(q=torch.zeros(1, 1, 8), k=torch.zeros(1, 1, 8), v=torch.zeros(1, 1, 8), meta=meta)
    with pytest.raises(ValueError, match="`inputs`"):
        lookup("gdn", "prefill", "triton").fn(spec, st.views(0), bad)


@pytest.mark.parametrize("ring", [1, 2], ids=["copy", "ring"])
def test_live_rows_unchanged_and_repeatable_output(ring):
    """The backend writes nothing but the batch's spare ring rows; running it twice gives the same bits."""
    spec = spec_of("kda")
    st = prefilled(spec, {0: 3, 1: 2}, ring=ring)
    st = st.reserve({0: 1})
    batch = fa.Batch.decode(st, [0])
    spare = batch.recurrent_write_rows.tolist() if batch.ring else []
    before = {n: getattr(st.views(0), n).clone() for n in ("ssm", "conv")}
    inp = recurrent_inputs(spec, 1, seed=9)
    a = forward("triton", spec, st, batch, inp)
    a_states = states_of(a[1][0], st).clone()
    b = forward("triton", spec, st, batch, inp)
    assert same_bits(a[0].o, b[0].o) and same_bits(a_states, states_of(b[1][0], st))
    assert spare == ([st.recurrent_row(0, 0)] if ring == 2 else [])
    others = [i for i in range(before["ssm"].shape[0]) if i not in spare]
    assert all(same_bits(getattr(st.views(0), n)[others], t[others]) for n, t in before.items())


@pytest.mark.parametrize("kind", KINDS)
def test_replay_recovery_equals_native_bit_for_bit(kind):
    """Replay mode keeps no state per draft; replaying the accepted tokens leaves the native state exactly."""
    spec = spec_of(kind)
    k = 3
    st = prefilled(spec, {0: 5, 1: 2})
    st = st.reserve({0: 1 + k, 1: 1 + k})
    native_b = fa.Batch.verify(st, [0, 1], num_draft=k)
    replay_b = fa.Batch.verify(st, [0, 1], num_draft=k, recovery="replay")
    inp = recurrent_inputs(spec, native_b.num_tokens, seed=9)
    native_out, native_d = forward("triton", spec, st, native_b, inp)
    replay_out, replay_d = forward("triton", spec, st, replay_b, inp)
    assert replay_d == () and torch.equal(native_out.o, replay_out.o)
    accepted = {0: 2, 1: 4}
    native = st.apply(fa.StepDeltas.collect(native_b, [native_d]).accept(native_b, accepted), inplace=False)
    rows = [0, 1, 4, 5, 6, 7]  # the accepted tokens of each request
    again = fa.Batch.replay(st, accepted)
    sliced = dataclasses.replace(replay_out.replay, x=inp.x[rows], g=inp.g[rows], beta=inp.beta[rows])
    _, writes = forward("triton", spec, st, again, sliced)
    replayed = st.apply(fa.StepDeltas(step_id=replay_b.step_id, state_version=st.version, writes=writes,
                                      cursor=fa.CursorAdvance((0, 1), (2, 4))), inplace=False)
    for name in ("ssm", "conv"):
        assert same_bits(getattr(native.views(0), name), getattr(replayed.views(0), name))
