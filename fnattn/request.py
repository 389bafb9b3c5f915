"""The host bookkeeping of one admitted request, which `State` keeps and a `Checkpoint` copies."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    """Host bookkeeping of one admitted request."""

    id: int
    slot: int  # recurrent state slot
    pages: tuple[int, ...]  # reserved pages, in token order
    length: int  # the cursor: tokens already in the cache / recurrent steps taken
    ring_pos: int = 0  # which of the slot's ring rows holds its current recurrent state
    admission: int = 0  # unique per admission: a released and readmitted id is another request
    rollbacks: tuple[tuple[int, int], ...] = ()  # (serial, length) of every restore since admission
