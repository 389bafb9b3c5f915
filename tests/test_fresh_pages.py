"""Freshly handed-out storage holding garbage never changes a step's outputs.

A page (or a recurrent slot) a request is given still holds whatever was
there before: another request's rows, or bytes nobody wrote. Rows past a
request's cursor must never reach its outputs, whatever they hold: not NaN
(``0 * NaN`` is NaN, and `torch.topk` ranks NaN first), not values so large
that a masked score overflows to ``inf - inf``, not random bytes (which in an
FP8 e4m3 cache include its NaN encodings). Each family runs prefill, a
chunked prefill after another request, decode and verify on a State whose
every pool was filled with garbage before any page was handed out, and must
give the logits of the same run on zero-filled storage bit for bit, with the
reference backends and with the CPU fast ones. DeepSeek-V3.2 runs with an
FP8 e4m3 MLA latent cache and FP8 index keys.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from fnattn.models.registry import random_model
from helpers import same_bits, snapshot

import fnattn as fa

PAGE = 4


def fill_with_garbage(state, seed: int = 0) -> None:
    """Overwrite every storage tensor of ``state``, null page and slot included, element by element with NaN,
    the largest finite value of either sign, or random bytes (integer tensors: random bytes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pool in state.pools.values():
            for t in pool.tensors.values():
                raw = t.view(torch.uint8)
                raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
                if t.dtype.is_floating_point:
                    kind = torch.randint(0, 3, t.shape, generator=g)
                    big = (torch.randint(0, 2, t.shape, generator=g) * 2 - 1) * torch.finfo(t.dtype).max
                    t.copy_(torch.where(kind == 0, float("nan"), torch.where(kind == 1, big, t.float())).to(t.dtype))


def unwritten_slots(state) -> torch.Tensor:
    """Flat cache slots of the requests' pages past their cursors: rows they were handed and never wrote."""
    S = state.page_size
    return torch.tensor([p * S + o for r in state.requests.values() for i, p in enumerate(r.pages)
                         for o in range(S) if i * S + o >= r.length], dtype=torch.long)


def script(model, attn, state):
    """Prefill, a chunked prefill beside it, decode, a verify accepting 3 of 3 drafts and 1 of 3, decode:
    ``-> (every step's logits in order, the State after them)``."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(5)

    def tokens(n):
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    def step(st, batch, toks):
        with attn.session(st, batch) as s:
            logits, deltas = model.step(model.params, s, torch.tensor(toks))
        return st, deltas, logits

    seen = []

    def apply(st, deltas, logits):
        seen.append(logits)
        return st.apply(deltas)

    st = state.admit(0).reserve({0: 7})
    st = apply(*step(st, fa.Batch.prefill(st, {0: 7}), tokens(7)))
    st = st.admit(1)
    for n in (3, 3):  # the second chunk starts inside a page: a cached prefix under fresh rows
        st = st.reserve({1: n})
        st = apply(*step(st, fa.Batch.prefill(st, {1: n}), tokens(n)))
    st = st.reserve({0: 1, 1: 1})
    st = apply(*step(st, fa.Batch.decode(st, [0, 1]), tokens(2)))
    st = st.reserve({0: 4, 1: 4})
    batch = fa.Batch.verify(st, [0, 1], num_draft=3)
    st, deltas, logits = step(st, batch, tokens(8))
    st = apply(st, deltas.accept(batch, {0: 4, 1: 2}), logits)
    st = st.reserve({0: 1, 1: 1})
    st = apply(*step(st, fa.Batch.decode(st, [0, 1]), tokens(2)))
    return seen, st


@functools.cache
def model_of(name):
    if name != "deepseek_v32_fp8":
        return random_model(name, seed=2)
    model = random_model("deepseek_v32", seed=2)
    cfg = model.config
    cfg = dataclasses.replace(cfg, cache_dtype="fp8_e4m3",
                              indexer=dataclasses.replace(cfg.indexer, key_dtype="fp8_e4m3"))
    return dataclasses.replace(model, config=cfg, params=dataclasses.replace(model.params, config=cfg))


@pytest.mark.parametrize("backends", ["reference", "fast"])
@pytest.mark.parametrize("name", ["qwen3_5", "kimi_linear", "deepseek_v32_fp8", "deepseek_v4"])
def test_garbage_in_fresh_storage_never_reaches_the_outputs(name, backends):
    model = model_of(name)
    attn = fa.ModelAttention(model.specs, prefer=("reference",) if backends == "reference" else None)

    def fresh():
        return fa.State(model.specs, num_pages=12, page_size=PAGE, max_requests=2, recurrent_ring=2)

    want, _ = script(model, attn, fresh())
    assert all(bool(torch.isfinite(x).all()) for x in want)
    st = fresh()
    fill_with_garbage(st)
    garbage = snapshot(st)
    got, st = script(model, attn, st)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i} differs by {(a - b).abs().max()}"
    # The pages handed out held garbage beside the rows the steps wrote, up to the end.
    slots = unwritten_slots(st)
    assert slots.numel()
    for pool_name, pool in st.pools.items():
        if pool.index_space == "token":
            for t, x in pool.tensors.items():
                before = garbage[(pool_name, t)].flatten(1, 2)[:, slots]
                assert same_bits(x.flatten(1, 2)[:, slots], before), (pool_name, t)
