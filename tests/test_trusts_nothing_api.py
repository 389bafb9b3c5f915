"""The API trusts nothing either: bad arguments, purity, sessions only, checked backends.

One test per defect class (the apply's own classes are in test_trusts_nothing.py). Every
refusal names the argument and leaves the State as it was (`helpers.assert_refused`).
"""

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_refused,
    bookkeeping,
    constant_states,
    full_inputs,
    full_spec,
    gdn_spec,
    nan_state,
    recurrent_inputs,
    register_constant_backends,
    registry_scope,
    ring_step,
    run,
    snapshot,
    unchanged,
)

import fnattn as fa
from fnattn import registry


@pytest.fixture(autouse=True)
def _own_registry():
    with registry_scope():
        yield


def full_state(n=2):
    spec = full_spec(0)
    st = nan_state([spec]).admit(0).reserve({0: n})
    return spec, st, fa.ModelAttention([spec])


# --------------------------------------------------------------------------- 8. bad arguments

BAD_ARGUMENTS = {  # name -> (call(spec, state, ma), what the error must name)
    "decode of a bool id": (lambda spec, st, ma: fa.Batch.decode(st, [True]), "`request_ids`"),
    "prefill of a float id": (lambda spec, st, ma: fa.Batch.prefill(st, {1.0: 2}), "`request_ids`"),
    "views of a bool layer": (lambda spec, st, ma: st.views(True), "`layer`"),
    "reserve of a list": (lambda spec, st, ma: st.reserve([1]), "`counts`"),
    "a misspelt backend": (lambda spec, st, ma: fa.ModelAttention([spec], prefer=("tritn",)),
                           r"`prefer` must be names of registered backends \(known: \[.*'reference'.*'tritn'"),
    "an unknown kind": (lambda spec, st, ma: fa.register("no_such_kind", "decode", "x"),
                        r"`kind` must be a registered kind \(known: \[.*'full'.*'gdn'.*'no_such_kind'"),
}


@pytest.mark.parametrize("what", list(BAD_ARGUMENTS))
def test_a_bad_argument_is_refused_by_name(what):
    call, match = BAD_ARGUMENTS[what]
    spec, st, ma = full_state()
    assert_refused(st, lambda: call(spec, st, ma), match)


def test_forward_refuses_a_bool_layer_and_a_layer_run_twice():
    spec, st, ma = full_state()
    b = fa.Batch.prefill(st, {0: 2})
    with ma.session(st, b) as s:
        assert_refused(st, lambda: s.forward(layer=True, inputs=full_inputs(spec, 2)), "`layer`")
        _, w = s.forward(0, full_inputs(spec, 2))
        assert_refused(st, lambda: s.forward(0, full_inputs(spec, 2, gen=torch.Generator().manual_seed(3))),
                       "`layer` must be a layer not yet run in this step")
    assert st.apply(fa.StepDeltas.collect(b, [w])).request(0).length == 2  # the first forward's writes stand


def test_register_twice_needs_replace():
    def backend(spec, views, inputs):  # pragma: no cover - never run
        raise AssertionError

    def other(spec, views, inputs):  # pragma: no cover - never run
        raise AssertionError

    fa.register("full", "decode", "test_twice")(backend)
    with pytest.raises(ValueError, match=r"'test_twice'\) is already registered.*replace=True"):
        fa.register("full", "decode", "test_twice")(other)
    assert registry.lookup("full", "decode", "test_twice").source is backend
    fa.register("full", "decode", "test_twice", replace=True)(other)
    assert registry.lookup("full", "decode", "test_twice").source is other


