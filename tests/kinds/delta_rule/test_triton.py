"""Triton GDN / KDA backends against the reference backends, on the CPU.

The kernels run under TRITON_INTERPRET=1 (set by conftest without CUDA) in fp32 on
tiny shapes with 16-token chunks. `supports` refuses a CPU, so each test hands its
`ModelAttention` the registered triton backend with that check lifted, and runs it
through a session like any step (the session builds its plan once per group); the
CUDA path with the real checks is covered by tests/gpu/test_recurrent_backends_gpu.py.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from helpers import nan_state, recurrent_inputs, run, same_bits

import fnattn as fa
from fnattn.kinds.delta_rule import triton as triton_backend
from fnattn.registry import backend_names, lookup

pytest.importorskip("triton")

TOL = dict(atol=3e-5, rtol=3e-5)
KINDS = ("gdn", "kda")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    # The interpreter runs every program in Python: 16-token chunks keep it quick, and
    # the test lengths still span several chunks.
    monkeypatch.setattr(triton_backend, "CHUNK_SIZE", 16)


def spec_of(kind, *, index=0, dtype=torch.float32, state_dtype=torch.float32):
    if kind == "gdn":  # fewer key heads than value heads: the kernels read them unrepeated
        cfg = fa.GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, state_dtype=state_dtype)
    else:
        cfg = fa.KDAConfig(num_heads=2, head_k_dim=16, head_v_dim=16, state_dtype=state_dtype)
    return fa.LayerSpec(index=index, config=cfg, dtype=dtype)


def on_cpu(backend: fa.Backend) -> fa.Backend:
    """A registered backend with its device check lifted (the kernels run interpreted here)."""
    return dataclasses.replace(backend, supports=lambda spec, device: [])


def model_attention(name, specs, phase):
    """``name`` ("reference", or a fast backend run on the CPU) for every layer of ``specs``, one phase."""
    prefer = ("reference",) if name == "reference" else (on_cpu(lookup(specs[0].kind, phase, name)),)
    return fa.ModelAttention(specs, prefer=prefer, phases=(phase,))


def forward(name, spec, st, batch, inp):
    """One layer through backend ``name``, in a session of its own: ``-> (output, writes)``."""
    with model_attention(name, [spec], batch.phase).session(st, batch) as s:
        return s.forward(spec.index, inp)


def states_of(w, st, batch):
    """The new states of a layer's writes: its values, or the spare ring rows the backend filled in place
    (valid until the next session over the same rows)."""
    if w["ssm"] is not None:
        return w["ssm"]
    rows = batch.recurrent_write_rows
    assert batch.ring and (rows >= 0).all()
    return st.views(w.layer).ssm.index_select(0, rows)


def assert_matches(got, want, st, batch):
    (out, w), (ref_out, ref_w) = got, want
    assert isinstance(out, fa.RecurrentOutput) and out.o.dtype == ref_out.o.dtype
    torch.testing.assert_close(out.o, ref_out.o, **TOL)
    assert w.layer == ref_w.layer and w.step == ref_w.step == batch.step_id and set(w.values) == set(ref_w.values)
    # decode and verify fill the batch's spare ring rows in place when it hands some out; prefill never does
    assert (w["ssm"] is None) == (bool(batch.ring) and batch.phase != "prefill") and ref_w["ssm"] is not None
    for a, b in ((states_of(w, st, batch), ref_w["ssm"]), (w["conv"], ref_w["conv"])):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **TOL)


def both(spec, st, batch, inp):
    """(triton, reference) results of one layer; the state is read by both, its live rows written by neither.

    The reference runs first: a session over a ring batch takes over its spare rows, so triton's
    in-place states stay valid (and applicable) only as the last session's.
    """
    want = forward("reference", spec, st, batch, inp)
    return forward("triton", spec, st, batch, inp), want


def prefilled(spec, prompts, *, seed=1, max_requests=4, ring=2):
    """Requests with ``prompts`` tokens prefilled by the reference; unused slots stay NaN."""
    st = nan_state([spec], num_pages=64, max_requests=max_requests, recurrent_ring=ring)
    for r in prompts:
        st = st.admit(r)
    st = st.reserve(prompts)
    batch = fa.Batch.prefill(st, prompts)
    _, writes = forward("reference", spec, st, batch, recurrent_inputs(spec, batch.num_tokens, seed=seed))
    return st.apply(fa.StepDeltas.collect(batch, [writes]))


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
    assert_matches(got, want, st, batch)
    assert torch.isfinite(got[0].o).all()


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_after_a_cached_prefix_matches_reference(kind):
    spec = spec_of(kind)
    st = prefilled(spec, {0: 5, 1: 3})
    # Request 2 reuses request 1's slot, which still holds request 1's state; request 3's slot is NaN.
    slot, row = st.request(1).slot, st.recurrent_row(1)
    st = st.release(1).admit(2).admit(3)
    assert st.request(2).slot == slot and torch.isfinite(st.views(0).ssm[row]).all()
    assert torch.isnan(st.views(0).ssm[st.request(3).slot :: st.slots_per_ring]).all()
    counts = {0: 18, 2: 1, 3: 9}
    st = st.reserve(counts)
    batch = fa.Batch.prefill(st, counts)
    got, want = both(spec, st, batch, recurrent_inputs(spec, batch.num_tokens, seed=2))
    assert_matches(got, want, st, batch)
    assert torch.isfinite(got[0].o).all() and torch.isfinite(got[1]["ssm"]).all()
    assert got[0].replay is None


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("ring", [1, 2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_decode_steps_match_reference(kind, ring):
    spec = spec_of(kind)
    st = prefilled(spec, {0: 6, 1: 2, 2: 1}, ring=ring)
    ref = prefilled(spec, {0: 6, 1: 2, 2: 1}, ring=ring)  # the same bits, in storage of its own
    for i in range(4):
        st, ref = st.reserve({0: 1, 1: 1, 2: 1}), ref.reserve({0: 1, 1: 1, 2: 1})
        batch, ref_batch = fa.Batch.decode(st, [2, 0, 1]), fa.Batch.decode(ref, [2, 0, 1])
        inp = recurrent_inputs(spec, 3, seed=10 + i)
        want = forward("reference", spec, st, batch, inp)
        got = forward("triton", spec, st, batch, inp)
        w = got[1]
        assert (w["ssm"] is None) == (ring > 1) and batch.ring == (ring if ring > 1 else 0)
        assert_matches(got, want, st, batch)
        st = st.apply(fa.StepDeltas.collect(batch, [w]))
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
    w = got[1]
    assert states_of(w, st, batch).dtype == torch.float16 and w["conv"].dtype == torch.float32
    torch.testing.assert_close(got[0].o, want[0].o, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(states_of(w, st, batch), want[1]["ssm"], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(w["conv"], want[1]["conv"], **TOL)


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
    assert_matches(got, want, st, batch)
    out, w = got
    if ring > 1 + k:  # 1 + k spare rows: every position's state in place
        assert w["ssm"] is None and batch.ring == ring
        assert batch.recurrent_write_rows.tolist() == [st.recurrent_row(r, (st.request(r).ring_pos + 1 + i) % ring)
                                                       for r in (1, 0) for i in range(1 + k)]
    else:
        slots = [st.recurrent_row(r) for r in (1, 0)]
        assert w["ssm"] is not None and batch.ring == 0
        assert batch.recurrent_write_rows.tolist() == [-1] * k + [slots[0]] + [-1] * k + [slots[1]]
    assert states_of(w, st, batch).shape[0] == w["conv"].shape[0] == batch.num_tokens
    assert out.replay.meta is None
    assert all(getattr(out.replay, f) is getattr(inp, f) for f in ("x", "conv_weight", "conv_bias", "g", "beta"))

    for accepted in ({0: 1, 1: 4}, {0: 3, 1: 2}):
        counts = tuple(accepted[r] for r in batch.request_ids)
        if not batch.ring:  # only the state after each request's last accepted token leaves the step
            cu = batch.host_cu_seqlens
            assert batch.state_rows(counts).tolist() == [
                slots[b] if t == cu[b] + n - 1 else -1 for b, n in enumerate(counts) for t in range(cu[b], cu[b + 1])]
        ours = st.apply(fa.StepDeltas.collect(batch, [got[1]]).accept(batch, accepted), inplace=False)
        ref = st.apply(fa.StepDeltas.collect(batch, [want[1]]).accept(batch, accepted), inplace=False)
        for r, n in accepted.items():
            assert ours.request(r).length == ref.request(r).length == st.request(r).length + n
            assert ours.recurrent_row(r) == ref.recurrent_row(r)
            for name in ("ssm", "conv"):
                torch.testing.assert_close(getattr(ours.views(0), name)[ours.recurrent_row(r)],
                                           getattr(ref.views(0), name)[ref.recurrent_row(r)], **TOL)
        # Slots no request holds keep their NaN.
        for slot in range(3, st.slots_per_ring):
            assert torch.isnan(ours.views(0).ssm[slot :: st.slots_per_ring]).all()


# --------------------------------------------------------------------------- plan, registry


def test_one_plan_serves_every_layer_of_a_group():
    specs = [spec_of("gdn", index=i) for i in range(2)]
    st = nan_state(specs, num_pages=64).admit(0).admit(1).reserve({0: 3})
    first = fa.Batch.prefill(st, {0: 3})
    _, deltas = run(model_attention("reference", specs, "prefill"), st, first,
                    {s.index: recurrent_inputs(s, 3, seed=s.index) for s in specs})
    st = st.apply(deltas)
    counts = {0: 17, 1: 2}  # request 1 is fresh
    st = st.reserve(counts)
    batch = fa.Batch.prefill(st, counts)
    triton_prefill = lookup("gdn", "prefill", "triton")
    plan = triton_prefill.plan(tuple(specs), batch, None)
    assert plan.read_slots.tolist() == [st.recurrent_row(0), -1]
    assert plan.write_slots.tolist() == [st.recurrent_row(0, 0), st.recurrent_row(1, 1)]  # the next ring rows
    assert plan.write_slots.tolist() == batch.recurrent_write_rows.tolist()
    assert [t.tolist() for t in plan.chunks] == [[0, 0, 1], [0, 1, 0]] and plan.chunk_size == 16
    # Through a session: both layers form one group, whose plan is built once for the step.
    plans = []

    def counted(group, b, lease):
        plans.append(group)
        return triton_prefill.plan(group, b, lease)

    ma = fa.ModelAttention(specs, prefer=(dataclasses.replace(on_cpu(triton_prefill), plan=counted),),
                           phases=("prefill",))
    inputs = {s.index: recurrent_inputs(s, batch.num_tokens, seed=6 + s.index) for s in specs}
    want = {s.index: forward("reference", s, st, batch, inputs[s.index]) for s in specs}
    with ma.session(st, batch) as s:
        got = {spec.index: s.forward(spec.index, inputs[spec.index]) for spec in specs}
    assert plans == [tuple(specs)]
    for spec in specs:
        assert_matches(got[spec.index], want[spec.index], st, batch)


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
        assert plan.in_ring and batch.ring == ring
    else:  # only each request's last row, into its current row
        assert plan.write_slots.tolist() == [-1, -1, s0, -1, -1, s1] and not plan.in_ring and batch.ring == 0
    assert plan.write_slots.tolist() == batch.recurrent_write_rows.tolist()


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
    # on a CPU: the torch backend's batched decode and chunk-parallel prefill, the reference for verify
    assert {p: c.backend.name for (_, p), c in ma.choices.items()} == {
        "prefill": "torch", "decode": "torch", "verify": "reference"}
    assert "triton (needs a CUDA device" in ma.explain()


def test_supports_names_head_dims_and_dtype():
    big = fa.LayerSpec(index=0, config=fa.KDAConfig(num_heads=1, head_k_dim=512, head_v_dim=1024),
                       dtype=torch.float32)
    reasons = triton_backend.supports(big, torch.device("cpu"))
    assert any("head_k_dim=512" in r for r in reasons) and any("head_v_dim=1024" in r for r in reasons)
    assert any("K=512" in r for r in triton_backend.fla_supports(big, torch.device("cpu")))
    ok = spec_of("gdn", dtype=torch.bfloat16)
    assert not any("dtype" in r for r in triton_backend.supports(ok, torch.device("cpu")))


def test_wrong_inputs_type_is_refused_naming_the_argument():
    spec = spec_of("gdn")
    st = nan_state([spec]).admit(0).reserve({0: 1})
    batch = fa.Batch.prefill(st, {0: 1})
    bad = fa.FullAttentionInputs(q=torch.zeros(1, 1, 8), k=torch.zeros(1, 1, 8), v=torch.zeros(1, 1, 8))
    with model_attention("triton", [spec], "prefill").session(st, batch) as s:
        with pytest.raises(ValueError, match="`inputs`"):
            s.forward(0, bad)


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
    a = forward("triton", spec, st, batch, inp)  # under FNATTN_CHECKS=1 the session also refuses any other write
    a_states = states_of(a[1], st, batch).clone()
    b = forward("triton", spec, st, batch, inp)
    assert same_bits(a[0].o, b[0].o) and same_bits(a_states, states_of(b[1], st, batch))
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
    native_out, native_w = forward("triton", spec, st, native_b, inp)
    replay_out, replay_w = forward("triton", spec, st, replay_b, inp)
    assert replay_w is None and torch.equal(native_out.o, replay_out.o)
    accepted = {0: 2, 1: 4}
    native = st.apply(fa.StepDeltas.collect(native_b, [native_w]).accept(native_b, accepted), inplace=False)
    rows = [0, 1, 4, 5, 6, 7]  # the accepted tokens of each request
    again = fa.Batch.replay(st, accepted)
    sliced = dataclasses.replace(replay_out.replay, x=inp.x[rows], g=inp.g[rows], beta=inp.beta[rows])
    _, writes = forward("triton", spec, st, again, sliced)
    replay = fa.StepDeltas.collect(again, [writes])
    assert replay.cursor == fa.CursorAdvance((0, 1), (2, 4))
    replayed = st.apply(fa.StepDeltas.collect(replay_b, [replay_w]).accept(replay_b, accepted, replay=replay),
                        inplace=False)
    for name in ("ssm", "conv"):
        assert same_bits(getattr(native.views(0), name), getattr(replayed.views(0), name))


def _stand_in_fla(monkeypatch, fwd):
    """A stand-in for the two fla-core functions `_fla_gdn_forward` reaches (fla-core needs CUDA)."""
    import sys
    import types

    norm = types.ModuleType("fla.modules.norm.l2norm")
    norm.l2norm_fwd = lambda x, eps=1e-6: (x / (x.float().pow(2).sum(-1, keepdim=True) + eps).sqrt().to(x.dtype),
                                           None)
    chunk = types.ModuleType("fla.ops.gated_delta_rule.chunk")
    chunk.chunk_gated_delta_rule_fwd = fwd
    for name in ("fla", "fla.modules", "fla.modules.norm", "fla.ops", "fla.ops.gated_delta_rule"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.modules.norm.l2norm", norm)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule.chunk", chunk)
    fresh = functools.cache(triton_backend._fla_gdn_forward.__wrapped__)  # the real one's answer stays cached
    monkeypatch.setattr(triton_backend, "_fla_gdn_forward", fresh)


def test_the_direct_fla_forward_passes_contiguous_normalized_inputs_and_the_plan_chunks(monkeypatch):
    seen = {}

    def fwd(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first=False, cu_seqlens=None,
            cp_context=None, chunk_indices=None, use_gate_in_kernel=False, A_log=None, dt_bias=None, chunk_size=64):
        seen.update(q=q, k=k, v=v, scale=scale, h0=initial_state, final=output_final_state, cu=cu_seqlens,
                    chunks=chunk_indices, chunk_size=chunk_size)
        return g, v * 2, None, initial_state + 1, initial_state, None

    _stand_in_fla(monkeypatch, fwd)
    forward = triton_backend._fla_gdn_forward()
    assert forward is not None
    mixed = torch.randn(1, 5, 3 * 8)
    q, k, v = mixed[..., :8].view(1, 5, 1, 8), mixed[..., 8:16].view(1, 5, 1, 8), mixed[..., 16:].view(1, 5, 1, 8)
    g, beta, h0 = torch.randn(1, 5, 1), torch.rand(1, 5, 1), torch.randn(1, 1, 8, 8)
    cu, chunks = torch.tensor([0, 5]), torch.tensor([[0, 0]])
    o, final = forward(q, k, v, g, beta, 0.5, h0, cu, chunks)
    assert all(seen[n].is_contiguous() for n in ("q", "k", "v"))
    torch.testing.assert_close(seen["q"].norm(dim=-1), torch.ones(1, 5, 1))
    torch.testing.assert_close(seen["k"].norm(dim=-1), torch.ones(1, 5, 1))
    assert seen["scale"] == 0.5 and seen["final"] is True and seen["cu"] is cu and seen["chunks"] is chunks
    assert seen["chunk_size"] == triton_backend.CHUNK_SIZE
    torch.testing.assert_close(o, v * 2)
    torch.testing.assert_close(final, h0 + 1)


def test_an_fla_forward_of_another_form_leaves_the_public_function(monkeypatch):
    def fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens=None):  # no chunk_indices
        raise AssertionError("not to be called")

    _stand_in_fla(monkeypatch, fwd)
    assert triton_backend._fla_gdn_forward() is None


def test_fla_direct_is_on_by_default_and_takes_only_a_bool():
    from fnattn.bench import environment

    assert triton_backend._FLA_DIRECT[-1] is True and environment()["switches"]["fla_direct"] is True
    with triton_backend.fla_direct(False):
        assert environment()["switches"]["fla_direct"] is False
    with pytest.raises(ValueError, match="fla_direct: expected True or False, got 1"):
        with triton_backend.fla_direct(1):
            pass


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("apart", [False, True])
def test_the_fla_prefill_hands_q_k_v_contiguous_with_qkv_apart(monkeypatch, kind, apart):
    """`qkv_apart(True)`: the conv writes q, k and v as three contiguous tensors, so fla-core's chunk gets
    them as they are (no copies), with the values of the one-output path's column slices (GDN through the
    direct forward, KDA through fla-core's public function)."""
    import sys
    import types

    seen = {}

    def recorder(q, k, v, g, beta, scale, h0, cu, chunks):
        seen.update(q=q, k=k, v=v, h0=h0)
        return v.clone(), h0.clone()  # o [1, T, H, V] (GDN 2 key heads read by 4 value heads), states

    def public(q, k, v, g, beta, *, initial_state, **kw):
        return recorder(q, k, v, g, beta, None, initial_state, None, None)

    fla_ops = types.ModuleType("fla.ops.gated_delta_rule")
    fla_ops.chunk_gated_delta_rule = None
    kda = types.ModuleType("fla.ops.kda")
    kda.chunk_kda = public
    for name, module in {"fla": types.ModuleType("fla"), "fla.ops": types.ModuleType("fla.ops"),
                         "fla.ops.gated_delta_rule": fla_ops, "fla.ops.kda": kda}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(triton_backend, "_fla_gdn_forward", lambda: recorder)
    spec = spec_of(kind)
    counts = {0: 3, 1: 20}
    st = nan_state([spec], num_pages=64)
    for r in counts:
        st = st.admit(r)
    st = st.reserve(counts)
    batch = fa.Batch.prefill(st, counts)
    inp = recurrent_inputs(spec, batch.num_tokens)
    with torch.no_grad(), triton_backend.qkv_apart(False):  # the direct forward runs without autograd
        forward("fla", spec, st, batch, inp)
    one = dict(seen)
    with torch.no_grad(), triton_backend.qkv_apart(apart):
        forward("fla", spec, st, batch, inp)
    for name in ("q", "k", "v"):
        assert seen[name].is_contiguous() == apart  # the one output's slices are strided
        assert torch.equal(seen[name], one[name])
    # fresh requests start from zeros, never from their slots' NaN (the plan's rows and mask)
    assert torch.equal(seen["h0"], torch.zeros_like(seen["h0"]))


