"""Streaming text, stop conditions and sampling (fnattn.generation) and the driver's use of them.

The streaming property is checked over random id sequences of a small
byte-level BPE tokenizer trained here from sentences with multi-byte
characters, so ids often end inside a UTF-8 sequence.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_model_qwen import hf_model, hf_torch_path  # noqa: F401 (a fixture)

import fnattn as fa
from fnattn.driver import generate, generate_completions
from fnattn.generation import Sampler, StopCriteria, StopText, TextStream
from fnattn.models import tiny

SENTENCES = ["the café sat on the mat", "naïve résumé déjà vu", "中文 字符 测试 中文", "emoji 🎉🚀 party 🎉",
             "attention is a pure function", "ünïcödé ßtraße ½ €"]


@pytest.fixture(scope="module")
def bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    tok.train_from_iterator(SENTENCES, trainer)
    assert tok.get_vocab_size() == 320  # the id strategy below covers the whole vocabulary
    return tok


class Counting:
    """A tokenizer without DecodeStream support that counts the ids it decodes."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


ids_strategy = st.lists(st.integers(0, 319), min_size=1, max_size=24)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("incremental", [False, True], ids=["decode_stream", "fallback"])
@SETTINGS
@given(ids=ids_strategy)
def test_stream_equals_decode_of_every_prefix(bpe, incremental, ids):
    stream = TextStream(bpe, incremental=incremental)
    for n, i in enumerate(ids, 1):
        stream.step(i)
        whole = bpe.decode(ids[:n])
        assert whole.startswith(stream.text)  # never shows what a later id changes
        if not whole.endswith("\ufffd"):
            assert stream.text == whole  # and holds nothing back once the text is complete
        closed = TextStream(bpe, incremental=incremental)
        for j in ids[:n]:
            closed.step(j)
        closed.finish()
        assert closed.text == whole


def test_multibyte_characters_are_held_until_complete(bpe):
    text = "日本語 🍣 ok"  # not in the training sentences: these characters are split into byte pieces
    ids = bpe.encode(text).ids
    for tok in (bpe, Counting(bpe)):
        stream = TextStream(tok)
        chunks = [stream.step(i) for i in ids]
        assert "".join(chunks) == text and "" in chunks


def test_fallback_is_linear_in_the_output(bpe):
    counting = Counting(bpe)
    ids = bpe.encode(" ".join(SENTENCES) * 40).ids
    stream = TextStream(counting)
    for i in ids:
        stream.step(i)
    stream.finish()
    assert stream.text == bpe.decode(ids)
    assert counting.decoded < 8 * len(ids)  # a whole re-decode per id would be ~len(ids)**2 / 2


def test_stop_text_cuts_before_a_stop_string_split_across_chunks():
    cut = StopText(["END", "\n\n"])
    shown = [cut.push(c) for c in ["ab", "cE", "N", "Dxyz"]]
    assert "".join(shown) == "abc" and cut.stopped and cut.push("more") == ""
    cut = StopText(["END"])
    assert cut.push("aEN") == "a" and cut.push("x") == "ENx" and cut.finish() == "" and not cut.stopped


def test_stop_criteria_validates_and_takes_one_or_several_eos():
    assert StopCriteria(max_new_tokens=3, eos_token_ids=7).eos_token_ids == {7}
    assert StopCriteria(max_new_tokens=3, eos_token_ids=[1, 2]).eos_token_ids == {1, 2}
    assert StopCriteria(max_new_tokens=3, stop_strings="x").stop_strings == ("x",)
    with pytest.raises(ValueError, match="max_new_tokens"):
        StopCriteria(max_new_tokens=0)
    with pytest.raises(ValueError, match="eos_token_ids"):
        StopCriteria(max_new_tokens=1, eos_token_ids=[1, "2"])
    with pytest.raises(ValueError, match="stop_strings"):
        StopCriteria(max_new_tokens=1, stop_strings=[""])


def test_sampler_warpers_match_transformers():
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    for t, k, p, m in [(0.7, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (0.9, 0, 1.0, 0.1),
                       (0.8, 10, 0.9, 0.05)]:
        want = TemperatureLogitsWarper(t)(None, logits.clone())
        want = TopKLogitsWarper(k)(None, want) if k else want
        want = TopPLogitsWarper(p)(None, want) if p < 1 else want
        want = MinPLogitsWarper(m)(None, want) if m else want
        got = Sampler(temperature=t, top_k=k, top_p=p, min_p=m, seed=0).warp(logits)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), (t, k, p, m)
        torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)])


