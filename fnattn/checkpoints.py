"""Checks of a checkpoint before `State.restore` writes it back: all of them pass before a byte moves."""

from __future__ import annotations

import torch
from torch import Tensor

from . import pages
from .checks import fail
from .request import Request


def check_restore(state, checkpoint, where: str) -> dict:
    """``checkpoint``'s requests are still those it was taken of, none rolled back below it or sharing pages
    it would write, and its copies match the recurrent tensors; ``-> {(pool, tensor): live tensor}``."""
    requests, shared = state.requests, state.shared_pages
    for old in checkpoint.requests:
        if old.id not in requests:
            fail(where, "checkpoint", f"requests that are still admitted (request {old.id} is not)",
                 sorted(requests))
        cur = requests[old.id]
        if not isinstance(old, Request) or not 0 <= old.ring_pos < state.recurrent_ring \
                or not 0 <= old.length <= len(old.pages) * state.page_size:
            fail(where, "checkpoint", f"request {old.id} with a cursor inside its pages and a ring position "
                 f"below {state.recurrent_ring}", (old.length, old.pages, old.ring_pos))
        if cur.admission != old.admission or cur.slot != old.slot or cur.pages[: len(old.pages)] != old.pages:
            fail(where, "checkpoint", f"the admission of request {old.id} it was taken in "
                 "(it was released and readmitted since)", (old.admission, cur.admission))
        if checkpoint.serial < cur.rollbacks_from:
            fail(where, "checkpoint", f"a checkpoint of request {old.id} taken after its oldest kept rollback "
                 f"(serial {cur.rollbacks_from}; older ones cannot be checked)", checkpoint.serial)
        # Rolled back below this checkpoint since it was taken: its rows past that point may be rewritten.
        later = cur.later_rollbacks(checkpoint.serial, old.length)
        if later:
            fail(where, "checkpoint", f"a checkpoint whose rows request {old.id} still holds (it was rolled "
                 f"back to {min(n for _, n in later)} < {old.length} tokens after the checkpoint)", checkpoint.serial)
        # Its writes after the rollback would land in pages another request now shares as its prefix.
        held = pages.shared_after(state, cur, old.length)
        if held:
            fail(where, "checkpoint", f"a checkpoint after which request {old.id} writes no page another "
                 f"request holds (pages {held} past its {old.length} tokens are shared since)",
                 {p: shared[p] for p in held})
    expected = {(p.name, t): tensor for p in state.pools.values() if p.index_space == "request"
                for t, tensor in p.tensors.items()}
    if set(checkpoint.recurrent) != set(expected):
        fail(where, "checkpoint", f"copies of the recurrent tensors {sorted(expected)}",
             sorted(checkpoint.recurrent))
    n = len(checkpoint.requests)
    for key, saved in checkpoint.recurrent.items():
        live = expected[key]
        want = (live.shape[0], n, *live.shape[2:])
        if not isinstance(saved, Tensor) or saved.layout != torch.strided:
            fail(where, f"checkpoint.recurrent[{key}]", "a dense tensor", type(saved).__name__)
        if tuple(saved.shape) != want or saved.dtype != live.dtype or saved.device != live.device:
            fail(where, f"checkpoint.recurrent[{key}]", f"a {want} {live.dtype} tensor on {live.device}",
                 (tuple(saved.shape), saved.dtype, saved.device))
    return expected
