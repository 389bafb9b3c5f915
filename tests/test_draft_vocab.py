"""A draft vocabulary (`models.mtp.DraftModel.with_vocab`, `Speculator(draft_ids=...)`): the draft's head keeps
some token ids' rows, its logits have a column each, and a proposal is the id of the column picked. Decoding
stays the target's: greedy speculation emits plain greedy decoding's tokens whatever the set, eager or through
both runners; the whole vocabulary in another order proposes what the whole head does; the refusals."""

import pytest
import torch
from fnattn.models.registry import random_model

import fnattn as fa
from fnattn.driver import generate
from fnattn.generation import Sampler
from fnattn.graph import StepRunner
from fnattn.lanes import step_manifest
from fnattn.speculative import Speculator

PROMPTS = {0: [1, 2, 3, 4], 1: [9, 8]}
STEPS = 6


def _state(specs, **kw):
    return fa.State(specs, **{"num_pages": 32, "page_size": 8, "max_requests": 4, "fill": float("nan"),
                              "recurrent_ring": 6, **kw})


@pytest.fixture(scope="module")
def qwen():
    model = random_model("qwen3_5")
    return model, model.family.draft(model.config, model.params, None, seed=1)


def _speculator(model, draft, *, runners=False, **kw):
    """A k = 3 speculator, eager or through both runners (a bucket of 2); ``kw`` to `Speculator`."""
    t_attn, d_attn = fa.ModelAttention(model.specs), fa.ModelAttention(draft.specs)
    runner = d_runner = None
    if runners:
        runner = StepRunner(model.family.step_hidden, model.params, t_attn, model.manifest(hidden=True),
                            max_context=96, buckets=(2,))
        d_runner = StepRunner(draft.step, draft.params, d_attn, draft.manifest(model.config), max_context=96,
                              buckets=(2,), host_reads="error")
    return Speculator(target_step=model.family.step_hidden, target_params=model.params, target_attn=t_attn,
                      target_state=_state(model.specs), draft_step=draft.step, draft_params=draft.params,
                      draft_attn=d_attn, draft_state=_state(draft.specs), num_draft=3, target_runner=runner,
                      draft_runner=d_runner, **kw)


def _speculate(model, draft, *, runners=False, steps=STEPS, **kw):
    """``-> (emitted tokens a step, every proposal the draft made, the speculator)`` (two requests)."""
    spec = _speculator(model, draft, runners=runners, draft_ids=draft.vocab_ids, **kw)
    first = spec.start(PROMPTS)
    proposals = []
    real = spec._draft_chain

    def chain(ids):
        drafts, probs = real(ids)
        proposals.extend(drafts.flatten().tolist())
        return drafts, probs

    spec._draft_chain = chain
    out = [{r: [t] for r, t in first.items()}] + [spec.step() for _ in range(steps)]
    return out, proposals, spec


def _plain_greedy(model, n):
    ma = fa.ModelAttention(model.specs)
    _, out = generate(model.family.step, model.params, ma, _state(model.specs), PROMPTS, max_new_tokens=n)
    return out


def _joined(out):
    return {r: [t for step in out for t in step.get(r, [])] for r in PROMPTS}


def test_the_whole_vocabulary_in_another_order_proposes_what_the_whole_head_does(qwen):
    model, draft = qwen
    order = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(3))
    reordered = draft.with_vocab(order)
    assert reordered.vocab_ids.tolist() == order.tolist()
    assert reordered.params.lm_head.shape == draft.params.lm_head.shape
    assert reordered.params.lm_head is not model.params.lm_head  # the target keeps its own head
    a, proposals_a, _ = _speculate(model, draft)
    b, proposals_b, _ = _speculate(model, reordered)
    assert a == b and proposals_a == proposals_b


@pytest.mark.parametrize("runners", [False, True], ids=["eager", "runners"])
def test_a_small_draft_vocabulary_proposes_only_its_ids_and_emits_plain_greedy_tokens(qwen, runners):
    model, draft = qwen
    ids = torch.arange(0, model.config.vocab_size, 7)  # every seventh id
    small = draft.with_vocab(ids)
    assert small.params.lm_head.shape == (len(ids), model.config.hidden_size)
    assert small.manifest(model.config).dims["L"] == len(ids)
    out, proposals, _ = _speculate(model, small, runners=runners)
    assert proposals and set(proposals) <= set(ids.tolist())
    emitted = _joined(out)
    plain = _plain_greedy(model, max(len(t) for t in emitted.values()))
    for r in PROMPTS:
        assert emitted[r] == plain[r][: len(emitted[r])]
    if runners:  # through the runners: what the eager speculative step emits with the same draft
        assert out == _speculate(model, small)[0]


