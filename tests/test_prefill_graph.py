"""Prefill through `fnattn.prefill_graph.PrefillRunner`'s buckets (capture-free on a CPU): the padded step
equals the eager prefill bit for bit in the invariant mode (and closely without it), for every family, with
prompts that fill a bucket exactly, leave pad lanes, and are fed in chunks; the bucket rules and the padded
batch's refusals."""

import functools

import pytest
import torch

import fnattn as fa
import fnattn.switches
from fnattn.driver import generate, prefill
from fnattn.models.registry import family_names
from fnattn.prefill_graph import PrefillRunner

PROMPTS = {0: [3, 17, 5, 9, 11, 2, 7, 1, 4, 8, 13], 1: [6, 1, 12, 19, 3]}  # 16 tokens: bucket (2, 16) exactly


@functools.cache
def model(name):
    from fnattn.models.registry import random_model

    return random_model(name, seed=0, dtype=torch.bfloat16)


def fresh(m, requests=3):
    return fa.State(m.specs, num_pages=requests * 16 + 4, page_size=4, max_requests=requests + 1)


def prefilled(m, prompts, runner=None, *, chunk=None):
    st = fresh(m)
    for r in prompts:
        st = st.admit(r)
    attn = runner.attn if runner else fa.ModelAttention(m.specs)
    st, last = prefill(m.step, m.params, attn, st, prompts, runner=runner, chunk=chunk)
    # one decode step after: the State the prefill left (caches, recurrent states) reads the same too
    st = st.reserve({r: 1 for r in prompts})
    ids = torch.stack([last[r] for r in prompts]).argmax(-1)
    with attn.session(st, fa.Batch.decode(st, list(prompts))) as s:
        logits, _ = m.step(m.params, s, ids)
    return torch.stack([last[r] for r in prompts]), logits


@pytest.mark.parametrize("name", family_names())
@pytest.mark.parametrize("prompts,tokens", [
    (PROMPTS, (8, 16, 32)),  # the requests fill the bucket: no pad lane
    ({0: PROMPTS[0]}, (8, 16, 32)),  # one request and a pad lane of 5 tokens
    (PROMPTS, (4, 8)),  # chunks of 8: both requests, then the rest of the longer one beside a pad lane
])
def test_runner_prefill_equals_eager_bitwise(name, prompts, tokens):
    m = model(name)
    with fnattn.switches.set(invariant=True):
        want = prefilled(m, prompts)
        runner = PrefillRunner(m.step, m.params, fa.ModelAttention(m.specs), lanes=(1, 2, 4), tokens=tokens)
        got = prefilled(m, prompts, runner)
    assert not runner.capture and runner.entries()
    for w, g in zip(want, got):
        assert torch.equal(w, g), name


def test_runner_prefill_close_outside_the_invariant_mode():
    m = model("qwen3_5")
    want = prefilled(m, PROMPTS)
    runner = PrefillRunner(m.step, m.params, fa.ModelAttention(m.specs), tokens=(8, 32))
    got = prefilled(m, PROMPTS, runner)
    assert [(e.lanes, e.tokens) for e in runner.entries()] == [(4, 32)]
    for w, g in zip(want, got):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


def test_generate_with_a_prefill_runner_emits_what_eager_generate_does():
    m = model("llama")
    prompts = {r: [(7 * r + i) % 50 + 1 for i in range(n)] for r, n in enumerate([9, 3, 14])}
    with fnattn.switches.set(invariant=True):
        _, want = generate(m.step, m.params, fa.ModelAttention(m.specs), fresh(m), prompts, max_new_tokens=4)
        attn = fa.ModelAttention(m.specs)
        runner = PrefillRunner(m.step, m.params, attn, lanes=(2, 4), tokens=(16, 32))
        _, got = generate(m.step, m.params, attn, fresh(m), prompts, max_new_tokens=4, prefill_runner=runner)
    assert got == want


def test_bucket_rules():
    m = model("llama")
    r = PrefillRunner(m.step, m.params, fa.ModelAttention(m.specs), lanes=(1, 2, 4), tokens=(16, 64))
    assert r.bucket({0: 16}) == (1, 16)  # exactly a bucket: no pad lane
    assert r.bucket({0: 15}) == (2, 16)  # a pad lane of one token
    assert r.bucket({0: 16, 1: 16}) == (4, 64)  # two requests fill no (2, T) bucket: two pad lanes
    assert r.bucket({0: 63, 1: 1}) == (2, 64)
    assert r.bucket({0: 61, 1: 1}) == (4, 64)  # two pad lanes, one token each
    assert r.bucket({0: 62, 1: 1}) is None  # one token left, and a pad lane needs company
    assert r.bucket({0: 64, 1: 1}) is None
    assert r.bucket({i: 1 for i in range(5)}) is None


