"""Which storage rows a step writes: derived here, and nowhere else.

Rows never come from the writes: a token's row is its flat cache slot
(``page * S + offset``) and a recurrent state's row is ``ring_pos * N + slot``
(``N`` = `State.slots_per_ring`). `Batch` builds its row tensors from
`slot_runs` and `recurrent_rows`; the apply asks `step_rows` where each part
of a step goes and checks every written value against it (`fnattn.apply`,
the one place values meet rows); export and import of a request
(`fnattn.transfer`), prefix copies (`fnattn.pages`) and probes read the same
arithmetic from here.

This module imports nothing of fnattn: it only does arithmetic on the numbers
and tensors it is handed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .staging import to_device


class Rows(NamedTuple):
    """Where the writes of one index space go for one batch."""

    index: Tensor  # [n] rows of a layer's flattened storage; < 0: skipped
    count: int  # the leading size every written value of this space must have
    every_row: bool  # known on the host: no entry of ``index`` is skipped


class StepRows(NamedTuple):
    """A batch's rows by index space; ``token`` None: the part writes no token rows (a verify's replay)."""

    request: Rows
    token: Rows | None

    def of_space(self, token_space: bool) -> Rows | None:
        return self.token if token_space else self.request


def ring_row(ring_pos: int, slot: int, slots_per_ring: int) -> int:
    """The recurrent storage row of ring position ``ring_pos`` of request slot ``slot``."""
    return ring_pos * slots_per_ring + slot


def slot_runs(pages, start: int, n: int, page_size: int):
    """The flat cache slots of positions ``start .. start + n - 1`` as one range per page they touch."""
    S, end = page_size, start + n
    for i in range(start // S, -(-end // S)):  # the pages from start's to the last one end reaches into
        lo, hi = max(start, i * S), min(end, (i + 1) * S)
        yield range(pages[i] * S + lo - i * S, pages[i] * S + hi - i * S)


def token_slots(pages, length: int, page_size: int) -> list[int]:
    """Flat cache slot of tokens ``0 .. length - 1`` of a request holding ``pages``."""
    return [s for run in slot_runs(pages, 0, length, page_size) for s in run]


def ring_of(state, phase: str, reqs) -> int:
    """The ring a batch of ``reqs`` [(request, new tokens)] writes new recurrent states into (0: none, they
    overwrite the current row)."""
    R = state.recurrent_ring
    fits = max(n for _, n in reqs) <= R - 1 if phase == "verify" else R >= 2
    return R if state.has_recurrent and fits else 0


def recurrent_rows(state, phase: str, reqs) -> tuple[list[int], list[int], int]:
    """``-> (row read per request, row written per state, ring)`` of a batch of ``reqs``; see `State` on the
    ring. Prefill and decode write one state per request, verify one per token."""
    N, R = state.slots_per_ring, state.recurrent_ring
    ring = ring_of(state, phase, reqs)
    rows = [ring_row(r.ring_pos, r.slot, N) for r, _ in reqs]
    write_rows = []
    for (r, n), row in zip(reqs, rows):
        if phase != "verify":
            write_rows.append(ring_row((r.ring_pos + 1) % R, r.slot, N) if ring else row)
        elif ring:
            write_rows += [ring_row((r.ring_pos + 1 + i) % R, r.slot, N) for i in range(n)]
        else:  # states after every token, but only the last one's row is the slot's
            write_rows += [-1] * (n - 1) + [row]
    return rows, write_rows, ring


def token_rows(batch, accepted: tuple[int, ...] | None = None) -> Tensor:
    """``[T]`` flat cache slot of each new token of ``batch``; -1 (not written) for rejected tokens."""
    if accepted is None or tuple(accepted) == batch.host_new_lens:
        return batch.slot_mapping
    keep = [i < n for n, m in zip(accepted, batch.host_new_lens) for i in range(m)]
    keep_t = to_device(keep, torch.bool, batch.slot_mapping.device)
    return torch.where(keep_t, batch.slot_mapping, torch.full_like(batch.slot_mapping, -1))


def state_rows(batch, accepted: tuple[int, ...] | None = None) -> Tensor:
    """``[R]`` recurrent storage row of each new state of ``batch`` (R = B, or T for verify); -1: not written.

    With a ring every row is a spare one (rows of rejected tokens are written but never pointed at); without
    one only the state after each request's last accepted token goes to its current row.
    """
    if batch.phase != "verify" or batch.ring or accepted is None or tuple(accepted) == batch.host_new_lens:
        return batch.recurrent_write_rows
    cu = batch.host_cu_seqlens
    last = [cu[b] + n - 1 for b, n in enumerate(accepted)]
    rows = torch.full((batch.num_tokens,), -1, dtype=torch.long, device=batch.recurrent_write_rows.device)
    return rows.index_copy(0, to_device(last, torch.long, rows.device), batch.recurrent_slots)


def step_rows(batch, accepted: tuple[int, ...] | None = None, *, tokens: bool = True) -> StepRows:
    """Where the writes of ``batch`` go once ``accepted`` tokens per request are kept (None: all of them);
    ``tokens=False``: a part that writes recurrent states only (the replay of a verify's accepted tokens)."""
    states = state_rows(batch, accepted)
    every_state = states is batch.recurrent_write_rows and (batch.phase != "verify" or batch.ring > 0)
    request = Rows(states, batch.recurrent_write_rows.shape[0], every_state)
    if not tokens:
        return StepRows(request, None)
    slots = token_rows(batch, accepted)
    return StepRows(request, Rows(slots, batch.num_tokens, slots is batch.slot_mapping))


__all__ = ["Rows", "StepRows", "recurrent_rows", "ring_of", "ring_row", "slot_runs", "state_rows", "step_rows",
           "token_rows", "token_slots"]
