"""Captured steps without a GPU: the capture-free StepRunner, its lane checks, padding and the host-read guard."""

from dataclasses import replace

import pytest
import torch
from fnattn.models.registry import FAMILIES, _load_builtin, random_model
from helpers import gdn_spec

import fnattn as fa
from fnattn.graph import StepRunner
from fnattn.lanes import Bucket, HostReadError, Lane, LaneError, Manifest, check_lanes, no_host_reads, step_manifest
from fnattn.models import tiny
from fnattn.speculative import Speculator

_load_builtin()
FAMILY_NAMES = sorted(FAMILIES)
NAN = float("nan")


def _state(specs, **kw):
    kw = {"num_pages": 32, "page_size": 8, "max_requests": 4, "fill": NAN, "recurrent_ring": 4, **kw}
    return fa.State(specs, **kw)


def _prefill(step, params, attn, st, prompts):
    for r in prompts:
        st = st.admit(r)
    st = st.reserve({r: len(p) for r, p in prompts.items()})
    b = fa.Batch.prefill(st, {r: len(p) for r, p in prompts.items()})
    tok = torch.tensor([t for r in b.request_ids for t in prompts[r]])
    with attn.session(st, b) as s:
        logits, d = step(params, s, tok)
    return st.apply(d), {r: int(logits[b.host_cu_seqlens[i + 1] - 1].argmax()) for i, r in enumerate(b.request_ids)}


def _decode_run(model, attn, runner, steps=6):
    """Decode with requests joining (2 at step 2) and leaving (0 after step 3); ``-> logits per step``."""
    st, last = _prefill(model.step, model.params, attn, _state(model.specs), {0: [1, 2, 3, 4, 5], 1: [7, 8, 9]})
    out = []
    for i in range(steps):
        if i == 2:
            st, first = _prefill(model.step, model.params, attn, st, {2: [4, 4, 2]})
            last.update(first)
        if i == 4:
            st = st.release(0)
            del last[0]
        ids = list(last)
        st = st.reserve({r: 1 for r in ids})
        tok = torch.tensor([last[r] for r in ids])
        if runner is None:
            b = fa.Batch.decode(st, ids)
            with attn.session(st, b) as s:
                logits, d = model.step(model.params, s, tok)
            st = st.apply(d)
        else:
            st, logits = runner.decode(st, ids, tok)
        out.append(logits)
        last = {r: int(logits[j].argmax()) for j, r in enumerate(ids)}
    return out, st


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_capture_free_steps_equal_eager_steps_for_every_family(name):
    model = random_model(name)
    attn = fa.ModelAttention(model.specs)
    runner = StepRunner(model.step, model.params, attn, model.manifest(), host_reads="error", max_context=64,
                        buckets=(1, 2, 4))
    assert runner.capture is False
    want, _ = _decode_run(model, attn, None)
    got, st = _decode_run(model, attn, runner)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.isfinite(a).all()  # the NaN null page/slot never reached a live lane
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert {e.bucket.lanes for e in runner._entries.values()} == {2, 4}  # 2 requests, then 3, then 2 again
    assert st.free_slots == 2


@pytest.mark.parametrize("name", ["qwen3_5", "llama", "deepseek_v32"])
def test_a_prepared_next_batch_gives_the_steps_a_fresh_one_gives(name):
    """`decode` builds the next batch of the same requests after each step: a later step takes it only when
    it is what a fresh build would give. On the CPU the apply re-derives every row of a batch it has no seal
    for (a restamped one), so a prepared batch with any other rows would be refused here."""
    model = random_model(name)
    attn = fa.ModelAttention(model.specs)

    def runner(prepare):
        return StepRunner(model.step, model.params, attn, model.manifest(), max_context=64, buckets=(1, 2, 4),
                          prepare=prepare)

    fresh, prepared = runner(False), runner(True)
    assert fresh.prepare is False and runner(None).prepare is False  # None: where steps are captured
    want, want_state = _decode_run(model, attn, fresh, steps=12)
    got, got_state = _decode_run(model, attn, prepared, steps=12)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    used = sum(e.prepared_used for e in prepared._entries.values())
    # requests joining and leaving change the ids, and a page boundary leaves no room to prepare: neither is taken
    assert 0 < used < 12 and sum(e.prepared_used for e in fresh._entries.values()) == 0
    assert {r: got_state.request(r).length for r in got_state.requests} == \
        {r: want_state.request(r).length for r in want_state.requests}


