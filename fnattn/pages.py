"""Shared prefixes: page reference counts and prefix admission (host bookkeeping of `State`).

A page is held by one request, or by several that share a common prefix:
``State._shared`` maps each page held by more than one request to its number
of holders (a held page absent from it has one holder; a free page none). Only
*full* pages below every holder's cursor are ever shared, so no request writes
into them; a prefix that ends inside a page gets that page's rows copied into a
fresh page of its own at admission (copy-on-admit), and a recurrent state is
copied from the other request's current row (it is only known at its cursor).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .checks import fail
from .errors import PoolExhaustedError


def prefix_plan(state, request_id: int, prefix_of, tokens) -> tuple:
    """Check a prefix admission; ``-> (other request, tokens, shared pages, tail rows)``. Changes nothing."""
    where = "State.admit"
    if isinstance(prefix_of, bool) or not isinstance(prefix_of, int) or prefix_of not in state._requests:
        fail(where, "prefix_of", f"an admitted request id (admitted: {sorted(state._requests)})", prefix_of)
    other = state._requests[prefix_of]
    n = other.length if tokens is None else tokens
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= other.length:
        fail(where, "tokens", f"an int in 0..{other.length} (request {prefix_of}'s cached tokens)", n)
    if state.has_recurrent and n != other.length:
        fail(where, "tokens", f"{other.length}, request {prefix_of}'s cursor: this State has recurrent layers, and "
             "a recurrent state is only known at the other request's cursor (no checkpoints at page "
             "boundaries are kept)", n)
    S = state.page_size
    full, tail = divmod(n, S)
    if not state._free_slots:
        raise PoolExhaustedError(f"{where}: no free request slot for request {request_id} "
                                 f"(max_requests={state.max_requests}, all in use)")
    if tail and not state._free_pages:
        raise PoolExhaustedError(f"{where}: request {request_id} needs a page for the copy of the last {tail} "
                                 f"prefix tokens of request {prefix_of}, none is free (num_pages={state.num_pages})")
    return other, n, other.pages[:full], tail


def copy_prefix(state, other, n: int, slot: int, page: int | None) -> None:
    """Copy-on-admit for a prefix of ``n`` tokens of ``other``: the rows of its partial last page into
    ``page`` (every token pool), and its current recurrent rows into ring row 0 of ``slot`` (every request
    pool). Both targets are free storage no request reads."""
    S, N = state.page_size, state.max_requests
    full, tail = divmod(n, S)
    src_row = other.ring_pos * N + other.slot
    with torch.no_grad():
        for pool in state._storage.pools.values():
            for t in pool.tensors.values():
                if pool.index_space == "request":
                    t[:, slot] = t[:, src_row]
                elif tail:
                    t[:, page, :tail] = t[:, other.pages[full], :tail]


def share(shared: Mapping[int, int], pages) -> dict[int, int]:
    """Reference counts after one more request holds ``pages``."""
    out = dict(shared)
    for p in pages:
        out[p] = out.get(p, 1) + 1
    return out


def unshare(free, shared: Mapping[int, int], pages) -> tuple[tuple[int, ...], dict[int, int]]:
    """``-> (free pages, shared counts)`` after one holder of ``pages`` lets go: a page is free only when no
    request holds it."""
    free, out = list(free), dict(shared)
    for p in pages:
        c = out.get(p)
        if c is None:
            free.append(p)
        elif c == 2:
            del out[p]
        else:
            out[p] = c - 1
    return tuple(sorted(free)), out


def shared_after(state, req, length: int) -> list[int]:
    """Pages of ``req`` at or after the one holding token ``length`` that another request also holds: the
    pages a request with its cursor at ``length`` would write into."""
    return [p for p in req.pages[length // state.page_size:] if p in state._shared]