def test_a_backend_declares_its_page_size_and_the_model_attention_reports_it():
    """`register(page_size=)`: the one page size a backend serves; `ModelAttention.page_size` is what the chosen
    backends need (None: any), two chosen backends needing different sizes are refused by name, and a session
    refuses a batch of another page size for the phase such a backend serves, before anything runs."""
    def backend(spec, views, inputs):  # pragma: no cover - never run
        raise AssertionError

    for bad in (0, -64, True, 64.0):
        with pytest.raises(ValueError, match=r"register: `page_size` must be a positive int or None, got"):
            fa.register("full", "decode", "test_paged", page_size=bad)
    spec = full_spec(0)
    assert fa.ModelAttention([spec]).page_size is None  # the built-in backends serve any page size
    fa.register("full", "decode", "test_paged", page_size=64)(backend)
    fa.register("full", "verify", "test_paged_32", page_size=32)(backend)
    assert fa.ModelAttention([spec], prefer=("test_paged", "reference")).page_size == 64
    both = fa.ModelAttention([spec], prefer=("test_paged", "test_paged_32", "reference"))
    with pytest.raises(ValueError, match=r"ModelAttention.page_size: `backends` must be chosen backends that agree "
                                         r"on a page size, got \[\('test_paged', 64\), \('test_paged_32', 32\)\]"):
        _ = both.page_size
    st = nan_state([spec]).admit(0).reserve({0: 2})  # pages of 4
    st = st.apply(run(fa.ModelAttention([spec]), st, fa.Batch.prefill(st, {0: 2}), {0: full_inputs(spec, 2)})[1])
    st = st.reserve({0: 1})
    paged = fa.ModelAttention([spec], prefer=("test_paged", "reference"))
    assert paged.page_sizes("prefill") == () and paged.page_sizes("decode") == (("test_paged", 64),)
    assert_refused(st, lambda: paged.session(st, fa.Batch.decode(st, [0])).__enter__(),
                   r"AttentionSession: `batch.page_size` must be 64, the one page size backend 'test_paged' serves "
                   r"\(build the State with page_size=64 or prefer another backend\), got 4")