def test_a_prepared_batch_is_not_taken_once_the_state_moved_under_it():
    model = random_model("qwen3_5")
    attn = fa.ModelAttention(model.specs)
    runner = StepRunner(model.step, model.params, attn, model.manifest(), max_context=64, buckets=(1,), prepare=True)
    st, last = _prefill(model.step, model.params, attn, _state(model.specs), {0: [1, 2, 3]})
    st = st.reserve({0: 1})
    st, _ = runner.decode(st, [0], torch.tensor([last[0]]))
    entry = runner._entries[next(iter(runner._entries))]
    assert entry.prepared is not None
    saved = st.checkpoint([0])
    st = st.reserve({0: 1})
    st, _ = runner.decode(st, [0], torch.tensor([3]))  # takes it: nothing moved
    assert entry.prepared_used == 1
    st = st.restore(saved)  # the request's cursor goes back a token: the prepared rows are a token ahead
    st = st.reserve({0: 1})
    st, logits = runner.decode(st, [0], torch.tensor([3]))
    assert entry.prepared_used == 1 and torch.isfinite(logits).all()
    assert st.request(0).length == 5


def test_a_batch_handed_to_run_voids_the_prepared_one():
    """`run` copies its own lanes over the staged ones: a later `decode` of the requests the prepared batch was
    built for builds afresh (taking it would replay another request's rows)."""
    model = random_model("qwen3_5")
    attn = fa.ModelAttention(model.specs)
    runner = StepRunner(model.step, model.params, attn, model.manifest(), max_context=64, buckets=(1,), prepare=True)
    st, last = _prefill(model.step, model.params, attn, _state(model.specs), {0: [1, 2, 3], 1: [4, 5]})
    st = st.reserve({0: 1, 1: 1})
    st, _ = runner.decode(st, [0], torch.tensor([last[0]]))
    entry = runner._entries[next(iter(runner._entries))]
    assert entry.prepared is not None
    b = fa.Batch.decode(st, [1], pad_to=1, columns=runner.columns(st))
    st, _ = runner.run(st, b, torch.tensor([last[1]]))  # request 1 only: request 0's bookkeeping is unchanged
    assert entry.prepared is None
    st = st.reserve({0: 1})
    st, logits = runner.decode(st, [0], torch.tensor([2]))
    assert entry.prepared_used == 0 and torch.isfinite(logits).all()
    assert (st.request(0).length, st.request(1).length) == (5, 3)


def _tiny():
    cfg = tiny.TinyConfig(num_layers=2)
    params = tiny.init_params(cfg)
    attn = fa.ModelAttention(tiny.layer_specs(cfg))
    runner = StepRunner(tiny.step, params, attn, tiny.manifest(cfg), max_context=32, buckets=(2, 4))
    st, last = _prefill(tiny.step, params, attn, _state(tiny.layer_specs(cfg)), {0: [1, 2, 3], 1: [5, 6]})
    st = st.reserve({0: 1, 1: 1})
    st, _ = runner.decode(st, [0, 1], torch.tensor([last[0], last[1]]))  # the bucket's buffers now exist
    st = st.reserve({0: 1, 1: 1})
    return cfg, runner, st


def _good(runner, st):
    return fa.Batch.decode(st, [0, 1], pad_to=2, columns=runner.columns(st)), torch.tensor([3, 4])


def _buffers(runner):
    (entry,) = runner._entries.values()
    return {k: v.clone() for k, v in entry.inputs.items()}


def _unchanged(runner, before):
    (entry,) = runner._entries.values()
    return all(torch.equal(entry.inputs[k], v) for k, v in before.items())


