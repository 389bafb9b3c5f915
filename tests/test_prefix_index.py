"""The prefix index (fnattn.prefix_index) and `driver.generate(..., share_prefixes=True)`.

Keys chain page-sized blocks, so a block matches only after the same blocks
before it; a match is the longest run of full blocks a live request holds.
Generation with shared prefixes (greedy, the tiny model and qwen3_5, requests
admitted while others run) gives the tokens of generation without sharing,
frees every page at the end and reports the hit rate.
"""

from __future__ import annotations

import pytest
import torch
from fnattn.models.registry import random_model

import fnattn as fa
from fnattn.driver import GenerateResult, generate, generate_completions
from fnattn.generation import StopCriteria
from fnattn.models import tiny
from fnattn.prefix_index import PrefixIndex, block_keys

PAGE = 4


# ------------------------------------------------------------------ the index
def test_keys_are_chained():
    a, b = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), block_keys([5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 1
    assert a[1] != b[0]  # the same block after another one is another key
    assert block_keys([1, 2, 3, 4, 0, 0, 0, 0], 4)[0] == a[0]


def test_longest_full_block_match_limit_and_drop():
    ix = PrefixIndex(4)
    ix.insert(1, range(10))  # blocks 0..3, 4..7 (8, 9 are a partial block: not indexed)
    ix.insert(2, list(range(4)) + [99] * 8)
    assert ix.num_blocks == 4 and len(ix) == 2 and 1 in ix
    assert ix.match(range(12)) == (1, 8)
    assert ix.match(list(range(4)) + [99] * 5) == (2, 8)
    assert ix.match(list(range(4)) + [7] * 5) in {(1, 4), (2, 4)}
    assert ix.match(range(12), limit=7) in {(1, 4), (2, 4)}
    assert ix.match([5, 0, 1, 2, 3]) == (None, 0)  # the first block differs
    assert ix.match(range(3)) == (None, 0) and ix.match([], limit=-1) == (None, 0)
    assert ix.match(range(12), usable=lambda rid, n: n == 4) in {(1, 4), (2, 4)}
    assert ix.match(range(12), usable=lambda rid, n: False) == (None, 0)
    ix.drop(1)
    assert ix.match(range(12)) == (2, 4)
    ix.drop(2)
    ix.drop(2)  # twice, or never indexed: ignored
    assert ix.num_blocks == 0 and ix.match(range(12)) == (None, 0)
    with pytest.raises(ValueError, match="block"):
        PrefixIndex(0)
    ix.insert(3, [1])
    with pytest.raises(ValueError, match="request_id"):
        ix.insert(3, [1])


def test_a_hash_collision_never_matches_other_tokens():
    ix = PrefixIndex(2)
    ix.insert(1, [1, 2, 3, 4])
    key = block_keys([7, 7], 2)[0]
    ix._holders[key] = {1: None}  # as if [7, 7] hashed like request 1's first block
    assert ix.match([7, 7, 0]) == (None, 0)


# ------------------------------------------------------------------ generation
def tiny_model():
    cfg = tiny.TinyConfig()
    params = tiny.init_params(cfg, seed=0)
    return tiny.step, params, tiny.layer_specs(cfg)


def qwen_model():
    m = random_model("qwen3_5", seed=1, dtype=torch.float32, device="cpu")
    return m.step, m.params, m.specs


def run(model, prompts, *, share, max_running, stop, page=PAGE, chunk=None):
    step, params, specs = model
    state = fa.State(specs, num_pages=96, page_size=page, max_requests=len(prompts))
    result = generate_completions(step, params, fa.ModelAttention(specs), state, prompts, stop=stop,
                                  max_running=max_running, share_prefixes=share, chunk=chunk)
    state, done = result
    assert state.free_pages == state.num_pages and not state.shared_pages and not state.requests
    return {r: c.ids for r, c in done.items()}, result.stats


class AdmitSpy:
    """Records each prefix admission as (rid, holder, tokens, whether the holder had decoded)."""

    def __init__(self, monkeypatch, prompts):
        self.calls = []
        real = fa.State.admit

        def admit(st, rid, *, prefix_of=None, tokens=None):
            if prefix_of is not None:
                self.calls.append((rid, prefix_of, tokens, st.request(prefix_of).length > len(prompts[prefix_of])))
            return real(st, rid, prefix_of=prefix_of, tokens=tokens)

        monkeypatch.setattr(fa.State, "admit", admit)


def tiny_prompts():
    base = list(b"You are a helpful assistant. Answer briefly: ")  # 45 tokens: 11 full pages
    return {r: base + list(q) for r, q in enumerate([b"why?", b"what is 2+2?", b"name a colour", b"and one more",
                                                     b"last"])}


def staggering_stop(model, prompts, n=8):
    """An eos id that ends request 0 early while request 1 goes on, so the next prompt is admitted while
    request 1 still runs (with ``max_running=2``)."""
    free, _ = run(model, prompts, share=False, max_running=None, stop=StopCriteria(max_new_tokens=n))
    eos = next(t for t in free[0][1:n - 1] if t not in free[1])
    return StopCriteria(max_new_tokens=n, eos_token_ids=[eos])


def test_tiny_shared_prefixes_give_the_tokens_of_a_run_without(monkeypatch):
    model, prompts = tiny_model(), tiny_prompts()
    stop = staggering_stop(model, prompts)
    want, cold = run(model, prompts, share=False, max_running=2, stop=stop)
    assert cold == {"prompt_tokens": sum(map(len, prompts.values())), "prefix_hit_tokens": 0,
                    "prefix_hit_rate": 0.0, "mixed_steps": 0}
    spy = AdmitSpy(monkeypatch, prompts)
    got, stats = run(model, prompts, share=True, max_running=2, stop=stop)
    assert got == want
    # Every prompt after the first starts on 44 shared tokens (11 pages); one prefill per wave.
    assert spy.calls[0] == (1, 0, 44, False)  # admitted with request 0, prefilled after it
    assert len(spy.calls) == len(prompts) - 1 and all(c[2] == 44 for c in spy.calls), spy.calls
    assert any(c[3] for c in spy.calls), "no prompt was admitted on a request that was already decoding"
    assert stats["prefix_hit_tokens"] == 44 * len(spy.calls)
    assert stats["prefix_hit_rate"] == pytest.approx(stats["prefix_hit_tokens"] / stats["prompt_tokens"])
    # All at once, a chunked prefill, a page size that ends the prefix inside a page: still the same tokens.
    for max_running, page, chunk in ((None, PAGE, None), (2, PAGE, 5), (3, 16, None)):
        want, _ = run(model, prompts, share=False, max_running=max_running, stop=stop, page=page, chunk=chunk)
        got, stats = run(model, prompts, share=True, max_running=max_running, stop=stop, page=page, chunk=chunk)
        assert got == want and stats["prefix_hit_rate"] == 4 * (44 - 44 % page) / stats["prompt_tokens"]


def test_qwen3_5_shares_only_at_the_holder_cursor(monkeypatch):
    model = qwen_model()
    base = torch.randint(0, 200, (8,), generator=torch.Generator().manual_seed(0)).tolist()  # two full pages
    prompts = {0: base, 1: base + [5, 6, 7], 2: base + [9], 3: base + [1, 2], 4: base[:6] + [3, 3, 3]}
    stop = staggering_stop(model, prompts, n=6)
    for max_running in (2, None):
        want, _ = run(model, prompts, share=False, max_running=max_running, stop=stop)
        spy = AdmitSpy(monkeypatch, prompts)
        got, stats = run(model, prompts, share=True, max_running=max_running, stop=stop)
        monkeypatch.undo()
        assert got == want
        # Only request 0's whole prompt, before it decodes; never a holder that advanced, never 4's 6 tokens.
        assert spy.calls and all(c[1] == 0 and c[2] == 8 and not c[3] for c in spy.calls), spy.calls
        assert stats["prefix_hit_tokens"] == 8 * len(spy.calls)
    assert len(spy.calls) == 3  # all at once: 1, 2 and 3 wait for request 0's prefill


def test_generate_result_unpacks_and_reports():
    step, params, specs = tiny_model()
    prompts = {r: list(b"shared prefix!!!") + [r] for r in range(3)}
    state = fa.State(specs, num_pages=32, page_size=PAGE, max_requests=3)
    result = generate(step, params, fa.ModelAttention(specs), state, prompts, max_new_tokens=3, share_prefixes=True)
    assert isinstance(result, GenerateResult)
    st, out = result
    assert set(out) == {0, 1, 2} and all(len(v) == 3 for v in out.values())
    assert result.stats["prefix_hit_rate"] == pytest.approx(2 * 16 / (3 * 17))
    with pytest.raises(ValueError, match="share_prefixes"):
        generate(step, params, fa.ModelAttention(specs), st, prompts, max_new_tokens=3, share_prefixes=1)
