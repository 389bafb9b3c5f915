"""Speculative sampling (`fnattn.speculative.sampled_accept_rows`, `Speculator(sampler=)`): the emitted tokens are
distributed as the target's own sampling draws them whatever the draft proposes; a draft equal to the target is
always kept; the same seed repeats a run, through the eager step and through both runners alike."""

import pytest
import torch

import fnattn as fa
import fnattn.switches
from fnattn.generation import Sampler
from fnattn.graph import StepRunner
from fnattn.models.registry import random_model
from fnattn.speculative import Speculator, sampled_accept_rows

N, K, V = 60000, 2, 6


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(K + 1, V, generator=g) * 1.5  # the target's logits at each position
    q = torch.randn(K, V, generator=g).mul(1.5).softmax(-1)  # the draft's distributions
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(K)], 1)
    logits = target.repeat(N, 1)  # [N * (1 + K), V]
    return target, q, drafts, logits


def test_the_first_emitted_token_is_distributed_as_the_target_samples_it():
    target, q, drafts, logits = _setup()
    sampler = Sampler(temperature=0.7, seed=3)
    rows = sampled_accept_rows(logits, drafts, q.expand(N, K, V), sampler, sampler.generator())
    p = sampler.warp(target).softmax(-1)
    first = torch.bincount(rows[:, 1], minlength=V).float() / N
    assert (first - p[0]).abs().sum() < 0.02  # total variation, ~4 sigma at 60k draws
    # the first draft is kept with probability sum_x min(p(x), q(x))
    kept_first = (rows[:, 0] >= 2).float().mean()
    assert abs(kept_first - torch.minimum(p[0], q[0]).sum()) < 0.01
    # after both drafts kept, the bonus is drawn from the last position's distribution
    all_kept = rows[rows[:, 0] == K + 1]
    bonus = torch.bincount(all_kept[:, K + 1], minlength=V).float() / len(all_kept)
    assert (bonus - p[K]).abs().sum() < 0.05


def test_a_draft_equal_to_the_target_is_always_kept():
    target, _, _, logits = _setup(1)
    sampler = Sampler(temperature=1.0, top_k=4, seed=0)
    p = sampler.warp(target).softmax(-1)
    g = torch.Generator().manual_seed(2)
    drafts = torch.stack([torch.multinomial(p[j], 1000, replacement=True, generator=g) for j in range(K)], 1)
    rows = sampled_accept_rows(logits[: 1000 * (K + 1)], drafts, p[:K].expand(1000, K, V), sampler,
                               sampler.generator())
    assert (rows[:, 0] == K + 1).all() and torch.equal(rows[:, 1:K + 1], drafts)


def test_sampled_acceptance_refuses_mismatched_shapes_by_name():
    _, q, drafts, logits = _setup()
    sampler = Sampler(temperature=1.0, seed=0)
    with pytest.raises(ValueError, match="`logits`"):
        sampled_accept_rows(logits[:-1], drafts, q.expand(N, K, V), sampler, sampler.generator())
    with pytest.raises(ValueError, match="`draft_probs`"):
        sampled_accept_rows(logits, drafts, q, sampler, sampler.generator())


def _speculator(model, draft, sampler, runners, **kw):
    def state(specs, ring=2):
        return fa.State(specs, num_pages=40, page_size=8, max_requests=3, recurrent_ring=ring)

    t_attn, d_attn = fa.ModelAttention(model.specs), fa.ModelAttention(draft.specs)
    target_runner = draft_runner = None
    if runners:
        target_runner = StepRunner(model.family.step_hidden, model.params, t_attn, model.manifest(hidden=True),
                                   max_context=96, buckets=(2,))
        draft_runner = StepRunner(draft.step, draft.params, d_attn, draft.manifest(model.config), max_context=96,
                                  buckets=(2,))
    return Speculator(target_step=model.family.step_hidden, target_params=model.params, target_attn=t_attn,
                      target_state=state(model.specs, 6), draft_step=draft.step, draft_params=draft.params,
                      draft_attn=d_attn, draft_state=state(draft.specs), num_draft=3, sampler=sampler,
                      target_runner=target_runner, draft_runner=draft_runner, **kw)


def _run(model, draft, sampler, runners):
    spec = _speculator(model, draft, sampler, runners)
    first = spec.start({0: [1, 2, 3, 4], 1: [9, 8]})
    return first, [spec.step() for _ in range(5)]


def test_a_seeded_sampled_run_repeats_and_the_runners_draw_what_the_eager_step_draws():
    model = random_model("qwen3_5", dtype=torch.bfloat16)
    draft = model.family.draft(model.config, model.params, None, seed=1)
    sampler = Sampler(temperature=1.0, top_p=0.9, seed=11)
    with fnattn.switches.set(invariant=True):  # the runners' logits are the eager step's bits
        a, b, c = _run(model, draft, sampler, False), _run(model, draft, sampler, False), \
            _run(model, draft, sampler, True)
        other = _run(model, draft, Sampler(temperature=1.0, top_p=0.9, seed=12), False)
    assert a == b == c
    assert other != a  # the seed is what repeats it
    assert all(1 <= len(t) <= 4 for out in a[1] for t in out.values())


def test_a_sampler_is_refused_with_hooks_and_by_type():
    model = random_model("qwen3_5")
    draft = model.family.draft(model.config, model.params, None, seed=1)
    with pytest.raises(ValueError, match="`sampler`"):
        _speculator(model, draft, Sampler(temperature=1.0), False, accept_hook=lambda s, a: a)
    with pytest.raises(ValueError, match="`sampler`"):
        _speculator(model, draft, "greedy", False)
    greedy = _speculator(model, draft, Sampler(), False)  # temperature 0: greedy acceptance, no generator
    assert greedy.sampler is None and greedy.generator is None