@pytest.mark.parametrize("problem, match", [
    ("missing", "lane 'positions': missing"),
    ("shape", "lane 'positions': expected shape"),
    ("dtype", "lane 'slot_mapping': expected dtype torch.int64"),
    ("device", "lane 'cache_lens': expected a tensor on cpu"),
    ("strided", "lane 'positions': a view onto the storage"),
    ("overlap", "overlaps lane"),
])
def test_each_bad_lane_is_named_and_nothing_is_copied(problem, match):
    _, runner, st = _tiny()
    batch, tokens = _good(runner, st)
    if problem == "missing":
        batch = replace(batch, positions=None)
    elif problem == "shape":
        batch = replace(batch, positions=batch.positions[:1])
    elif problem == "dtype":
        batch = replace(batch, slot_mapping=batch.slot_mapping.int())
    elif problem == "device":
        batch = replace(batch, cache_lens=torch.empty(2, dtype=torch.int32, device="meta"))
    elif problem == "strided":  # two lanes carved out of one buffer, with gaps
        buf = torch.empty(8, dtype=torch.int64)
        buf[0:4:2], buf[1:4:2] = batch.positions, batch.slot_mapping
        batch = replace(batch, positions=buf[0:4:2], slot_mapping=buf[1:4:2])
    else:
        buf = torch.cat([batch.positions, batch.slot_mapping])
        batch = replace(batch, positions=buf[0:2], slot_mapping=buf[1:3])
    before = _buffers(runner)
    with pytest.raises(LaneError, match=match):
        runner.run(st, batch, tokens)
    assert _unchanged(runner, before) and st.is_live


def test_an_out_buffer_with_padded_rows_is_refused_and_nothing_is_copied():
    cfg, runner, st = _tiny()
    batch, tokens = _good(runner, st)
    before = _buffers(runner)
    with pytest.raises(LaneError, match="packed rows"):
        runner.run(st, batch, tokens, out=torch.empty(2, cfg.vocab_size + 8)[:, :cfg.vocab_size])
    assert _unchanged(runner, before)
    out = torch.empty(2, cfg.vocab_size)
    st, logits = runner.run(st, batch, tokens, out=out)
    assert logits is out and torch.isfinite(out).all()


def test_tokens_out_of_range_are_refused_before_copying():
    cfg, runner, st = _tiny()
    batch, _ = _good(runner, st)
    before = _buffers(runner)
    with pytest.raises(LaneError, match="lane 'tokens': expected ids in 0..255"):
        runner.run(st, batch, torch.tensor([3, cfg.vocab_size]))
    assert _unchanged(runner, before)


def _twin(runner, st):
    """Another State holding the same requests on the same pages and slots as ``st``."""
    specs = runner.attn.specs
    twin, _ = _prefill(tiny.step, runner.params, runner.attn, _state(specs), {0: [1, 2, 3, 4], 1: [5, 6, 7]})
    twin = twin.reserve({0: 1, 1: 1})
    assert all((twin.request(r).length, twin.request(r).pages) == (st.request(r).length, st.request(r).pages)
               for r in (0, 1))
    return twin


@pytest.mark.parametrize("which", ["stale", "twin"])
def test_a_stale_or_twin_states_batch_is_refused_before_anything_is_copied(which):
    """Its requests, pages and rows are this State's, but it was built from another handle: refused by name
    before any lane or token reaches the static buffers."""
    _, runner, st = _tiny()
    if which == "stale":
        batch, tokens = _good(runner, st)
        st = st.reserve({0: 1})  # no new page: the same bookkeeping, a new handle
    else:
        batch, tokens = _good(runner, _twin(runner, st))
    before = _buffers(runner)
    with pytest.raises(ValueError, match="StepRunner: `batch` must be a batch built from this state"):
        runner.run(st, batch, tokens)
    assert _unchanged(runner, before) and st.is_live


def test_a_batch_for_a_new_bucket_is_checked_before_the_bucket_is_made():
    cfg, runner, st = _tiny()
    twin = _twin(runner, st)
    batch = fa.Batch.decode(twin, [0, 1], pad_to=4, columns=runner.columns(twin))  # bucket 4: no buffers yet
    with pytest.raises(ValueError, match="StepRunner.run: `batch` must be a batch built from this state"):
        runner.run(st, batch, torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="`request_ids` must be admitted requests"):
        runner.decode(st, [0, 1, 7], torch.tensor([3, 4, 5]))
    with pytest.raises(ValueError, match="`tokens`"):
        runner.decode(st, [0, 1, 1], torch.tensor([3, 4]))
    assert len(runner._entries) == 1 and st.is_live


