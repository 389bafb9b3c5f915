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
from .prefix_index import PrefixIndex
from .staging import to_device


class GenerateResult(tuple):
    """``(state, outputs)`` as before (it unpacks the same), with ``stats``: ``prompt_tokens``,
    ``prefix_hit_tokens`` (prompt tokens served from another request's pages with ``share_prefixes``) and
    ``prefix_hit_rate`` (their ratio; 0.0 without sharing)."""

    def __new__(cls, state, outputs, stats):
        self = super().__new__(cls, (state, outputs))
        self.stats = stats
        return self


def run_step(step: Callable, params, model_attention, state, batch: Batch, tokens: torch.Tensor):
    """Run one step and apply its deltas: ``-> (new state, logits [T, vocab])``."""
    with model_attention.session(state, batch) as session:
        logits, deltas = step(params, session, tokens)
    return state.apply(deltas), logits


def prefill(step, params, model_attention, state, prompts: Mapping[int, Sequence[int]], *, chunk: int | None = None,
            align: int | None = None, runner=None):
    """Feed each prompt after its request's cursor; ``-> (state, {rid: last logits})``.

    Each step's batch asks for the last token's logits only (``Batch.prefill(..., logits_for="last")``); a
    step that returns every token's logits anyway is read at each request's last row.

    ``align`` (with a ``chunk`` that is a multiple of it): every chunk but a prompt's last ends at a cache
    position that is a multiple of ``align`` (a page boundary, where ``prefix_checkpoints`` keeps copies).

    ``runner``: a `fnattn.prefill_graph.PrefillRunner` of this model that runs each step through its buckets
    (captured on CUDA); ``chunk`` is then at most its largest bucket (its default), and each step takes as
    many prompts as its largest lane bucket holds.

    An error from a step leaves the given handle stale (room was reserved first): the exception's ``state``
    is the live State, with the chunks fed before it applied and nothing of the failed one."""
    if chunk is not None and (not isinstance(chunk, int) or chunk <= 0):
        fail("prefill", "chunk", "a positive int or None", chunk)
    if align is not None and (chunk is None or chunk % align):
        fail("prefill", "align", f"None or a divisor of chunk ({chunk})", align)
    if runner is not None:
        if runner.attn is not model_attention:
            fail("prefill", "runner", "None or a PrefillRunner over model_attention", type(runner).__name__)
        if chunk is not None and chunk > runner.max_tokens:
            fail("prefill", "chunk", f"None or at most the runner's largest bucket ({runner.max_tokens})", chunk)
        chunk = chunk or runner.max_tokens
    pending = {r: list(p) for r, p in prompts.items()}
    for r, p in pending.items():
        if not p:
            fail("prefill", f"prompts[{r}]", "at least one token", p)
    last: dict = {}
    while pending:
        counts = {r: len(p) if chunk is None else min(chunk - (state.request(r).length % align if align else 0),
                                                       len(p)) for r, p in pending.items()}
        if runner is not None:
            counts = _fitting(runner, counts)
        state = state.reserve(counts)
        try:
            if runner is None:
                state = _prefill_step(step, params, model_attention, state, counts, pending, last)
            else:
                state = _runner_step(runner, state, counts, pending, last)
        except Exception as e:
            # The caller's handle went stale with the reserve: hand back the live one (the prompts fed so far
            # applied, nothing of the step that failed).
            e.state = state
            raise
        pending = {r: p for r, p in pending.items() if p}
    return state, last


def _fitting(runner, counts: dict) -> dict:
    """The first of ``counts``' requests that one of ``runner``'s buckets holds together; at least the first,
    with fewer tokens where its whole count fills no bucket alone (no one-lane bucket of exactly that size)."""
    taken: dict = {}
    for r, n in counts.items():
        if runner.bucket({**taken, r: n}) is None:
            break
        taken[r] = n
    if not taken:
        r, n = next(iter(counts.items()))
        while n > 1 and runner.bucket({r: n}) is None:  # n - 1 fits beside a one-token pad lane
            n -= 1
        taken[r] = n
    return taken


def _runner_step(runner, state, counts, pending, last):
    tokens = torch.tensor([t for r in counts for t in pending[r][: counts[r]]], dtype=torch.long,
                          device=state.device)
    state, logits = runner.prefill(state, counts, tokens)
    for b, r in enumerate(counts):
        last[r] = logits[b]
        pending[r] = pending[r][counts[r]:]
    return state


def _last_rows(logits, batch: Batch) -> Sequence[int]:
    """The row of each lane's last token in a prefill step's ``logits``: one row a lane, as a batch with
    ``logits_for="last"`` asks, or every token's from a step that ignores it."""
    if logits.shape[0] == batch.num_requests:
        return range(batch.num_requests)
    if logits.shape[0] == batch.num_tokens:
        return [end - 1 for end in batch.host_cu_seqlens[1:]]
    fail("prefill", "step", f"logits of {batch.num_requests} rows (each request's last token) or "
         f"{batch.num_tokens} (every token)", tuple(logits.shape))


