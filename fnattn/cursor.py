"""How a step moves each request's cursor: the one value `Batch` derives and `StepDeltas` carries."""

from __future__ import annotations

from dataclasses import dataclass

import optree

from .checks import fail


@dataclass(frozen=True)
class CursorAdvance:
    """How many tokens each request's cursor moves, once per step, after all layers."""

    request_ids: tuple[int, ...]
    counts: tuple[int, ...]
    ring: tuple[int, ...] | None = None  # new ring position of each request's recurrent state; None: unmoved

    def __post_init__(self):
        object.__setattr__(self, "request_ids", tuple(self.request_ids))
        object.__setattr__(self, "counts", tuple(self.counts))
        if len(self.request_ids) != len(self.counts):
            fail("CursorAdvance", "counts", f"{len(self.request_ids)} entries (one per request)", len(self.counts))
        if self.ring is not None:
            object.__setattr__(self, "ring", tuple(self.ring))
            if len(self.ring) != len(self.request_ids) or not all(
                    isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in self.ring):
                fail("CursorAdvance", "ring", f"{len(self.request_ids)} non-negative ints (one per request)",
                     self.ring)
        if len(set(self.request_ids)) != len(self.request_ids):
            fail("CursorAdvance", "request_ids", "unique ids", self.request_ids)
        for c in self.counts:
            if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                fail("CursorAdvance", "counts", "non-negative ints", self.counts)


optree.register_pytree_node(
    CursorAdvance,
    lambda c: ((), (c.request_ids, c.counts, c.ring), None),
    lambda aux, _: CursorAdvance(*aux),
    namespace="fnattn",
)