def test_a_bad_recovery_is_refused_before_a_bucket_is_made():
    _, runner, st = _tiny()
    for recovery in ("bogus", None):
        with pytest.raises(ValueError, match="StepRunner.verify: `recovery` must be one of"):
            runner.verify(st, [0, 1], torch.tensor([1, 2, 3, 4]), num_draft=1, recovery=recovery)
    assert len(runner._entries) == 1 and st.is_live


@pytest.mark.parametrize("field", ["block_table", "slot_mapping"])
def test_run_refuses_a_non_tensor_or_strided_lane_by_name_before_copying(field):
    _, runner, st = _tiny()
    batch, tokens = _good(runner, st)
    before = _buffers(runner)
    with pytest.raises(ValueError, match=rf"`batch\.{field}`|lane '{field}': expected a dense tensor"):
        runner.run(st, replace(batch, **{field: getattr(batch, field).tolist()}), tokens)
    column = torch.stack([getattr(batch, field)] * 2, dim=-1)[..., 0]  # the right values, strided
    with pytest.raises(ValueError, match=rf"`batch\.{field}` must be a contiguous tensor"):
        runner.run(st, replace(batch, **{field: column}), tokens)
    assert _unchanged(runner, before) and st.is_live


def test_a_captured_bucket_refuses_another_states_step_before_anything_is_copied():
    """A captured graph replays into the pools it was captured on: a step of another State (a twin built the
    same way) through that bucket would read and write the first State's storage, so it is refused by name.
    The CPU runner captures nothing: its bucket is marked captured on ``st`` here to reach the check (the CUDA
    twin runs in tests/gpu/test_graph_gpu.py)."""
    cfg, runner, st = _tiny()
    (entry,) = runner._entries.values()
    entry.graph, entry.lineage = object(), st.lineage
    _, _, twin = _tiny()
    before = _buffers(runner)
    with pytest.raises(ValueError, match=r"StepRunner.decode: `state` must be a handle of the State"):
        runner.decode(twin, [0, 1], torch.tensor([3, 4]))
    batch, tokens = _good(runner, twin)
    with pytest.raises(ValueError, match=r"StepRunner.run: `state` must be a handle of the State"):
        runner.run(twin, batch, tokens)
    assert _unchanged(runner, before) and twin.is_live


def test_a_verify_step_is_refused_once_a_later_batch_overwrote_its_lanes():
    """`Verified.accept` applies the batch built into the bucket's staging: a later batch built there (a
    verify of other requests) rewrites its lanes, so the acceptance is refused instead of writing request 0's
    rows into request 1's."""
    _, runner, st = _tiny()
    st = st.reserve({0: 2, 1: 2})
    verified = runner.verify(st, [0, 1], torch.tensor([1, 2, 3, 4]), num_draft=1)
    (entry,) = [e for e in runner._entries.values() if e.bucket.phase == "verify"]
    fa.Batch.verify(st, [1, 0], num_draft=1, pad_to=entry.bucket.lanes, columns=entry.bucket.columns,
                    staging=entry.staging)
    with pytest.raises(ValueError, match=r"`batch\."):
        verified.accept({0: 2, 1: 1})
    assert st.is_live


def test_a_batch_is_classified_by_its_phase_never_by_its_shape():
    _, runner, st = _tiny()
    prefill = fa.Batch.prefill(st, {0: 1, 1: 1})  # two requests of one token: shaped like a decode batch
    with pytest.raises(ValueError, match="`batch.phase` must be 'decode'"):
        runner.run(st, prefill, torch.tensor([1, 2]))
    from fnattn.batch import _build

    with pytest.raises(ValueError, match="`pad_to` must be None"):  # prefill batches are never padded by lanes
        _build(st, "prefill", {0: 1}, num_draft=0, pad_to=4)


