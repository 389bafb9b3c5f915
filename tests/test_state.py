import dataclasses
import re

import pytest
import torch
from helpers import full_inputs, full_spec, gdn_spec, nan_state, registry_scope, ring_step, run, snapshot, unchanged

import fnattn as fa


@pytest.fixture(autouse=True)
def _own_registry():
    with registry_scope():
        yield


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
    assert st.request(0).pages == (1, 2, 3) and st.free_pages == 1
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
    assert torch.equal(k0, deltas.writes[0]["k"])
    with pytest.raises(fa.DoubleApplyError, match=f"step {deltas.step_id}"):
        new.apply(deltas)
    with pytest.raises(fa.StaleStateError):
        st.apply(deltas)


def test_a_long_run_remembers_a_bounded_window_of_applied_steps():
    """Each apply copies what the storage remembers of applied steps: after many steps that stays a short
    window (no set growing with the run), and the last step's deltas are still refused as a double apply."""
    specs = (full_spec(0),)
    st = fa.State(specs, num_pages=64, page_size=4, max_requests=1).admit(0)
    ma = fa.ModelAttention(specs)
    for _ in range(150):
        st = st.reserve({0: 1})
        b = fa.Batch.decode(st, [0])
        _, deltas = run(ma, st, b, {0: full_inputs(specs[0], 1)})
        st = st.apply(deltas)
        if st.request(0).length % 60 == 0:  # keep within the pages: release and start again
            st = st.release(0).admit(0)
    assert len(st._storage.applied_steps) <= 64 and st._storage.applied_steps[-1] == deltas.step_id
    with pytest.raises(fa.DoubleApplyError, match=f"step {deltas.step_id}"):
        st.apply(deltas)


def test_copy_mode_keeps_the_old_handle_and_its_bytes():
    specs, st, batch, deltas = two_layer_step()
    snap = snapshot(st)
    copy = st.apply(deltas, inplace=False)
    assert st.is_live and copy.is_live and unchanged(st, snap)
    assert copy.request(7).length == 5 and st.request(7).length == 0
    assert not torch.equal(copy.views(0).k.nan_to_num(), st.views(0).k.nan_to_num())


def _bad_variants(deltas):
    """(the argument the error names, a broken step): the second layer's writes, or the step's batch."""
    kv, batch = deltas.writes[1], deltas.batch

    def values(**change):
        return dataclasses.replace(deltas, writes=(deltas.writes[0], dataclasses.replace(
            kv, values={**kv.values, **change})))

    yield "k", values(k=kv["k"][:, :1])
    yield "v", values(v=kv["v"].double())
    # Rows come from the batch: a batch pointing past the pool, or with another index dtype, is refused.
    yield "batch.slot_mapping", dataclasses.replace(
        deltas, batch=dataclasses.replace(batch, slot_mapping=batch.slot_mapping + 10_000))
    yield "batch.slot_mapping", dataclasses.replace(
        deltas, batch=dataclasses.replace(batch, slot_mapping=batch.slot_mapping.float()))
    yield "layer", dataclasses.replace(deltas, writes=(deltas.writes[0], dataclasses.replace(kv, layer=9)))


@pytest.mark.parametrize("which", range(5))
def test_one_malformed_delta_changes_no_byte(which):
    specs, st, batch, deltas = two_layer_step()
    field, broken = list(_bad_variants(deltas))[which]
    snap = snapshot(st)
    with pytest.raises(ValueError, match=f"`{re.escape(field)}`"):
        st.apply(broken)
    assert st.is_live and unchanged(st, snap) and st.request(7).length == 0
    st.apply(deltas)  # the well-formed step still applies afterwards


def test_cursor_beyond_reserved_room_is_refused_before_writing():
    specs, st, batch, deltas = two_layer_step()
    snap = snapshot(st)
    greedy = dataclasses.replace(deltas, cursor=fa.CursorAdvance((7,), (9,)))
    with pytest.raises(ValueError, match="`cursor` must be the advance the batch and acceptance imply"):
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


