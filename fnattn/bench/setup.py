"""Benchmark setup shared by every kind: a State whose requests already hold a cached context."""

from __future__ import annotations

import torch

from ..batch import Batch
from ..deltas import StepDeltas, Writes
from ..spec import LayerSpec
from ..state import State


def placeholder_step(state, counts) -> State:
    """``state`` after one prefill step of ``counts`` tokens per request whose rows no backend computed.

    Benchmark setup: the step writes every storage tensor of every layer (the apply takes nothing
    less) with uninitialized rows, and moves the cursors and ring positions as a real prefill would;
    the caller then fills the storage. The writes are bound to their layers and step here, since no
    session ran a backend for them; the apply still checks every row.
    """
    batch = Batch.prefill(state, counts)
    writes = []
    for spec in state.specs:
        views, values = state.views(spec.index), {}
        for name, space in state.storage_spaces[spec.index].items():
            t = views[name]
            n, row = (batch.num_tokens, t.shape[2:]) if space == "token" else (batch.recurrent_write_rows.shape[0],
                                                                                t.shape[1:])
            values[name] = torch.empty((n, *row), dtype=t.dtype, device=t.device)
        writes.append(Writes(values, layer=spec.index, step=batch.step_id))
    return state.apply(StepDeltas.collect(batch, writes))


def cached_state(specs, *, batch: int, ctx: int, page_size: int, extra: int = 1, recurrent_ring: int = 2,
                 device="cuda"):
    """``batch`` requests with ``ctx`` random cached tokens each, room for ``extra`` more."""
    specs = [specs] if isinstance(specs, LayerSpec) else list(specs)
    pages = batch * (-(-(ctx + extra) // page_size))
    state = State(specs, num_pages=pages, page_size=page_size, max_requests=batch, device=device,
                  recurrent_ring=recurrent_ring)
    for r in range(batch):
        state = state.admit(r)
    state = state.reserve({r: ctx + extra for r in range(batch)})
    if ctx:
        state = placeholder_step(state, {r: ctx for r in range(batch)})
    gen = torch.Generator(device=device).manual_seed(0)  # independent of any graph capture
    for pool in state.pools.values():
        for t in pool.tensors.values():
            t.normal_(generator=gen)
    return state