def test_pad_lanes_use_the_null_page_and_slot_and_move_no_cursor():
    specs = (gdn_spec(),)
    st = fa.State(specs, num_pages=4, page_size=4, max_requests=2).admit(0).reserve({0: 1})
    b = fa.Batch.decode(st, [0], pad_to=3, columns=4)
    assert b.request_ids == (0, -1, -2) and b.live_ids == (0,) and b.num_pad == 2
    assert b.block_table.shape == (3, 4) and b.block_table[1:].eq(0).all() and b.slot_mapping[1:].tolist() == [0, 0]
    N = st.slots_per_ring
    assert b.recurrent_slots[1:].tolist() == [0, 0] and b.recurrent_write_rows[1:].tolist() == [N, N]
    assert b.cursor_after(b.host_new_lens).request_ids == (0,)
    bad = replace(b, host_pages=(b.host_pages[0], (1,), (0,)))
    from fnattn.apply import check_batch
    with pytest.raises(ValueError, match="pad lane -1"):
        check_batch(st, bad, "test")
    with pytest.raises(ValueError, match="pad lane -1 \\(lane 0\\) after the requests"):  # a request after a pad
        check_batch(st, replace(b, request_ids=(-1, 0, -2), host_new_lens=(1, 1, 1),
                                host_pages=((0,), b.host_pages[0], (0,))), "test")
    with pytest.raises(ValueError, match="`columns`"):
        fa.Batch.decode(st, [0], pad_to=3, columns=0)


def test_the_guard_names_a_host_read():
    with no_host_reads():
        t = torch.arange(3)
        _ = t + 1  # device work is fine
        for read in (lambda: t.sum().item(), lambda: t.tolist(), lambda: bool(t[0]), lambda: t[t > 0],
                     lambda: t.nonzero()):
            with pytest.raises(HostReadError):
                read()


def test_a_step_that_reads_the_device_fails_under_the_guard():
    cfg = tiny.TinyConfig(num_layers=1)
    params = tiny.init_params(cfg)
    attn = fa.ModelAttention(tiny.layer_specs(cfg))

    def step(params, session, tokens):
        if tokens.sum().item() < 0:  # a host read inside the step
            pass
        return tiny.step(params, session, tokens)

    runner = StepRunner(step, params, attn, tiny.manifest(cfg), host_reads="error", max_context=16, buckets=(1,))
    st, last = _prefill(tiny.step, params, attn, _state(tiny.layer_specs(cfg)), {0: [1, 2]})
    st = st.reserve({0: 1})
    with pytest.raises(HostReadError, match="`item`"):
        runner.decode(st, [0], torch.tensor([last[0]]))


def test_manifest_declarations_are_checked():
    m = step_manifest(vocab=10)
    with pytest.raises(ValueError, match="lanes\\['positions'\\]"):
        Manifest(tuple(lane for lane in m.lanes if lane.name != "positions"), m.dims)
    with pytest.raises(ValueError, match="`role`"):
        Lane("x", ("T",), torch.int64, "copied")
    bucket = Bucket("decode", 2, 0, 4)
    g = step_manifest(vocab=10, generated=(Lane("topk", ("T", 3), torch.int64, "generated"),))
    with pytest.raises(LaneError, match="generated lanes are never copied"):
        check_lanes(g, bucket, {"topk": torch.zeros(2, 3, dtype=torch.int64)}, torch.device("cpu"))
    assert g.shape(g.lanes[-1], bucket) == (2, 3) and g.shape(g.lanes[1], bucket) == (3,)


@pytest.mark.parametrize("name", ["deepseek_v32", "glm5"])
def test_dsa_families_declare_and_fill_their_generated_top_k(name):
    model = random_model(name)
    attn = fa.ModelAttention(model.specs)
    manifest = model.manifest()
    names = [lane.name for lane in manifest.role("generated")]
    assert names and all(n.startswith("indexer_topk_") for n in names)
    runner = StepRunner(model.step, model.params, attn, manifest, max_context=64, buckets=(2,))
    _decode_run(model, attn, runner, steps=2)
    (entry,) = runner._entries.values()
    assert sorted(entry.generated) == sorted(names)


