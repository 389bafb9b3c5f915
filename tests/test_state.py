import dataclasses

import pytest
import torch
from helpers import full_inputs, full_spec, nan_state, run, snapshot, unchanged

import fnattn as fa


def two_layer_step(state=None, n=5):
    specs = (full_spec(0), full_spec(1))
    state = state or nan_state(specs)
    state = state.admit(7).reserve({7: n})
    batch = fa.Batch.prefill(state, {7: n})
    ma = fa.ModelAttention(specs)
    _, deltas = run(ma, state, batch, {i: full_inputs(specs[i], n) for i in range(2)})
    return specs, state, batch, deltas


def test_allocator_admit_reserve_release_and_exhaustion():
    specs = (full_spec(0),)
    st = fa.State(specs, num_pages=4, page_size=4, max_requests=2)
    st = st.admit(0).admit(1)
    with pytest.raises(fa.PoolExhaustedError, match="max_requests=2"):
        st.admit(2)
    with pytest.raises(ValueError, match="`request_id`"):
        st.admit(1)
    st = st.reserve({0: 9})  # 3 pages
    assert st.request(0).pages == (0, 1, 2) and st.free_pages == 1
    before = st
    with pytest.raises(fa.PoolExhaustedError, match="2 more pages"):
        st.reserve({1: 5})
    assert before.is_live and st.free_pages == 1  # a refused reserve changes nothing
    with pytest.raises(ValueError, match="`counts\\[0\\]`"):
        st.reserve({0: -1})
    st = st.release(0).release(1)
    assert st.free_pages == 4 and st.free_slots == 2 and not st.requests
    with pytest.raises(ValueError, match="`request_id`"):
        st.release(0)


def test_stale_handle_raises_on_any_use():
    specs = (full_spec(0),)
    st = fa.State(specs, num_pages=4)
    st2 = st.admit(0)
    for use in (lambda: st.views(0), lambda: st.admit(1), lambda: st.requests, lambda: st.version,
                lambda: st.checkpoint([0]), lambda: fa.Batch.decode(st, [0])):
        with pytest.raises(fa.StaleStateError, match="replaced by version"):
            use()
    assert st2.is_live and not st.is_live


def test_apply_writes_rows_advances_cursor_and_refuses_a_second_apply():
    specs, st, batch, deltas = two_layer_step()
    new = st.apply(deltas)
    assert new.request(7).length == 5
    k0 = new.views(0).k.flatten(0, 1)[batch.slot_mapping]
    assert torch.equal(k0, deltas.writes[0].k)
    with pytest.raises(fa.DoubleApplyError, match=f"step {deltas.step_id}"):
        new.apply(deltas)
    with pytest.raises(fa.StaleStateError):
        st.apply(deltas)


def test_copy_mode_keeps_the_old_handle_and_its_bytes():
    specs, st, batch, deltas = two_layer_step()
    snap = snapshot(st)
    copy = st.apply(deltas, inplace=False)
    assert st.is_live and copy.is_live and unchanged(st, snap)
    assert copy.request(7).length == 5 and st.request(7).length == 0
    assert not torch.equal(copy.views(0).k.nan_to_num(), st.views(0).k.nan_to_num())


def _bad_variants(deltas):
    kv = deltas.writes[1]
    yield "k", dataclasses.replace(kv, k=kv.k[:, :1])
    yield "v", dataclasses.replace(kv, v=kv.v.double())
    yield "slots", dataclasses.replace(kv, slots=kv.slots + 10_000)
    yield "slots", dataclasses.replace(kv, slots=kv.slots.float())
    yield "layer", dataclasses.replace(kv, layer=9)


@pytest.mark.parametrize("which", range(5))
def test_one_malformed_delta_changes_no_byte(which):
    specs, st, batch, deltas = two_layer_step()
    field, bad = list(_bad_variants(deltas))[which]
    broken = dataclasses.replace(deltas, writes=(deltas.writes[0], bad))
    snap = snapshot(st)
    with pytest.raises(ValueError, match=f"`{field}`"):
        st.apply(broken)
    assert st.is_live and unchanged(st, snap) and st.request(7).length == 0
    st.apply(deltas)  # the well-formed step still applies afterwards


def test_cursor_beyond_reserved_room_is_refused_before_writing():
    specs, st, batch, deltas = two_layer_step()
    snap = snapshot(st)
    greedy = dataclasses.replace(deltas, cursor=fa.CursorAdvance((7,), (9,)))
    with pytest.raises(ValueError, match="reserved room"):
        st.apply(greedy)
    assert unchanged(st, snap)


def test_deltas_from_another_state_version_are_refused():
    specs, st, batch, deltas = two_layer_step()
    moved = st.admit(8)
    with pytest.raises(fa.StaleDeltasError, match="version"):
        moved.apply(deltas)


def test_checkpoint_restore_rolls_back_the_cursor():
    specs, st, batch, deltas = two_layer_step()
    st = st.apply(deltas)
    ckpt = st.checkpoint([7])
    st = st.reserve({7: 1})
    b = fa.Batch.decode(st, [7])
    ma = fa.ModelAttention(specs)
    _, d = run(ma, st, b, {i: full_inputs(specs[i], 1) for i in range(2)})
    st = st.apply(d)
    assert st.request(7).length == 6
    st = st.restore(ckpt)
    assert st.request(7).length == 5
    released = st.release(7).admit(7)
    with pytest.raises(ValueError, match="`checkpoint`"):
        released.restore(ckpt)
