"""`fa.probe` sees NaN and Inf, and probes verify steps (native and replay) against plain functions."""

import dataclasses
import math

import pytest
import torch
from helpers import full_inputs, full_spec, gdn_spec, nan_state, recurrent_inputs, registry_scope, run

import fnattn as fa
from fnattn.kinds.delta_rule import reference as delta_rule
from fnattn.registry import all_backends

FULL, GDN = full_spec(0), gdn_spec(1)


@pytest.fixture(autouse=True)
def _own_registry():
    with registry_scope():
        yield


def prefill_setup():
    st = nan_state([FULL, GDN]).admit(0).admit(1).reserve({0: 3, 1: 2})
    return st, fa.Batch.prefill(st, {0: 3, 1: 2})


def _registered(kind, phase):
    """The reference backend's function itself (the module's name for it is a guard outside sessions)."""
    return next(b.fn for b in all_backends() if (b.kind, b.phase, b.name) == (kind, phase, "reference"))


def full_prefill(spec, views, inputs):
    """A plain function of the kind: causal attention over the cache and the new tokens."""
    return _registered("full", "prefill")(spec, views, inputs)


def spoiled(kind, phase, name, spoil):
    """Register backend ``name``: the reference, then ``spoil(out, writes) -> (out, writes)``."""
    ref = _registered(kind, phase)

    @fa.register(kind, phase, name, replace=True)
    def backend(spec, views, inputs):
        return spoil(*ref(spec, views, inputs))

    return backend


def with_o(out, o):
    return dataclasses.replace(out, o=o)


def test_a_nan_output_or_row_is_a_difference_not_zero():
    st, b = prefill_setup()
    spoiled("full", "prefill", "all_nan", lambda out, w: (with_o(out, torch.full_like(out.o, math.nan)), w))
    spoiled("full", "prefill", "one_nan_row", lambda out, w: (with_o(out, out.o.clone().index_fill_(
        0, torch.tensor([2]), math.nan)), w))
    report = fa.probe(FULL, state=st, batch=b, inputs=full_inputs(FULL, 5),
                      backends=("reference", "all_nan", "one_nan_row"))
    rows = {r.backend: r for r in report.rows}
    assert rows["reference"].max_abs == 0 and rows["reference"].nonfinite == 0
    o_size = 5 * FULL.config.num_q_heads * FULL.config.head_dim_v
    assert math.isinf(rows["all_nan"].max_abs) and math.isinf(rows["all_nan"].max_rel)
    assert rows["all_nan"].nonfinite == rows["all_nan"].unmatched == o_size
    assert rows["all_nan"].reference_nonfinite == 0
    assert math.isinf(rows["one_nan_row"].max_abs) and rows["one_nan_row"].nonfinite == o_size // 5
    text = str(report)
    assert f"non-finite: {o_size} here, 0 in the reference" in text and "inf" in text


def test_nan_written_recurrent_rows_are_a_difference():
    st, b = prefill_setup()
    spoiled("gdn", "prefill", "nan_state",
            lambda out, w: (out, fa.writes(ssm=torch.full_like(w["ssm"], math.nan), conv=w["conv"])))
    report = fa.probe(GDN, state=st, batch=b, inputs=recurrent_inputs(GDN, 5), backends=("nan_state",))
    (row,) = report.rows
    c = GDN.config
    assert math.isinf(row.max_abs)
    assert row.nonfinite == row.unmatched == 2 * c.num_state_heads * c.head_k_dim * c.head_v_dim


def test_a_nan_reference_against_a_finite_backend_is_a_difference():
    st, b = prefill_setup()
    ref = _registered("full", "prefill")

    def nan_reference(spec, views, inputs):
        out, w = ref(spec, views, inputs)
        return with_o(out, out.o.clone().index_fill_(0, torch.tensor([0]), math.nan)), w

    report = fa.probe(FULL, state=st, batch=b, inputs=full_inputs(FULL, 5), reference=nan_reference)
    (row,) = report.rows
    assert math.isinf(row.max_abs) and row.nonfinite == 0 and row.reference_nonfinite == row.unmatched > 0


