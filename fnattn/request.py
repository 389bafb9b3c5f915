"""The host bookkeeping of one admitted request, which `State` keeps and a `Checkpoint` copies."""

from __future__ import annotations

import bisect
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
    # (serial, length) of the restores since admission that a checkpoint's check may need: a newer one to fewer
    # tokens makes an older one to as many or more redundant, and at most ROLLBACKS_KEPT are kept
    rollbacks: tuple[tuple[int, int], ...] = ()
    rollbacks_from: int = 0  # the newest serial dropped past ROLLBACKS_KEPT: older checkpoints cannot be checked

    def rolled_back(self, serial: int, length: int, ring_pos: int) -> Request:
        """This request restored to ``length`` tokens and ring row ``ring_pos`` by restore ``serial``: the rollbacks to
        as many tokens or more are dropped (this one makes them redundant), so the kept ones stay in increasing
        order of serial and of length alike (`later_rollbacks` counts on it)."""
        kept = self.rollbacks[:bisect.bisect_left(self.rollbacks, length, key=_length)] + ((serial, length),)
        dropped = kept[:-ROLLBACKS_KEPT]
        return Request(self.id, self.slot, self.pages, length, ring_pos, self.admission, kept[-ROLLBACKS_KEPT:],
                       dropped[-1][0] if dropped else self.rollbacks_from)

    def later_rollbacks(self, serial: int, below: int) -> tuple[tuple[int, int], ...]:
        """The kept rollbacks after ``serial`` to fewer than ``below`` tokens."""
        first = bisect.bisect_right(self.rollbacks, serial, key=_serial)
        return tuple(r for r in self.rollbacks[first:] if r[1] < below)

    def with_pages(self, pages: tuple[int, ...]) -> Request:
        """This request holding ``pages`` (built directly, as `moved`)."""
        return Request(self.id, self.slot, pages, self.length, self.ring_pos, self.admission, self.rollbacks,
                       self.rollbacks_from)

    def moved(self, length: int, ring_pos: int) -> Request:
        """This request with its cursor at ``length`` and its recurrent state in ring row ``ring_pos``: what every
        step changes, built directly (`dataclasses.replace` costs a few microseconds a request a step)."""
        return Request(self.id, self.slot, self.pages, length, ring_pos, self.admission, self.rollbacks,
                       self.rollbacks_from)


#: Rollbacks a request keeps for `State.restore`'s checks: a speculative decoder restores its draft every step,
#: and an unbounded history would grow with the generation (and each restore's check with it).
ROLLBACKS_KEPT = 32


def _serial(rollback: tuple[int, int]) -> int:
    return rollback[0]


def _length(rollback: tuple[int, int]) -> int:
    return rollback[1]
