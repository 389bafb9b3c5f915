"""A batch is checked for what it holds, not for its version counters.

Each test forges a batch the way a user can by mistake (building another batch into the same staging,
writing through `tensor.numpy()`, `dataclasses.replace` onto another request's rows, a strided column view,
a list in place of a tensor) and checks that the session and the apply refuse it by name, before anything
is written (`helpers.assert_refused`), on the reference and the CPU fast backends alike.
"""

import dataclasses

import pytest
import torch
from helpers import assert_refused, full_inputs, full_spec, gdn_spec, nan_state, recurrent_inputs, run

import fnattn as fa
from fnattn.lanes import Bucket, step_manifest
from fnattn.staging import Staging

R = dataclasses.replace
SPECS = (full_spec(0), gdn_spec(1))
PREFER = [None, ("reference",)]  # the CPU fast backends (sdpa, torch), then the references


def layer_inputs(T, seed=0):
    return {0: full_inputs(SPECS[0], T, gen=torch.Generator().manual_seed(seed)),
            1: recurrent_inputs(SPECS[1], T, seed=seed + 1)}


def prefilled(prefer=None):
    """Requests 0 and 1 with 3 and 2 tokens cached, room for one more each (one page each)."""
    ma = fa.ModelAttention(SPECS, prefer=prefer)
    st = nan_state(SPECS).admit(0).admit(1).reserve({0: 3, 1: 2})
    b = fa.Batch.prefill(st, {0: 3, 1: 2})
    st = st.apply(run(ma, st, b, layer_inputs(5))[1]).reserve({0: 1, 1: 1})
    return ma, st


def staging_for(st, lanes, columns):
    shapes = step_manifest(vocab=8).shapes(Bucket("decode", lanes, 0, columns))
    return Staging({name: shapes[name] for name in fa.batch.TENSOR_DTYPES}, fa.batch.TENSOR_DTYPES, st.device)


def enter(ma, st, batch):
    return lambda: ma.session(st, batch).__enter__()


# --------------------------------------------------------------- tensors rewritten after building
@pytest.mark.parametrize("prefer", PREFER)
def test_a_batch_built_later_into_the_same_staging_voids_the_earlier_one(prefer):
    """The staging's tensors are the batch's: the next batch built into it rewrites them through the host
    arrays, which moves no version counter. The earlier step's apply would write request 0's K/V and state
    into request 1's rows and back."""
    ma, st = prefilled(prefer)
    stage = staging_for(st, 2, 1)
    first = fa.Batch.decode(st, [0, 1], pad_to=2, columns=1, staging=stage)
    _, deltas = run(ma, st, first, layer_inputs(2, 1))
    fa.Batch.decode(st, [1, 0], pad_to=2, columns=1, staging=stage)  # request 1's rows first, in the same tensors
    assert_refused(st, lambda: st.apply(deltas), r"`batch\.")
    assert_refused(st, enter(ma, st, first), r"AttentionSession: `batch\.")
    fa.Batch.decode(st, [0, 1], pad_to=2, columns=1, staging=stage)  # its own rows again: read back, accepted
    assert st.apply(deltas).request(1).length == 3


def test_a_staging_counts_its_writes_and_a_batch_pickles_with_its_seal():
    import pickle

    from fnattn.batch import unchanged_since_built

    _, st = prefilled()
    stage = staging_for(st, 2, 1)
    b = fa.Batch.decode(st, [0, 1], pad_to=2, columns=1, staging=stage)
    assert unchanged_since_built(b, st) and stage.generation.value == 1
    copy = pickle.loads(pickle.dumps(b))
    assert not unchanged_since_built(copy, st) and unchanged_since_built(b, st)
    fa.Batch.decode(st, [0, 1], pad_to=2, columns=1, staging=stage)
    assert stage.generation.value == 2 and not unchanged_since_built(b, st)


