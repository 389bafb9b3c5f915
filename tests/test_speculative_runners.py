"""Speculative steps through both runners (`Speculator` with ``target_runner`` and ``draft_runner``; capture-free
on a CPU): the draft's proposals, the verify, acceptance (greedy, forced by a hook or on the device) and the
draft's catch-up emit what the eager speculative step emits; a draft runner's own refusals."""

import pytest
import torch
from fnattn.models.registry import random_model

import fnattn as fa
from fnattn.graph import StepRunner
from fnattn.speculative import Speculator

NAN = float("nan")


def _state(specs, **kw):
    kw = {"num_pages": 32, "page_size": 8, "max_requests": 4, "fill": NAN, "recurrent_ring": 4, **kw}
    return fa.State(specs, **kw)


def _draft_runner(model, draft, d_attn, **kw):
    return StepRunner(draft.step, draft.params, d_attn, draft.manifest(model.config), max_context=96,
                      **{"host_reads": "error", **kw})


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("recovery", ["native", "replay"])
@pytest.mark.parametrize("name", ["qwen3_5", "deepseek_v3", "deepseek_v32", "glm5", "deepseek_v4"])
def test_the_speculative_step_through_both_runners_equals_eager(name, recovery, invariant):
    """The draft's proposal steps (`StepRunner.propose`) and its catch-up (a fixed-shape verify of the step's
    positions, padded) through a draft runner, the verify through the target runner, all padded to a bucket of 4
    lanes, emit eager speculation's tokens; in bf16 with the invariant mode on, every logits row the eager path
    computes is the same bits (padding lanes, buckets and the catch-up's padded positions change nothing),
    otherwise equal to rounding."""
    import fnattn.switches

    dtype = torch.bfloat16 if invariant else torch.float32
    reads = "allow" if invariant else "error"  # the CPU fixed-order paths read host numbers: they are not captured
    model = random_model(name, dtype=dtype)
    draft = model.family.draft(model.config, model.params, None, seed=1)

    def run(use_runners):
        t_attn, d_attn = fa.ModelAttention(model.specs), fa.ModelAttention(draft.specs)
        runner = StepRunner(model.family.step_hidden, model.params, t_attn, model.manifest(hidden=True),
                            host_reads=reads, max_context=96, buckets=(4,)) if use_runners else None
        spec = Speculator(trace=True, target_step=model.family.step_hidden, target_params=model.params,
                          target_attn=t_attn,
                          target_state=_state(model.specs, recurrent_ring=6), draft_step=draft.step,
                          draft_params=draft.params, draft_attn=d_attn, draft_state=_state(draft.specs),
                          num_draft=3, recovery=recovery, target_runner=runner,
                          draft_runner=_draft_runner(model, draft, d_attn, buckets=(4,), host_reads=reads)
                          if use_runners else None)
        spec.start({0: [1, 2, 3, 4], 1: [9, 8]})
        out = [spec.step() for _ in range(3)]
        spec.release(0)  # a request leaves and another joins: the buckets keep their shapes
        spec.start({2: [7, 5, 3]})
        out += [spec.step() for _ in range(3)]
        return out, spec.trace

    with fnattn.switches.set(invariant=invariant):
        (a, ta), (b, tb) = run(False), run(True)
    assert a == b and len(ta) == len(tb)
    for x, y in zip(ta, tb):
        if invariant:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def _speculator(model, draft, use_runners, **kw):
    """Qwen3.5's MTP speculator over two prompts (k = 3), with both runners (a bucket of 2) or eager."""
    t_attn, d_attn = fa.ModelAttention(model.specs), fa.ModelAttention(draft.specs)
    runner = StepRunner(model.family.step_hidden, model.params, t_attn, model.manifest(hidden=True),
                        max_context=96, buckets=(2,)) if use_runners else None
    spec = Speculator(trace=True, target_step=model.family.step_hidden, target_params=model.params,
                      target_attn=t_attn, target_state=_state(model.specs, recurrent_ring=6), draft_step=draft.step,
                      draft_params=draft.params, draft_attn=d_attn, draft_state=_state(draft.specs), num_draft=3,
                      target_runner=runner,
                      draft_runner=_draft_runner(model, draft, d_attn, buckets=(2,)) if use_runners else None, **kw)
    spec.start({0: [1, 2, 3, 4], 1: [9, 8]})
    return spec


def test_forced_acceptance_through_both_runners_emits_what_the_eager_step_does():
    """`Speculator`'s ``accept_hook`` on the one-read path (both runners): the kept drafts are the proposals,
    then the target's choice after them, as on the eager path, for every count 1 .. k + 1."""
    model = random_model("qwen3_5")
    draft = model.family.draft(model.config, model.params, None, seed=1)

    def run(use_runners):
        spec = _speculator(model, draft, use_runners,
                           accept_hook=lambda step, got: {r: 1 + (step + r) % 4 for r in got})
        return [spec.step() for _ in range(5)]

    a, b = run(False), run(True)
    assert a == b
    assert [{r: len(t) for r, t in out.items()} for out in b] == [{r: 1 + (i + r) % 4 for r in (0, 1)}
                                                                  for i in range(5)]