def test_a_speculative_loop_keeps_a_bounded_rollback_history():
    """A draft restored every step (checkpoint, speculative tokens, restore at a longer length each time) keeps
    at most ROLLBACKS_KEPT rollbacks, so a restore's checks do not grow with the generation; a checkpoint
    older than the kept history is refused by name, a recent one restores."""
    from fnattn.request import ROLLBACKS_KEPT

    specs = [full_spec(0)]
    st = fa.State(specs, num_pages=64, page_size=4, max_requests=2).admit(0)
    oldest = st.checkpoint([0])
    for _ in range(3 * ROLLBACKS_KEPT):
        st = st.reserve({0: 2})
        st = st.apply(_step_deltas(specs, st, 2))  # two tokens kept
        ckpt = st.checkpoint([0])
        st = st.reserve({0: 1})
        st = st.apply(_step_deltas(specs, st, 1))  # a speculative one, rolled back
        st = st.restore(ckpt)
    req = st.request(0)
    assert len(req.rollbacks) == ROLLBACKS_KEPT and req.rollbacks_from > oldest.serial
    with pytest.raises(ValueError, match=r"`checkpoint` must be a checkpoint of request 0 taken after its oldest "
                                         r"kept rollback"):
        st.restore(oldest)
    assert st.restore(ckpt).request(0).length == req.length