@pytest.mark.parametrize("kwargs,arg", [
    (dict(lanes=(1,)), "lanes"),  # no room for a pad lane beside one request
    (dict(lanes=(2, 1)), "lanes"),
    (dict(tokens=()), "tokens"),
    (dict(tokens=(16, True)), "tokens"),
    (dict(max_context=0), "max_context"),
    (dict(capture=True), "capture"),  # a CPU model
])
def test_runner_refuses_bad_arguments_by_name(kwargs, arg):
    m = model("llama")
    with pytest.raises(ValueError, match=arg):
        PrefillRunner(m.step, m.params, fa.ModelAttention(m.specs), **kwargs)


def test_prefill_refusals_write_nothing():
    m = model("llama")
    attn = fa.ModelAttention(m.specs)
    runner = PrefillRunner(m.step, m.params, attn, lanes=(2,), tokens=(8,))
    st = fresh(m).admit(0).reserve({0: 3})  # one page of 4
    with pytest.raises(ValueError, match="tokens"):
        runner.prefill(st, {0: 3}, torch.arange(2))  # 2 ids for 3 tokens
    with pytest.raises(ValueError, match="counts"):
        runner.prefill(st, {0: 9}, torch.arange(9))  # no bucket holds 9 tokens
    with pytest.raises(ValueError, match="counts"):
        runner.prefill(st, {0: 5}, torch.arange(5))  # room reserved for 4
    assert runner.entries() == [] and st.request(0).length == 0
    st, last = runner.prefill(st, {0: 3}, torch.arange(3))  # the handle is still live
    assert last.shape == (1, m.config.vocab_size) and st.request(0).length == 3
    # with the bucket's buffers in place: a refused step still changes nothing
    st = st.reserve({0: 1})
    with pytest.raises(ValueError, match="request_ids"):
        runner.prefill(st, {7: 1}, torch.arange(1))  # not admitted
    with pytest.raises(ValueError, match="counts"):
        runner.prefill(st, {0: 2}, torch.arange(2))  # one token of room
    st, again = runner.prefill(st, {0: 1}, torch.arange(1))
    assert st.request(0).length == 4 and len(runner.entries()) == 1


def test_padded_prefill_batch_refusals():
    m = model("llama")
    st = fresh(m).admit(0).reserve({0: 5})
    with pytest.raises(ValueError, match="tokens"):
        fa.Batch.prefill(st, {0: 5}, pad_to=2)  # pad_to without tokens
    with pytest.raises(ValueError, match="tokens"):
        fa.Batch.prefill(st, {0: 5}, pad_to=3, tokens=6)  # two pad lanes, one token left
    with pytest.raises(ValueError, match="tokens"):
        fa.Batch.prefill(st, {0: 5}, pad_to=1, tokens=8)  # tokens left and no pad lane
    with pytest.raises(ValueError, match="pad_to"):
        fa.Batch.prefill(st, {0: 5}, pad_to=0, tokens=5)
    b = fa.Batch.prefill(st, {0: 5}, pad_to=3, tokens=12, logits_for="last")
    assert b.request_ids == (0, -1, -2) and b.host_new_lens == (5, 6, 1)
    assert b.cu_seqlens.tolist() == [0, 5, 11, 12]


def test_driver_refuses_a_runner_of_another_model_attention_and_too_long_chunks():
    m = model("llama")
    runner = PrefillRunner(m.step, m.params, fa.ModelAttention(m.specs), tokens=(8,))
    st = fresh(m).admit(0)
    with pytest.raises(ValueError, match="runner"):
        prefill(m.step, m.params, fa.ModelAttention(m.specs), st, {0: [1, 2]}, runner=runner)
    with pytest.raises(ValueError, match="chunk"):
        prefill(m.step, m.params, runner.attn, st, {0: [1, 2]}, runner=runner, chunk=16)


def test_a_prompt_of_exactly_the_largest_bucket_without_a_one_lane_bucket_goes_in_two_steps():
    """(2, 8) holds 7 tokens beside a pad lane, not 8 alone: the driver feeds 7, then 1."""
    m = model("llama")
    prompt = {0: [3, 1, 4, 1, 5, 9, 2, 6]}
    with fnattn.switches.set(invariant=True):
        want = prefilled(m, prompt)
        runner = PrefillRunner(m.step, m.params, fa.ModelAttention(m.specs), lanes=(2,), tokens=(8,))
        got = prefilled(m, prompt, runner)
    assert [(e.lanes, e.tokens, e.replays) for e in runner.entries()] == [(2, 8, 0)]
    for w, g in zip(want, got):
        assert torch.equal(w, g)
