"""Recurrent prefix hits at page boundaries: `State(prefix_checkpoints=True)`.

After every apply the State copies the recurrent rows of each request whose
cursor lands on a page boundary; a request admitted on another's first ``k``
pages (``admit(prefix_of=holder, tokens=k * S)``, the holder further on) then
resumes the GDN/KDA state of that boundary and decodes the logits of a cold
run of it alone.

Chunking: a GDN/KDA prefill computes a chunk's states by a chunk-parallel
formula, so one 8-token chunk and two 4-token chunks give the same state only
up to rounding, not bitwise (qwen3_5's tiny model: logits ~1e-6 apart after 8
tokens as one chunk against two, ~3e-6 for a 13-token prompt in one chunk
against page-sized ones; kimi_linear ~1e-7). The cold run is therefore prefilled in the
same page-sized chunks as the holder's prefix and the new request's suffix;
then every operation is the same and the logits agree to <= 1e-6 (bitwise in
practice, checked below with ``torch.equal`` where it holds).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_refused
from test_transfer import Model, prompt

import fnattn as fa
from fnattn.driver import generate_completions
from fnattn.generation import StopCriteria

PAGE = 4
A_LEN = 14  # three full pages and two tokens of a fourth
K = 2  # B shares A's first two pages


def fresh(model, **kw):
    kw = {"num_pages": 24, "page_size": PAGE, "max_requests": 3, "recurrent_ring": 2, "fill": float("nan"),
          "prefix_checkpoints": True, **kw}
    return fa.State(model.specs, **kw)


def chunked_prefill(model, st, rid, tokens):
    """Prefill ``tokens`` in chunks ending at page boundaries; ``-> (state, logits of the last chunk)``."""
    logits = None
    while tokens:
        n = min(len(tokens), PAGE - st.request(rid).length % PAGE)
        st, logits = model.prefill(st, rid, tokens[:n])
        tokens = tokens[n:]
    return st, logits


def close(got, want):
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module", params=["qwen3_5", "kimi_linear"])
def model(request):
    return Model(request.param)


def test_boundary_hit_equals_cold_run(model):
    a_prompt = prompt(model, A_LEN)
    b_prompt = a_prompt[: K * PAGE] + prompt(model, 5, seed=3)
    a_follow, b_follow = prompt(model, 3, seed=4), prompt(model, 3, seed=5)

    st = fresh(model).admit(2)
    st, cold_b = chunked_prefill(model, st, 2, b_prompt)
    _, cold_b_dec = model.decode(st, 2, b_follow)
    st = fresh(model).admit(1)
    st, _ = chunked_prefill(model, st, 1, a_prompt)
    _, cold_a_dec = model.decode(st, 1, a_follow)

    st = fresh(model).admit(1)
    st, _ = chunked_prefill(model, st, 1, a_prompt)
    assert st.boundary_checkpoints(1) == (4, 8, 12)
    st, got_a1 = model.decode(st, 1, a_follow[:2])  # A moves on past 16: a checkpoint there too
    assert st.boundary_checkpoints(1) == (4, 8, 12, 16)
    st = st.admit(2, prefix_of=1, tokens=K * PAGE)
    b = st.request(2)
    assert b.length == K * PAGE and b.pages == st.request(1).pages[:K]
    assert all(st.refcount(p) == 2 for p in b.pages)
    assert st.boundary_checkpoints(2) == (4, 8)  # A's checkpoints of the prefix they share
    st, got = chunked_prefill(model, st, 2, b_prompt[K * PAGE:])
    close(got, cold_b)
    assert torch.equal(got, cold_b)
    st, got_b1 = model.decode(st, 2, b_follow[:2])
    st, got_a2 = model.decode(st, 1, a_follow[2:])
    st, got_b2 = model.decode(st, 2, b_follow[2:])
    close(torch.cat([got_b1, got_b2]), cold_b_dec)
    close(torch.cat([got_a1, got_a2]), cold_a_dec)
    # A third request on one page of B (B's inherited checkpoint at 4), after B moved on.
    st = st.admit(0, prefix_of=2, tokens=PAGE)
    st, got = chunked_prefill(model, st, 0, b_prompt[PAGE:])
    close(got, cold_b)


def test_refusals_release_and_restore(model):
    st = fresh(model).admit(1)
    st, _ = chunked_prefill(model, st, 1, prompt(model, A_LEN))
    for n in (6, 13, 3):  # inside a page, or short of the first boundary
        assert_refused(st, lambda n=n: st.admit(2, prefix_of=1, tokens=n), r"tokens.*recurrent state is only known")
    plain = fresh(model, prefix_checkpoints=False).admit(1)
    plain, _ = chunked_prefill(model, plain, 1, prompt(model, A_LEN))
    assert plain.boundary_checkpoints(1) == ()
    assert_refused(plain, lambda: plain.admit(2, prefix_of=1, tokens=8), r"tokens.*prefix_checkpoints=True")
    with pytest.raises(ValueError, match="prefix_checkpoints"):
        fresh(model, prefix_checkpoints=1)

    # A restore drops the checkpoints past the length it rolls back to.
    ck = st.checkpoint([1])
    st, _ = model.decode(st, 1, prompt(model, 6, seed=7))  # 14 -> 20: boundaries 16 and 20
    assert st.boundary_checkpoints(1) == (4, 8, 12, 16, 20)
    st = st.restore(ck)
    assert st.boundary_checkpoints(1) == (4, 8, 12)
    # Release drops a request's checkpoints; the one admitted on it keeps its own.
    st = st.admit(2, prefix_of=1, tokens=8)
    st = st.release(1)
    assert not any(r == 1 for r, _ in st._boundary)
    assert st.boundary_checkpoints(2) == (4, 8)
    st = st.release(2)
    assert not st._boundary and st.free_pages == st.num_pages


def test_a_restore_below_every_checkpoint_drops_them_all(model):
    """Rolled back below its first boundary, a request keeps no checkpoint of the abandoned timeline: a prefix
    hit there would resume that timeline's recurrent state under the new timeline's tokens."""
    st = fresh(model).admit(1)
    st, _ = model.prefill(st, 1, prompt(model, 3))  # short of the first boundary
    ck = st.checkpoint([1])
    st, _ = chunked_prefill(model, st, 1, prompt(model, 5, seed=8))  # 3 -> 8, landing on 4 and 8
    assert st.boundary_checkpoints(1) == (4, 8)
    st = st.restore(ck)
    assert st.boundary_checkpoints(1) == ()
    st, _ = model.prefill(st, 1, prompt(model, 7, seed=9))  # another timeline, 3 -> 10 in one chunk
    assert st.boundary_checkpoints(1) == ()
    for n in (4, 8):
        assert_refused(st, lambda n=n: st.admit(2, prefix_of=1, tokens=n), r"tokens.*kept at \[\]")


def test_generate_shares_page_boundaries_of_a_holder():
    model = Model("qwen3_5")
    base = prompt(model, 12, seed=11)  # three full pages
    prompts = {0: base + [1, 2, 3], 1: base + [4, 5], 2: base[:8] + [7, 7, 7], 3: base[:4] + [9] * 6}
    stop = StopCriteria(max_new_tokens=5)

    def run(share, checkpoints, max_running=None, chunk=None):
        step = lambda params, session, tokens: model.step(session, tokens)  # noqa: E731
        st = fresh(model, num_pages=64, max_requests=len(prompts), prefix_checkpoints=checkpoints)
        result = generate_completions(step, None, model.attn, st, prompts, stop=stop, share_prefixes=share,
                                      max_running=max_running, chunk=chunk)
        st, done = result
        assert st.free_pages == st.num_pages and not st.requests and not st._boundary
        return {r: c.ids for r, c in done.items()}, result.stats

    want, cold = run(False, False)
    assert cold["prefix_hit_rate"] == 0.0
    # Without checkpoints no holder's cursor is at a shared boundary: no hit at all.
    assert run(True, False)[1]["prefix_hit_tokens"] == 0
    got, stats = run(True, True)
    assert got == want
    assert stats["prefix_hit_tokens"] == 12 + 8 + 4 and stats["prefix_hit_rate"] > 0
    # Admitted while the holder decodes, and with a chunk that is not a multiple of the page size.
    got, stats = run(True, True, max_running=2, chunk=6)
    assert got == want and stats["prefix_hit_rate"] > 0
