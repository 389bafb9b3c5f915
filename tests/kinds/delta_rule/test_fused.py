"""The opt-in ``triton_fused`` GDN / KDA decode backend against ``reference`` and ``triton``, on the CPU.

The kernel runs under TRITON_INTERPRET=1 (set by conftest without CUDA) in fp32 on tiny
shapes. Its `supports` refuses a CPU, so each test runs the registered backend with that
check lifted through a session like any step; the bf16 CUDA path with the real checks is
tests/gpu/test_gdn_decode_fused_gpu.py. States start as NaN, so a read of a row that
holds no request's state (a fresh slot, a pad lane's) shows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import nan_state, recurrent_inputs, registry_scope, same_bits

import fnattn as fa
from fnattn.kinds.delta_rule import fused, triton
from fnattn.model_attention import DEFAULT_PREFER
from fnattn.registry import backend_names, lookup, register

pytest.importorskip("triton")

TOL = dict(atol=3e-5, rtol=3e-5)
KINDS = ("gdn", "kda")


def spec_of(kind, *, state_dtype=torch.float32):
    if kind == "gdn":  # 2 value heads per key head: the kernel reads the key heads unrepeated
        cfg = fa.GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, state_dtype=state_dtype)
    else:
        cfg = fa.KDAConfig(num_heads=2, head_k_dim=16, head_v_dim=16, state_dtype=state_dtype)
    return fa.LayerSpec(index=0, config=cfg, dtype=torch.float32)


def on_cpu(name, kind, phase="decode") -> fa.Backend:
    """The registered backend with its device check lifted (the kernels run interpreted here)."""
    return dataclasses.replace(lookup(kind, phase, name), supports=lambda spec, device: [])


def forward(name, spec, st, batch, inp):
    prefer = ("reference",) if name == "reference" else (on_cpu(name, spec.kind, batch.phase),)
    with fa.ModelAttention([spec], prefer=prefer, phases=(batch.phase,)).session(st, batch) as s:
        return s.forward(spec.index, inp)


def states_of(w, st, batch):
    """A layer's new states: its values, or the spare ring rows filled in place (this session's)."""
    if w["ssm"] is not None:
        return w["ssm"]
    assert batch.ring and (batch.recurrent_write_rows >= 0).all()
    return st.views(w.layer).ssm.index_select(0, batch.recurrent_write_rows)


def prefilled(spec, prompts, *, ring=2, max_requests=4):
    st = nan_state([spec], num_pages=64, max_requests=max_requests, recurrent_ring=ring)
    for r in prompts:
        st = st.admit(r)
    st = st.reserve(prompts)
    batch = fa.Batch.prefill(st, prompts)
    _, w = forward("reference", spec, st, batch, recurrent_inputs(spec, batch.num_tokens, seed=1))
    return st.apply(fa.StepDeltas.collect(batch, [w]))


def run_three(spec, st, batch, inp):
    """reference, triton, triton_fused on the same step; triton_fused last, so its in-place rows stand.
    ``-> {name: (output, writes, states)}`` with the states cloned right after each session."""
    got = {}
    for name in ("reference", "triton", fused.NAME):
        out, w = forward(name, spec, st, batch, inp)
        got[name] = (out, w, states_of(w, st, batch).clone())
    return got


def check_step(got, batch):
    """Every lane's output and conv window; the states of the live lanes (pad lanes of a ring batch share the
    null slot's spare row, so theirs are not each their own)."""
    live = batch.num_requests - batch.num_pad  # pad lanes come last
    ref_out, ref_w, ref_states = got["reference"]
    (out, w, states), (t_out, t_w, t_states) = got[fused.NAME], got["triton"]
    ref_states, states, t_states = ref_states[:live], states[:live], t_states[:live]
    assert set(w.values) == set(ref_w.values) == {"ssm", "conv"} and w.step == batch.step_id
    # the writes contract of triton: in place exactly when the batch hands out spare ring rows
    assert (w["ssm"] is None) == (t_w["ssm"] is None) == bool(batch.ring)
    assert out.o.dtype == ref_out.o.dtype and states.dtype == ref_states.dtype
    assert w["conv"].dtype == ref_w["conv"].dtype and w["conv"].shape == ref_w["conv"].shape
    torch.testing.assert_close(out.o, ref_out.o, **TOL)
    torch.testing.assert_close(states, ref_states, **TOL)
    torch.testing.assert_close(w["conv"], ref_w["conv"], **TOL)
    # the same arithmetic as the two launches it replaces
    assert same_bits(out.o, t_out.o) and same_bits(states, t_states) and same_bits(w["conv"], t_w["conv"])


