"""The apply trusts nothing: one test per defect class (DESIGN.md, "The apply trusts nothing").

Each test hands `State.apply` / `State.restore` something malformed and checks that the
error names the argument and that nothing changed: every storage byte, the handle still
live, cursors, allocator and ring lending as they were (`helpers.assert_refused`).
Bad arguments, purity and the registry are in test_trusts_nothing_api.py.
"""

import dataclasses

import pytest
import torch
from helpers import (
    assert_refused,
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
    same_bits,
)

import fnattn as fa

R = dataclasses.replace
# Two pools, each shared by two layers: full (0, 2) and gdn (1, 3); layer 3 is the last to write.
SPECS = (full_spec(0), gdn_spec(1), full_spec(2), gdn_spec(3))


@pytest.fixture(autouse=True)
def _own_registry():
    with registry_scope():
        yield


def layer_inputs(T, seed=0, *, requires_grad=False):
    out = {}
    for s in SPECS:
        if s.kind == "full":
            x = full_inputs(s, T, gen=torch.Generator().manual_seed(seed + s.index))
        else:
            x = recurrent_inputs(s, T, seed=seed + s.index)
        if requires_grad:
            x = R(x, **{f.name: getattr(x, f.name).clone().requires_grad_(True) for f in dataclasses.fields(x)
                        if isinstance(getattr(x, f.name), torch.Tensor) and getattr(x, f.name).is_floating_point()})
        out[s.index] = x
    return out


def prefilled(ring=2):
    """Two requests with a few tokens cached (so every pool holds real rows), room for more."""
    ma = fa.ModelAttention(SPECS)
    st = nan_state(SPECS, recurrent_ring=ring).admit(0).admit(1).reserve({0: 3, 1: 2})
    b = fa.Batch.prefill(st, {0: 3, 1: 2})
    st = st.apply(run(ma, st, b, layer_inputs(5))[1])
    return ma, st.reserve({0: 4, 1: 4})


def decode(ma, st, seed=1, **kw):
    b = fa.Batch.decode(st, [0, 1])
    return b, run(ma, st, b, layer_inputs(2, seed, **kw))[1]


def with_values(deltas, layer, **change):
    """``deltas`` with some write values of layer ``layer`` replaced (or added)."""
    return R(deltas, writes=tuple(R(w, values={**w.values, **change}) if w.layer == layer else w
                                  for w in deltas.writes))


# --------------------------------------------------------------------------- 1. all or nothing


BAD_VALUES = {  # what -> (layer, name, the bad value from the step's deltas and state)
    "a view of the pool": (2, "k", lambda st, d: st.views(0).k.reshape(-1, *d.writes[2]["k"].shape[1:])[:2]),
    "a view of the layer's own rows": (2, "k", lambda st, d: st.views(2).k.flatten(0, 1)[:2]),
    "a sparse tensor": (2, "k", lambda st, d: d.writes[2]["k"].to_sparse()),
    "a wrong dtype": (3, "ssm", lambda st, d: d.writes[3]["ssm"].double()),
    "a wrong shape": (3, "conv", lambda st, d: d.writes[3]["conv"][:1]),
    "a wrong device": (3, "ssm", lambda st, d: d.writes[3]["ssm"].to("meta")),
}


@pytest.mark.parametrize("what", list(BAD_VALUES))
def test_a_malformed_value_of_a_later_layer_leaves_every_layer_untouched(what):
    layer, name, make = BAD_VALUES[what]
    ma, st = prefilled()
    b, d = decode(ma, st)
    assert [w.layer for w in d.writes] == [0, 1, 2, 3]  # the bad one comes after good ones
    assert_refused(st, lambda: st.apply(with_values(d, layer, **{name: make(st, d)})), f"layer {layer}: `{name}`")
    assert st.apply(d).request(0).length == 4  # the well-formed step still applies


def test_a_value_aliasing_another_storage_tensor_is_refused():
    ma, st = prefilled()
    b, d = decode(ma, st)
    k_rows = st.views(2).k.flatten(0, 1)[:2]  # same row shape as V here (head_dim_v == head_dim)
    assert_refused(st, lambda: st.apply(with_values(d, 2, v=k_rows)), "layer 2: `v`")


def test_a_value_sharing_pool_memory_through_another_storage_is_refused():
    ma, st = prefilled()
    b, d = decode(ma, st)
    pool = st.pools["full0"].tensors["k"]  # [L, P, S, H, D]
    rows = torch.from_numpy(pool.numpy()[1].reshape(-1, *pool.shape[3:])[:2])  # layer 2's first two rows
    assert_refused(st, lambda: st.apply(with_values(d, 2, k=rows)), "layer 2: `k`")


