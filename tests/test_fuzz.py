"""Bad batch and delta values: always a clear error, never a touched state."""

import dataclasses

import pytest
import torch
from helpers import full_inputs, full_spec, nan_state, run, snapshot, unchanged
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st_

import fnattn as fa

SPECS = (full_spec(0), full_spec(1, hq=2, hkv=2, d=4))
bad_count = st_.one_of(st_.integers(max_value=0), st_.just(True), st_.floats(allow_nan=True), st_.text(max_size=2),
                       st_.integers(min_value=100, max_value=10_000))


def fresh():
    state = nan_state(SPECS, num_pages=8, page_size=4).admit(0).admit(1)
    return state.reserve({0: 6, 1: 2})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rid=st_.sampled_from([0, 1, 5, -1]), count=bad_count)
def test_bad_batch_counts_raise_and_touch_nothing(rid, count):
    state = fresh()
    snap = snapshot(state)
    with pytest.raises(ValueError, match="Batch.prefill: `(counts|request_ids)"):
        fa.Batch.prefill(state, {rid: count} if rid in (0, 1) else {rid: 1})
    assert state.is_live and unchanged(state, snap)


@settings(max_examples=30, deadline=None)
@given(k=st_.one_of(st_.integers(max_value=0), st_.just(False), st_.floats(0.5, 2.0)))
def test_bad_draft_counts_raise(k):
    with pytest.raises(ValueError, match="`num_draft`"):
        fa.Batch.verify(fresh(), [0], num_draft=k)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layer=st_.sampled_from([0, 1]),
    field=st_.sampled_from(["slots", "k", "v"]),
    how=st_.sampled_from(["shape", "dtype", "range", "negative_only"]),
)
def test_bad_deltas_raise_and_touch_nothing(layer, field, how):
    _bad_delta(layer, field, how)


def test_slot_mapping_of_another_dtype_is_refused():
    _bad_delta(0, "slots", "dtype")


def _bad_delta(layer, field, how):
    """Values of one layer's writes, or the rows the batch gives them (writes carry no index: the batch's
    ``slot_mapping`` says where each token goes, so "bad slots" are a tampered batch)."""
    state = fresh()
    batch = fa.Batch.prefill(state, {0: 6, 1: 2})
    ma = fa.ModelAttention(SPECS)
    _, deltas = run(ma, state, batch, {i: full_inputs(SPECS[i], 8) for i in range(2)})
    w = deltas.writes[layer]
    value = batch.slot_mapping if field == "slots" else w[field]
    if how == "shape":
        value = value[:-1]
    elif how == "dtype":
        value = value.to(torch.float16) if field != "slots" else value.float()
    elif how == "range":  # slots past the pool, or values of the wrong head dim
        value = value + 10_000 if field == "slots" else value[..., :1]
    else:  # slots of no token at all; for values: the same values again (a valid step)
        value = -torch.ones_like(value) if field == "slots" else value
    if field == "slots":
        bad = dataclasses.replace(deltas, batch=dataclasses.replace(batch, slot_mapping=value))
    else:
        bad = dataclasses.replace(deltas, writes=tuple(
            dataclasses.replace(x, values={**x.values, field: value}) if i == layer else x
            for i, x in enumerate(deltas.writes)))
    snap = snapshot(state)
    if how == "negative_only" and field != "slots":
        new = state.apply(bad)
        assert new.request(0).length == 6
        return
    named = "batch\\.slot_mapping" if field == "slots" else field
    with pytest.raises(ValueError, match=f"`{named}`"):
        state.apply(bad)
    assert state.is_live and unchanged(state, snap) and state.request(0).length == 0