@pytest.mark.parametrize("ring", [1, 2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_decode_steps_match_reference_and_triton(kind, ring):
    spec = spec_of(kind)
    st = prefilled(spec, {0: 6, 1: 2, 2: 1}, ring=ring)
    ref = prefilled(spec, {0: 6, 1: 2, 2: 1}, ring=ring)  # the same bits, in storage of its own
    for i in range(3):
        st, ref = st.reserve({0: 1, 1: 1, 2: 1}), ref.reserve({0: 1, 1: 1, 2: 1})
        batch, ref_batch = fa.Batch.decode(st, [2, 0, 1]), fa.Batch.decode(ref, [2, 0, 1])
        inp = recurrent_inputs(spec, 3, seed=10 + i)
        got = run_three(spec, st, batch, inp)
        check_step(got, batch)
        st = st.apply(fa.StepDeltas.collect(batch, [got[fused.NAME][1]]))
        ref = ref.apply(fa.StepDeltas.collect(ref_batch, [forward("reference", spec, ref, ref_batch, inp)[1]]))
        for r in (0, 1, 2):  # the chain of in-place steps keeps the states the reference copies
            for name in ("ssm", "conv"):
                torch.testing.assert_close(getattr(st.views(0), name)[st.recurrent_row(r)],
                                           getattr(ref.views(0), name)[ref.recurrent_row(r)], **TOL)


@pytest.mark.parametrize("ring", [1, 2], ids=["copy", "ring"])
@pytest.mark.parametrize("kind", KINDS)
def test_pad_lanes_read_the_zero_state(kind, ring):
    """A padded batch (as for a captured step): pad lanes sit on the NaN null slot with nothing cached, so
    they read zeros and stay finite; the live lanes match the reference and every lane triton."""
    spec = spec_of(kind)
    st = prefilled(spec, {0: 3, 1: 5}, ring=ring).reserve({0: 1, 1: 1})
    null = st.views(0).ssm[0 :: st.slots_per_ring]  # every ring row of the null slot
    assert torch.isnan(null).all() and torch.isnan(st.views(0).conv[0 :: st.slots_per_ring]).all()
    batch = fa.Batch.decode(st, [1, 0], pad_to=4)
    assert batch.request_ids[2:] == (-1, -2) and batch.host_cache_lens[2:] == (0, 0)
    got = run_three(spec, st, batch, recurrent_inputs(spec, 4, seed=5))
    check_step(got, batch)
    out, w, states = got[fused.NAME]
    assert torch.isfinite(out.o).all() and torch.isfinite(states).all() and torch.isfinite(w["conv"]).all()


@pytest.mark.parametrize("kind", KINDS)
def test_fp16_state_pool(kind):
    """States leave in the pool's dtype (fp16 here), the conv windows in the layer's."""
    spec = spec_of(kind, state_dtype=torch.float16)
    st = prefilled(spec, {0: 4, 1: 7}).reserve({0: 1, 1: 1})
    batch = fa.Batch.decode(st, [0, 1])
    inp = recurrent_inputs(spec, 2, seed=3)
    ref_out, ref_w = forward("reference", spec, st, batch, inp)
    out, w = forward(fused.NAME, spec, st, batch, inp)
    states = states_of(w, st, batch)
    assert states.dtype == torch.float16 and w["conv"].dtype == torch.float32
    torch.testing.assert_close(out.o, ref_out.o, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(states, ref_w["ssm"], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(w["conv"], ref_w["conv"], **TOL)


@pytest.mark.parametrize("ring", [1, 2], ids=["copy", "ring"])
@pytest.mark.parametrize("kind", KINDS)
def test_probe_against_reference(kind, ring):
    """fnattn.probe compares outputs and the storage rows each backend leaves after its apply."""
    spec = spec_of(kind)
    st = prefilled(spec, {0: 3, 1: 2, 2: 9}, ring=ring).reserve({0: 1, 1: 1, 2: 1})
    batch = fa.Batch.decode(st, [0, 1, 2])
    with registry_scope():
        for name in ("triton", fused.NAME):
            b = lookup(kind, "decode", name)
            register(kind, "decode", f"{name}_cpu", plan=b.plan, capturable=True)(b.source)
        report = fa.probe(spec, state=st, batch=batch, inputs=recurrent_inputs(spec, 3, seed=8),
                          backends=[f"{fused.NAME}_cpu", "triton_cpu"])
    rows = {r.backend: r for r in report.rows}
    assert rows[f"{fused.NAME}_cpu"].max_rel < 1e-5 and rows["triton_cpu"].max_rel < 1e-5
    assert rows[f"{fused.NAME}_cpu"].max_abs == rows["triton_cpu"].max_abs  # the same bits, so the same error


def test_live_rows_unchanged_and_repeatable():
    """Nothing but the batch's spare ring rows is written (the session's purity check also watches);
    running it twice gives the same bits."""
    spec = spec_of("gdn")
    st = prefilled(spec, {0: 3, 1: 2}).reserve({0: 1})
    batch = fa.Batch.decode(st, [0])
    spare = batch.recurrent_write_rows.tolist()
    before = {n: getattr(st.views(0), n).clone() for n in ("ssm", "conv")}
    inp = recurrent_inputs(spec, 1, seed=9)
    a = forward(fused.NAME, spec, st, batch, inp)
    a_states = states_of(a[1], st, batch).clone()
    b = forward(fused.NAME, spec, st, batch, inp)
    assert same_bits(a[0].o, b[0].o) and same_bits(a_states, states_of(b[1], st, batch))
    others = [i for i in range(before["ssm"].shape[0]) if i not in spare]
    assert all(same_bits(getattr(st.views(0), n)[others], t[others]) for n, t in before.items())


@pytest.mark.parametrize("kind", KINDS)
def test_registered_first_for_decode_only(kind):
    assert fused.NAME in backend_names(kind, "decode")
    assert fused.NAME not in backend_names(kind, "prefill") and fused.NAME not in backend_names(kind, "verify")
    b = lookup(kind, "decode", fused.NAME)
    assert b.capturable and b.plan is triton.plan and b.supports is triton.supports and b.builtin
    assert DEFAULT_PREFER.index(fused.NAME) < DEFAULT_PREFER.index("triton")
    spec = spec_of(kind)
    assert any("CUDA" in r for r in b.supports(spec, torch.device("cpu")))
    default = fa.ModelAttention([spec])
    assert f"{fused.NAME} (needs a CUDA device" in default.explain()  # tried first, refused on a CPU
    assert default.backend(0, "decode").name != fused.NAME
    asked = fa.ModelAttention([spec], prefer=[fused.NAME, "triton", "reference"])
    assert asked.backend(0, "decode").name == "reference"  # on a CPU both Triton backends refuse
    assert f"{fused.NAME} (needs a CUDA device" in asked.explain()
    # prefill and verify have no fused entry: the rest of the prefer list serves them
    assert asked.backend(0, "prefill").name == asked.backend(0, "verify").name == "reference"


def test_guard_refuses_a_call_outside_a_session():
    with pytest.raises(fa.OutsideSessionError, match="runs only inside a session"):
        fused._decode(None, None, None)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_ranks_fla_first_and_decode_ranks_the_fused_kernel_first(kind):
    """Prefill has its own order (fla-core's chunk leads ours there), over the same names as the other
    phases'; on a CPU both are refused in that order and the CPU backends serve."""
    from fnattn.model_attention import DEFAULT_PREFER_PREFILL

    assert sorted(DEFAULT_PREFER_PREFILL) == sorted(DEFAULT_PREFER)
    assert DEFAULT_PREFER_PREFILL.index("fla") < DEFAULT_PREFER_PREFILL.index("triton")
    default = fa.ModelAttention([spec_of(kind)])
    prefill = default.choices[(0, "prefill")]
    decode = default.choices[(0, "decode")]
    assert [name for name, _ in prefill.refused][:2] == ["fla", "triton"]
    assert [name for name, _ in decode.refused][:2] == [fused.NAME, "triton"]
    assert prefill.backend.name == "torch"
