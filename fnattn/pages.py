"""Shared prefixes: page reference counts and prefix admission (host bookkeeping of `State`).

A page is held by one request, or by several that share a common prefix:
``State.shared_pages`` maps each page held by more than one request to its number
of holders (a held page absent from it has one holder; a free page none). Only
*full* pages below every holder's cursor are ever shared, so no request writes
into them; a prefix that ends inside a page gets that page's rows copied into a
fresh page of its own at admission (copy-on-admit), and a recurrent state is
copied from the other request's current row (it is only known at its cursor), or from a
boundary checkpoint of it (below).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from .checks import fail
from .errors import PoolExhaustedError
from .staging import to_device


def prefix_plan(state, boundary: Mapping, request_id: int, prefix_of, tokens) -> tuple:
    """Check a prefix admission; ``-> (other request, tokens, shared pages, tail rows, saved recurrent rows)``
    (the last None: copy ``other``'s current rows). ``boundary``: the State's boundary checkpoints (below).
    Changes nothing."""
    where = "State.admit"
    requests = state.requests
    if isinstance(prefix_of, bool) or not isinstance(prefix_of, int) or prefix_of not in requests:
        fail(where, "prefix_of", f"an admitted request id (admitted: {sorted(requests)})", prefix_of)
    other = requests[prefix_of]
    n = other.length if tokens is None else tokens
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= other.length:
        fail(where, "tokens", f"an int in 0..{other.length} (request {prefix_of}'s cached tokens)", n)
    saved = None
    if state.has_recurrent and n != other.length:
        saved = boundary.get((prefix_of, n))
        if saved is None:
            kept = sorted(m for r, m in boundary if r == prefix_of)
            why = (f"checkpoints at page boundaries are kept at {kept}" if state.prefix_checkpoints
                   else "no checkpoints at page boundaries are kept: State(prefix_checkpoints=True) keeps them")
            fail(where, "tokens", f"{other.length}, request {prefix_of}'s cursor, or a page boundary it keeps a "
                 "checkpoint for: this State has recurrent layers, and a recurrent state is only known at the "
                 f"other request's cursor or such a boundary ({why})", n)
    S = state.page_size
    full, tail = divmod(n, S)
    if not state.free_slots:
        raise PoolExhaustedError(f"{where}: no free request slot for request {request_id} "
                                 f"(max_requests={state.max_requests}, all in use)")
    if tail and not state.free_pages:
        raise PoolExhaustedError(f"{where}: request {request_id} needs a page for the copy of the last {tail} "
                                 f"prefix tokens of request {prefix_of}, none is free (num_pages={state.num_pages})")
    return other, n, other.pages[:full], tail, saved


def copy_prefix(state, other, n: int, slot: int, page: int | None, saved: Mapping | None = None) -> None:
    """Copy-on-admit for a prefix of ``n`` tokens of ``other``: the rows of its partial last page into
    ``page`` (every token pool), and its current recurrent rows (or the boundary checkpoint ``saved``) into
    ring row 0 of ``slot`` (every request pool). Both targets are free storage no request reads."""
    S, N = state.page_size, state.slots_per_ring
    full, tail = divmod(n, S)
    src_row = other.ring_pos * N + other.slot
    with torch.no_grad():
        for pool in state.pools.values():
            for name, t in pool.tensors.items():
                if pool.index_space == "request":
                    t[:, slot] = t[:, src_row] if saved is None else saved[(pool.name, name)]
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
    shared = state.shared_pages
    return [p for p in req.pages[length // state.page_size:] if p in shared]


# ------------------------------------------------------- boundary checkpoints
# With ``State(prefix_checkpoints=True)`` a State keeps, for each request whose cursor lands on a page
# boundary after an apply, copies of its current recurrent rows: its boundary checkpoints map
# ``(request, length)`` to ``{(pool, tensor): [L, *row]}``. A prefix admission on another request may then
# start at any such length (its recurrent state is known there), not only at the other request's cursor.

def recurrent_rows(state, rows: Mapping[int, int]) -> dict:
    """``{request: {(pool, tensor): copy of its storage row [L, *row]}}`` for ``rows`` (request -> row)."""
    if not rows:
        return {}
    idx = to_device(list(rows.values()), torch.long, state.device)
    out: dict = {r: {} for r in rows}
    with torch.no_grad():
        for pool in state.pools.values():
            if pool.index_space == "request":
                for t, tensor in pool.tensors.items():
                    copies = tensor.index_select(1, idx)
                    for i, r in enumerate(rows):
                        out[r][(pool.name, t)] = copies[:, i]
    return out


def new_boundaries(state, reqs: Mapping, request_ids) -> dict | None:
    """The boundary checkpoints an apply that moved ``request_ids`` to the cursors in ``reqs`` adds: one
    for each whose cursor is a positive multiple of the page size; None if none."""
    if not (state.prefix_checkpoints and state.has_recurrent):
        return None
    S, N = state.page_size, state.slots_per_ring
    rows = {r: reqs[r].ring_pos * N + reqs[r].slot for r in dict.fromkeys(request_ids)
            if reqs[r].length > 0 and reqs[r].length % S == 0}
    if not rows:
        return None
    return {(r, reqs[r].length): MappingProxyType(copies) for r, copies in recurrent_rows(state, rows).items()}


def drop_boundaries(boundary: Mapping, request_id: int, above: int = -1) -> dict:
    """``boundary`` without the entries of ``request_id`` longer than ``above`` (all by default). Always a
    dict: an empty one is every checkpoint dropped, not "nothing changed"."""
    return {k: v for k, v in boundary.items() if not (k[0] == request_id and k[1] > above)}


def inherit_boundaries(boundary: Mapping, holder: int, request_id: int, n: int) -> dict | None:
    """After ``request_id`` was admitted on ``n`` tokens of ``holder``: it also holds the holder's boundary
    checkpoints up to ``n`` (the same tensors: nothing ever writes into a checkpoint copy)."""
    got = {(request_id, m): v for (r, m), v in boundary.items() if r == holder and m <= n}
    return {**boundary, **got} if got else None