def test_sampler_greedy_seeded_and_filtered():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    assert torch.equal(Sampler().sample(logits), logits.argmax(-1))
    for s in [Sampler(temperature=1.0, top_k=1, seed=3), Sampler(temperature=1.0, min_p=1.0, seed=3)]:
        assert torch.equal(s.sample(logits, s.generator()), logits.argmax(-1))
    s = Sampler(temperature=1.0, seed=5)
    draws = [s.sample(logits, g).tolist() for g in (s.generator(), s.generator())]
    assert draws[0] == draws[1]
    s2 = Sampler(temperature=1.0, top_k=2, seed=5)
    g = s2.generator()
    top2 = logits.topk(2, dim=-1).indices
    for _ in range(20):
        picked = s2.sample(logits, g)
        assert (top2 == picked[:, None]).any(-1).all()
    for bad in [dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(min_p=1.5), dict(seed=-1),
                dict(temperature=float("nan"))]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            Sampler(**bad)


@pytest.fixture(scope="module")
def tiny_model():
    cfg = tiny.TinyConfig()
    return tiny.init_params(cfg, seed=0), tiny.layer_specs(cfg)


def _run(tiny_model, prompts, **kw):
    params, specs = tiny_model
    state = fa.State(specs, num_pages=40, page_size=4, max_requests=len(prompts))
    seen = []

    def step(p, session, tokens):  # records each step's batch and the pages free while it runs
        seen.append((list(session.batch.request_ids), session.state.free_pages))
        return tiny.step(p, session, tokens)

    state, done = generate_completions(step, params, fa.ModelAttention(specs), state, prompts, **kw)
    return state, done, seen


PROMPTS = {0: list(b"hello"), 1: list(b"attention!")}


def test_each_request_stops_on_its_own_and_is_released(tiny_model):
    _, free, _ = _run(tiny_model, PROMPTS, max_new_tokens=6)
    assert all(c.finish_reason == "length" and len(c.ids) == 6 for c in free.values())
    eos = free[0].ids[2]
    assert eos not in free[1].ids[:5]  # the tiny random model: request 1 goes on to the end
    state, done, seen = _run(tiny_model, PROMPTS, stop=StopCriteria(max_new_tokens=6, eos_token_ids=[eos]))
    assert done[0].ids == free[0].ids[:3] and done[0].finish_reason == "eos"
    assert done[1].ids == free[1].ids and done[1].finish_reason == "length"
    # After request 0's eos, decode steps run request 1 alone, with request 0's pages back in the pool.
    assert [r for r, _ in seen[3:]] == [[1]] * 3
    assert seen[3][1] > seen[2][1]
    assert state.free_pages == state.num_pages


def test_waiting_requests_are_admitted_as_others_finish(tiny_model):
    prompts = {**PROMPTS, 2: list(b"third one")}
    params, specs = tiny_model
    _, free, _ = _run(tiny_model, prompts, max_new_tokens=5)
    eos = free[0].ids[1]
    assert eos not in free[1].ids + free[2].ids[:4]
    stop = StopCriteria(max_new_tokens=5, eos_token_ids=[eos])
    state = fa.State(specs, num_pages=40, page_size=4, max_requests=2)  # room for two requests at a time
    seen = []

    def step(p, session, tokens):
        seen.append((session.batch.num_requests, sorted(session.batch.request_ids)))
        return tiny.step(p, session, tokens)

    state, done = generate_completions(step, params, fa.ModelAttention(specs), state, prompts, stop=stop,
                                       max_running=2)
    assert done[0].ids == free[0].ids[:2] and done[0].finish_reason == "eos"
    assert done[1].ids == free[1].ids and done[2].ids == free[2].ids
    # prefill {0, 1}; decode {0, 1} (0 ends); prefill {2}; then {1, 2} decode together.
    assert [r for _, r in seen[:4]] == [[0, 1], [0, 1], [2], [1, 2]]
    assert state.free_pages == state.num_pages
    with pytest.raises(ValueError, match="max_running"):
        _run(tiny_model, prompts, max_new_tokens=2, max_running=0)


