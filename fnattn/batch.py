"""Batch: the immutable phase metadata of one step.

Built from a `State` and per-request token counts. Host copies of the small
per-request numbers (`host_*`) travel with the device tensors so reference
code can loop over requests without reading the device back.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import optree
import torch
from torch import Tensor

from .checks import fail
from .deltas import CursorAdvance

PHASES = ("prefill", "decode", "verify")
RECOVERY = ("native", "replay")
_steps = itertools.count(1)


@dataclass(frozen=True)
class Batch:
    phase: str  # "prefill" | "decode" | "verify"
    request_ids: tuple[int, ...]  # [B]
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

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return sum(self.host_new_lens)

    @property
    def host_cu_seqlens(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate(self.host_new_lens, initial=0))

    @property
    def has_prefix(self) -> bool:
        return any(self.host_cache_lens)

    def cursor_advance(self) -> CursorAdvance:
        """Every new token of every request; verify steps are filtered by acceptance first."""
        ring = None if self.recovery == "replay" else self.ring_after(self.host_new_lens)
        return CursorAdvance(self.request_ids, self.host_new_lens, ring=ring)

    def ring_after(self, counts, *, ring: bool | None = None) -> tuple[int, ...] | None:
        """Ring positions holding each request's state after ``counts[b]`` tokens; None: no ring move.

        Prefill and decode write one state per request (the next ring row);
        verify and replay write one per token, token i of a request into the
        ring row i + 1 after its current one. ``ring`` overrides whether the
        writes went into the ring (a replay's do when its verify's did not fit).
        """
        if not (self.ring if ring is None else ring):
            return None
        steps = counts if self.phase == "verify" else (1,) * self.num_requests
        return tuple((p + n) % self.ring_size for p, n in zip(self.host_ring_pos, steps))

    # --------------------------------------------------------------- builders
    @staticmethod
    def prefill(state, counts: Mapping[int, int]) -> "Batch":
        """New tokens after each request's cached prefix (fresh, prefixed or chunked)."""
        if not isinstance(counts, Mapping) or not counts:
            fail("Batch.prefill", "counts", "a non-empty mapping request id -> new token count", counts)
        return _build(state, "prefill", dict(counts), num_draft=0)

    @staticmethod
    def decode(state, request_ids: Iterable[int]) -> "Batch":
        """One new token per request."""
        ids = tuple(request_ids)
        if not ids:
            fail("Batch.decode", "request_ids", "at least one request", ids)
        return _build(state, "decode", {r: 1 for r in ids}, num_draft=0, ids=ids)

    @staticmethod
    def verify(state, request_ids: Iterable[int], *, num_draft: int, recovery: str = "native") -> "Batch":
        """The last accepted token plus ``num_draft`` draft tokens per request.

        ``recovery="native"``: recurrent layers return their state after every
        token and `StepDeltas.accept` keeps the accepted one. ``"replay"``: they
        return only their per-token inputs; the accepted tokens are replayed
        afterwards with `Batch.replay`.
        """
        ids = tuple(request_ids)
        if isinstance(num_draft, bool) or not isinstance(num_draft, int) or num_draft < 1:
            fail("Batch.verify", "num_draft", "an int >= 1", num_draft)
        if recovery not in RECOVERY:
            fail("Batch.verify", "recovery", f"one of {RECOVERY}", recovery)
        if not ids:
            fail("Batch.verify", "request_ids", "at least one request", ids)
        return _build(state, "verify", {r: 1 + num_draft for r in ids}, num_draft=num_draft, ids=ids,
                      recovery=recovery)

    @staticmethod
    def replay(state, counts: Mapping[int, int]) -> "Batch":
        """Re-run the accepted tokens of a verify step (token by token) from the same state.

        Built from the state the verify step read; each request replays its
        ``counts[r]`` accepted tokens, so recurrent layers leave exactly the
        state a native verify would have kept.
        """
        if not isinstance(counts, Mapping) or not counts:
            fail("Batch.replay", "counts", "a non-empty mapping request id -> accepted tokens", counts)
        return _build(state, "verify", dict(counts), num_draft=max(counts.values()) - 1, recovery="native")


