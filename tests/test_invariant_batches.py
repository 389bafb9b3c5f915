"""The invariant mode over batch compositions and buckets (hypothesis): a request's logits are the same bits
whoever shares its steps, however long their prompts, and whichever bucket a capture-free `StepRunner` pads
the step to."""

import functools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fnattn as fa
import fnattn.switches
from fnattn.graph import StepRunner

STEPS = 4
MINE = [5, 17, 9, 3, 11, 2, 7]


@functools.cache
def model(name):
    from fnattn.models.registry import random_model

    return random_model(name, seed=0, dtype=torch.bfloat16)


def fresh(m, requests):
    return fa.State(m.specs, num_pages=requests * 8 + 4, page_size=4, max_requests=requests + 1)


def decode_logits(m, prompts, runner=None):
    """Request 0's logits over its prefill's last token and ``STEPS`` greedy decode steps beside ``prompts``."""
    attn = runner.attn if runner else fa.ModelAttention(m.specs)
    st = fresh(m, len(prompts))
    for r in prompts:
        st = st.admit(r)
    counts = {r: len(p) for r, p in prompts.items()}
    st = st.reserve(counts)
    with attn.session(st, fa.Batch.prefill(st, counts)) as s:
        logits, d = m.step(m.params, s, torch.tensor([t for p in prompts.values() for t in p]))
    st = st.apply(d)
    ends = torch.tensor(list(counts.values())).cumsum(0) - 1
    out, ids = [logits[ends[0]]], logits[ends].argmax(-1)
    for _ in range(STEPS):
        st = st.reserve({r: 1 for r in prompts})
        if runner is None:
            with attn.session(st, fa.Batch.decode(st, list(prompts))) as s:
                logits, d = m.step(m.params, s, ids)
            st = st.apply(d)
        else:
            st, logits = runner.decode(st, list(prompts), ids)
        out.append(logits[0])
        ids = logits.argmax(-1)
    return torch.stack(out)


others = st.lists(st.lists(st.integers(0, 150), min_size=1, max_size=19), min_size=0, max_size=3)


@settings(max_examples=6, deadline=None)
@given(name=st.sampled_from(["qwen3_5", "deepseek_v32", "kimi_linear", "deepseek_v4", "glm5"]), neighbours=others)
def test_a_requests_logits_do_not_depend_on_its_neighbours(name, neighbours):
    m = model(name)
    with fnattn.switches.set(invariant=True):
        alone = decode_logits(m, {0: MINE})
        beside = decode_logits(m, {0: MINE, **{i + 1: p for i, p in enumerate(neighbours)}})
    assert torch.equal(alone, beside)


@settings(max_examples=4, deadline=None)
@given(name=st.sampled_from(["qwen3_5", "llama", "deepseek_v32", "kimi_linear", "deepseek_v4"]), neighbours=others,
       bucket=st.sampled_from([4, 8]))
def test_a_padded_bucket_decodes_the_eager_steps_bits(name, neighbours, bucket):
    m = model(name)
    prompts = {0: MINE, **{i + 1: p for i, p in enumerate(neighbours)}}
    with fnattn.switches.set(invariant=True):
        eager = decode_logits(m, prompts)
        runner = StepRunner(m.step, m.params, fa.ModelAttention(m.specs), m.manifest(), buckets=(bucket,),
                            capture=False)
        padded = decode_logits(m, prompts, runner)
    assert torch.equal(eager, padded)