def test_qkv_apart_is_on_by_default_and_recorded_with_the_switches():
    from fnattn.bench import environment

    assert triton_backend._QKV_APART[-1] is True and environment()["switches"]["qkv_apart"] is True
    with triton_backend.qkv_apart(False):
        assert environment()["switches"]["qkv_apart"] is False


# --------------------------------------------------------------------------- the invariant mode


def _rows(inp, rows):
    """The inputs of token rows ``rows`` (a slice) of ``inp``."""
    return dataclasses.replace(inp, x=inp.x[rows], g=inp.g[rows], beta=inp.beta[rows])


@pytest.mark.parametrize("kind", KINDS)
def test_invariant_prefill_is_decode_token_by_token_bit_for_bit(kind):
    """With the mode on, a prompt's prefill runs decode's launches over its tokens: each output row and the
    final state and conv window are the bits of decoding those tokens one a step, whatever other request shares
    the prefill (a verify's per-token recurrence is decode's too: `test_verify_and_accept_match_reference`)."""
    import fnattn.switches

    spec = spec_of(kind)
    n = 7
    inp = recurrent_inputs(spec, n + 4, seed=5)
    with fnattn.switches.set(invariant=True):
        # three copies of the same prefilled requests (the reference's bits), one for each way through
        pre, alone, dec = (prefilled(spec, {0: 5, 1: 3}) for _ in range(3))
        pre = pre.reserve({0: n, 1: 4})
        batch = fa.Batch.prefill(pre, {0: n, 1: 4})
        out, w = forward("triton", spec, pre, batch, inp)
        alone = alone.reserve({0: n})
        batch_alone = fa.Batch.prefill(alone, {0: n})
        out_alone, w_alone = forward("triton", spec, alone, batch_alone, _rows(inp, slice(0, n)))
        rows = []
        for t in range(n):
            dec = dec.reserve({0: 1})
            b = fa.Batch.decode(dec, [0])
            o, wd = forward("triton", spec, dec, b, _rows(inp, slice(t, t + 1)))
            rows.append(o.o)
            dec = dec.apply(fa.StepDeltas.collect(b, [wd]))
    first = batch.request_ids.index(0)
    decoded = torch.cat(rows)  # [n, H, V]
    assert same_bits(out.o[:n] if first == 0 else out.o[4:], decoded) and same_bits(out_alone.o, decoded)
    assert w["ssm"] is not None  # a prefill's states leave as values, as the chunked prefill's do
    for name in ("ssm", "conv"):
        kept = getattr(dec.views(0), name)[dec.recurrent_row(0)]
        assert same_bits(w_alone[name][0], kept) and same_bits(w[name][first], kept)
