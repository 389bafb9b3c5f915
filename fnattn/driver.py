"""A small driver: admit, prefill (optionally chunked), decode until each request stops, release.

``step(params, session, tokens) -> (logits, StepDeltas)`` is any model step
function; the driver owns the State handle and applies each step's deltas once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from .batch import Batch
from .checks import fail
from .generation import RequestStream, Sampler, StopCriteria


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
             max_new_tokens: int | None = None, stop: StopCriteria | None = None, sampler: Sampler | None = None,
             tokenizer=None, chunk: int | None = None,
             on_step: Callable[[int, dict[int, int]], None] | None = None, release: bool = True,
             max_running: int | None = None):
    """Generate for a batch of new requests; ``-> (state, {rid: new tokens})``.

    Greedy unless ``sampler`` says otherwise. ``stop`` (or ``max_new_tokens`` alone)
    ends each request on its own; `generate_completions` also returns the text,
    the finish reason and timings. ``on_step(i, {rid: token})`` is called after each
    step (i = 0 after prefill) with the requests that produced a token.
    """
    state, done = generate_completions(step, params, model_attention, state, prompts, max_new_tokens=max_new_tokens,
                                       stop=stop, sampler=sampler, tokenizer=tokenizer, chunk=chunk,
                                       on_step=on_step, release=release, max_running=max_running)
    return state, {r: c.ids for r, c in done.items()}


def _criteria(max_new_tokens, stop) -> StopCriteria:
    if stop is None:
        if max_new_tokens is None:
            fail("generate", "max_new_tokens", "an int >= 1 (or stop=StopCriteria(...))", None)
        return StopCriteria(max_new_tokens=max_new_tokens)
    if not isinstance(stop, StopCriteria):
        fail("generate", "stop", "a StopCriteria", type(stop).__name__)
    if max_new_tokens is not None and max_new_tokens != stop.max_new_tokens:
        fail("generate", "max_new_tokens", f"None or stop.max_new_tokens ({stop.max_new_tokens})", max_new_tokens)
    return stop


def generate_completions(step, params, model_attention, state, prompts: Mapping[int, Sequence[int]], *,
                         max_new_tokens: int | None = None, stop: StopCriteria | None = None,
                         sampler: Sampler | None = None, tokenizer=None, chunk: int | None = None,
                         on_step: Callable[[int, dict[int, int]], None] | None = None,
                         on_text: Callable[[int, str], None] | None = None, release: bool = True,
                         max_running: int | None = None):
    """`generate` with ``-> (state, {rid: Completion})``; ``on_text(rid, chunk)`` streams each request's text.

    A request that finishes leaves the decode batch at once and, with
    ``release=True``, is released (its pages and slot freed) while the others go on.
    ``max_running`` caps the requests admitted at a time: the others wait, in
    ``prompts`` order, and each is admitted and prefilled as soon as one finishes.
    """
    stop = _criteria(max_new_tokens, stop)
    if max_running is not None:
        if isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1:
            fail("generate", "max_running", "an int >= 1 or None", max_running)
        if not release and max_running < len(prompts):
            fail("generate", "release", f"True when max_running ({max_running}) < the number of prompts", release)
    sampler = sampler if sampler is not None else Sampler()
    if not isinstance(sampler, Sampler):
        fail("generate", "sampler", "a Sampler", type(sampler).__name__)
    streams = {r: RequestStream(p, stop, tokenizer) for r, p in prompts.items()}
    generator = sampler.generator(state.device)
    started = time.perf_counter()

    def take(rids: list[int], logits: torch.Tensor, i: int):
        nonlocal state
        tokens = sampler.sample(logits, generator).tolist()
        now = time.perf_counter() - started
        for r, t in zip(rids, tokens):
            shown = streams[r].push(t, now)
            if shown and on_text:
                on_text(r, shown)
        if on_step:
            on_step(i, dict(zip(rids, tokens)))
        for r in rids:
            if streams[r].completion.finished and release:
                state = state.release(r)

    waiting, running, i = list(prompts), [], 0
    while waiting or running:
        room = len(waiting) if max_running is None else max_running - len(running)
        if waiting and room > 0:  # admission: a finished request's slot and pages went back to the pool
            new, waiting = waiting[:room], waiting[room:]
            for r in new:
                state = state.admit(r)
            state, last = prefill(step, params, model_attention, state, {r: prompts[r] for r in new}, chunk=chunk)
            take(new, torch.stack([last[r] for r in new]), i)
            running, i = running + new, i + 1
        running = [r for r in running if not streams[r].completion.finished]
        if running:
            state = state.reserve({r: 1 for r in running})
            batch = Batch.decode(state, running)
            tokens = torch.tensor([streams[r].completion.ids[-1] for r in batch.request_ids], dtype=torch.long,
                                  device=state.device)
            state, logits = run_step(step, params, model_attention, state, batch, tokens)
            take(list(batch.request_ids), logits, i)
            running, i = [r for r in running if not streams[r].completion.finished], i + 1
    return state, {r: s.completion for r, s in streams.items()}
