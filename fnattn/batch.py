"""Batch: the immutable phase metadata of one step.

Built from a `State` and per-request token counts. Host copies of the small
per-request numbers (`host_*`) travel with the device tensors so reference
code can loop over requests without reading the device back.

A batch for a captured step is padded when it is built (``pad_to``, ``columns``):
pad lanes come after the requests, with negative ids (-1, -2, ...), an empty
cache, the null page and the null recurrent slot; the block table has a fixed
width. Every tensor is then shaped by the bucket alone, and the padding is part
of the metadata from the start instead of being patched onto it afterwards.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import optree
import torch
from torch import Tensor

from . import rows
from .checks import fail
from .cursor import CursorAdvance
from .staging import Staging, packed

PHASES = ("prefill", "decode", "verify")

# `fnattn.state.State`, which registers itself here when its module loads (`accept_states_of`): this module sits
# below it (State builds on batches), so it cannot import the class it checks its argument against.
_STATE_CLASS: list[type] = []


def accept_states_of(cls: type) -> None:
    """Make ``cls`` the one class whose instances the builders take as ``state``."""
    if _STATE_CLASS and _STATE_CLASS[0] is not cls:
        fail("accept_states_of", "cls", f"{_STATE_CLASS[0].__qualname__}, the class already accepted", cls)
    _STATE_CLASS[:] = [cls]
LOGITS_FOR = ("all", "last")
#: Page and recurrent slot of pad lanes (State.NULL_PAGE / NULL_SLOT).
_NULL = 0
RECOVERY = ("native", "replay")
_steps = itertools.count(1)


@dataclass(frozen=True)
class Batch:
    phase: str  # "prefill" | "decode" | "verify"
    request_ids: tuple[int, ...]  # [B] admitted requests, then pad lanes (-1, -2, ...)
    cu_seqlens: Tensor  # [B + 1] int32: new tokens of request b are rows cu[b]:cu[b+1]
    cache_lens: Tensor  # [B] int32: tokens already cached per request
    positions: Tensor  # [T] int64: absolute position of each new token
    block_table: Tensor  # [B, M] int32: reserved pages per request, 0-padded
    slot_mapping: Tensor  # [T] int64: flat cache slot (page * S + offset) of each new token
    recurrent_slots: Tensor  # [B] int64: recurrent storage row each request reads (its current ring row)
    recurrent_write_rows: Tensor  # [R] int64: row each new recurrent state goes to (R = B, or T for verify), -1 none
    page_size: int  # S
    num_draft: int  # verify: k draft tokens per request (1 + k new tokens); else 0
    recovery: str  # verify: "native" (recurrent state after every token) or "replay" (inputs only)
    state_version: int  # the State version this batch was built from
    step_id: int  # unique per batch; a step's deltas carry it
    host_new_lens: tuple[int, ...]  # [B] new tokens per request
    host_cache_lens: tuple[int, ...]  # [B]
    host_pages: tuple[tuple[int, ...], ...]  # [B][pages]: reserved pages per request
    host_ring_pos: tuple[int, ...] = ()  # [B] current ring position of each request's recurrent state
    ring: int = 0  # ring rows per slot when new states go to spare ring rows; 0: they overwrite the current row
    ring_size: int = 1  # the State's recurrent_ring, whether or not this batch writes into the ring
    logits_for: str = "all"  # "all": a step returns logits for every new token; "last": each request's last only
    decode_lanes: int = 0  # a mixed prefill: its first lanes are decode tokens (one each) for the decode backends

    @property
    def num_requests(self) -> int:
        """Lanes of the batch: its requests and its pad lanes."""
        return len(self.request_ids)

    @property
    def num_pad(self) -> int:
        return sum(1 for r in self.request_ids if r < 0)

    @property
    def live_tokens(self) -> int:
        """New tokens of the batch's requests (pad lanes' left out); theirs are the first rows."""
        return sum(n for r, n in zip(self.request_ids, self.host_new_lens) if r >= 0)

    @property
    def live_ids(self) -> tuple[int, ...]:
        """The admitted requests of the batch (pad lanes left out), in lane order."""
        return tuple(r for r in self.request_ids if r >= 0)

    @property
    def num_tokens(self) -> int:
        return sum(self.host_new_lens)

    @property
    def host_cu_seqlens(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate(self.host_new_lens, initial=0))

    @property
    def has_prefix(self) -> bool:
        return any(self.host_cache_lens)

    # ------------------------------------------------------------- the write plan
    # Where the ring moves and what the cursor advances by: the apply, `StepDeltas.collect/accept`
    # and the speculative driver all read it from here. Which rows a step writes is `fnattn.rows`'.

    def ring_after(self, counts) -> tuple[int, ...] | None:
        """Ring positions holding each request's state after ``counts[b]`` tokens; None: no ring move.

        Prefill and decode write one state per request (the next ring row);
        verify writes one per token, token i of a request into the ring row
        i + 1 after its current one.
        """
        if not self.ring:
            return None
        steps = counts if self.phase == "verify" else (1,) * self.num_requests
        return tuple((p + n) % self.ring_size for p, n in zip(self.host_ring_pos, steps))

    def cursor_after(self, counts, *, ring_of: Batch | None = None) -> CursorAdvance:
        """The cursor advance of ``counts`` new tokens per request; ``ring_of``: the batch whose
        recurrent writes the step applies (a replay batch's, for recovery "replay")."""
        usual = ring_of is None and tuple(counts) == self.host_new_lens  # every token kept: asked twice a step
        if usual:
            memo = self.__dict__.get("_usual_cursor")
            if memo is not None:
                return memo  # a frozen value: the step's deltas and the apply share it
        writer = self if ring_of is None else ring_of
        ring = None if (writer is self and self.recovery == "replay") else writer.ring_after(tuple(counts))
        live = [b for b, r in enumerate(self.request_ids) if r >= 0]  # pad lanes move no cursor
        cursor = CursorAdvance(tuple(self.request_ids[b] for b in live), tuple(counts[b] for b in live),
                               ring=None if ring is None else tuple(ring[b] for b in live))
        if usual:
            object.__setattr__(self, "_usual_cursor", cursor)
        return cursor

    def token_rows(self, accepted: tuple[int, ...] | None = None) -> Tensor:
        """``[T]`` flat cache slot of each new token; -1 (not written) for rejected tokens (`fnattn.rows`)."""
        return rows.token_rows(self, accepted)

    def state_rows(self, accepted: tuple[int, ...] | None = None) -> Tensor:
        """``[R]`` recurrent storage row of each new state (R = B, or T for verify); -1: not written.

        With a ring every row is a spare one (rows of rejected tokens are
        written but never pointed at); without one only the state after each
        request's last accepted token goes to its current row (`fnattn.rows`).
        """
        return rows.state_rows(self, accepted)

    # --------------------------------------------------------------- builders
    @staticmethod
    def prefill(state, counts: Mapping[int, int], *, logits_for: str = "all", pad_to: int | None = None,
                tokens: int | None = None, columns: int | None = None, staging=None) -> "Batch":
        """New tokens after each request's cached prefix (fresh, prefixed or chunked).

        ``logits_for="last"``: the step returns logits for each request's last new token only ``[B, V]``
        (what sampling the next token needs), instead of every token's ``[T, V]``.

        A captured prefill's bucket (`fnattn.prefill_graph`): ``pad_to`` lanes and ``tokens`` tokens in all.
        The pad lanes after the requests take the tokens the requests leave: the first all but one each for
        the rest (every pad lane has at least one token, on the null page). ``columns`` / ``staging``: see
        `decode`.
        """
        if not isinstance(counts, Mapping) or (not counts and not pad_to):
            fail("Batch.prefill", "counts", "a non-empty mapping request id -> new token count", counts)
        if logits_for not in LOGITS_FOR:
            fail("Batch.prefill", "logits_for", f"one of {LOGITS_FOR}", logits_for)
        pad_counts = _bucket_pads("Batch.prefill", counts, pad_to, tokens)
        return _build(state, "prefill", dict(counts), num_draft=0, logits_for=logits_for, columns=columns,
                      staging=staging, pad_counts=pad_counts)

    @staticmethod
    def mixed(state, decode_ids: Iterable[int], counts: Mapping[int, int], *, logits_for: str = "last",
              pad_to: int | None = None, tokens: int | None = None, columns: int | None = None,
              staging=None) -> "Batch":
        """One step of both phases: a decode token of each of ``decode_ids`` (the first lanes), then the prompt
        chunks of ``counts``. A prefill to the apply (each request's new tokens after its cursor); the
        session runs each layer's decode backend on the decode lanes' rows and its prefill backend on the
        rest (`parts`), so both phases share every projection and MLP launch of the step. ``pad_to`` /
        ``tokens`` / ``columns`` / ``staging``: a captured prefill's bucket, as `prefill` pads it (the pad
        lanes after the prompts belong to the prefill part)."""
        ids = _ids("Batch.mixed", decode_ids)
        if not ids:
            fail("Batch.mixed", "decode_ids", "at least one request (a step without decode lanes is a prefill)", ids)
        if not isinstance(counts, Mapping) or (not counts and not pad_to):
            fail("Batch.mixed", "counts", "a non-empty mapping request id -> new token count", counts)
        both = sorted(set(ids) & set(counts))
        if both:
            fail("Batch.mixed", "counts", "requests other than decode_ids (a request is in one phase a step)", both)
        if logits_for not in LOGITS_FOR:
            fail("Batch.mixed", "logits_for", f"one of {LOGITS_FOR}", logits_for)
        every = {**dict.fromkeys(ids, 1), **counts}
        return _build(state, "prefill", every, num_draft=0, logits_for=logits_for, decode_lanes=len(ids),
                      columns=columns, staging=staging, pad_counts=_bucket_pads("Batch.mixed", every, pad_to, tokens))

    def parts(self, state) -> tuple["Batch", "Batch"]:
        """A mixed batch's decode lanes and prefill lanes, each as a batch of its own phase built from
        ``state`` (the handle this batch was built from): what the session runs each phase's backends on."""
        d = self.decode_lanes
        if not 0 < d < self.num_requests or any(n != 1 for n in self.host_new_lens[:d]):
            fail("Batch.parts", "batch.decode_lanes", f"an int in 1..{self.num_requests - 1} whose lanes have one "
                 "new token each", d)
        ids, lens = self.request_ids[d:], self.host_new_lens[d:]
        live = {r: n for r, n in zip(ids, lens) if r >= 0}
        pads = len(ids) - len(live)  # a captured bucket's: the prefill part keeps them, padded the same way
        prefill = Batch.prefill(state, live, logits_for=self.logits_for, **(
            dict(pad_to=len(ids), tokens=sum(lens)) if pads else {}))
        return Batch.decode(state, self.request_ids[:d]), prefill

    @staticmethod
    def decode(state, request_ids: Iterable[int], *, pad_to: int | None = None,
               columns: int | None = None, staging=None) -> "Batch":
        """One new token per request.

        ``pad_to``: lanes in all (the requests, then pad lanes up to it); ``columns``: the block table's width
        (at least the most pages a request holds). Both fix the shapes of a captured step. ``staging``: a
        `fnattn.staging.Staging` of exactly those shapes; the batch's tensors are then its device views (one
        copy per dtype; overwritten by the next batch built into it).
        """
        ids = _ids("Batch.decode", request_ids)
        if not ids and not pad_to:
            fail("Batch.decode", "request_ids", "at least one request (or pad lanes only, with pad_to)", ids)
        return _build(state, "decode", {r: 1 for r in ids}, num_draft=0, ids=ids, pad_to=pad_to, columns=columns,
                      pad_tokens=1, staging=staging)

    @staticmethod
    def verify(state, request_ids: Iterable[int], *, num_draft: int, recovery: str = "native",
               pad_to: int | None = None, columns: int | None = None, staging=None) -> "Batch":
        """The last accepted token plus ``num_draft`` draft tokens per request.

        ``recovery="native"``: recurrent layers return their state after every
        token and `StepDeltas.accept` keeps the accepted one. ``"replay"``: they
        return only their per-token inputs; the accepted tokens are replayed
        afterwards with `Batch.replay`. ``pad_to`` / ``columns`` / ``staging``: see `decode`.
        """
        ids = _ids("Batch.verify", request_ids)
        if isinstance(num_draft, bool) or not isinstance(num_draft, int) or num_draft < 1:
            fail("Batch.verify", "num_draft", "an int >= 1", num_draft)
        if recovery not in RECOVERY:
            fail("Batch.verify", "recovery", f"one of {RECOVERY}", recovery)
        if not ids and not pad_to:
            fail("Batch.verify", "request_ids", "at least one request (or pad lanes only, with pad_to)", ids)
        return _build(state, "verify", {r: 1 + num_draft for r in ids}, num_draft=num_draft, ids=ids,
                      recovery=recovery, pad_to=pad_to, columns=columns, pad_tokens=1 + num_draft, staging=staging)

    @staticmethod
    def replay(state, counts: Mapping[int, int], *, pad_to: int | None = None, columns: int | None = None,
               pad_tokens: int = 1) -> "Batch":
        """Re-run the accepted tokens of a verify step (token by token) from the same state.

        Built from the state the verify step read; each request replays its
        ``counts[r]`` accepted tokens, so recurrent layers leave exactly the
        state a native verify would have kept. ``pad_to`` / ``columns``: see `decode`; the pad lanes replay
        ``pad_tokens`` tokens each (a padded verify's pad lanes keep all of theirs).
        """
        if not isinstance(counts, Mapping) or not counts:
            fail("Batch.replay", "counts", "a non-empty mapping request id -> accepted tokens", counts)
        if isinstance(pad_tokens, bool) or not isinstance(pad_tokens, int) or pad_tokens < 1:
            fail("Batch.replay", "pad_tokens", "an int >= 1", pad_tokens)
        for rid, n in counts.items():  # before the most of them sets the drafts
            _check_count("Batch.replay", rid, n)
        return _build(state, "verify", dict(counts), num_draft=max(counts.values()) - 1, recovery="native",
                      pad_to=pad_to, columns=columns, pad_tokens=pad_tokens)


def _bucket_pads(where: str, counts: Mapping[int, int], pad_to, tokens) -> tuple[int, ...]:
    """The pad lanes' token counts that fill a bucket of ``pad_to`` lanes and ``tokens`` tokens after
    ``counts``: the first takes all the requests leave but one token for each other pad lane."""
    if (pad_to is None) != (tokens is None):
        fail(where, "tokens", "given with pad_to (a bucket's lanes and tokens), or neither", tokens)
    if pad_to is None:
        return ()
    for rid, n in counts.items():
        _check_count(where, rid, n)
    live = sum(counts.values())
    pads = pad_to - len(counts) if isinstance(pad_to, int) and not isinstance(pad_to, bool) else -1
    if pads < 0:
        fail(where, "pad_to", f"an int >= {len(counts)} (the batch's requests)", pad_to)
    spare = tokens - live if isinstance(tokens, int) and not isinstance(tokens, bool) else -1
    if spare < pads or (pads == 0 and spare != 0):
        fail(where, "tokens", f"{live} (the requests' tokens) when pad_to leaves no pad lane, else at least "
             f"{live} + one a pad lane ({live + pads})", tokens)
    return (spare - pads + 1,) + (1,) * (pads - 1) if pads else ()


def _check_count(where: str, rid, n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        fail(where, f"counts[{rid}]", "an int >= 1", n)


def next_step_id() -> int:
    """A step id no batch has had (a restamped batch takes one: `fnattn.graph.StepRunner`)."""
    return next(_steps)


def _ids(where: str, request_ids) -> tuple:
    if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Iterable):
        fail(where, "request_ids", "an iterable of int request ids", request_ids)
    return tuple(request_ids)


@dataclass(frozen=True)
class PadLane:
    """What a pad lane looks like to the write plan: an empty cache on the null page and the null slot."""

    id: int
    pages: tuple[int, ...]
    length: int = 0
    slot: int = _NULL
    ring_pos: int = 0


def pad_lane(lane: int, tokens: int, page_size: int) -> PadLane:
    """Pad lane ``lane`` (id -1 - lane) of ``tokens`` new tokens, all on the null page."""
    return PadLane(-1 - lane, (_NULL,) * -(-tokens // page_size))


def _build(state, phase: str, counts: dict, *, num_draft: int, ids: tuple | None = None,
           recovery: str = "native", pad_to: int | None = None, columns: int | None = None,
           pad_tokens: int = 1, staging=None, logits_for: str = "all", pad_counts: tuple[int, ...] = (),
           decode_lanes: int = 0) -> Batch:
    where = f"Batch.{phase}"
    if not (_STATE_CLASS and isinstance(state, _STATE_CLASS[0])):
        fail(where, "state", "a State", type(state).__name__)
    if staging is not None and (not isinstance(staging, Staging) or staging.device != state.device):
        fail(where, "staging", f"None or a fnattn.staging.Staging on {state.device}",
             getattr(staging, "device", type(staging).__name__))
    for rid in counts if ids is None else ids:
        if isinstance(rid, bool) or not isinstance(rid, int):
            fail(where, "request_ids", "int request ids", rid)
    if ids is not None and len(set(ids)) != len(ids):
        fail(where, "request_ids", "unique ids", ids)
    reqs = []
    for rid, n in counts.items():
        _check_count(where, rid, n)
        if rid not in state.requests:
            fail(where, "request_ids", f"admitted requests (admitted: {sorted(state.requests)})", rid)
        req = state.requests[rid]
        room = len(req.pages) * state.page_size
        if req.length + n > room:
            fail(where, f"counts[{rid}]",
                 f"<= {room - req.length}: reserve room first with state.reserve({{{rid}: {n}}})", n)
        reqs.append((req, n))
    if pad_to is not None:
        if isinstance(pad_to, bool) or not isinstance(pad_to, int) or pad_to < max(1, len(reqs)):
            fail(where, "pad_to", f"None or an int >= {max(1, len(reqs))} (the batch's requests)", pad_to)
        if phase == "prefill":  # its pad lanes take what the requests leave of a bucket's tokens: pad_counts
            fail(where, "pad_to", "None (a prefill bucket is padded by Batch.prefill(..., pad_to=, tokens=))", pad_to)
        reqs += [(pad_lane(i, pad_tokens, state.page_size), pad_tokens) for i in range(pad_to - len(reqs))]
    reqs += [(pad_lane(i, n, state.page_size), n) for i, n in enumerate(pad_counts)]  # a prefill bucket's
    values, ring = expected_tensors(state, phase, reqs, columns=columns, where=where)
    new_lens = tuple(n for _, n in reqs)
    device = state.device
    if staging is not None:
        tensors = staging.write(values)
    elif device.type == "cuda":
        tensors = packed(values, TENSOR_DTYPES, device)
    else:
        tensors = {name: torch.tensor(v, dtype=TENSOR_DTYPES[name], device=device) for name, v in values.items()}

    batch = Batch(
        phase=phase,
        request_ids=tuple(r.id for r, _ in reqs),
        **tensors,
        page_size=state.page_size,
        num_draft=num_draft,
        recovery=recovery,
        state_version=state.version,
        step_id=next(_steps),
        host_new_lens=new_lens,
        host_cache_lens=tuple(r.length for r, _ in reqs),
        host_pages=tuple(r.pages for r, _ in reqs),
        host_ring_pos=tuple(r.ring_pos for r, _ in reqs),
        ring=ring,
        ring_size=state.recurrent_ring,
        logits_for=logits_for,
        decode_lanes=decode_lanes,
    )
    # What the apply needs to know the tensors still hold what was derived here: the storage (its lineage
    # number) and version they were derived from, each tensor with its version counter (an in-place op moves
    # it), the staging's generation (the next batch built into it rewrites these very tensors) and, on the
    # CPU, a copy of the contents (a write through NumPy's view of the memory moves no counter). A copy made
    # by `dataclasses.replace` has no seal, and unpickling rebuilds the tensors: both are checked in full.
    object.__setattr__(batch, "_sealed", _Seal(
        state.lineage, state.version, tuple((name, t, t._version) for name, t in tensors.items()),
        None if staging is None else staging.generation, None if staging is None else staging.generation.value,
        {name: t.clone() for name, t in tensors.items()} if device.type == "cpu" else None))
    return batch


class _Seal(NamedTuple):
    lineage: int
    version: int
    tensors: tuple  # (name, tensor, its version counter then)
    generation: object  # the staging's Generation the tensors are views of (None: tensors of their own)
    written: int  # its value once this batch was written
    contents: dict | None  # name -> a copy of the tensor (the CPU only: there reading it back costs no sync)


def rebound(batch: Batch, *, state_version: int, step_id: int) -> Batch:
    """``batch`` for another handle of the same bookkeeping (the same requests, lengths, pages and ring
    positions): the same rows and tensors, a new state version and step id. The copy is not sealed: the seal
    vouches for the handle the original was built from, so the apply checks the copy in full."""
    # A frozen dataclass copied field for field (`dataclasses.replace` costs more than the rest of a step's check).
    fresh = object.__new__(Batch)
    fresh.__dict__.update(batch.__dict__)
    fresh.__dict__.pop("_sealed", None)
    fresh.__dict__.update(state_version=state_version, step_id=step_id)
    return fresh


def unchanged_since_built(batch: Batch, state) -> bool:
    """Whether ``batch``'s device tensors still hold what `Batch` derived from ``state``'s storage at its
    version: the same tensors, no in-place op on them since, no later batch built into the same staging and,
    on the CPU, the same contents (a write through NumPy's view of the memory moves no version counter).

    On an accelerator the contents are not read back (that is a sync, and a captured step cannot): a write
    into a batch's device memory through another library's handle to it (DLPack, a raw pointer) is not seen.
    Its caller has refused malformed tensor fields first (`check_tensors`)."""
    seal = batch.__dict__.get("_sealed")
    if seal is None:
        return False
    if seal.lineage != state.lineage or seal.version != state.version \
            or len(seal.tensors) != len(TENSOR_DTYPES):
        return False
    if seal.generation is not None and seal.generation.value != seal.written:
        return False  # a later batch was built into the same staging: these tensors hold its rows now
    if not all(getattr(batch, name) is t and t._version == v for name, t, v in seal.tensors):
        return False
    return seal.contents is None or all(torch.equal(getattr(batch, name), t) for name, t in seal.contents.items())


def check_tensors(batch: Batch, where: str) -> None:
    """Each device tensor of ``batch`` is a dense, contiguous torch.Tensor, or the error names it.

    Kernels read a block table or a slot list by rows of packed entries: a strided view (one column of a
    wider table, every other entry) holding the right values would be read as other entries, so it is
    refused here rather than copied silently. The builders always make contiguous tensors."""
    for name in TENSOR_DTYPES:
        t = getattr(batch, name)
        if not isinstance(t, Tensor) or t.layout is not torch.strided:
            fail(where, f"batch.{name}", "a dense torch.Tensor", type(t).__name__)
        if not t.is_contiguous():
            fail(where, f"batch.{name}", "a contiguous tensor (a strided view such as table[:, 0] is not)",
                 f"strides {t.stride()} for shape {tuple(t.shape)}")


#: The dtype of each device tensor of a batch.
TENSOR_DTYPES = {"cu_seqlens": torch.int32, "cache_lens": torch.int32, "positions": torch.int64,
                 "block_table": torch.int32, "slot_mapping": torch.int64, "recurrent_slots": torch.int64,
                 "recurrent_write_rows": torch.int64}


def expected_tensors(state, phase: str, reqs, *, columns: int | None = None,
                     where: str = "Batch") -> tuple[dict[str, list], int]:
    """The host values of every device tensor of a batch of ``reqs`` [(Request or PadLane, new tokens)],
    and its ring; ``columns`` fixes the block table's width.

    The one derivation of a step's rows from the State's bookkeeping: batches
    are built from it and the apply checks a batch against it.
    """
    S = state.page_size
    max_pages = max(1, max(len(r.pages) for r, _ in reqs))
    if columns is not None:
        if isinstance(columns, bool) or not isinstance(columns, int) or columns < max_pages:
            fail(where, "columns", f"None or an int >= {max_pages} (the most pages a request of the batch holds)",
                 columns)
        max_pages = columns
    # Whole runs at a time, not token by token: a long prefill's rows are thousands of tokens, and the host
    # time of building them is part of the step's.
    positions = list(itertools.chain.from_iterable(range(r.length, r.length + n) for r, n in reqs))
    slots = list(itertools.chain.from_iterable(
        run for r, n in reqs for run in rows.slot_runs(r.pages, r.length, n, S)))
    read_rows, write_rows, ring = rows.recurrent_rows(state, phase, reqs)
    values = {
        "cu_seqlens": list(itertools.accumulate((n for _, n in reqs), initial=0)),
        "cache_lens": [r.length for r, _ in reqs],
        "positions": positions,
        "block_table": [list(r.pages) + [0] * (max_pages - len(r.pages)) for r, _ in reqs],
        "slot_mapping": slots,
        "recurrent_slots": read_rows,
        "recurrent_write_rows": write_rows,
    }
    return values, ring


_TENSORS = ("cu_seqlens", "cache_lens", "positions", "block_table", "slot_mapping", "recurrent_slots",
            "recurrent_write_rows")
_STATIC = ("phase", "request_ids", "page_size", "num_draft", "recovery", "state_version", "step_id", "logits_for",
           "decode_lanes",
           "host_new_lens", "host_cache_lens", "host_pages", "host_ring_pos", "ring", "ring_size")
optree.register_pytree_node(
    Batch,
    lambda b: (tuple(getattr(b, n) for n in _TENSORS), tuple(getattr(b, n) for n in _STATIC), None),
    lambda aux, ch: Batch(**dict(zip(_STATIC, aux)), **dict(zip(_TENSORS, ch))),
    namespace="fnattn",
)

__all__ = ["Batch", "PHASES"]