def test_restore_of_tampered_copies_writes_nothing():
    ma, st = prefilled()
    ckpt = st.checkpoint([0, 1])
    b, d = decode(ma, st)
    st = st.apply(d)
    (ssm_key,) = [k for k in ckpt.recurrent if k[1] == "ssm"]
    (conv_key,) = [k for k in ckpt.recurrent if k[1] == "conv"]
    ssm, conv = ckpt.recurrent[ssm_key], ckpt.recurrent[conv_key]
    for key, value in ((conv_key, conv[:, :1]), (conv_key, conv.double()), (conv_key, conv.to("meta")),
                       (conv_key, conv.to_sparse()), (ssm_key, ssm.unsqueeze(-1))):
        # the other tensor is well formed: a restore that wrote it before checking this one would show
        bad = R(ckpt, recurrent={**ckpt.recurrent, key: value})
        assert_refused(st, lambda bad=bad: st.restore(bad), r"`checkpoint\.recurrent\[")
    assert_refused(st, lambda: st.restore(R(ckpt, recurrent={ssm_key: ssm})), "`checkpoint`")
    assert st.restore(ckpt).request(0).length == 3


# --------------------------------------------------------------------------- 2. the batch decides the rows


def test_writes_carry_no_index():
    assert {f.name for f in dataclasses.fields(fa.Writes)} == {"values", "layer", "step", "session"}


def _tampered_batches(st, b):
    other = {0: 1, 1: 0}  # each request's entry gets the other request's row
    free_page = next(p for p in range(st.num_pages) if all(p not in r.pages for r in st.requests.values()))
    yield "slot_mapping", R(b, slot_mapping=b.slot_mapping.flip(0)), r"`batch\.slot_mapping`"
    yield "recurrent_slots", R(b, recurrent_slots=b.recurrent_slots.flip(0)), r"`batch\.recurrent_slots`"
    yield "host_pages", R(b, host_pages=((free_page,),) + b.host_pages[1:]), "`batch`"
    yield "host_cache_lens", R(b, host_cache_lens=b.host_cache_lens[::-1]), "`batch`"
    yield "host_ring_pos", R(b, host_ring_pos=tuple(1 - p for p in b.host_ring_pos)), "`batch`"
    yield "request_ids", R(b, request_ids=tuple(other[r] for r in b.request_ids)), "`batch`"


@pytest.mark.parametrize("field", ["slot_mapping", "recurrent_slots", "host_pages", "host_cache_lens",
                                   "host_ring_pos", "request_ids"])
def test_a_batch_whose_metadata_was_tampered_is_refused(field):
    ma, st = prefilled()
    b, d = decode(ma, st)
    (tampered, match), = [(t, m) for f, t, m in _tampered_batches(st, b) if f == field]
    assert_refused(st, lambda: st.apply(R(d, batch=tampered)), match)
    assert st.apply(d).request(1).length == 3


@pytest.mark.parametrize("field", [
    "recurrent_write_rows",
    "block_table",
    "cache_lens",
    "positions",
])
def test_a_batch_whose_device_tensors_disagree_with_the_state_is_refused(field):
    ma, st = prefilled()
    b, d = decode(ma, st)
    if field == "recurrent_write_rows":
        value = torch.tensor([st.recurrent_row(1), b.recurrent_write_rows[1].item()])
    else:
        value = getattr(b, field).flip(0)
    assert not torch.equal(value, getattr(b, field))
    assert_refused(st, lambda: st.apply(R(d, batch=R(b, **{field: value}))), rf"`batch\.{field}`")


@pytest.mark.parametrize("field", ["slot_mapping", "block_table", "cache_lens", "recurrent_write_rows"])
def test_a_batch_tensor_changed_in_place_after_it_was_built_is_refused(field):
    """A Batch's own tensors are read back unless they are provably as built: an in-place op after
    `Batch.decode` moves their version counter, so the apply compares them with the State again."""
    ma, st = prefilled()
    b, d = decode(ma, st)
    t = getattr(b, field)
    t.view(-1)[0] += 1
    assert_refused(st, lambda: st.apply(d), rf"`batch\.{field}`")
    t.view(-1)[0] -= 1  # the same values again, the counter still moved: read back, and accepted
    assert st.apply(d).request(1).length == 3


