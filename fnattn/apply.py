"""The once-per-step apply: validate every write of a step, then scatter them.

Validation runs to completion before the first byte is written, so a malformed
delta leaves the state untouched. Writes to the same pool tensor are gathered
so a pool costs one scatter for all its layers when their rows line up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .checks import CHECKS_ENABLED, fail
from .deltas import RecurrentWrite, StepDeltas
from .errors import StaleDeltasError


@dataclass(frozen=True)
class _Target:
    pool: str
    tensor: str
    layer_pos: int  # position of the layer on the pool's leading axis
    index: Tensor  # [n] rows of the flattened layer storage, < 0 skipped
    value: Tensor  # [n, *row]


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def validate_step(state, deltas: StepDeltas) -> list[_Target]:
    """Check every write and the cursor advance; return the resolved targets."""
    storage = state._storage
    targets: list[_Target] = []
    for i, w in enumerate(deltas.writes):
        where = f"State.apply: writes[{i}] ({type(w).__name__}, layer {w.layer})"
        if w.layer not in storage.layer_pools:
            fail(where, "layer", f"a layer of this State ({sorted(storage.layer_pools)})", w.layer)
        index = w.index
        if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
            fail(where, "slots", "a 1-D int32/int64 tensor", (tuple(index.shape), index.dtype))
        found = 0
        if isinstance(w, RecurrentWrite) and w.ring_step is not None and w.ring_step != storage.ring_owner:
            if w.in_place:  # its rows were handed to a later batch, which may have overwritten them
                raise StaleDeltasError(f"{where}: its states were written in place into the spare ring rows of "
                                       f"step {w.ring_step}; step {storage.ring_owner} has been handed those "
                                       "rows since (build a batch only for the step you apply)")
        for tname, field in w.targets:
            pool = next((storage.pools[p] for p in storage.layer_pools[w.layer]
                         if tname in storage.pools[p].tensors), None)
            if pool is None:
                continue
            found += 1
            if pool.index_space != w.index_space:
                fail(where, "slots", f"{pool.index_space}-indexed rows", w.index_space)
            live = pool.tensors[tname]
            row = live.shape[3:] if pool.index_space == "token" else live.shape[2:]
            rows = live.shape[1] * live.shape[2] if pool.index_space == "token" else live.shape[1]
            value = getattr(w, field)
            if value is None:
                if w.ring_step is None:
                    fail(where, field, "a tensor (in-place states need the batch's spare ring rows)", None)
                continue  # already in place: nothing to write
            if tuple(value.shape) != (index.shape[0], *row):
                fail(where, field, f"shape {(index.shape[0], *row)}", tuple(value.shape))
            if value.dtype != live.dtype:
                fail(where, field, f"dtype {live.dtype} (no silent casts)", value.dtype)
            if value.device != live.device or index.device != live.device:
                fail(where, field, f"tensors on {live.device}", (value.device, index.device))
            # A range check reads the index back to the host; on an accelerator
            # that is a sync, so it only runs with checks on.
            if index.numel() and (index.device.type == "cpu" or (CHECKS_ENABLED and not _capturing())):
                hi = int(index.max())
                if hi >= rows:
                    fail(where, "slots", f"indices below {rows}", hi)
            targets.append(_Target(pool.name, tname, pool.position(w.layer), index, value))
        if found != len(w.targets):
            fail(where, "layer", f"a layer that owns {[t for t, _ in w.targets]} storage", state.spec(w.layer).kind)
    if deltas.cursor is not None:
        c = deltas.cursor
        if c.ring is not None:
            _check_ring(state, deltas)
        elif any(isinstance(w, RecurrentWrite) and w.ring_step is not None for w in deltas.writes):
            fail("State.apply: cursor", "ring", "the ring positions the step's recurrent writes moved to "
                 "(Batch.cursor_advance / StepDeltas.accept)", None)
        for rid, n in zip(c.request_ids, c.counts):
            if rid not in state._requests:
                fail("State.apply: cursor", "request_ids", "admitted requests", rid)
            req = state._requests[rid]
            room = len(req.pages) * state.page_size
            if req.length + n > room and any(p.index_space == "token" for p in storage.pools.values()):
                fail("State.apply: cursor", f"counts[{rid}]",
                     f"<= {room - req.length} (reserved room of request {rid})", n)
    return targets


def _check_ring(state, deltas: StepDeltas) -> None:
    """A ring move must land on rows the step wrote: every recurrent layer, in range."""
    c = deltas.cursor
    for rid, pos in zip(c.request_ids, c.ring):
        if not pos < state.recurrent_ring:
            fail("State.apply: cursor", f"ring[{rid}]", f"a ring position below {state.recurrent_ring}", pos)
    written = {w.layer for w in deltas.writes if isinstance(w, RecurrentWrite) and w.ring_step is not None}
    recurrent = {layer for layer, names in state._storage.layer_pools.items()
                 if any(state._storage.pools[n].index_space == "request" for n in names)}
    if written != recurrent:
        fail("State.apply: cursor", "ring",
             f"recurrent writes into the ring for every recurrent layer {sorted(recurrent)} "
             "(a moved ring position would otherwise point at a row nothing wrote)", sorted(written))


def write_step(pools, targets: list[_Target]) -> None:
    """Scatter every target into its pool tensor (in place).

    On a GPU, when every layer of a pool writes the same rows (the usual case:
    all layers see the same tokens), the pool tensor gets one scatter launch for
    all its layers instead of one per layer.
    """
    groups: dict[tuple[str, str], list[_Target]] = {}
    for t in targets:
        groups.setdefault((t.pool, t.tensor), []).append(t)
    fused = _fused_kv(pools, groups)
    for (pool, tensor), ts in groups.items():
        if (pool, tensor) in fused:
            continue
        live = pools[pool].tensors[tensor]
        row = ts[0].value.shape[1:]
        if live.is_cuda and _whole_pool(ts, live.shape[0]):
            from .kernels import scatter_rows

            scatter_rows(live.view(live.shape[0], -1, *row), ts[0].index, _stacked(ts))
            continue
        for t in ts:
            flat = live[t.layer_pos].view(-1, *row)
            keep = t.index >= 0
            index = t.index.long()
            if keep.all():
                flat.index_copy_(0, index, t.value)
            else:
                flat.index_copy_(0, index[keep], t.value[keep])


def _stacked(ts: list[_Target]):
    """Values of every layer of a pool as [L, N, *row], in pool order (a view when L == 1)."""
    ts.sort(key=lambda t: t.layer_pos)
    return ts[0].value.unsqueeze(0) if len(ts) == 1 else torch.stack([t.value for t in ts])


def _fused_kv(pools, groups) -> set:
    """On a GPU, write a pool's K and V (same rows, every layer) in one launch; returns what was written."""
    done = set()
    for pool_name, pool in pools.items():
        k, v = groups.get((pool_name, "k")), groups.get((pool_name, "v"))
        if not (k and v) or not pool.tensors["k"].is_cuda:
            continue
        L = pool.tensors["k"].shape[0]
        if not (_whole_pool(k, L) and _whole_pool(v, L) and k[0].index is v[0].index):
            continue
        from .kernels import scatter_rows_pair

        kt, vt = pool.tensors["k"], pool.tensors["v"]
        scatter_rows_pair(kt.view(L, -1, *kt.shape[3:]), vt.view(L, -1, *vt.shape[3:]), k[0].index,
                          _stacked(k), _stacked(v))
        done |= {(pool_name, "k"), (pool_name, "v")}
    return done


def _whole_pool(ts: list[_Target], num_layers: int) -> bool:
    return (len(ts) == num_layers and len({t.layer_pos for t in ts}) == num_layers
            and all(t.index is ts[0].index for t in ts))