def test_runner_arguments_are_checked():
    cfg = tiny.TinyConfig(num_layers=1)
    params, attn = tiny.init_params(cfg), fa.ModelAttention(tiny.layer_specs(cfg))
    for kw, arg in ((dict(buckets=(4, 2)), "buckets"), (dict(max_context=0), "max_context"),
                    (dict(capture=True), "capture"), (dict(host_reads="warn"), "host_reads"),
                    (dict(prepare="yes"), "prepare")):
        with pytest.raises(ValueError, match=f"`{arg}`"):
            StepRunner(tiny.step, params, attn, tiny.manifest(cfg), **kw)
    assert StepRunner(tiny.step, params, attn, tiny.manifest(cfg)).uncapturable()  # CPU: reference backends


@pytest.mark.parametrize("recovery", ["native", "replay"])
def test_mtp_through_the_verify_runner_equals_eager(recovery):
    model = random_model("qwen3_5")
    draft = model.family.draft(model.config, model.params, None, seed=1)

    def run(use_runner):
        t_attn, d_attn = fa.ModelAttention(model.specs), fa.ModelAttention(draft.specs)
        runner = StepRunner(model.family.step_hidden, model.params, t_attn, model.manifest(hidden=True),
                            host_reads="error", max_context=96, buckets=(2,)) if use_runner else None
        spec = Speculator(trace=True, target_step=model.family.step_hidden, target_params=model.params,
                          target_attn=t_attn,
                          target_state=_state(model.specs, recurrent_ring=5), draft_step=draft.step,
                          draft_params=draft.params, draft_attn=d_attn, draft_state=_state(draft.specs),
                          num_draft=2, recovery=recovery, target_runner=runner)
        spec.start({0: [1, 2, 3, 4], 1: [9, 8]})
        return [spec.step() for _ in range(5)], spec.trace

    (a, ta), (b, tb) = run(False), run(True)
    assert a == b and len(ta) == len(tb)  # the same tokens, and every target and draft logits in the same order
    for x, y in zip(ta, tb):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recovery", ["native", "replay"])