def test_a_batch_round_trips_through_pickle_and_is_checked_in_full():
    """A Batch pickles (its record of what it was built from holds no unpicklable reference); unpickling
    rebuilds its tensors, which moves their version counters, so the apply derives the copy's rows again,
    and accepts its deltas."""
    import pickle

    from fnattn.batch import unchanged_since_built

    ma, st = prefilled()
    b = fa.Batch.decode(st, [0, 1])
    copy = pickle.loads(pickle.dumps(b))
    assert unchanged_since_built(b, st) and not unchanged_since_built(copy, st)
    d = run(ma, st, copy, layer_inputs(2, 1))[1]
    assert st.apply(d).request(1).length == 3


def test_duplicate_request_ids_are_refused_when_the_batch_is_built():
    ma, st = prefilled()
    for build in (lambda: fa.Batch.decode(st, [0, 1, 0]), lambda: fa.Batch.verify(st, [1, 1], num_draft=1)):
        assert_refused(st, build, "`request_ids` must be unique")
    with pytest.raises(ValueError, match="`request_ids`"):
        fa.CursorAdvance((0, 0), (1, 1))


# --------------------------------------------------------------------------- 3. complete, and the cursor


def test_incomplete_writes_and_a_cursor_past_them_are_refused():
    ma, st = prefilled()
    b, d = decode(ma, st)
    w = {x.layer: x for x in d.writes}
    c = d.cursor
    n = c.counts[0]
    cases = [
        (R(d, writes=tuple(x for x in d.writes if x.layer != 2)), "`writes` must be a Writes for every layer"),
        (R(d, writes=()), "`writes` must be a Writes for every layer"),
        (R(d, writes=tuple(R(x, values={"k": x["k"]}) if x.layer == 0 else x for x in d.writes)),
         "layer 0: `values` must be exactly"),
        (with_values(d, 2, q=w[2]["k"]), "layer 2: `values` must be exactly"),
        (R(d, writes=d.writes + (w[1],)), "`layer` must be one Writes per layer"),
        (R(d, writes=tuple(R(x, step=x.step + 1) if x.layer == 3 else x for x in d.writes)), "`step`"),
        (R(d, writes=tuple(R(x, layer=None, step=None) if x.layer == 0 else x for x in d.writes)), "`layer`"),
        (R(d, cursor=fa.CursorAdvance(c.request_ids, (n + 1, *c.counts[1:]), ring=c.ring)), "`cursor`"),
        (R(d, cursor=fa.CursorAdvance(c.request_ids, tuple(x + 1 for x in c.counts))), "`cursor`"),
        (R(d, cursor=fa.CursorAdvance(c.request_ids, c.counts, ring=tuple(1 - p for p in c.ring))), "`cursor`"),
        (R(d, cursor=fa.CursorAdvance(c.request_ids, c.counts)), "`cursor`"),
        (R(d, cursor=fa.CursorAdvance(c.request_ids[:1], c.counts[:1], ring=c.ring[:1])), "`cursor`"),
    ]
    for bad, match in cases:
        assert_refused(st, lambda bad=bad: st.apply(bad), match)
    assert st.apply(d).request(0).length == 4


def test_a_layer_whose_backend_wrote_nothing_is_refused():
    @fa.register("full", "decode", "test_writes_nothing")
    def writes_nothing(spec, views, inputs):
        return fa.AttentionOutput(o=torch.zeros_like(inputs.q)), None

    ma, st = prefilled()
    ma2 = fa.ModelAttention(SPECS, prefer=("test_writes_nothing", "reference"))
    b = fa.Batch.decode(st, [0, 1])
    _, d = run(ma2, st, b, layer_inputs(2))
    assert sorted(w.layer for w in d.writes) == [1, 3]
    assert_refused(st, lambda: st.apply(d), r"`writes` must be a Writes for every layer that owns storage \(layer 0")


# --------------------------------------------------------------------------- 4. the ring


def gdn_state(ring=2):
    return nan_state([gdn_spec(0), gdn_spec(1)], recurrent_ring=ring).admit(0).reserve({0: 4})