def test_greedy_default_is_argmax_and_a_seed_repeats(tiny_model):
    params, specs = tiny_model
    _, greedy, _ = _run(tiny_model, PROMPTS, max_new_tokens=5, sampler=Sampler(temperature=0.0))
    _, plain, _ = _run(tiny_model, PROMPTS, max_new_tokens=5)
    assert {r: c.ids for r, c in greedy.items()} == {r: c.ids for r, c in plain.items()}
    sampler = Sampler(temperature=1.5, top_p=0.95, seed=7)
    runs = [_run(tiny_model, PROMPTS, max_new_tokens=8, sampler=sampler)[1] for _ in range(2)]
    assert {r: c.ids for r, c in runs[0].items()} == {r: c.ids for r, c in runs[1].items()}
    other = _run(tiny_model, PROMPTS, max_new_tokens=8, sampler=Sampler(temperature=1.5, top_p=0.95, seed=8))[1]
    assert {r: c.ids for r, c in other.items()} != {r: c.ids for r, c in runs[0].items()}
    state = fa.State(specs, num_pages=40, page_size=4, max_requests=2)
    _, out = generate(tiny.step, params, fa.ModelAttention(specs), state, PROMPTS, max_new_tokens=5)
    assert out == {r: c.ids for r, c in plain.items()}


class Bytes:
    """The tiny model's byte vocabulary as a tokenizer (invalid UTF-8 shows as U+FFFD)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_stop_string_ends_the_text_and_the_request(tiny_model):
    _, free, _ = _run(tiny_model, PROMPTS, max_new_tokens=12, tokenizer=Bytes())
    text = free[1].text
    # Random weights emit arbitrary bytes: stop at the first whole character after the first one.
    j = next(j for j, ch in enumerate(text[1:-1], 1) if ch != "\ufffd")
    stop = text[j]
    _, done, _ = _run(tiny_model, PROMPTS, stop=StopCriteria(max_new_tokens=12, stop_strings=[stop]),
                      tokenizer=Bytes())
    assert done[1].finish_reason == "stop" and done[1].text == text[: text.find(stop)]
    assert len(done[1].ids) < len(free[1].ids)
    with pytest.raises(ValueError, match="tokenizer"):
        _run(tiny_model, PROMPTS, stop=StopCriteria(max_new_tokens=2, stop_strings=["x"]))


@pytest.mark.parametrize("sampler", [Sampler(), Sampler(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, seed=11)],
                         ids=["greedy", "sampled"])
def test_transformers_generate_gives_the_same_tokens(tmp_path, hf_torch_path, sampler):  # noqa: F811
    """A transformers-written checkpoint: the same tokens as `model.generate`, greedy and with a fixed seed
    (the same warpers and one multinomial draw per step from an equally seeded CPU generator)."""
    from fnattn.models.registry import load_model

    hf = hf_model("qwen3_5", seed=5)
    hf.save_pretrained(tmp_path)
    prompt, n = [3, 17, 42, 9, 77], 10
    kw = dict(do_sample=False) if sampler.greedy else dict(
        do_sample=True, temperature=sampler.temperature, top_k=sampler.top_k, top_p=sampler.top_p,
        min_p=sampler.min_p)
    torch.manual_seed(sampler.seed or 0)
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, **kw)[0, len(prompt):]
    model = load_model(tmp_path)
    state = fa.State(model.specs, num_pages=8, page_size=8, max_requests=1)
    _, out = generate(model.step, model.params, fa.ModelAttention(model.specs), state, {0: prompt},
                      max_new_tokens=n, sampler=sampler)
    assert out[0] == want.tolist()


def test_the_sampling_kernel_is_checked_and_torch_is_the_cpu_path():
    from fnattn.generation import Sampler

    with pytest.raises(ValueError, match="`kernel`"):
        Sampler(kernel="cuda")
    x = torch.randn(3, 16)
    auto, plain = Sampler(temperature=0.9, seed=4, kernel="auto"), Sampler(temperature=0.9, seed=4)
    assert torch.equal(auto.sample(x, auto.generator()), plain.sample(x, plain.generator()))
    forced = Sampler(temperature=0.9, seed=4, kernel="flashinfer")
    with pytest.raises(ValueError, match="`kernel`"):
        forced.sample(x, forced.generator())