def test_bad_arguments_do_not_depend_on_checks():
    """The same refusals with FNATTN_CHECKS=0 (decided at import, hence a fresh interpreter)."""
    script = textwrap.dedent("""
        import torch
        import fnattn as fa
        from fnattn.checks import CHECKS_ENABLED
        assert not CHECKS_ENABLED
        cfg = fa.FullAttentionConfig(num_q_heads=2, num_kv_heads=1, head_dim=4)
        spec = fa.LayerSpec(index=0, config=cfg, dtype=torch.float32)
        st = fa.State([spec], num_pages=4, page_size=4, max_requests=2).admit(0).reserve({0: 1})
        ma = fa.ModelAttention([spec])
        def refused(call, name):
            try:
                call()
            except ValueError as e:
                assert f"`{name}`" in str(e), (name, e)
            else:
                raise AssertionError(f"not refused: {name}")
            assert st.is_live and st.request(0).length == 0
        refused(lambda: fa.Batch.decode(st, [True]), "request_ids")
        refused(lambda: fa.Batch.prefill(st, {1.0: 2}), "request_ids")
        refused(lambda: st.views(True), "layer")
        refused(lambda: st.reserve([1]), "counts")
        refused(lambda: fa.ModelAttention([spec], prefer=("tritn",)), "prefer")
        refused(lambda: fa.register("no_such_kind", "decode", "x"), "kind")
        b = fa.Batch.decode(st, [0])
        x = torch.zeros(1, 2, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4)
        with ma.session(st, b) as s:
            refused(lambda: s.forward(True, fa.FullAttentionInputs(*x)), "layer")
            _, w = s.forward(0, fa.FullAttentionInputs(*x))
            refused(lambda: s.forward(0, fa.FullAttentionInputs(*x)), "layer")
        d = fa.StepDeltas.collect(b, [w])
        import dataclasses
        refused(lambda: st.apply(dataclasses.replace(d, writes=())), "writes")
        print("refused")
    """)
    env = {**os.environ, "FNATTN_CHECKS": "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "refused"


# --------------------------------------------------------------------------- 9. purity


def test_a_backend_that_writes_a_view_is_refused_by_name():
    @fa.register("full", "decode", "test_dirty_k")
    def dirty_k(spec, views, inputs):
        views.k.zero_()
        return fa.AttentionOutput(o=torch.zeros_like(inputs.q)), fa.writes(k=inputs.k, v=inputs.v)

    spec, st, _ = full_state()
    st = st.apply(run(fa.ModelAttention([spec]), st, fa.Batch.prefill(st, {0: 1}), {0: full_inputs(spec, 1)})[1])
    ma = fa.ModelAttention([spec], prefer=("test_dirty_k",))
    b = fa.Batch.decode(st, [0])
    book = bookkeeping(st)
    with ma.session(st, b) as s:
        with pytest.raises(fa.PurityError, match="backend 'test_dirty_k' .*wrote into its view 'k'"):
            s.forward(0, full_inputs(spec, 1))
    assert bookkeeping(st) == book  # the cursor, handle and allocator stand; the backend's write was its own


def test_a_recurrent_backend_that_writes_its_state_without_a_ring_is_refused():
    @fa.register("gdn", "decode", "test_dirty_ssm")
    def dirty_ssm(spec, views, inputs):
        out, ssm, conv = constant_states(spec, inputs)
        views.ssm.zero_()
        return out, fa.writes(ssm=ssm, conv=conv)

    spec = gdn_spec(0)
    for ring in (1, 2):  # without a ring nothing may be written; with one, only the spare rows
        st = nan_state([spec], recurrent_ring=ring).admit(0).reserve({0: 1})
        ma = fa.ModelAttention([spec], prefer=("test_dirty_ssm",))
        b = fa.Batch.decode(st, [0])
        assert bool(b.ring) == (ring > 1)
        with ma.session(st, b) as s:
            book = bookkeeping(st)
            with pytest.raises(fa.PurityError, match="backend 'test_dirty_ssm' .*wrote into its view 'ssm'"):
                s.forward(0, recurrent_inputs(spec, 1))
            assert bookkeeping(st) == book


def test_a_backend_that_writes_only_the_spare_ring_rows_is_accepted():
    st = nan_state([gdn_spec(0), gdn_spec(1)]).admit(0).admit(1).reserve({0: 1, 1: 1})
    others = {r: st.recurrent_row(r) for r in (0, 1)}
    b, d = ring_step(st, [1], value=3.0, in_place=True)  # request 0 is not in the batch: its rows stay
    spare = b.recurrent_write_rows.tolist()
    assert b.ring and all(w["ssm"] is None for w in d.writes)
    new = st.apply(d)
    assert new.recurrent_row(1) == spare[0] != others[1] and new.recurrent_row(0) == others[0]
    for layer in (0, 1):
        assert (new.views(layer).ssm[spare] == 3.0).all()
        assert new.views(layer).ssm[others[0]].isnan().all()


def test_a_write_through_data_is_refused():
    @fa.register("full", "decode", "test_dirty_data")
    def dirty_data(spec, views, inputs):
        views.k.data.zero_()
        return fa.AttentionOutput(o=torch.zeros_like(inputs.q)), fa.writes(k=inputs.k, v=inputs.v)

    spec, st, _ = full_state()
    ma = fa.ModelAttention([spec], prefer=("test_dirty_data",))
    with ma.session(st, fa.Batch.decode(st, [0])) as s:
        with pytest.raises(fa.PurityError, match="'k'"):
            s.forward(0, full_inputs(spec, 1))


def test_building_a_batch_changes_nothing():
    specs = [full_spec(0), gdn_spec(1)]
    st = nan_state(specs, recurrent_ring=4).admit(0).admit(1).reserve({0: 6, 1: 6})
    st = st.apply(run(fa.ModelAttention(specs), st, fa.Batch.prefill(st, {0: 2, 1: 1}),
                      {0: full_inputs(specs[0], 3), 1: recurrent_inputs(specs[1], 3)})[1])
    snap, book = snapshot(st), bookkeeping(st)
    lent = st._storage.ring_lent
    batches = [fa.Batch.prefill(st, {0: 2}), fa.Batch.decode(st, [0, 1]), fa.Batch.verify(st, [1], num_draft=2),
               fa.Batch.verify(st, [0, 1], num_draft=1, recovery="replay"), fa.Batch.replay(st, {0: 2, 1: 1})]
    assert all(b.ring for b in batches)  # every one of them has spare ring rows to hand out
    assert st._storage.ring_lent == lent and bookkeeping(st) == book and unchanged(st, snap)
    with fa.ModelAttention(specs).session(st, batches[1]) as s:  # handing the rows out is the session's
        assert st._storage.ring_lent == (st.version, s.id)


# --------------------------------------------------------------------------- 10. sessions only


def test_a_registered_function_called_directly_raises():
    @fa.register("full", "decode", "test_direct")
    def direct(spec, views, inputs):  # pragma: no cover - only its guard is reachable by name
        raise AssertionError

    spec, st, ma = full_state()
    b = fa.Batch.decode(st, [0])
    book = bookkeeping(st)
    with pytest.raises(fa.OutsideSessionError, match=r"\('full', 'decode', 'test_direct'\) runs only inside a"):
        direct(spec, st.views(0), full_inputs(spec, 1))
    from fnattn.kinds.full import reference

    with pytest.raises(fa.OutsideSessionError, match="runs only inside a session"):
        reference.decode(spec, st.views(0), full_inputs(spec, 1))
    assert bookkeeping(st) == book
    assert b.step_id not in st._storage.applied_steps


def test_no_public_name_runs_a_builtin_backend_outside_a_session():
    """A decorated backend's module-level name is the guard. (The fast backends register private
    functions with ``register(...)(_decode)``: those names stay plain functions, and writes they return
    outside a session are unbound, which the apply refuses.)"""
    guards = 0
    for b in registry.all_backends():
        if not b.builtin:
            continue
        name = b.source.__name__
        attr = getattr(sys.modules[b.source.__module__], name, None)
        if hasattr(attr, "backend_key"):
            guards += 1
            with pytest.raises(fa.OutsideSessionError, match="runs only inside a session"):
                attr(None, None, None)
        else:
            assert name.startswith("_"), f"{b.source.__module__}.{name} runs backend {b.kind}/{b.phase}/{b.name}"
    assert guards >= 9  # the reference backends of full, mla and sparse_mla, gdn and kda at least


# --------------------------------------------------------------------------- 11. built-ins are checked


def test_every_builtin_backend_is_checked_and_annotated():
    builtins = [b for b in registry.all_backends() if b.builtin]
    assert {b.kind for b in builtins} >= {"full", "mla", "sparse_mla", "gdn", "kda"}
    bad = []
    for b in builtins:
        where = f"{b.kind}/{b.phase}/{b.name} ({b.source.__module__}.{b.source.__qualname__})"
        if not getattr(b.fn, "__fnattn_checked__", False):
            bad.append(f"{where}: fn is not wrapped by fnattn.checks.checked")
        params = inspect.signature(b.source).parameters
        missing = [n for n in ("spec", "views", "inputs") if n not in params
                   or params[n].annotation is inspect.Parameter.empty]
        if inspect.signature(b.source).return_annotation is inspect.Signature.empty:
            missing.append("return")
        if missing:
            bad.append(f"{where}: no annotation for {missing}")
    assert not bad, "\n".join(bad)


def test_a_user_backend_is_checked_too_but_not_held_to_builtin_rules():
    register_constant_backends()
    (b,) = [x for x in registry.all_backends() if x.name == "test_value"]
    assert not b.builtin and b.fn.__fnattn_checked__