def _prefill_step(step, params, model_attention, state, counts, pending, last):
    """One chunk of every pending prompt; fills ``last`` and trims ``pending``; ``-> the state after``."""
    batch = Batch.prefill(state, counts, logits_for="last")
    tokens = torch.tensor([t for r in batch.request_ids for t in pending[r][: counts[r]]],
                          dtype=torch.long, device=state.device)
    with model_attention.session(state, batch) as session:
        logits, deltas = step(params, session, tokens)
    rows = _last_rows(logits, batch)  # refused before the apply
    state = state.apply(deltas)
    for b, r in zip(rows, batch.request_ids):
        last[r] = logits[b]
        pending[r] = pending[r][counts[r]:]
    return state


def generate(step, params, model_attention, state, prompts: Mapping[int, Sequence[int]], *,
             max_new_tokens: int | Mapping[int, int] | None = None,
             stop: StopCriteria | Mapping[int, StopCriteria] | None = None, sampler: Sampler | None = None,
             tokenizer=None, chunk: int | None = None,
             on_step: Callable[[int, dict[int, int]], None] | None = None, release: bool = True,
             max_running: int | None = None, share_prefixes: bool = False, runner=None, prefill_runner=None,
             mixed: bool = False):
    """Generate for a batch of new requests; ``-> (state, {rid: new tokens})``, a `GenerateResult` whose
    ``.stats["prefix_hit_rate"]`` is the share of prompt tokens served from shared pages.

    Greedy unless ``sampler`` says otherwise. ``stop`` (or ``max_new_tokens`` alone; either may be a mapping
    request -> its own) ends each request on its own; `generate_completions` also returns the text,
    the finish reason and timings. ``on_step(i, {rid: token})`` is called after each
    step (i = 0 after prefill) with the requests that produced a token. ``share_prefixes``: see
    `generate_completions`.
    """
    result = generate_completions(step, params, model_attention, state, prompts, max_new_tokens=max_new_tokens,
                                  stop=stop, sampler=sampler, tokenizer=tokenizer, chunk=chunk, on_step=on_step,
                                  release=release, max_running=max_running, share_prefixes=share_prefixes,
                                  runner=runner, prefill_runner=prefill_runner, mixed=mixed)
    state, done = result
    return GenerateResult(state, {r: c.ids for r, c in done.items()}, result.stats)


def _criteria(max_new_tokens, stop, prompts) -> dict:
    """Each request's StopCriteria: ``stop`` (one for all, or a mapping request -> its own), or
    ``max_new_tokens`` alone (one int for all, or a mapping request -> int)."""
    if stop is None:
        if isinstance(max_new_tokens, Mapping):
            if set(max_new_tokens) != set(prompts):
                fail("generate", "max_new_tokens", f"an int, or a mapping with every request {sorted(prompts)}",
                     sorted(max_new_tokens))
            return {r: StopCriteria(max_new_tokens=max_new_tokens[r]) for r in prompts}
        if max_new_tokens is None:
            fail("generate", "max_new_tokens", "an int >= 1 (or stop=StopCriteria(...))", None)
        stop = StopCriteria(max_new_tokens=max_new_tokens)
    elif isinstance(stop, Mapping):
        if set(stop) != set(prompts) or not all(isinstance(s, StopCriteria) for s in stop.values()):
            fail("generate", "stop", f"a StopCriteria, or a mapping request -> StopCriteria for every request "
                 f"{sorted(prompts)}", sorted(stop))
        if max_new_tokens is not None:
            fail("generate", "max_new_tokens", "None with a stop per request", max_new_tokens)
        return dict(stop)
    elif not isinstance(stop, StopCriteria):
        fail("generate", "stop", "a StopCriteria", type(stop).__name__)
    elif max_new_tokens is not None and max_new_tokens != stop.max_new_tokens:
        fail("generate", "max_new_tokens", f"None or stop.max_new_tokens ({stop.max_new_tokens})", max_new_tokens)
    return dict.fromkeys(prompts, stop)