def test_a_ring_move_needs_every_recurrent_layer_and_both_tensors():
    st = gdn_state()
    b, d = ring_step(st, [0], value=1.0)
    assert b.ring and d.cursor.ring == (1,)
    assert_refused(st, lambda: st.apply(R(d, writes=d.writes[:1])), "`writes` must be a Writes for every layer")

    @fa.register("gdn", "decode", "test_ssm_only")
    def ssm_only(spec, views, inputs):
        out, ssm, _ = constant_states(spec, inputs)
        return out, fa.writes(ssm=ssm)

    ma = fa.ModelAttention(st.specs, prefer=("test_ssm_only",))
    b2 = fa.Batch.decode(st, [0])
    _, d2 = run(ma, st, b2, {s.index: recurrent_inputs(s, 1) for s in st.specs})
    assert_refused(st, lambda: st.apply(d2), r"layer 0: `values` must be exactly the tensors \['conv', 'ssm'\]")
    assert st.apply(d).request(0).ring_pos == 1


def test_in_place_writes_on_rows_lent_to_a_later_session_are_stale():
    st = gdn_state()
    _, old = ring_step(st, [0], value=1.0, in_place=True)
    assert all(w["ssm"] is None for w in old.writes)
    _, newer = ring_step(st, [0], value=5.0, in_place=True)  # a later session is handed the same spare rows
    assert_refused(st, lambda: st.apply(old), "spare ring rows", fa.StaleDeltasError)
    st = st.apply(newer)
    assert (st.views(0).ssm[st.recurrent_row(0)] == 5.0).all()


def test_in_place_writes_without_a_ring_are_refused():
    register_constant_backends()
    st = gdn_state(ring=1)
    ma = fa.ModelAttention(st.specs, prefer=("test_value",))
    b = fa.Batch.decode(st, [0])
    assert not b.ring
    _, d = run(ma, st, b, {s.index: recurrent_inputs(s, 1) for s in st.specs})
    assert_refused(st, lambda: st.apply(with_values(d, 1, ssm=None)), "layer 1: `ssm` must be a tensor")


# --------------------------------------------------------------------------- 5. restore


def test_restore_refuses_checkpoints_it_cannot_trust():
    ma, st = prefilled()
    early = st.checkpoint([0])
    b, d = decode(ma, st)
    st = st.apply(d)
    late = st.checkpoint([0])

    other = prefilled()[1]  # another State of the same specs and requests
    assert_refused(other, lambda: other.restore(early), "`checkpoint` must be a checkpoint of this State")

    copy = st.apply(decode(ma, st, seed=2)[1], inplace=False)  # a copy-mode apply starts a new lineage
    assert copy.lineage != st.lineage
    assert_refused(copy, lambda: copy.restore(late), "`checkpoint` must be a checkpoint of this State")

    st = st.restore(early)  # back to 3 tokens, then token 3 is written again, differently
    b = fa.Batch.decode(st, [0])
    _, d = run(ma, st, b, layer_inputs(1, seed=9))
    st = st.apply(d)
    assert_refused(st, lambda: st.restore(late), "`checkpoint` must be a checkpoint whose rows request 0 still")
    back = st.restore(early)  # the earlier checkpoint is still good
    assert back.request(0).length == 3


def test_restore_refuses_a_checkpoint_of_a_released_and_readmitted_request():
    ma, st = prefilled()
    ckpt = st.checkpoint([1])
    st = st.release(1).admit(1)
    assert_refused(st, lambda: st.restore(ckpt), "`checkpoint` must be the admission of request 1")


def test_restore_refuses_a_checkpoint_whose_request_cursor_was_forged():
    ma, st = prefilled()
    ckpt = st.checkpoint([0])
    (req,) = ckpt.requests
    for forged in (R(req, length=40), R(req, ring_pos=st.recurrent_ring + 5)):
        assert_refused(st, lambda f=forged: st.restore(R(ckpt, requests=(f,))), "`checkpoint")


# --------------------------------------------------------------------------- 6. autograd


def test_values_requiring_grad_never_pull_the_pools_into_autograd():
    ma, st = prefilled()
    b, d = decode(ma, st, requires_grad=True)
    assert any(v is not None and v.requires_grad for w in d.writes for v in w.values.values())
    k = d.writes[0]["k"]
    spliced = with_values(d, 0, k=(k.detach().clone().requires_grad_(True) * 2))  # a value with a grad_fn
    for deltas, inplace in ((d, False), (spliced, True)):
        new = st.apply(deltas, inplace=inplace)
        for pool in new.pools.values():
            for t in pool.tensors.values():
                assert not t.requires_grad and t.grad_fn is None
        views = new.views(0)
        assert not views.k.requires_grad and views.k.grad_fn is None
        assert same_bits(views.k.flatten(0, 1)[b.slot_mapping], deltas.writes[0]["k"].detach())