def test_the_same_non_finite_value_in_the_same_place_counts_as_equal_and_is_said():
    st, b = prefill_setup()
    ref = _registered("full", "prefill")

    def inf_at(value):
        def fn(out, w):
            o = out.o.clone()
            o[0, 0, 0] = value
            return with_o(out, o), w
        return fn

    spoiled("full", "prefill", "same_inf", inf_at(math.inf))
    spoiled("full", "prefill", "other_inf", inf_at(-math.inf))
    report = fa.probe(FULL, state=st, batch=b, inputs=full_inputs(FULL, 5), backends=("same_inf", "other_inf"),
                      reference=lambda spec, views, inputs: inf_at(math.inf)(*ref(spec, views, inputs)))
    same, other = report.rows
    assert same.max_abs == 0 and same.same_nonfinite == 1 and same.unmatched == 0
    assert same.nonfinite == same.reference_nonfinite == 1
    assert "1 the same in both (counted as equal)" in str(report)
    assert math.isinf(other.max_abs) and other.unmatched == 1 and other.same_nonfinite == 0


# ------------------------------------------------------------------------------------------------ verify
K = 2


def verify_setup(ring, recovery):
    ma = fa.ModelAttention([FULL, GDN], prefer=("reference",))
    st = nan_state([FULL, GDN], recurrent_ring=ring).admit(0).admit(1).reserve({0: 3, 1: 2})
    b = fa.Batch.prefill(st, {0: 3, 1: 2})
    st = st.apply(run(ma, st, b, {0: full_inputs(FULL, 5), 1: recurrent_inputs(GDN, 5)})[1])
    st = st.reserve({0: K + 1, 1: K + 1})
    return st, fa.Batch.verify(st, [0, 1], num_draft=K, recovery=recovery)


def plain_decode(spec, views, inputs):
    """A plain function of the kind: token by token, one state per request (the one after its last token)."""
    return delta_rule.per_request(spec, views, inputs, chunked=False)


@pytest.mark.parametrize("ring", [2, 5], ids=["verify-copies", "verify-in-ring"])
@pytest.mark.parametrize("recovery", ["native", "replay"])
def test_a_verify_probes_against_a_plain_function(recovery, ring):
    st, b = verify_setup(ring, recovery)
    T = 2 * (K + 1)
    report = fa.probe(GDN, state=st, batch=b, inputs=recurrent_inputs(GDN, T, seed=3), reference=plain_decode)
    assert report.rows[0].max_abs == 0 and report.rows[0].nonfinite == 0, str(report)
    report = fa.probe(FULL, state=st, batch=b, inputs=full_inputs(FULL, T), reference=full_prefill,
                      backends=("reference", "sdpa"))
    assert all(r.max_rel < 1e-5 for r in report.rows), str(report)


@pytest.mark.parametrize("recovery", ["native", "replay"])
def test_a_verify_whose_states_are_wrong_shows_in_the_probe(recovery):
    st, b = verify_setup(5, recovery)
    ref = _registered("gdn", "verify")

    @fa.register("gdn", "verify", "off_by_one", replace=True)
    def off_by_one(spec, views, inputs):  # right outputs, wrong states (native) or wrong replay inputs
        if inputs.meta.batch.recovery == "replay":
            out, w = ref(spec, views, inputs)
            return dataclasses.replace(out, replay=dataclasses.replace(out.replay, beta=out.replay.beta * 0.5)), w
        out, w = ref(spec, views, inputs)
        return out, fa.writes(ssm=w["ssm"] + 1, conv=w["conv"])

    report = fa.probe(GDN, state=st, batch=b, inputs=recurrent_inputs(GDN, 2 * (K + 1), seed=3),
                      backends=("off_by_one",), reference=plain_decode)
    assert report.rows[0].max_abs > 0.1 and math.isfinite(report.rows[0].max_abs)