def test_rollbacks_stay_ordered_and_later_ones_are_those_a_scan_finds():
    """`Request.rolled_back` keeps the rollbacks in increasing serial and length (a restore to fewer tokens drops
    the ones to as many or more), so `later_rollbacks` (a bisection) names what a scan of them all would."""
    from fnattn.request import ROLLBACKS_KEPT, Request

    gen = torch.Generator().manual_seed(5)
    req = Request(0, 1, (1, 2, 3), 0)
    for serial in range(1, 4 * ROLLBACKS_KEPT):
        req = req.rolled_back(serial, int(torch.randint(0, 12, (1,), generator=gen)), 0)
        kept = req.rollbacks
        assert list(kept) == sorted(kept) and [n for _, n in kept] == sorted({n for _, n in kept})
        assert len(kept) <= ROLLBACKS_KEPT
        for since in (0, serial // 2, serial - 1, serial):
            for below in range(13):
                scan = tuple(r for r in kept if r[0] > since and r[1] < below)
                assert req.later_rollbacks(since, below) == scan


def _step_deltas(specs, st, n):
    batch = fa.Batch.prefill(st, {0: n})
    return run(fa.ModelAttention(specs), st, batch, {0: full_inputs(specs[0], n)})[1]


# --------------------------------------------------------------------------- ring of recurrent rows


_gdn = gdn_spec
_ring_step = ring_step  # a decode step of every recurrent layer writing constant states (helpers)


def test_ring_rows_move_the_current_state_without_copying_it():
    st = fa.State([_gdn(0), _gdn(1)], num_pages=4, page_size=4, max_requests=3, recurrent_ring=3, fill=float("nan"))
    st = st.admit(0).admit(1).reserve({0: 8, 1: 8})
    assert st.views(0).ssm.shape[0] == 12 and st.recurrent_row(1) == 2 and st.recurrent_row(1, 2) == 10
    for i in range(4):
        before = st.recurrent_row(0)
        batch, deltas = _ring_step(st, [0, 1], value=float(i), in_place=i % 2 == 1)
        assert batch.ring == 3 and batch.recurrent_slots.tolist() == [st.recurrent_row(0), st.recurrent_row(1)]
        assert deltas.cursor.ring == ((i + 1) % 3,) * 2
        st = st.apply(deltas)
        assert st.request(0).ring_pos == (i + 1) % 3 and st.recurrent_row(0) != before
        for layer in (0, 1):
            assert (st.views(layer).ssm[st.recurrent_row(0)] == i).all()
    with pytest.raises(ValueError, match="`ring_pos`"):
        st.recurrent_row(0, 3)


def test_ring_of_one_overwrites_the_current_row():
    st = fa.State([_gdn()], num_pages=4, page_size=4, max_requests=2, recurrent_ring=1).admit(0).reserve({0: 2})
    batch, deltas = _ring_step(st, [0], value=2.0)
    assert batch.ring == 0 and deltas.cursor.ring is None and batch.recurrent_write_rows.tolist() == [1]
    st = st.apply(deltas)
    assert st.recurrent_row(0) == 1 and (st.views(0).ssm[1] == 2.0).all()
    with pytest.raises(ValueError, match="`recurrent_ring`"):
        fa.State([_gdn()], num_pages=4, recurrent_ring=0)


def test_in_place_states_of_an_older_batch_are_refused():
    st = fa.State([_gdn()], num_pages=4, page_size=4, max_requests=2).admit(0).reserve({0: 2})
    _, old = _ring_step(st, [0], in_place=True)
    _ring_step(st, [0], value=5.0, in_place=True)  # a newer batch was handed (and filled) the same spare rows
    snap = snapshot(st)
    with pytest.raises(fa.StaleDeltasError, match="spare ring rows"):
        st.apply(old)
    assert unchanged(st, snap) and st.request(0).ring_pos == 0


def test_a_ring_move_needs_every_recurrent_layer_written():
    st = fa.State([_gdn(0), _gdn(1)], num_pages=4, page_size=4, max_requests=2).admit(0).reserve({0: 2})
    batch, deltas = _ring_step(st, [0])
    snap = snapshot(st)
    partial = dataclasses.replace(deltas, writes=deltas.writes[:1])
    with pytest.raises(ValueError, match="`writes`.*every layer"):
        st.apply(partial)
    unmoved = dataclasses.replace(deltas, cursor=fa.CursorAdvance((0,), (1,)))
    with pytest.raises(ValueError, match="`cursor`"):
        st.apply(unmoved)  # states in spare rows that nothing would point at
    out_of_range = dataclasses.replace(deltas, cursor=fa.CursorAdvance((0,), (1,), ring=(2,)))
    with pytest.raises(ValueError, match="`cursor`"):
        st.apply(out_of_range)
    assert unchanged(st, snap) and st.request(0).ring_pos == 0
    assert st.apply(deltas).request(0).ring_pos == 1


def test_checkpoint_restore_across_ring_moves():
    st = fa.State([_gdn()], num_pages=4, page_size=4, max_requests=2).admit(0).reserve({0: 4})
    _, d = _ring_step(st, [0], value=1.0)
    st = st.apply(d)
    ckpt = st.checkpoint([0])
    for v in (2.0, 3.0, 4.0):
        _, d = _ring_step(st, [0], value=v, in_place=True)
        st = st.apply(d)
    assert (st.views(0).ssm[st.recurrent_row(0)] == 4.0).all()
    st = st.restore(ckpt)
    assert st.request(0).length == 1 and (st.views(0).ssm[st.recurrent_row(0)] == 1.0).all()
    assert (st.views(0).conv[st.recurrent_row(0)] == 1.0).all()


def test_a_long_prefill_batch_holds_each_tokens_page_slot():
    """`Batch.prefill` derives its rows a page at a time: each token's slot is its page's, at its offset,
    across page boundaries and after a cached part that ends inside a page."""
    specs = (full_spec(0),)
    st = fa.State(specs, num_pages=40, page_size=4, max_requests=2).admit(0).admit(1)
    st = st.reserve({0: 3, 1: 5})
    b = fa.Batch.prefill(st, {0: 3, 1: 5})
    st = st.apply(run(fa.ModelAttention(specs), st, b, {0: full_inputs(specs[0], 8)})[1])
    st = st.reserve({0: 37, 1: 2})
    b = fa.Batch.prefill(st, {0: 37, 1: 2})
    want_pos, want_slots = [], []
    for rid, n in ((0, 37), (1, 2)):
        r = st.request(rid)
        for p in range(r.length, r.length + n):
            want_pos.append(p)
            want_slots.append(r.pages[p // 4] * 4 + p % 4)
    assert b.positions.tolist() == want_pos and b.slot_mapping.tolist() == want_slots