def _build(state, phase: str, counts: dict, *, num_draft: int, ids: tuple | None = None,
           recovery: str = "native") -> Batch:
    where = f"Batch.{phase}"
    if ids is not None and len(set(ids)) != len(ids):
        fail(where, "request_ids", "unique ids", ids)
    reqs = []
    for rid, n in counts.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            fail(where, f"counts[{rid}]", "an int >= 1", n)
        if rid not in state.requests:
            fail(where, "request_ids", f"admitted requests (admitted: {sorted(state.requests)})", rid)
        req = state.requests[rid]
        room = len(req.pages) * state.page_size
        if req.length + n > room:
            fail(where, f"counts[{rid}]",
                 f"<= {room - req.length}: reserve room first with state.reserve({{{rid}: {n}}})", n)
        reqs.append((req, n))
    S = state.page_size
    device = state.device
    new_lens = tuple(n for _, n in reqs)
    cache_lens = tuple(r.length for r, _ in reqs)
    max_pages = max(1, max(len(r.pages) for r, _ in reqs))
    table = [list(r.pages) + [0] * (max_pages - len(r.pages)) for r, _ in reqs]
    positions, slots = [], []
    for r, n in reqs:
        for p in range(r.length, r.length + n):
            positions.append(p)
            slots.append(r.pages[p // S] * S + p % S)
    cu = list(itertools.accumulate(new_lens, initial=0))
    ring_pos = tuple(r.ring_pos for r, _ in reqs)
    rows, write_rows, ring = _recurrent_rows(state, phase, reqs)

    def t(x, dtype):
        return torch.tensor(x, dtype=dtype, device=device)

    batch = Batch(
        phase=phase,
        request_ids=tuple(r.id for r, _ in reqs),
        cu_seqlens=t(cu, torch.int32),
        cache_lens=t(cache_lens, torch.int32),
        positions=t(positions, torch.int64),
        block_table=t(table, torch.int32),
        slot_mapping=t(slots, torch.int64),
        recurrent_slots=t(rows, torch.int64),
        recurrent_write_rows=t(write_rows, torch.int64),
        page_size=S,
        num_draft=num_draft,
        recovery=recovery,
        state_version=state.version,
        step_id=next(_steps),
        host_new_lens=new_lens,
        host_cache_lens=cache_lens,
        host_pages=tuple(r.pages for r, _ in reqs),
        host_ring_pos=ring_pos,
        ring=ring,
        ring_size=state.recurrent_ring,
    )
    if ring:
        # This batch now owns the spare ring rows: in-place writes of an older batch are void.
        state._storage.ring_owner = batch.step_id
    return batch


def _recurrent_rows(state, phase: str, reqs) -> tuple[list[int], list[int], int]:
    """``-> (row read per request, row written per state, ring)``; see `State` on the ring."""
    N, R = state.max_requests, state.recurrent_ring
    fits = max(n for _, n in reqs) <= R - 1 if phase == "verify" else R >= 2
    ring = R if state.has_recurrent and fits else 0
    rows = [r.ring_pos * N + r.slot for r, _ in reqs]
    write_rows = []
    for (r, n), row in zip(reqs, rows):
        if phase != "verify":
            write_rows.append((r.ring_pos + 1) % R * N + r.slot if ring else row)
        elif ring:
            write_rows += [(r.ring_pos + 1 + i) % R * N + r.slot for i in range(n)]
        else:  # states after every token, but only the last one's row is the slot's
            write_rows += [-1] * (n - 1) + [row]
    return rows, write_rows, ring


_TENSORS = ("cu_seqlens", "cache_lens", "positions", "block_table", "slot_mapping", "recurrent_slots",
            "recurrent_write_rows")
_STATIC = ("phase", "request_ids", "page_size", "num_draft", "recovery", "state_version", "step_id",
           "host_new_lens", "host_cache_lens", "host_pages", "host_ring_pos", "ring", "ring_size")
optree.register_pytree_node(
    Batch,
    lambda b: (tuple(getattr(b, n) for n in _TENSORS), tuple(getattr(b, n) for n in _STATIC), None),
    lambda aux, ch: Batch(**dict(zip(_STATIC, aux)), **dict(zip(_TENSORS, ch))),
    namespace="fnattn",
)

__all__ = ["Batch", "PHASES"]