def test_sampled_proposals_come_from_the_vocabulary_and_their_distribution_is_zero_elsewhere(qwen):
    model, draft = qwen
    ids = torch.arange(5, model.config.vocab_size, 3)
    small = draft.with_vocab(ids)
    sampler = Sampler(temperature=1.0, seed=11)
    out, proposals, spec = _speculate(model, small, sampler=sampler, steps=3)
    assert set(proposals) <= set(ids.tolist())
    logits = torch.randn(2, len(ids))
    tokens, probs = spec._choose_draft(logits)
    assert probs.shape == (2, model.config.vocab_size) and set(tokens.tolist()) <= set(ids.tolist())
    outside = torch.ones(model.config.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.all(probs[:, outside] == 0) and torch.allclose(probs.sum(-1), torch.ones(2))
    assert out == _speculate(model, small, sampler=Sampler(temperature=1.0, seed=11), steps=3)[0]  # a seed repeats


@pytest.mark.parametrize("ids, match", [
    (torch.tensor([3, 3, 5]), "distinct token ids"),
    (torch.tensor([0, 10 ** 6]), r"token ids in 0\.\."),
    (torch.tensor([-1, 2]), r"token ids in 0\.\."),
    (torch.tensor([]), "non-empty 1-D integer tensor"),
    (torch.tensor([1.0, 2.0]), "non-empty 1-D integer tensor"),
    (torch.tensor([[1, 2]]), "non-empty 1-D integer tensor"),
])
def test_with_vocab_refuses_ids_that_name_no_distinct_rows(qwen, ids, match):
    _, draft = qwen
    with pytest.raises(ValueError, match=f"DraftModel.with_vocab: `ids`.*{match}"):
        draft.with_vocab(ids)
    with pytest.raises(ValueError, match="whole head"):
        draft.with_vocab(torch.tensor([1, 2])).with_vocab(torch.tensor([1]))


@pytest.mark.parametrize("bad, match", [(torch.tensor([1, 2], dtype=torch.int32), "int64"), ([1, 2], "int64"),
                                        (torch.tensor([2, 2]), "distinct"), (torch.tensor([-3, 2]), ">= 0")])
def test_the_speculator_refuses_draft_ids_it_cannot_use(qwen, bad, match):
    model, draft = qwen
    with pytest.raises(ValueError, match=f"Speculator: `draft_ids`.*{match}"):
        _speculator(model, draft, draft_ids=bad)


def test_draft_ids_past_the_vocabulary_are_refused_at_the_first_prefill_which_applies_nothing(qwen):
    model, draft = qwen
    spec = _speculator(model, draft, draft_ids=torch.tensor([1, model.config.vocab_size]))
    with pytest.raises(ValueError, match=f"`draft_ids` must be token ids below {model.config.vocab_size}"):
        spec.start(PROMPTS)
    for st in (spec.tstate, spec.dstate):
        assert st.free_pages == st.num_pages and st.free_slots == st.max_requests and not st.requests


def _clean(spec):
    for st in (spec.tstate, spec.dstate):
        assert st.free_pages == st.num_pages and st.free_slots == st.max_requests and not st.requests
    assert not spec.last and not spec.proposal


def test_the_draft_logits_must_have_a_column_per_id_and_a_refused_start_leaves_nothing(qwen):
    model, draft = qwen
    whole_with_four = _speculator(model, draft, draft_ids=torch.arange(4))
    with pytest.raises(ValueError, match=r"`draft_ids` must be one id per column of the draft's logits \(\d+\)"):
        whole_with_four.start(PROMPTS)
    _clean(whole_with_four)
    small = draft.with_vocab(torch.arange(8))
    without_ids = _speculator(model, small)  # a smaller head, but its columns taken for token ids
    with pytest.raises(ValueError, match="`draft_ids` must be the token id of each of the draft's 8 logits columns"):
        without_ids.start(PROMPTS)
    _clean(without_ids)
    with pytest.raises(ValueError, match="`draft_ids` must be the token id of each of the draft's 8 logits columns"):
        _speculator(model, small, runners=True)  # a draft runner's columns, at construction


def test_step_manifest_logits_columns():
    assert step_manifest(vocab=10).dims["L"] == 10
    assert step_manifest(vocab=10, logits=4).dims["L"] == 4
    for bad in (0, 11, True, 2.0):
        with pytest.raises(ValueError, match="step_manifest: `logits`"):
            step_manifest(vocab=10, logits=bad)
