"""Captured steps: decode per lane bucket and verify per (bucket, drafts), replayed from a lane manifest.

    runner = StepRunner(model.step, model.params, attn, manifest)
    state, logits = runner.decode(state, request_ids, tokens)          # [n, V]
    verified = runner.verify(state, request_ids, tokens, num_draft=k)  # .logits [n * (1 + k), V]
    state = verified.accept(accepted)

A step's batch is padded when it is built (`Batch.decode(..., pad_to=, columns=)`): pad lanes read and write
only the State's null page and null slot, and every tensor is shaped by the bucket. On CUDA each bucket is
captured once -- the model step and the once-per-step apply inside one graph -- and replayed: the runner
checks the batch against the State and every replay lane against the manifest (present, shape, dtype,
device, the layout of lanes carved from one buffer) before it copies any into the graph's buffers, then
replays, then moves the cursors on the host. Capture and replay take their batch from the same builder.

A model with decode backends that are not capturable (`StepRunner.uncapturable`: a notebook's new kind) has
its decode buckets captured in pieces around those layers (`fnattn.pieces`): each runs eagerly between two
graphs over the live batch, and the last graph holds the apply.

Without capture (the CPU, a notebook, ``capture=False``) the same validation and the same static buffers
surround the eager step and its full `State.apply`; with ``host_reads="error"`` the step also runs under
`fnattn.lanes.no_host_reads` (and on CUDA under ``torch.cuda.set_sync_debug_mode("error")``).

Verify writes every token row and every spare ring row inside the graph; acceptance then moves cursors
only (rows past a cursor are never read). Replay recovery re-runs the accepted tokens eagerly after the
graph, since how many there are is known only then. Prefill runs eagerly.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .batch import RECOVERY, TENSOR_DTYPES, Batch, next_step_id, rebound
from .checks import CHECKS_ENABLED, fail
from .deltas import StepDeltas
from .kernels.invariant import invariant_on
from .lanes import (
    BATCH_LANES,
    Bucket,
    LaneError,
    Manifest,
    block_columns,
    bucket_sizes,
    check_lanes,
    check_max_context,
    check_out,
    no_host_reads,
    static_shapes,
)
from .pieces import CapturingSession, Pieces, ending, replay
from .session import check_of_state
from .staging import Staging

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class _Entry:
    bucket: Bucket
    recovery: str
    inputs: dict[str, Tensor]  # lane -> static buffer the step reads
    staging: Staging  # the batch lanes of `inputs` are its device views: the runner builds batches into them
    graph: object | None = None  # torch.cuda.CUDAGraph once captured whole
    # captured in pieces around the layers whose backends cannot be: a graph per piece, len(islands) + 1
    graphs: list = field(default_factory=list)
    islands: list = field(default_factory=list)  # `fnattn.pieces.Island` per layer run between two pieces
    lineage: int | None = None  # the State storage the graph was captured on: its replays write there
    outputs: dict[str, Tensor] = field(default_factory=dict)  # captured output lanes
    generated: dict[str, Tensor] = field(default_factory=dict)
    replay_outputs: dict[int, object] = field(default_factory=dict)
    replays: int = 0
    # (a decode batch built into the staging for the requests' next tokens, what it was derived from): see
    # `StepRunner._prepare_next`
    prepared: tuple[Batch, tuple] | None = None
    prepared_used: int = 0  # decode steps that took the prepared batch
    invariant: bool = False  # captured while the invariant mode was on (its launches honour it)

    @property
    def captured(self) -> bool:
        return self.graph is not None or bool(self.graphs)


def _check_lineage(state, entry: _Entry, where: str) -> None:
    """A captured graph replays into the pools of the State it was captured on, whatever handle the step is
    given: another State's step would read and write that first State's storage."""
    if entry.captured and state.lineage != entry.lineage:
        fail(where, "state", f"a handle of the State this runner's graphs were captured on (lineage "
             f"{entry.lineage}; another State needs a StepRunner of its own)", f"lineage {state.lineage}")


class StepRunner:
    """Runs decode and verify steps of one model through bucketed static buffers, captured on CUDA.

    ``step(params, session, tokens)`` returns ``(logits, deltas)``, or ``(logits, hidden, deltas)`` when the
    manifest has a ``hidden`` output lane. ``buckets``: the lane counts steps are padded to.
    ``max_context``: the longest cache a request may reach (fixes the block table's width; default the
    whole pool). ``capture``: None captures on CUDA. Decode steps whose model has backends that are not
    capturable (`uncapturable`: a notebook's new kind, say) are captured in pieces around those layers, which
    run eagerly between the graphs (`fnattn.pieces`); verify steps are captured where every verify backend is
    capturable, and otherwise run the checked eager step.
    ``prepare``: whether `decode` builds the next decode batch of the same requests right after it launches
    a replay, while the device runs it (`_prepare_next`); None: where steps are captured.
    """

    def __init__(self, step, params, model_attention, manifest: Manifest, *, buckets: Iterable[int] = DEFAULT_BUCKETS,
                 max_context: int | None = None, capture: bool | None = None, host_reads: str = "allow",
                 prepare: bool | None = None):
        if not callable(step):
            fail("StepRunner", "step", "a step function (params, session, tokens) -> (logits, ..., deltas)", step)
        if not isinstance(manifest, Manifest):
            fail("StepRunner", "manifest", "a fnattn.lanes.Manifest", type(manifest).__name__)
        buckets = bucket_sizes("StepRunner", "buckets", buckets)
        check_max_context("StepRunner", max_context)
        if capture not in (None, True, False):
            fail("StepRunner", "capture", "None, True or False", capture)
        if host_reads not in ("allow", "error"):
            fail("StepRunner", "host_reads", "'allow' or 'error'", host_reads)
        if prepare not in (None, True, False):
            fail("StepRunner", "prepare", "None, True or False", prepare)
        self.step, self.params, self.attn, self.manifest = step, params, model_attention, manifest
        self.buckets, self.max_context, self.host_reads = buckets, max_context, host_reads
        self.hidden = any(lane.name == "hidden" for lane in manifest.role("output"))
        self.hidden_in = any(lane.name == "hidden_in" for lane in manifest.role("input"))  # a draft's step
        on_cuda = model_attention.device.type == "cuda"
        if capture and not on_cuda:
            fail("StepRunner", "capture", "False or None on a CPU model (CUDA graphs need a CUDA device)", capture)
        self.capture = on_cuda if capture is None else capture
        # Decode captured in pieces: the layers of `uncapturable` decode backends run between the graphs.
        self.in_pieces = self.capture and bool(self.uncapturable("decode"))
        # Verify is captured where its backends allow it too; otherwise it runs the checked eager step.
        self.capture_verify = self.capture and not self.uncapturable("verify")
        self.prepare = self.capture if prepare is None else prepare
        self._entries: dict[tuple[Bucket, str], _Entry] = {}
        self.last_validation_s = 0.0
        self._pool = None

    # ---------------------------------------------------------------- info
    def uncapturable(self, phase: str | None = None) -> list[str]:
        """Why this model's decode and verify (or just ``phase``) cannot be captured: one line per (layer, phase)
        whose backend is not capturable."""
        out = []
        for (layer, p), choice in sorted(self.attn.choices.items()):
            if p != "prefill" and phase in (None, p) and choice.backend is not None and not choice.backend.capturable:
                out.append(f"layer {layer} {p}: {choice.backend.name!r} is not capturable")
        return out

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        fail("StepRunner", "request_ids", f"at most {self.buckets[-1]} requests (the largest bucket)", n)

    def columns(self, state) -> int:
        return block_columns(state, self.max_context)

    # --------------------------------------------------------------- steps
    def decode(self, state, request_ids: Iterable[int], tokens: Int[Tensor, " n"], *,
               out: Float[Tensor, "n V"] | None = None):
        """One token per request: ``-> (state, logits [n, V])`` (written into ``out`` when given)."""
        self._not_a_draft("StepRunner.decode")
        ids = tuple(request_ids)
        if not ids:
            fail("StepRunner.decode", "request_ids", "at least one request", ids)
        bucket = Bucket("decode", self.bucket_for(len(ids)), 0, self.columns(state))
        started = time.perf_counter()
        self._check_tokens(tokens, len(ids), state.device, out)  # before the batch is built into the buffers
        self.last_validation_s = time.perf_counter() - started
        if (bucket, "native") not in self._entries:  # the bucket's buffers (and graph) only for a valid step
            Batch.decode(state, ids, pad_to=bucket.lanes, columns=bucket.columns)
        state, entry = self._ensure(state, bucket, "native")
        # Built here from the live handle a moment ago: checking it against that handle again would compare
        # the State with itself (`run` checks a batch it is handed).
        batch = self._take_prepared(state, entry, ids)
        if batch is None:
            batch = Batch.decode(state, ids, pad_to=bucket.lanes, columns=bucket.columns, staging=entry.staging)
        state, logits = self._decode(state, entry, batch, tokens, out, built_here=True)
        if self.prepare:
            self._prepare_next(state, entry, ids)
        return state, logits

    def propose(self, state, request_ids: Iterable[int], tokens: Int[Tensor, " n"], hidden: Float[Tensor, "n D"],
                *, copy: bool = True):
        """A draft model's decode step (a runner whose manifest has the ``hidden_in`` lane): one token per request
        and the hidden state it continues from (``hidden`` [n, D]); ``-> (state, logits [n, V], hidden_out [n, D])``.
        Captured per bucket as `decode` is, ``hidden`` copied into its lane with the tokens. ``copy=False``: a
        replayed step's outputs are views of its graph's buffers, which the bucket's next replay overwrites (for
        a caller that reads them before then: `fnattn.speculative.Speculator`'s chain); True: copies."""
        if not self.hidden_in:
            fail("StepRunner.propose", "manifest", "a draft step's lanes (step_manifest(..., hidden_in=True))",
                 "no 'hidden_in' input lane")
        ids = tuple(request_ids)
        if not ids:
            fail("StepRunner.propose", "request_ids", "at least one request", ids)
        if not isinstance(copy, bool):
            fail("StepRunner.propose", "copy", "a bool", copy)
        bucket = Bucket("decode", self.bucket_for(len(ids)), 0, self.columns(state))
        self._check_tokens(tokens, len(ids), state.device, None)
        self._check_hidden("StepRunner.propose", hidden, len(ids), state)
        if (bucket, "native") not in self._entries:  # the bucket's buffers (and graph) only for a valid step
            Batch.decode(state, ids, pad_to=bucket.lanes, columns=bucket.columns)
        state, entry = self._ensure(state, bucket, "native")
        batch = Batch.decode(state, ids, pad_to=bucket.lanes, columns=bucket.columns, staging=entry.staging)
        state, outputs = self._decode_outputs(state, entry, batch, tokens, None, built_here=True, hidden=hidden,
                                              copy=copy)
        return state, outputs["logits"], outputs["hidden"]

    def _check_hidden(self, where: str, hidden, rows: int, state) -> None:
        """A draft runner's ``hidden`` (one row a token, its lane's dtype, the State's device); none elsewhere."""
        if not self.hidden_in:
            if hidden is not None:
                fail(where, "hidden", "None (this runner's manifest has no 'hidden_in' lane)", type(hidden).__name__)
            return
        lane = next(lane for lane in self.manifest.role("input") if lane.name == "hidden_in")
        want = (rows, self.manifest.dims["D"])
        if not isinstance(hidden, Tensor) or tuple(hidden.shape) != want:
            fail(where, "hidden", f"a tensor of shape {want} (a draft runner's step reads one a token)",
                 getattr(hidden, "shape", hidden))
        if hidden.dtype != lane.dtype or hidden.device != state.device:
            raise LaneError(f"lane 'hidden_in': expected {lane.dtype} on {state.device}, got {hidden.dtype} on "
                            f"{hidden.device}")

    def _not_a_draft(self, where: str) -> None:
        if self.hidden_in:
            fail(where, "manifest", "a target step's lanes (a runner with a 'hidden_in' lane runs `propose`)",
                 "a 'hidden_in' input lane")

    def run(self, state, batch: Batch, tokens: Int[Tensor, " n"], *, out: Float[Tensor, "n V"] | None = None):
        """One decode step over a batch padded to one of this runner's buckets (``Batch.decode(state, ids,
        pad_to=bucket, columns=runner.columns(state))``); ``tokens`` [n] for its requests.
        ``-> (state, logits [n, V])``. Every lane is checked before any is copied."""
        self._not_a_draft("StepRunner.run")
        if not isinstance(batch, Batch):
            fail("StepRunner.run", "batch", "a Batch", type(batch).__name__)
        if batch.phase != "decode":  # by its phase, never by its shape
            fail("StepRunner.run", "batch.phase", "'decode' (verify steps go through StepRunner.verify; prefill "
                 "runs eagerly)", batch.phase)
        table = batch.block_table
        if not isinstance(table, Tensor) or table.dim() != 2:
            fail("StepRunner.run", "batch.block_table", "a 2-D tensor [lanes, columns]",
                 getattr(table, "shape", type(table).__name__))
        bucket = Bucket("decode", batch.num_requests, 0, table.shape[1])
        entry = self._entries.get((bucket, "native"))
        if entry is not None:
            _check_lineage(state, entry, "StepRunner.run")
        else:
            if batch.num_requests not in self.buckets or bucket.columns != self.columns(state):
                raise LaneError(f"batch: expected a bucket of {self.buckets} lanes and {self.columns(state)} "
                                f"block-table columns, got {batch.num_requests} lanes and {bucket.columns}")
            self._check_tokens(tokens, batch.live_tokens, state.device, out)
            check_of_state(state, batch, "StepRunner.run")  # before the bucket's buffers (and graph) exist
            version = state.version
            state, entry = self._ensure(state, bucket, "native")
            if state.version != version:  # captured just now: the same builder, over the new handle
                batch = Batch.decode(state, batch.live_ids, pad_to=bucket.lanes, columns=bucket.columns)
        return self._decode(state, entry, batch, tokens, out, built_here=False)

    def _decode(self, state, entry: _Entry, batch: Batch, tokens: Tensor, out, *, built_here: bool):
        state, outputs = self._decode_outputs(state, entry, batch, tokens, out, built_here=built_here)
        return state, outputs["logits"]

    def _decode_outputs(self, state, entry: _Entry, batch: Batch, tokens: Tensor, out, *, built_here: bool,
                        hidden: Tensor | None = None, copy: bool = True):
        """A decode step run and committed (the apply, or past a replay the cursor moves): ``-> (state, outputs)``."""
        outputs, deltas, _ = self._run(state, entry, batch, tokens, out, built_here=built_here, hidden=hidden,
                                       copy=copy)
        if not entry.captured:
            return state.apply(deltas), outputs
        return advance_past(state, batch, batch.cursor_after(batch.host_new_lens)), outputs

    def verify(self, state, request_ids: Iterable[int], tokens: Int[Tensor, " T"], *, num_draft: int,
               recovery: str = "native", hidden: Tensor | None = None, copy: bool = True) -> "Verified":
        """The last token and ``num_draft`` drafts per request; `Verified.accept` applies the acceptance.
        ``hidden`` [T, D]: a draft runner's (``hidden_in`` lane) hidden state of every token, for the draft's
        catch-up on a speculative step's tokens in one fixed-shape step (`fnattn.speculative.Speculator`).
        ``copy``: as `propose`'s (False: the logits and hidden are the graph's buffers until its next replay)."""
        ids = tuple(request_ids)
        if not ids:
            fail("StepRunner.verify", "request_ids", "at least one request", ids)
        if not isinstance(copy, bool):
            fail("StepRunner.verify", "copy", "a bool", copy)
        if isinstance(num_draft, bool) or not isinstance(num_draft, int) or num_draft < 1:
            fail("StepRunner.verify", "num_draft", "an int >= 1", num_draft)
        self._check_hidden("StepRunner.verify", hidden, len(ids) * (1 + num_draft), state)
        if recovery not in RECOVERY:
            fail("StepRunner.verify", "recovery", f"one of {RECOVERY}", recovery)
        bucket = Bucket("verify", self.bucket_for(len(ids)), num_draft, self.columns(state))
        started = time.perf_counter()
        self._check_tokens(tokens, len(ids) * (1 + num_draft), state.device, None)
        self.last_validation_s = time.perf_counter() - started
        if (bucket, recovery) not in self._entries:  # the bucket's buffers (and graph) only for a valid step
            Batch.verify(state, ids, num_draft=num_draft, recovery=recovery, pad_to=bucket.lanes,
                         columns=bucket.columns)
        state, entry = self._ensure(state, bucket, recovery)
        batch = Batch.verify(state, ids, num_draft=num_draft, recovery=recovery, pad_to=bucket.lanes,
                             columns=bucket.columns, staging=entry.staging)
        outputs, deltas, replay_outputs = self._run(state, entry, batch, tokens, None, built_here=True,
                                                    hidden=hidden, copy=copy)
        return Verified(self, state, batch, entry, outputs, deltas, replay_outputs)

    # ------------------------------------------------------------- internals
    def _prepare_next(self, state, entry: _Entry, ids: tuple) -> None:
        """Build the decode batch of ``ids``' next tokens into the staging now, while the device runs the
        replay just launched: its copies queue behind that replay on the stream, so the graph has read this
        step's lanes before they land. The next `decode` of the same requests takes it when every request's
        length, pages, ring position and slot are still what it was built from (`_derivation`), and otherwise
        builds its own into the staging, which its copies overwrite. A request without room for one more token
        (its next page not reserved yet) leaves nothing prepared."""
        entry.prepared = None
        S, reqs = state.page_size, state.requests
        if any(reqs[r].length + 1 > len(reqs[r].pages) * S for r in ids):
            return
        b = entry.bucket
        batch = Batch.decode(state, ids, pad_to=b.lanes, columns=b.columns, staging=entry.staging)
        entry.prepared = (batch, _derivation(state, ids))

    def _take_prepared(self, state, entry: _Entry, ids: tuple) -> Batch | None:
        """The prepared batch, restamped for ``state`` (a handle of the same bookkeeping, after a reserve that
        added no page), or None: then the caller builds one."""
        prepared, entry.prepared = entry.prepared, None
        if prepared is None:
            return None
        batch, derived_from = prepared
        if batch.live_ids != ids or _derivation(state, ids) != derived_from:
            return None
        entry.prepared_used += 1
        # The same rows the builder would derive from ``state`` now: only the version and the step are new.
        return rebound(batch, state_version=state.version, step_id=next_step_id())

    def _check_tokens(self, tokens, live: int, device: torch.device, out: Tensor | None) -> None:
        """The requests' new tokens (and an ``out=`` buffer for their logits), before anything is copied."""
        if not isinstance(tokens, Tensor) or tokens.dim() != 1 or tokens.shape[0] != live:
            fail("StepRunner", "tokens", f"a 1-D tensor of {live} token ids (the requests' new tokens)",
                 getattr(tokens, "shape", type(tokens).__name__))
        if tokens.dtype != torch.int64:
            raise LaneError(f"lane 'tokens': expected dtype torch.int64, got {tokens.dtype}")
        if tokens.device != device:
            raise LaneError(f"lane 'tokens': expected a tensor on {device}, got {tokens.device}")
        vocab = self.manifest.dims["V"]
        if out is not None:
            check_out(out, (live, self.manifest.dims["L"]), torch.float32, device)
        if (tokens.device.type == "cpu" or CHECKS_ENABLED) and tokens.numel() and not (
                0 <= int(tokens.min()) and int(tokens.max()) < vocab):
            raise LaneError(f"lane 'tokens': expected ids in 0..{vocab - 1}, got {tokens.min()}..{tokens.max()}")

    def _run(self, state, entry: _Entry, batch: Batch, tokens: Tensor, out: Tensor | None, *, built_here: bool,
             hidden: Tensor | None = None, copy: bool = True):
        """Validate every lane, copy them into the static buffers, run the step; ``-> (outputs, deltas)``.

        A batch built here went into the entry's staging (its lanes are the buffers; the tokens were checked
        before it was built); a batch the caller hands over is checked whole, then copied."""
        live = batch.live_tokens
        if not built_here:
            entry.prepared = None  # the lanes copied below replace the prepared ones
            started = time.perf_counter()
            self._check_tokens(tokens, live, state.device, out)
            # The token buffer stands in for the tokens lane: the caller's tokens were just checked, and only
            # their `live` rows are copied (pad lanes keep earlier, checked ids).
            lanes = {"tokens": entry.inputs["tokens"], **{name: getattr(batch, name) for name in BATCH_LANES}}
            check_lanes(self.manifest, entry.bucket, lanes, state.device)
            check_of_state(state, batch, "StepRunner")  # this handle's batch, before anything is copied
            self.last_validation_s = time.perf_counter() - started  # host time of the checks, read by the bench
            for name in BATCH_LANES:  # nothing was copied before every lane passed
                entry.inputs[name].copy_(getattr(batch, name))
        elif any(getattr(batch, name) is not entry.inputs[name] for name in BATCH_LANES):
            fail("StepRunner", "batch", "a batch built into this bucket's staging", "another batch")
        entry.inputs["tokens"][:live].copy_(tokens)
        if hidden is not None:  # a draft's step (`propose`): checked there, pad lanes keep earlier rows
            entry.inputs["hidden_in"][:live].copy_(hidden)
        if entry.captured:
            if not entry.invariant and invariant_on():
                refuse_replay_in_the_mode("StepRunner", self.attn)
            if entry.graph is not None:
                entry.graph.replay()
            else:  # the captured layers' plans are in their pieces: the session plans the islands' alone
                static = self._static_batch(entry, batch)
                with static_shapes(), self.attn.session(state, static, defer_capturable=True) as s:
                    replay(entry.graphs, entry.islands, s, "StepRunner")
            entry.replays += 1
            outputs, deltas, replay_outputs = entry.outputs, None, entry.replay_outputs
        else:
            outputs, deltas, replay_outputs = self._eager(state, entry, self._static_batch(entry, batch),
                                                          guard=self.host_reads == "error")
        if out is not None:
            out.copy_(outputs["logits"][:live])
            outputs = {**outputs, "logits": out}
        elif entry.captured and copy:  # the graph's buffers are overwritten by the next replay: hand out copies
            outputs = {name: t[:live].clone() for name, t in outputs.items()}
        else:
            outputs = {name: t[:live] for name, t in outputs.items()}
        return outputs, deltas, replay_outputs

    def _static_batch(self, entry: _Entry, batch: Batch) -> Batch:
        if all(getattr(batch, name) is entry.inputs[name] for name in BATCH_LANES):
            return batch  # built into the staging: its seal still says whether a later batch overwrote it
        return replace(batch, **{name: entry.inputs[name] for name in BATCH_LANES})

    def _eager(self, state, entry: _Entry, batch: Batch, *, guard: bool = False, pieces: Pieces | None = None):
        """The step over a batch in the static buffers: ``-> (outputs, deltas, replay outputs)``; the
        generated lanes it recorded go to ``entry.generated``. ``pieces``: captured in pieces, the first begun
        once the session has planned the islands' layers (a plan may copy from the host), each island kept in
        ``entry.islands``; the last piece is left open for the apply."""
        reads = _host_reads_fail(state.device) if guard else contextlib.nullcontext()
        with static_shapes(), reads, self.attn.session(state, batch, defer_capturable=pieces is not None) as s:
            extra = (entry.inputs["hidden_in"],) if self.hidden_in else ()
            run = s
            if pieces is not None:
                pieces.begin()
                run = CapturingSession(s, pieces, entry.islands, hold=True)
            result = self.step(self.params, run, entry.inputs["tokens"], *extra)
        n_out = 2 if self.hidden else 1
        if not isinstance(result, tuple) or len(result) != n_out + 1 or not isinstance(result[-1], StepDeltas):
            fail("StepRunner", "step", f"a step returning ({'logits, hidden' if self.hidden else 'logits'}, deltas)",
                 type(result).__name__)
        outputs = {"logits": result[0], **({"hidden": result[1]} if self.hidden else {})}
        check_lanes(self.manifest, entry.bucket, outputs, state.device, role="output")
        check_lanes(self.manifest, entry.bucket, s.generated, state.device, role="generated")
        entry.generated = s.generated
        return outputs, result[-1], s.replay_outputs

    def bucket_entry(self, state, bucket: Bucket, recovery: str = "native"):
        """``bucket``'s static buffers and graph, captured now if they are not yet: ``-> (state, entry)``.
        For an instrument that replays one bucket itself (`fnattn.bench.overhead`); a step goes through
        `decode` / `verify`, which check the batch first."""
        if not isinstance(bucket, Bucket):
            fail("StepRunner.bucket_entry", "bucket", "a fnattn.lanes.Bucket", type(bucket).__name__)
        if recovery not in RECOVERY:
            fail("StepRunner.bucket_entry", "recovery", f"one of {RECOVERY}", recovery)
        return self._ensure(state, bucket, recovery)

    def entries(self) -> list:
        """The buckets captured (or prepared) so far, one entry per (bucket, recovery)."""
        return list(self._entries.values())

    def _ensure(self, state, bucket: Bucket, recovery: str):
        """The bucket's buffers (captured on first use); ``-> (state, entry)``."""
        key = (bucket, recovery)
        entry = self._entries.get(key)
        if entry is not None:
            _check_lineage(state, entry, f"StepRunner.{bucket.phase}")
            return state, entry
        capture = self.capture if bucket.phase == "decode" else self.capture_verify
        if bucket.phase == "verify" and state.has_recurrent and capture and \
                1 + bucket.num_draft > state.recurrent_ring - 1:
            fail("StepRunner.verify", "num_draft", f"at most {state.recurrent_ring - 2} for a captured verify: "
                 "its recurrent states go to spare ring rows (State(recurrent_ring >= num_draft + 2))",
                 bucket.num_draft)
        shapes = self.manifest.shapes(bucket)
        staging = Staging({name: shapes[name] for name in BATCH_LANES}, TENSOR_DTYPES, state.device)
        inputs = {lane.name: staging.views[lane.name] if lane.name in staging.views else
                  torch.zeros(shapes[lane.name], dtype=lane.dtype, device=state.device)
                  for lane in self.manifest.role("input")}
        entry = _Entry(bucket, recovery, inputs, staging)
        if capture:
            state = self._capture(state, entry)
        self._entries[key] = entry
        return state, entry

    def _pad_batch(self, state, entry: _Entry) -> Batch:
        """A batch of pad lanes only, in the static buffers: what warm-up and capture run."""
        b = entry.bucket
        if b.phase == "decode":
            batch = Batch.decode(state, (), pad_to=b.lanes, columns=b.columns, staging=entry.staging)
        else:
            batch = Batch.verify(state, (), num_draft=b.num_draft, recovery=entry.recovery, pad_to=b.lanes,
                                 columns=b.columns, staging=entry.staging)
        entry.inputs["tokens"].zero_()
        return batch

    def _write(self, state, deltas: StepDeltas):
        """The device half of the apply (what a captured graph holds)."""
        state.write(deltas, defer_replay=True)

    def _capture(self, state, entry: _Entry):
        stream = torch.cuda.Stream(device=state.device)
        stream.wait_stream(torch.cuda.current_stream(state.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: lazy kernel compilation and allocator pools, outside the graph
                batch = self._pad_batch(state, entry)
                outputs, deltas, _ = self._eager(state, entry, batch)
                self._write(state, deltas)
                state = advance_past(state, batch, deltas.cursor)
        torch.cuda.current_stream(state.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        batch = self._pad_batch(state, entry)
        if entry.bucket.phase == "decode" and self.in_pieces:
            pieces = Pieces(self._pool)
            stream.wait_stream(torch.cuda.current_stream(state.device))
            with torch.cuda.stream(stream), ending(pieces):
                outputs, deltas, replay_outputs = self._eager(state, entry, batch, pieces=pieces)
                self._write(state, deltas)  # inside the last piece: the step commits once, in a graph
            torch.cuda.current_stream(state.device).wait_stream(stream)
            entry.graphs = pieces.graphs
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                outputs, deltas, replay_outputs = self._eager(state, entry, batch)
                self._write(state, deltas)
            entry.graph = graph
        state = advance_past(state, batch, deltas.cursor)
        entry.outputs, entry.replay_outputs = outputs, replay_outputs
        entry.lineage, entry.invariant = state.lineage, invariant_on()
        return state


def refuse_replay_in_the_mode(where: str, attn) -> None:
    """Raise: a graph captured outside the invariant mode replays launches that do not honour it (the
    projections' GEMMs, the attention's split), and the mode is on now."""
    if attn.not_invariant:
        attn.refuse_outside_the_mode(where)
    fail(where, "the invariant mode", "off, as when this bucket's graph was captured (its launches do not honour "
         "the mode); use a runner whose graphs were captured inside `fnattn.switches.set(invariant=True)`", "on")


def advance_past(state, batch: Batch, cursor):
    """The host half of the apply of ``batch``'s step, whose rows are written (`State.advance`)."""
    if batch.state_version != state.version:
        fail("StepRunner", "state", f"the state the batch was built from (version {batch.state_version})",
             state.version)
    return state.advance(cursor, batch.step_id)


def _derivation(state, ids: tuple) -> tuple:
    """What `Batch.decode` derives a batch of ``ids`` from: the storage, and each request's length, pages, ring
    position and slot (pad lanes and the block table's width are the bucket's); None for a request no longer
    admitted."""
    reqs = state.requests
    return (state.lineage, tuple((r, q.length, q.pages, q.ring_pos, q.slot) if (q := reqs.get(r)) else None
                                          for r in ids))


@contextlib.contextmanager
def _host_reads_fail(device: torch.device):
    """`no_host_reads`, and on CUDA also ``torch.cuda.set_sync_debug_mode("error")``, around a step."""
    if device.type != "cuda":
        with no_host_reads():
            yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with no_host_reads():
            yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


class Verified:
    """A verify step that ran: ``logits`` [n * (1 + k), V] (and ``hidden``) of the requests' tokens;
    `accept` applies the acceptance once."""

    def __init__(self, runner: StepRunner, state, batch: Batch, entry: _Entry, outputs, deltas, replay_outputs):
        self.runner, self.state, self.batch, self.entry = runner, state, batch, entry
        self._replay_outputs = replay_outputs
        self.logits = outputs["logits"]
        self.hidden = outputs.get("hidden")
        self._deltas = deltas
        self._done = False

    @property
    def live_batch(self) -> Batch:
        """The batch without its pad lanes' host numbers (what acceptance helpers read)."""
        n = len(self.batch.live_ids)
        b = self.batch
        return replace(b, request_ids=b.request_ids[:n], host_new_lens=b.host_new_lens[:n],
                       host_cache_lens=b.host_cache_lens[:n], host_pages=b.host_pages[:n],
                       host_ring_pos=b.host_ring_pos[:n])

    def accept(self, accepted: Mapping[int, int]):
        """Keep the first ``accepted[r]`` tokens of each request; ``-> the new state``."""
        if self._done:
            fail("Verified.accept", "accepted", "one acceptance per verify step", dict(accepted))
        runner, state, batch, entry = self.runner, self.state, self.batch, self.entry
        replay = None
        if batch.recovery == "replay":
            from .speculative import replay_writes

            replay = replay_writes(runner.attn, state, batch, self._replay_outputs, accepted)
        if not entry.captured:
            self._done = True
            return state.apply(self._deltas.accept(runner._static_batch(entry, batch), accepted, replay=replay))
        self._done = True
        return accept_written(state, batch, accepted, replay)


def accept_written(state, batch: Batch, accepted: Mapping[int, int], replay: StepDeltas | None):
    """The apply's second half after a captured verify wrote its own rows (``StepRunner._write``): check the
    acceptance and the cursor, write the replay's recurrent rows (none with native recovery), move the
    cursors; ``-> the new state``."""
    deltas = StepDeltas.collect(batch, []).accept(batch, accepted, replay=replay)
    state.write(deltas, main_written=True)
    return advance_past(state, batch, deltas.cursor)


__all__ = ["DEFAULT_BUCKETS", "StepRunner", "Verified"]
