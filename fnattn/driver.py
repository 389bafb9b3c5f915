"""A small greedy driver: admit, prefill (optionally chunked), decode, release.

``step(params, session, tokens) -> (logits, StepDeltas)`` is any model step
function; the driver owns the State handle and applies each step's deltas once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from .batch import Batch
from .checks import fail


def run_step(step: Callable, params, model_attention, state, batch: Batch, tokens: torch.Tensor):
    """Run one step and apply its deltas: ``-> (new state, logits [T, vocab])``."""
    with model_attention.session(state, batch) as session:
        logits, deltas = step(params, session, tokens)
    return state.apply(deltas), logits


def prefill(step, params, model_attention, state, prompts: Mapping[int, Sequence[int]], *, chunk: int | None = None):
    """Feed each prompt after its request's cursor; ``-> (state, {rid: last logits})``."""
    if chunk is not None and (not isinstance(chunk, int) or chunk <= 0):
        fail("prefill", "chunk", "a positive int or None", chunk)
    pending = {r: list(p) for r, p in prompts.items()}
    for r, p in pending.items():
        if not p:
            fail("prefill", f"prompts[{r}]", "at least one token", p)
    last = {}
    while pending:
        counts = {r: len(p) if chunk is None else min(chunk, len(p)) for r, p in pending.items()}
        state = state.reserve(counts)
        batch = Batch.prefill(state, counts)
        tokens = torch.tensor([t for r in batch.request_ids for t in pending[r][: counts[r]]],
                              dtype=torch.long, device=state.device)
        state, logits = run_step(step, params, model_attention, state, batch, tokens)
        ends = batch.host_cu_seqlens[1:]
        for b, r in enumerate(batch.request_ids):
            last[r] = logits[ends[b] - 1]
            pending[r] = pending[r][counts[r]:]
        pending = {r: p for r, p in pending.items() if p}
    return state, last


def generate(step, params, model_attention, state, prompts: Mapping[int, Sequence[int]], *,
             max_new_tokens: int, chunk: int | None = None,
             on_step: Callable[[int, dict[int, int]], None] | None = None, release: bool = True):
    """Greedy generation for a batch of new requests; ``-> (state, {rid: new tokens})``.

    ``on_step(i, {rid: token})`` is called after each generated token (i = 0 after prefill).
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        fail("generate", "max_new_tokens", "an int >= 1", max_new_tokens)
    for r in prompts:
        state = state.admit(r)
    state, last = prefill(step, params, model_attention, state, prompts, chunk=chunk)
    out = {r: [int(last[r].argmax())] for r in prompts}
    if on_step:
        on_step(0, {r: out[r][-1] for r in prompts})
    for i in range(1, max_new_tokens):
        ids = list(prompts)
        state = state.reserve({r: 1 for r in ids})
        batch = Batch.decode(state, ids)
        tokens = torch.tensor([out[r][-1] for r in batch.request_ids], dtype=torch.long, device=state.device)
        state, logits = run_step(step, params, model_attention, state, batch, tokens)
        for b, r in enumerate(batch.request_ids):
            out[r].append(int(logits[b].argmax()))
        if on_step:
            on_step(i, {r: out[r][-1] for r in ids})
    if release:
        for r in prompts:
            state = state.release(r)
    return state, out
