"""Captured prefill: a step per (lanes, tokens) bucket, replayed in pieces around the attention layers.

    runner = PrefillRunner(model.step, model.params, attn)
    state, last = runner.prefill(state, {rid: n}, tokens)   # last: [requests, V], each request's last token

Most of a prefill step's attention launches follow the prompts' lengths (FlashInfer's plan), but everything
between two attention layers -- projections, norms, rope, the MLP, the logits -- is shaped by the token count
alone. So a bucket of ``lanes`` requests and ``tokens`` tokens (the requests, then pad lanes on the null page
and slot taking the rest: `Batch.prefill(..., pad_to=, tokens=)`) is captured as one CUDA graph per stretch
between attention layers, and a replay runs each layer's backend eagerly in between over the live batch,
through a session opened on it as any step's is: each backend plans for the real lengths. A layer whose
prefill backend is capturable (fla-core's GDN chunk forward over a chunk list padded to the bucket's most
chunks, planned from the batch's device tensors) stays inside its piece: a Qwen3.5 bucket is then six
eager attention layers between seven graphs, not 24 between 25. What a backend returns is copied into the
tensors the next piece was captured reading; the last piece holds the step's apply (`State.write`), so the
step still commits once, inside the graph.

A mixed step (``decode_ids``: decode tokens of running requests beside the prompt chunks, `Batch.mixed`) goes
through the same bucket: its session splits each layer between the decode and prefill backends and joins
what they return, which the next piece reads as it reads a prefill backend's.

Without capture (the CPU, ``capture=False``) the same padded batch runs as one eager step with its apply:
the bucket logic is the same, only the replay is missing. Prompts longer than the largest bucket are fed in
chunks of it (`fnattn.driver.prefill` with ``runner=``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from jaxtyping import Int
from torch import Tensor

from .batch import TENSOR_DTYPES, Batch
from .checks import CHECKS_ENABLED, fail
from .deltas import StepDeltas
from .graph import advance_past, refuse_replay_in_the_mode
from .kernels.invariant import invariant_on
from .lanes import LaneError, block_columns, bucket_sizes, check_max_context, static_shapes
from .pieces import CapturingSession, Pieces, ending, replay
from .staging import Staging

DEFAULT_LANES = (1, 2, 4, 8)
DEFAULT_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


def tokens_up_to(top: int) -> tuple[int, ...]:
    """Token buckets for steps of at most ``top`` tokens: the default ones below it, then ``top``."""
    return tuple(t for t in DEFAULT_TOKENS if t < top) + (top,)


@dataclass
class _Entry:
    lanes: int
    tokens: int
    columns: int
    mixed: bool  # a mixed steps' bucket: every attention layer between pieces (each splits by phase)
    staging: Staging
    token_ids: Tensor  # [tokens] int64, the step's tokens lane
    graphs: list = field(default_factory=list)  # torch.cuda.CUDAGraph per piece: len(islands) + 1
    islands: list = field(default_factory=list)
    logits: Tensor | None = None  # [lanes, V] captured
    lineage: int | None = None
    replays: int = 0
    invariant: bool = False  # captured while the invariant mode was on (its launches honour it)


class PrefillRunner:
    """Prefill steps of one model through (lanes, tokens) buckets, captured in pieces on CUDA.

    ``step(params, session, tokens) -> (logits, deltas)`` (a batch with ``logits_for="last"``: one row a
    lane). ``lanes`` / ``tokens``: the bucket sizes, increasing. ``max_context``: the longest cache a request
    may reach (the block table's width; default the whole pool). ``capture``: None captures on CUDA.
    """

    def __init__(self, step, params, model_attention, *, lanes: Iterable[int] = DEFAULT_LANES,
                 tokens: Iterable[int] = DEFAULT_TOKENS, max_context: int | None = None,
                 capture: bool | None = None):
        if not callable(step):
            fail("PrefillRunner", "step", "a step function (params, session, tokens) -> (logits, deltas)", step)
        lanes, tokens = bucket_sizes("PrefillRunner", "lanes", lanes), bucket_sizes("PrefillRunner", "tokens", tokens)
        if lanes[-1] < 2:  # a request shorter than its token bucket takes a pad lane beside it
            fail("PrefillRunner", "lanes", "lane buckets up to 2 at least (a pad lane beside one request)", lanes)
        check_max_context("PrefillRunner", max_context)
        on_cuda = model_attention.device.type == "cuda"
        if capture not in (None, True, False):
            fail("PrefillRunner", "capture", "None, True or False", capture)
        if capture and not on_cuda:
            fail("PrefillRunner", "capture", "False or None on a CPU model (CUDA graphs need a CUDA device)",
                 capture)
        self.step, self.params, self.attn = step, params, model_attention
        self.lanes, self.tokens, self.max_context = lanes, tokens, max_context
        self.capture = on_cuda if capture is None else capture
        self._entries: dict[tuple[int, int, int], _Entry] = {}
        self._pool = None

    @property
    def max_tokens(self) -> int:
        """The most tokens one step takes (the largest bucket): longer prompts go in chunks of it."""
        return self.tokens[-1]

    def columns(self, state) -> int:
        return block_columns(state, self.max_context)

    def bucket(self, counts: Mapping[int, int]) -> tuple[int, int] | None:
        """The smallest (lanes, tokens) bucket ``counts`` fits -- the requests alone, or with pad lanes that
        have a token each at least -- or None."""
        n, live = len(counts), sum(counts.values())
        for lanes in self.lanes:
            if lanes < n:
                continue
            for tokens in self.tokens:
                pads, spare = lanes - n, tokens - live
                if spare >= pads and (pads > 0 or spare == 0):
                    return lanes, tokens
        return None

    def bucket_for(self, counts: Mapping[int, int]) -> tuple[int, int]:
        found = self.bucket(counts)
        if found is None:
            fail("PrefillRunner.prefill", "counts", f"at most {self.lanes[-1] - 1} requests and {self.tokens[-1]} "
                 f"tokens in all, or exactly a bucket (lanes {self.lanes}, tokens {self.tokens})",
                 {"requests": len(counts), "tokens": sum(counts.values())})
        return found

    def entries(self) -> list:
        return list(self._entries.values())

    # --------------------------------------------------------------- steps
    def prefill(self, state, counts: Mapping[int, int], tokens: Int[Tensor, " T"], *,
                decode_ids: Iterable[int] = ()):
        """One prefill step of ``counts`` ({request: new tokens}, in the order of ``tokens``) through its
        bucket: ``-> (state, logits [requests, V])``, each request's last token's. ``decode_ids``: a mixed
        step (`Batch.mixed`): a decode token of each of these requests first (``tokens`` starts with them,
        the logits too), in the same bucket as a prefill of as many lanes and tokens."""
        decode_ids = tuple(decode_ids)
        if not isinstance(counts, Mapping) or not counts:
            fail("PrefillRunner.prefill", "counts", "a non-empty mapping request id -> new token count", counts)
        every = {**dict.fromkeys(decode_ids, 1), **counts}
        live = sum(every.values()) if all(isinstance(n, int) for n in counts.values()) else None
        if not isinstance(tokens, Tensor) or tokens.dim() != 1 or tokens.shape[0] != live:
            fail("PrefillRunner.prefill", "tokens", f"a 1-D tensor of {live} token ids (the requests' new tokens)",
                 getattr(tokens, "shape", type(tokens).__name__))
        if tokens.dtype != torch.int64 or tokens.device != state.device:
            raise LaneError(f"lane 'tokens': expected torch.int64 on {state.device}, got {tokens.dtype} on "
                            f"{tokens.device}")
        lanes, total = self.bucket_for(every)
        columns = self.columns(state)

        def build(state, staging=None):
            if decode_ids:
                return Batch.mixed(state, decode_ids, counts, pad_to=lanes, tokens=total, columns=columns,
                                   staging=staging)
            return Batch.prefill(state, counts, logits_for="last", pad_to=lanes, tokens=total, columns=columns,
                                 staging=staging)

        if (lanes, total, columns, bool(decode_ids)) not in self._entries:  # the builder's checks first
            build(state)  # (into a bucket's staging the builder checks everything before it writes a row)
        if (tokens.device.type == "cpu" or CHECKS_ENABLED) and int(tokens.min()) < 0:
            raise LaneError(f"lane 'tokens': expected ids >= 0, got {int(tokens.min())}")
        state, entry = self._ensure(state, lanes, total, columns, bool(decode_ids))
        batch = build(state, entry.staging)
        entry.token_ids[:live].copy_(tokens)  # pad rows keep earlier ids (zeros at first): valid ones
        if not entry.graphs:
            with static_shapes(), self.attn.session(state, batch) as s:
                logits, deltas = self.step(self.params, s, entry.token_ids)
            return state.apply(deltas), logits[:len(every)]
        if state.lineage != entry.lineage:
            fail("PrefillRunner.prefill", "state", f"a handle of the State this runner's graphs were captured on "
                 f"(lineage {entry.lineage})", f"lineage {state.lineage}")
        if not entry.invariant and invariant_on():
            refuse_replay_in_the_mode("PrefillRunner", self.attn)
        with self.attn.session(state, batch, defer_capturable=True) as s:  # plans for the eager layers only
            replay(entry.graphs, entry.islands, s, "PrefillRunner")
        entry.replays += 1
        return _advance(state, batch), entry.logits[:len(every)].clone()

    # ------------------------------------------------------------- internals
    def _ensure(self, state, lanes: int, tokens: int, columns: int, mixed: bool):
        """The bucket's entry, captured on first use. Mixed steps have entries of their own: a prefill bucket's
        graphs may hold layers (`AttentionSession.holds_in_graph`) that a mixed step runs by phase."""
        key = (lanes, tokens, columns, mixed)
        entry = self._entries.get(key)
        if entry is not None:
            return state, entry
        probe = Batch.prefill(state, {}, logits_for="last", pad_to=lanes, tokens=tokens, columns=columns)
        shapes = {name: tuple(getattr(probe, name).shape) for name in TENSOR_DTYPES}
        staging = Staging(shapes, TENSOR_DTYPES, state.device)
        entry = _Entry(lanes, tokens, columns, mixed, staging,
                       torch.zeros(tokens, dtype=torch.long, device=state.device))
        if self.capture:
            state = self._capture(state, entry)
        self._entries[key] = entry
        return state, entry

    def _pad_batch(self, state, entry: _Entry) -> Batch:
        return Batch.prefill(state, {}, logits_for="last", pad_to=entry.lanes, tokens=entry.tokens,
                             columns=entry.columns, staging=entry.staging)

    def _capture(self, state, entry: _Entry):
        device = state.device
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: compiles, plans and allocator pools, outside any graph
                batch = self._pad_batch(state, entry)
                with static_shapes(), self.attn.session(state, batch) as s:
                    _, deltas = self.step(self.params, s, entry.token_ids)
                state.write(deltas)
                state = _advance(state, batch)
            batch = self._pad_batch(state, entry)
            pieces = Pieces(self._pool)
            # The session opens (plans, lease) before the first piece begins: a plan copies from the host.
            with static_shapes(), self.attn.session(state, batch, defer_capturable=True) as s, ending(pieces):
                pieces.begin()
                capturing = CapturingSession(s, pieces, entry.islands, hold=not entry.mixed)
                logits, deltas = self.step(self.params, capturing, entry.token_ids)
                if not isinstance(deltas, StepDeltas):
                    fail("PrefillRunner", "step", "a step returning (logits, deltas)", type(deltas).__name__)
                state.write(deltas)
        torch.cuda.current_stream(device).wait_stream(stream)
        entry.graphs, entry.logits, entry.lineage = pieces.graphs, logits, state.lineage
        entry.invariant = invariant_on()
        return _advance(state, batch)


def _advance(state, batch: Batch):
    return advance_past(state, batch, batch.cursor_after(batch.host_new_lens))


__all__ = ["DEFAULT_LANES", "DEFAULT_TOKENS", "PrefillRunner", "tokens_up_to"]