def test_a_verify_applied_in_two_halves_equals_one_apply(recovery):
    """What a captured verify does (its own rows written before acceptance, then the acceptance and the
    replay's rows) leaves the same cursors and live rows as one `State.apply` of the accepted step."""
    from fnattn.graph import accept_written
    from fnattn.speculative import replay_writes

    model = random_model("qwen3_5")
    attn = fa.ModelAttention(model.specs)
    runner = StepRunner(model.step, model.params, attn, model.manifest(), max_context=64, buckets=(2,))
    states = []
    for halves in (False, True):
        st, last = _prefill(model.step, model.params, attn, _state(model.specs, recurrent_ring=5),
                            {0: [1, 2, 3, 4, 5], 1: [7, 8, 9]})
        st = st.reserve({0: 3, 1: 3})
        batch = fa.Batch.verify(st, [0, 1], num_draft=2, recovery=recovery)
        with attn.session(st, batch) as s:
            _, deltas = model.step(model.params, s, torch.tensor([last[0], 5, 6, last[1], 2, 2]))
        accepted = {0: 2, 1: 3}
        replay = replay_writes(attn, st, batch, s.replay_outputs, accepted) if recovery == "replay" else None
        if halves:
            runner._write(st, deltas)
            st = accept_written(st, batch, accepted, replay)
        else:
            st = st.apply(deltas.accept(batch, accepted, replay=replay))
        states.append(st)
    a, b = states
    for rid in (0, 1):
        assert (a.request(rid).length, a.request(rid).ring_pos) == (b.request(rid).length, b.request(rid).ring_pos)
    for layer, spaces in a.storage_spaces.items():
        for name, space in spaces.items():
            ta, tb = a.views(layer)[name], b.views(layer)[name]
            for rid, req in a.requests.items():
                if space == "token":
                    rows = [req.pages[p // a.page_size] * a.page_size + p % a.page_size for p in range(req.length)]
                    x, y = ta.flatten(0, 1)[rows], tb.flatten(0, 1)[rows]
                else:
                    x, y = ta[a.recurrent_row(rid)], tb[b.recurrent_row(rid)]
                assert torch.equal(x, y), (layer, name, rid)
    more = b.reserve({0: 3, 1: 3})
    with pytest.raises(ValueError, match="`accepted\\[0\\]`"):  # the second half still checks the acceptance
        accept_written(more, fa.Batch.verify(more, [0, 1], num_draft=2), {0: 9, 1: 1}, None)


# ----------------------------------------------------------------------------- staging
def test_runner_built_batches_land_in_the_buckets_buffers_one_storage_per_dtype():
    _, runner, st = _tiny()
    (entry,) = runner._entries.values()
    lanes = {name: entry.inputs[name] for name in fa.batch.TENSOR_DTYPES}
    by_dtype = {}
    for t in lanes.values():
        by_dtype.setdefault(t.dtype, set()).add(t.untyped_storage().data_ptr())
    assert {d: len(p) for d, p in by_dtype.items()} == {torch.int32: 1, torch.int64: 1}
    check_lanes(runner.manifest, entry.bucket, entry.inputs, st.device)  # carved without gaps or overlap
    plain = fa.Batch.decode(st, [0, 1], pad_to=2, columns=runner.columns(st))
    staged = fa.Batch.decode(st, [0, 1], pad_to=2, columns=runner.columns(st), staging=entry.staging)
    for name in fa.batch.TENSOR_DTYPES:
        assert getattr(staged, name) is entry.inputs[name]
        assert torch.equal(getattr(staged, name), getattr(plain, name)), name


def test_bad_tokens_to_decode_are_refused_before_the_batch_is_built_into_the_buffers():
    cfg, runner, st = _tiny()
    before = _buffers(runner)
    for tokens, match in ((torch.tensor([3]), "`tokens`"), (torch.tensor([3, 4], dtype=torch.int32), "dtype"),
                          (torch.tensor([3, cfg.vocab_size]), "expected ids in 0..255")):
        with pytest.raises(ValueError, match=match):
            runner.decode(st, [0, 1], tokens)
        assert _unchanged(runner, before) and st.is_live
    with pytest.raises(LaneError, match="packed rows"):
        runner.decode(st, [0, 1], torch.tensor([3, 4]), out=torch.empty(2, cfg.vocab_size + 8)[:, :cfg.vocab_size])
    assert _unchanged(runner, before)


def test_staging_refuses_values_that_do_not_fit_its_lanes():
    from fnattn.staging import Staging

    stage = Staging({"a": (2, 3), "b": (4,)}, {"a": torch.int32, "b": torch.int64}, torch.device("cpu"))
    with pytest.raises(ValueError, match="`values` must be the lanes \\['a', 'b'\\]"):
        stage.write({"a": [[0] * 3] * 2})
    with pytest.raises(ValueError, match="`values\\['b'\\]` must be 4 values"):
        stage.write({"a": [[0] * 3] * 2, "b": [1, 2]})
    views = stage.write({"a": [[1, 2, 3], [4, 5, 6]], "b": [7, 8, 9, 10]})
    assert views["a"].tolist() == [[1, 2, 3], [4, 5, 6]] and views["b"].tolist() == [7, 8, 9, 10]
    st = fa.State((gdn_spec(),), num_pages=4, page_size=4, max_requests=1)
    with pytest.raises(ValueError, match="`staging`"):
        fa.Batch.decode(st, (), pad_to=1, columns=1, staging=object())


def test_a_gpu_batch_is_packed_one_buffer_per_dtype_with_the_plain_values():
    from fnattn.batch import TENSOR_DTYPES, expected_tensors
    from fnattn.staging import packed

    _, runner, st = _tiny()
    reqs = [(st.request(0), 1), (st.request(1), 1)]
    values, _ = expected_tensors(st, "decode", reqs, columns=runner.columns(st))
    lanes = packed(values, TENSOR_DTYPES, st.device, pin=False)  # the CUDA layout, on the CPU without pinning
    storages = {}
    for name, v in values.items():
        plain = torch.tensor(v, dtype=TENSOR_DTYPES[name])
        assert lanes[name].dtype == plain.dtype and torch.equal(lanes[name], plain), name
        storages.setdefault(plain.dtype, set()).add(lanes[name].untyped_storage().data_ptr())
    assert all(len(p) == 1 for p in storages.values())
    manifest, bucket = runner.manifest, Bucket("decode", 2, 0, runner.columns(st))
    check_lanes(manifest, bucket, {"tokens": torch.zeros(2, dtype=torch.int64), **lanes}, st.device)