def generate_completions(step, params, model_attention, state, prompts: Mapping[int, Sequence[int]], *,
                         max_new_tokens: int | Mapping[int, int] | None = None,
                         stop: StopCriteria | Mapping[int, StopCriteria] | None = None,
                         sampler: Sampler | None = None, tokenizer=None, chunk: int | None = None,
                         on_step: Callable[[int, dict[int, int]], None] | None = None,
                         on_text: Callable[[int, str], None] | None = None, release: bool = True,
                         max_running: int | None = None, share_prefixes: bool = False, runner=None,
                         prefill_runner=None, mixed: bool = False):
    """`generate` with ``-> (state, {rid: Completion})`` (a `GenerateResult`); ``on_text(rid, chunk)`` streams
    each request's text.

    A request that finishes leaves the decode batch at once and, with
    ``release=True``, is released (its pages and slot freed) while the others go on.
    ``max_running`` caps the requests admitted at a time: the others wait, in
    ``prompts`` order, and each is admitted and prefilled as soon as one finishes.

    ``share_prefixes=True`` keeps a `PrefixIndex` of the prompts' page-sized token blocks held by requests
    still admitted, and admits each new prompt with ``state.admit(rid, prefix_of=holder, tokens=n)`` for the
    longest run of full blocks some holder has (at most all but the prompt's last token, whose logits start
    its generation), then prefills only the rest. With recurrent layers a holder serves only a match equal
    to its cursor (``n`` its whole cached length, before it decodes), or, on a State with
    ``prefix_checkpoints=True``, any page boundary it keeps a checkpoint for: then prompts are prefilled in
    chunks ending at page boundaries (``chunk`` rounded down to a multiple of the page size, one page by
    default), so every full page of a prompt has one. Prompts admitted together whose
    common prefix another of them would serve go in a later prefill of the same admission, after it. The
    generated tokens are those of a run without sharing; ``.stats`` reports the hit rate.

    ``runner``: a `fnattn.graph.StepRunner` of the same model, which runs the decode steps (captured CUDA
    graphs on a GPU; requests join and leave its buckets between replays). ``prefill_runner``: a
    `fnattn.prefill_graph.PrefillRunner` of the same model, which runs the prefill steps (`prefill`'s ``runner``).

    ``mixed``: prompts admitted while others decode are prefilled inside the decode steps (`Batch.mixed`: each
    step a decode token of every running request and a chunk of ``chunk`` tokens, default all, of each new
    prompt), not in prefill steps of their own that keep the running requests waiting. Not with
    ``share_prefixes``. With ``prefill_runner`` a mixed step goes through its buckets (chunks of its largest
    at most) where one holds it, else it runs eagerly.
    """
    stops = _criteria(max_new_tokens, stop, prompts)
    if max_running is not None:
        if isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1:
            fail("generate", "max_running", "an int >= 1 or None", max_running)
        if not release and max_running < len(prompts):
            fail("generate", "release", f"True when max_running ({max_running}) < the number of prompts", release)
    from .graph import StepRunner

    if runner is not None and (not isinstance(runner, StepRunner) or runner.attn is not model_attention):
        fail("generate", "runner", "None or a StepRunner over this model_attention", type(runner).__name__)
    sampler = sampler if sampler is not None else Sampler()
    if not isinstance(sampler, Sampler):
        fail("generate", "sampler", "a Sampler", type(sampler).__name__)
    if not isinstance(share_prefixes, bool):
        fail("generate", "share_prefixes", "a bool", share_prefixes)
    if not isinstance(mixed, bool) or (mixed and share_prefixes):
        fail("generate", "mixed", "a bool, False with share_prefixes", mixed)
    streams = {r: RequestStream(p, stops[r], tokenizer) for r, p in prompts.items()}
    index = PrefixIndex(state.page_size) if share_prefixes else None
    S = state.page_size
    boundaries = share_prefixes and state.has_recurrent and state.prefix_checkpoints
    fill = dict(chunk=S if chunk is None else max(S, chunk - chunk % S), align=S) if boundaries else dict(chunk=chunk)
    hits = 0
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
                if index is not None:
                    index.drop(r)

    def admit(new: list[int]) -> dict:
        """Admit and prefill ``new``; ``-> {rid: last prompt logits}``."""
        nonlocal state, hits
        if index is None:
            for r in new:
                state = state.admit(r)
            state, last = prefill(step, params, model_attention, state, {r: prompts[r] for r in new}, chunk=chunk,
                                  runner=prefill_runner)
            return last
        last, pending = {}, list(new)
        while pending:  # each wave admits at least its first request
            wave, later, start = [], [], {}
            for r in pending:
                p = list(prompts[r])
                holder, n = index.match(p, limit=len(p) - 1, usable=usable)
                if any(_lead(prompts[q], p, state) > n for q in wave):
                    later.append(r)  # a request of this wave serves a longer prefix once prefilled
                    continue
                state = state.admit(r) if holder is None else state.admit(r, prefix_of=holder, tokens=n)
                wave.append(r)
                start[r], hits = n, hits + n
            state, got = prefill(step, params, model_attention, state, {r: prompts[r][start[r]:] for r in wave},
                                 runner=prefill_runner, **fill)
            for r in wave:
                index.insert(r, prompts[r])
            last.update(got)
            pending = later
        return last

    def usable(holder: int, n: int) -> bool:
        # A recurrent state is only known at the holder's cursor or a boundary checkpoint (`State.admit`).
        return (not state.has_recurrent or state.request(holder).length == n
                or n in state.boundary_checkpoints(holder))

    waiting, running, i = list(prompts), [], 0
    filling: dict[int, list[int]] = {}  # mixed: admitted prompts not yet fed whole, their tokens left
    mixed_steps = 0
    while waiting or running or filling:
        room = len(waiting) if max_running is None else max_running - len(running) - len(filling)
        if waiting and room > 0:  # admission: a finished request's slot and pages went back to the pool
            new, waiting = waiting[:room], waiting[room:]
            if mixed and running:  # their prefill rides on the running requests' decode steps
                for r in new:
                    state = state.admit(r)
                    filling[r] = list(prompts[r])
            else:
                last = admit(new)
                take(new, torch.stack([last[r] for r in new]), i)
                running, i = running + new, i + 1
        running = [r for r in running if not streams[r].completion.finished]
        if filling and not running:  # nobody left to decode beside them: a prefill step of their own
            state, last = prefill(step, params, model_attention, state, filling, chunk=chunk, runner=prefill_runner)
            new, filling = list(filling), {}
            take(new, torch.stack([last[r] for r in new]), i)
            running, i = running + new, i + 1
            continue
        if filling:
            state, filled, logits = _mixed_step(step, params, model_attention, state, running, filling, chunk,
                                                [streams[r].completion.ids[-1] for r in running], prefill_runner)
            take(running + filled, logits, i)
            running, i = [r for r in running + filled if not streams[r].completion.finished], i + 1
            mixed_steps += 1
            continue
        if running:
            state = state.reserve({r: 1 for r in running})
            tokens = torch.tensor([streams[r].completion.ids[-1] for r in running], dtype=torch.long,
                                  device=state.device)
            if runner is not None:
                state, logits = runner.decode(state, running, tokens)
            else:
                state, logits = run_step(step, params, model_attention, state, Batch.decode(state, running), tokens)
            take(list(running), logits, i)
            running, i = [r for r in running if not streams[r].completion.finished], i + 1
    total = sum(len(p) for p in prompts.values())
    stats = {"prompt_tokens": total, "prefix_hit_tokens": hits, "prefix_hit_rate": hits / total if total else 0.0,
             "mixed_steps": mixed_steps}
    return GenerateResult(state, {r: s.completion for r, s in streams.items()}, stats)