@pytest.mark.parametrize("prefer", PREFER)
def test_a_write_through_numpy_after_building_is_seen(prefer):
    """`tensor.numpy()` shares the memory and moves no version counter: on the CPU the contents are compared."""
    ma, st = prefilled(prefer)
    b = fa.Batch.decode(st, [0, 1])
    _, deltas = run(ma, st, b, layer_inputs(2, 1))
    rows = b.slot_mapping.numpy()
    rows[:] = rows[::-1].copy()  # request 0's token goes to request 1's slot and back
    assert_refused(st, lambda: st.apply(deltas), r"`batch\.slot_mapping`")
    assert_refused(st, enter(ma, st, b), r"AttentionSession: `batch\.slot_mapping`")
    rows[:] = rows[::-1].copy()
    assert st.apply(deltas).request(0).length == 4


# --------------------------------------------------------------- copies of a batch
@pytest.mark.parametrize("prefer", PREFER)
def test_a_session_refuses_a_copied_batch_pointing_at_another_requests_pages(prefer):
    ma, st = prefilled(prefer)
    mine, theirs = fa.Batch.decode(st, [0]), fa.Batch.decode(st, [1])
    assert mine.host_pages != theirs.host_pages
    for field in ("block_table", "slot_mapping", "recurrent_slots", "recurrent_write_rows"):
        forged = R(mine, **{field: getattr(theirs, field)})
        assert_refused(st, enter(ma, st, forged), rf"AttentionSession: `batch\.{field}`")


def test_a_session_refuses_a_batch_of_a_twin_state():
    """Same requests, same pages, another State: the batch is not this handle's."""
    ma, st = prefilled()
    _, twin = prefilled()
    assert fa.Batch.decode(twin, [0]).host_pages == fa.Batch.decode(st, [0]).host_pages
    assert_refused(st, enter(ma, st, fa.Batch.decode(twin, [0])), "`batch` must be a batch built from this state")


# --------------------------------------------------------------- layouts and types
def _column(t):
    """``t``'s values as one column of a wider tensor: equal values, a strided view."""
    wide = torch.stack([t, torch.full_like(t, 7)], dim=-1)
    return wide[..., 0]


@pytest.mark.parametrize("prefer", PREFER)
@pytest.mark.parametrize("field", ["block_table", "slot_mapping", "cache_lens", "recurrent_slots"])
def test_a_strided_column_view_is_refused_by_name_never_misread(prefer, field):
    """A block table or slot list holding the right values as a strided view (a column of a wider table):
    kernels index packed rows, so it is refused, by the session and by the apply, before anything is read."""
    ma, st = prefilled(prefer)
    b = fa.Batch.decode(st, [0, 1])
    view = _column(getattr(b, field))
    assert torch.equal(view, getattr(b, field)) and not view.is_contiguous()
    forged = R(b, **{field: view})
    assert_refused(st, enter(ma, st, forged), rf"`batch\.{field}` must be a contiguous tensor")
    _, deltas = run(ma, st, b, layer_inputs(2, 1))
    tampered = fa.StepDeltas(forged, deltas.writes, deltas.cursor)
    assert_refused(st, lambda: st.apply(tampered), rf"`batch\.{field}` must be a contiguous tensor")


def test_a_non_tensor_field_is_refused_by_name():
    ma, st = prefilled()
    b = fa.Batch.decode(st, [0, 1])
    forged = R(b, block_table=b.block_table.tolist())
    assert_refused(st, enter(ma, st, forged), r"`batch\.block_table` must be a dense torch.Tensor, got 'list'")
    _, deltas = run(ma, st, b, layer_inputs(2, 1))
    tampered = fa.StepDeltas(forged, deltas.writes, deltas.cursor)
    assert_refused(st, lambda: st.apply(tampered), r"`batch\.block_table` must be a dense torch.Tensor")


@pytest.mark.parametrize("count", ["2", 2.0, None, True, 0])
def test_replay_counts_are_checked_by_name(count):
    _, st = prefilled()
    assert_refused(st, lambda: fa.Batch.replay(st, {0: 1, 1: count}), r"Batch.replay: `counts\[1\]` must be an int")