@pytest.mark.parametrize("count", [1, 2, 4])
def test_force_accept_on_the_device_emits_what_the_eager_step_does(count):
    """`Speculator`'s ``force_accept`` (the counts decided on the device, the draft's catch-up launched before
    the step's read): the one-read path emits what the eager path does with the same forced count, and its
    trace (target verify, draft proposals, the catch-up's kept rows) is the eager one's."""
    model = random_model("qwen3_5")
    draft = model.family.draft(model.config, model.params, None, seed=1)

    def run(use_runners):
        spec = _speculator(model, draft, use_runners, force_accept=count)
        return [spec.step() for _ in range(4)], spec.trace

    (a, ta), (b, tb) = run(False), run(True)
    assert a == b
    assert all(len(t) == count for out in b for t in out.values())
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_the_targets_acceptance_is_applied_by_the_next_read_of_its_state():
    """On the one-read path a step leaves the target's acceptance to be applied when `tstate` is next read (the
    next step reads it after launching the draft's proposals): every read sees each request's cursor past what
    it emitted, a release between steps applies it first, and setting the state past it is refused by name."""
    model = random_model("qwen3_5")
    draft = model.family.draft(model.config, model.params, None, seed=1)
    spec = _speculator(model, draft, True, force_accept=3)
    lengths = {0: 4 + 1, 1: 2 + 1}  # the prompts and their first generated tokens, the first not yet fed
    for _ in range(3):
        for r, toks in spec.step().items():
            lengths[r] += len(toks)
        assert spec._pending is not None  # left for the next read
        with pytest.raises(ValueError, match="`tstate` must be set after the last step's acceptance"):
            spec.tstate = spec.dstate
        assert {r: spec.tstate.request(r).length for r in (0, 1)} == {r: n - 1 for r, n in lengths.items()}
        assert spec._pending is None
    spec.step()
    spec.release(1)
    assert spec._pending is None and list(spec.tstate.requests) == [0]


@pytest.mark.parametrize("bad", [0, 5, True, 2.0])
def test_force_accept_outside_1_to_k_plus_1_is_refused_by_name(bad):
    model = random_model("qwen3_5")
    draft = model.family.draft(model.config, model.params, None, seed=1)
    with pytest.raises(ValueError, match=r"Speculator: `force_accept` must be None or an int in 1..4"):
        Speculator(target_step=model.family.step_hidden, target_params=model.params,
                   target_attn=fa.ModelAttention(model.specs), target_state=_state(model.specs),
                   draft_step=draft.step, draft_params=draft.params, draft_attn=fa.ModelAttention(draft.specs),
                   draft_state=_state(draft.specs), num_draft=3, force_accept=bad)


def test_a_draft_runner_takes_only_propose_and_checks_its_hidden():
    model = random_model("qwen3_5")
    draft = model.family.draft(model.config, model.params, None, seed=1)
    d_attn = fa.ModelAttention(draft.specs)
    runner = _draft_runner(model, draft, d_attn, buckets=(2,))
    st = _state(draft.specs).admit(0).reserve({0: 1})
    tokens = torch.tensor([3])
    with pytest.raises(ValueError, match="StepRunner.decode: `manifest`"):
        runner.decode(st, [0], tokens)
    with pytest.raises(ValueError, match="StepRunner.propose: `hidden`"):
        runner.propose(st, [0], tokens, torch.zeros(2, model.config.hidden_size))
    with pytest.raises(ValueError, match="lane 'hidden_in'"):
        runner.propose(st, [0], tokens, torch.zeros(1, model.config.hidden_size, dtype=torch.float64))
    with pytest.raises(ValueError, match="StepRunner.verify: `hidden`"):  # a draft's verify reads one a token
        runner.verify(st.reserve({0: 2}), [0], torch.tensor([3, 4]), num_draft=1)
    target = StepRunner(model.step, model.params, fa.ModelAttention(model.specs), model.manifest(), max_context=96)
    with pytest.raises(ValueError, match="StepRunner.propose: `manifest`"):
        target.propose(st, [0], tokens, torch.zeros(1, model.config.hidden_size))
    t_st = _state(model.specs).admit(0).reserve({0: 2})
    with pytest.raises(ValueError, match="StepRunner.verify: `hidden`"):
        target.verify(t_st, [0], torch.tensor([3, 4]), num_draft=1, hidden=torch.zeros(2, model.config.hidden_size))