def _mixed_step(step, params, model_attention, state, running: list, filling: dict, chunk, last_ids: list,
                runner=None):
    """One mixed step: a decode token of each of ``running``, the next chunk of each prompt of ``filling``
    (trimmed here), through ``runner``'s buckets where one holds them all, else eagerly. ``-> (state, the
    prompts fed whole, logits [running + those, V])``."""
    caps = [c for c in (chunk, None if runner is None else runner.max_tokens) if c is not None]
    counts = {r: min([len(p), *caps]) for r, p in filling.items()}
    every = {**dict.fromkeys(running, 1), **counts}
    state = state.reserve(every)
    tokens = torch.tensor(last_ids + [t for r in counts for t in filling[r][:counts[r]]], dtype=torch.long,
                          device=state.device)
    if runner is not None and runner.bucket(every) is not None:
        state, logits = runner.prefill(state, counts, tokens, decode_ids=running)  # [lanes, V]
        rows = range(len(every))
    else:
        batch = Batch.mixed(state, running, counts)
        with model_attention.session(state, batch) as session:
            logits, deltas = step(params, session, tokens)
        rows = _last_rows(logits, batch)  # refused before the apply
        state = state.apply(deltas)
    filled = [r for r in counts if counts[r] == len(filling[r])]
    for r in counts:
        filling[r] = filling[r][counts[r]:]
        if not filling[r]:
            del filling[r]
    lanes = [rows[b] for b, r in enumerate(every) if b < len(running) or r in filled]  # running, then filled
    return state, filled, logits[to_device(lanes, torch.long, logits.device)]


def _lead(leader: Sequence[int], p: Sequence[int], state) -> int:
    """Tokens of prompt ``p`` that request ``leader`` would serve once prefilled (full blocks, all but ``p``'s
    last token; with recurrent layers and no boundary checkpoints only all of ``leader``'s prompt)."""
    S, cap = state.page_size, len(p) - 1
    if state.has_recurrent and not state.prefix_checkpoints:
        n = len(leader)
        return n if n % S == 0 and 0 < n <= cap and list(p[:n]) == list(leader) else 0
    n = 0
    for a, b in zip(leader[:cap], p[:cap]):
        if a != b:
            break
        n += 1
    return n - n % S
