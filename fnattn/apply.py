"""The once-per-step apply: check a whole step, then scatter it.

The apply trusts nothing it is handed. The batch is checked against the State
(re-derived, unless `Batch` built it from this State as it is now and its
tensors are untouched since). The rows of every write come from the
batch and the State (each new token's cache slot, the recurrent rows the batch
hands out), never from the deltas; the step must write every storage-owning
layer, each with exactly the tensors its kind declared and one row per new
token (per token) or per recurrent row handed out (per request); the cursor
must be the one the batch and the acceptance imply. Values are checked for
shape, dtype, device, layout and aliasing with the storage before the first
byte is written, and written without autograd, so nothing fails half-way.
Writes to the same pool tensor are gathered so a pool costs one scatter for
all its layers when their rows line up.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import torch
from torch import Tensor

from .checks import _STRIDED, CHECKS_ENABLED, fail
from .deltas import StepDeltas, Writes, check_accepted
from .errors import StaleDeltasError
from .rows import ring_of, step_rows


class Target(NamedTuple):  # a tuple: one is built per layer and tensor every step
    """One checked write: ``value`` goes to rows ``index`` of the layer's slice of a pool tensor."""

    pool: str
    tensor: str
    layer_pos: int  # position of the layer on the pool's leading axis
    index: Tensor  # [n] rows of the flattened layer storage, < 0 skipped
    value: Tensor  # [n, *row]
    every_row: bool = False  # known on the host: no row of ``index`` is skipped (no device read to find out)


_NEW_TARGET = tuple.__new__


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _may_sync(t: Tensor) -> bool:
    """Reading ``t`` back is free on the host; on an accelerator it is a sync, so only with checks on."""
    return t.device.type == "cpu" or (CHECKS_ENABLED and not capturing())


def check_batch(state, batch, where: str) -> None:
    """The batch's metadata is this State's: its requests, cursors, pages, ring and every row tensor.

    Host numbers are compared always; the device tensors (dtype, shape, and
    values) against the same derivation `Batch` is built from, where reading
    them back costs no sync (the CPU, or checks on). A batch `Batch` built from
    this State as it is now, its tensors untouched since (`unchanged_since_built`),
    is what that derivation gives: only its tensors' dtypes and devices are checked.
    """
    from .batch import PHASES, TENSOR_DTYPES, check_tensors, expected_tensors, pad_lane, unchanged_since_built

    check_tensors(batch, where)
    if batch.page_size != state.page_size or batch.ring_size != state.recurrent_ring:
        fail(where, "batch", f"a batch of this State (page_size {state.page_size}, ring {state.recurrent_ring})",
             (batch.page_size, batch.ring_size))
    if batch.phase not in PHASES:
        fail(where, "batch.phase", f"one of {PHASES}", batch.phase)
    shared, requests = state.shared_pages, state.requests
    if not shared and unchanged_since_built(batch, state):  # shared pages: the full check below
        _check_tensor_types(state, batch, dict.fromkeys(TENSOR_DTYPES), where)
        return
    S = state.page_size
    reqs = []
    live = sum(1 for r in batch.request_ids if not (isinstance(r, int) and r < 0))
    for b, rid in enumerate(batch.request_ids):
        if isinstance(rid, int) and rid < 0:  # a pad lane: the null page and slot, an empty cache
            n = batch.host_new_lens[b]
            pad = pad_lane(-1 - rid, n, S) if isinstance(n, int) and n >= 1 else None
            if pad is None or rid != -1 - (b - live) or (batch.host_cache_lens[b], batch.host_pages[b],
                                                              batch.host_ring_pos[b]) != (0, pad.pages, 0):
                fail(where, "batch", f"pad lane {rid} (lane {b}) after the requests, with an empty cache on the "
                     "null page and the null slot", (batch.host_cache_lens[b], batch.host_pages[b]))
            reqs.append((pad, n))  # (a request after a pad lane puts that pad before `live`: refused here)
            continue
        req = requests.get(rid)
        if req is None:
            fail(where, "batch", f"requests admitted in this State (admitted: {sorted(requests)})", rid)
        if (batch.host_cache_lens[b], batch.host_pages[b], batch.host_ring_pos[b]) != (
                req.length, req.pages, req.ring_pos):
            fail(where, "batch", f"request {rid}'s cursor, pages and ring position in this State",
                 (batch.host_cache_lens[b], batch.host_pages[b], batch.host_ring_pos[b]))
        n = batch.host_new_lens[b]
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(req.pages) * S - req.length:
            fail(where, f"batch.host_new_lens[{b}]", f"an int in 1..{len(req.pages) * S - req.length} "
                 f"(request {rid}'s reserved room)", n)
        if shared:  # pages more than one request holds (a shared prefix): none is written
            _check_unshared(state, req.pages[req.length // S:(req.length + n - 1) // S + 1], where)
        reqs.append((req, n))
    if len(set(batch.request_ids)) != len(batch.request_ids) or not reqs:
        fail(where, "batch.request_ids", "unique admitted request ids", batch.request_ids)
    # The expected rows are worth building only where the batch's tensors can be read back without a sync.
    readable = _may_sync(batch.cu_seqlens) if isinstance(batch.cu_seqlens, Tensor) else True
    if readable:
        values, ring = expected_tensors(state, batch.phase, reqs, columns=batch.block_table.shape[1], where=where)
    else:
        values, ring = dict.fromkeys(TENSOR_DTYPES), ring_of(state, batch.phase, reqs)
    if batch.ring != ring:
        fail(where, "batch.ring", f"{ring} (what this State's ring and the step's tokens give)", batch.ring)
    _check_tensor_types(state, batch, values, where)


def _check_tensor_types(state, batch, values: dict, where: str) -> None:
    """Each device tensor of ``batch`` has its dtype and the State's device; where ``values`` holds its
    expected rows (not None) and it reads back without a sync, it holds them (and no shared page's slot)."""
    from .batch import TENSOR_DTYPES

    S, device, shared = state.page_size, state.device, state.shared_pages
    for name, want in values.items():
        got = getattr(batch, name)
        if not isinstance(got, Tensor) or got.dtype is not TENSOR_DTYPES[name] or got.device != device:
            fail(where, f"batch.{name}", f"a {TENSOR_DTYPES[name]} tensor on {device}",
                 (getattr(got, "dtype", type(got).__name__), getattr(got, "device", None)))
        if want is None and not shared:  # the usual step: nothing to read back
            continue
        if name == "slot_mapping" and shared and _may_sync(got):
            _check_unshared(state, {s // S for s in got.tolist() if s >= 0}, where)
        if want is not None and _may_sync(got) and got.tolist() != want:
            fail(where, f"batch.{name}", f"the rows of the batch's requests in this State {want}", got.tolist())


def _check_unshared(state, pages, where: str) -> None:
    """No token row of the step lands in a page more than one request holds (a shared prefix page)."""
    holders = state.shared_pages
    shared = sorted(p for p in pages if p in holders)
    if shared:
        fail(where, "batch", "a batch that writes no page another request also holds (shared prefix pages are "
             f"read-only; pages {shared} are held by {[holders[p] for p in shared]} requests)", shared)


def _owners(state, layers) -> tuple[list[int], list[int]]:
    """(the layers that own storage, those of them with per-request storage), limited to ``layers``."""
    if layers is None:  # every step asks this: the declarations never change, so once per storage
        return state.storage.derived(("apply", "owners"), lambda: _owners(state, frozenset(state.storage_spaces)))
    owners = [layer for layer, spaces in state.storage_spaces.items() if spaces and layer in layers]
    recurrent = [layer for layer in owners if "request" in state.storage_spaces[layer].values()]
    return owners, recurrent


def _names(state, replay_mode: bool) -> dict:
    """layer -> ((names the step's writes must hold, sorted), (names the replay's must hold, sorted)), for every
    layer; built once per storage and mode (the layers' declarations never change)."""
    names = {}
    for layer, spaces in state.storage_spaces.items():
        token = frozenset(n for n, s in spaces.items() if s == "token")
        request = frozenset(n for n, s in spaces.items() if s == "request")
        names[layer] = (token, request) if replay_mode else (token | request, frozenset())
        names[layer] = tuple((want, tuple(sorted(want))) for want in names[layer])  # with their order
    return names


def _by_layer(state, writes, step_id: int, where: str) -> dict[int, Writes]:
    found: dict[int, Writes] = {}
    spaces = state.storage_spaces
    for i, w in enumerate(writes):
        layer = w.layer
        if layer is None or w.step != step_id or layer not in spaces or layer in found:
            at = f"{where}: writes[{i}]"  # built only to name what is wrong
            if layer is None or w.step is None:
                fail(at, "layer", "writes bound to a layer by the session that ran its backend", None)
            if w.step != step_id:
                fail(at, "step", f"writes of step {step_id}", w.step)
            if layer not in spaces:
                fail(at, "layer", f"a layer of this State ({sorted(spaces)})", layer)
            fail(at, "layer", "one Writes per layer", layer)
        found[layer] = w
    return found


def validate_step(state, deltas: StepDeltas, *, layers=None, defer_replay: bool = False,
                  main_written: bool = False) -> list[Target]:
    """Check the whole step; ``-> the resolved targets``. ``layers`` limits it to some layers (probe).

    A captured verify is applied in two halves (`fnattn.graph`): inside the graph, before acceptance, the
    step's own writes with ``defer_replay`` (a replay-mode step's recurrent writes come later); after it,
    the acceptance with ``main_written`` (those writes are in the storage already: only the cursor and the
    replay's writes are checked and resolved).
    """
    where = "State.apply"
    batch = deltas.batch
    check_batch(state, batch, where)
    if deltas.accepted is not None:  # checked when built, but the apply trusts no field it is handed
        check_accepted(batch, deltas.accepted, where)
    counts = deltas.accepted if deltas.accepted is not None else batch.host_new_lens
    replay_mode = batch.phase == "verify" and batch.recovery == "replay"
    owners, recurrent = _owners(state, layers)
    replay = deltas.replay
    if replay_mode and recurrent and (deltas.accepted is None or replay is None) and not defer_replay:
        fail(where, "deltas", "a replay-mode verify step filtered by acceptance with its replay "
             "(StepDeltas.accept(batch, accepted, replay=...))", "unaccepted verify deltas")
    if replay is not None:
        rb = replay.batch
        if not replay_mode:
            fail(where, "replay", "None (the verify step's recovery is native)", f"step {rb.step_id}")
        if rb.state_version != batch.state_version or rb.request_ids != batch.request_ids \
                or rb.host_new_lens != counts or rb.phase != "verify":
            fail(where, "replay", f"a replay batch of this state for the accepted counts {counts}",
                 (rb.phase, rb.request_ids, rb.host_new_lens))
        check_batch(state, rb, where + " (replay)")
        if replay.accepted not in (None, rb.host_new_lens) or replay.replay is not None:
            fail(where, "replay", "the unfiltered deltas of the replay batch (every replayed token is kept)",
                 (replay.accepted, type(replay.replay).__name__))
    expected_cursor = batch.cursor_after(counts, ring_of=replay.batch if replay is not None else None)
    if deltas.cursor != expected_cursor:
        fail(f"{where}: cursor", "cursor", f"the advance the batch and acceptance imply, {expected_cursor}",
             deltas.cursor)
    main = _by_layer(state, deltas.writes, batch.step_id, where)
    if replay_mode and not main_written:
        _refuse_replay_mode_states(state, main)
    extra = _by_layer(state, replay.writes, replay.batch.step_id, where + " (replay)") if replay else {}
    for layer in set(main) | set(extra):
        if layer not in owners:
            fail(where, "writes", f"writes only for layers that own storage {owners}", layer)
    # (writes by layer, the batch whose rows they take), and per part what every one of its writes is checked
    # against, by index space (`fnattn.rows`; indexed False: request, True: token): the rows it goes to, how
    # many, whether no row is skipped. The replay's writes are per-request only.
    parts = [None if main_written else (main, batch)]
    rows_by_space = [None if main_written else step_rows(batch, deltas.accepted)]
    if replay is not None:
        parts.append((extra, replay.batch))
        rows_by_space.append(step_rows(replay.batch, tokens=False))
    targets: list[Target] = []
    storage = state.storage
    spans, checks = _spans(storage), _checks(state, storage, replay_mode)
    for layer in owners:
        for part, spaces, (want, entries) in zip(parts, rows_by_space, checks[layer]):
            if not want or part is None:
                continue
            writes, wb = part[0], part[1]
            w = writes.get(layer)
            if w is None and wb is not batch:  # the replay's: the layer's verify left nothing to replay
                fail(where + " (replay)", "writes", f"the replayed state of every recurrent layer (layer {layer} "
                     f"writes {sorted(want)}; its replay-mode verify must return Output(replay=inputs), which "
                     "speculative.replay_writes re-runs)", sorted(writes))
            if w is None:
                fail(where, "writes", f"a Writes for every layer that owns storage (layer {layer} writes "
                     f"{sorted(want)})", sorted(writes))
            values = w.values
            if values.keys() != want:
                fail(f"{where}: layer {layer}", "values", f"exactly the tensors {sorted(want)}", sorted(values))
            for name, layout in entries:
                value = values[name]
                if value is None:  # written in place: a per-request state in the spare ring rows lent to w's session
                    if layout[3] or not (wb.ring and storage.ring_lent == (wb.state_version, w.session)):
                        _refuse_in_place(storage, layer, name, layout[3], wb)
                    continue
                targets.append(_target(storage, layer, name, value, layout, spaces, spans))
    return targets


def _refuse_replay_mode_states(state, main: dict[int, Writes]) -> None:
    """A verify step with replay recovery returns no recurrent state: the replay of its accepted tokens
    writes it. States it returned anyway would otherwise be dropped, or taken for the replayed ones."""
    spaces = state.storage_spaces
    for layer, w in main.items():
        for name in w.values:
            if spaces[layer].get(name) == "request":
                fail(_Where(layer), name, "absent: a verify step with recovery 'replay' returns no recurrent "
                     "state (return its inputs in Output(replay=...); the replay of the accepted tokens writes "
                     "the state)", "a tensor" if w.values[name] is not None else "None (written in place)")


def _refuse_in_place(storage, layer: int, name: str, token_space: bool, batch) -> None:
    where = _Where(layer)
    if token_space or not batch.ring:
        fail(where, name, "a tensor (only per-request states of a ring batch may be written in place)", None)
    raise StaleDeltasError(f"{where}: `{name}` was written in place into the spare ring rows of step "
                           f"{batch.step_id}, which were handed to another session since (open one "
                           "session per batch and apply it before the next)")


def _checks(state, storage, replay_mode: bool) -> dict:
    """layer -> per part of the step (its own writes, the replay's): (the names its writes must hold, and
    each of them in order with its layout, `_layouts`); built once per storage and mode."""
    def build():
        layouts = _layouts(storage)
        return {layer: tuple((want, tuple((name, layouts[(layer, name)]) for name in order)) for want, order in parts)
                for layer, parts in _names(state, replay_mode).items()}

    return storage.derived(("apply", "checks", replay_mode), build)


class _Where:
    """``State.apply: layer N``, as text only when an error message needs it."""

    def __init__(self, layer: int):
        self.layer = layer

    def __str__(self) -> str:
        return f"State.apply: layer {self.layer}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def _layouts(storage) -> dict:
    """(layer, tensor name) -> (pool, its tensor, its dtype, token space?, row shape as a tuple, the layer's
    position, the tensor's device index, its device kind: 1 CUDA, 0 CPU, -1 another, its memory key), fixed for
    the life of a storage: built once."""
    return storage.derived(("apply", "layouts"), lambda: {
            (lay, t): (pool, live, live.dtype, pool.index_space == "token",
                       tuple(live.shape[3:] if pool.index_space == "token" else live.shape[2:]), pool.position(lay),
                       live.get_device(), 1 if live.is_cuda else 0 if live.is_cpu else -1, _memory_key(live))
            for lay, names in storage.layer_pools.items() for p in names
            for pool in (storage.pools[p],) for t, live in pool.tensors.items()})


def _spans(storage) -> dict:
    """memory key -> (starts, ends) of the pools' storages (`_disjoint_spans`), fixed for the life of a storage."""
    return storage.derived(("apply", "spans"), lambda: _disjoint_spans(storage))


def _target(storage, layer: int, name: str, value, layout: tuple, spaces: tuple, spans: dict) -> Target:
    """The checked target of one written tensor (not None: `validate_step` takes those)."""
    pool, live, dtype, token_space, row, position, device_index, kind, key = layout
    index, rows, every_row = spaces[token_space]
    # The usual case in one test (the same checks as below, which name what is wrong when it fails): a CPU or
    # CUDA tensor, the device by kind and index without building device objects; any other device goes below.
    if isinstance(value, Tensor) and value.dtype is dtype and value.layout is _STRIDED \
            and value.get_device() == device_index and (value.is_cuda if kind == 1 else kind == 0 and value.is_cpu) \
            and value.shape == (rows,) + row:
        if value.numel():  # its storage's span against the pools' (the device is the pool's: its key is known)
            found = spans.get(key)
            if found is not None:
                u = value.untyped_storage()
                lo = u.data_ptr()
                i = bisect.bisect_left(found[0], lo + u.nbytes())
                if i > 0 and found[1][i - 1] > lo:
                    fail(_Where(layer), name, "a tensor that does not share memory with the State's storage "
                         "(clone it)", "memory of the storage")
        # tuple.__new__ straight: the NamedTuple's own __new__ is a Python call, a third of this check's time
        return _NEW_TARGET(Target, (pool.name, name, position, index, value.detach() if value.requires_grad else value,
                                     every_row))
    # Not the usual case: the same checks one at a time, each naming what is wrong.
    where = _Where(layer)  # formatted only when a check fails
    if not isinstance(value, Tensor) or value.layout != torch.strided:
        fail(where, name, "a dense (strided) tensor", getattr(value, "layout", type(value).__name__))
    shape = value.shape
    if tuple(shape) != (rows, *row):
        fail(where, name, f"shape {(rows, *row)}", tuple(shape))
    if value.dtype != live.dtype:
        fail(where, name, f"dtype {live.dtype} (no silent casts)", value.dtype)
    if value.get_device() != live.get_device() or value.device.type != live.device.type:
        fail(where, name, f"a tensor on {live.device}", value.device)
    if value.numel() and _overlaps_storage(value, storage):
        fail(where, name, "a tensor that does not share memory with the State's storage (clone it)",
             "memory of the storage")
    return Target(pool.name, name, position, index, value.detach() if value.requires_grad else value, every_row)


def _memory_key(t: Tensor):
    """Which memory ``t`` lives in, as a dict key: the CUDA device index, -1 for host memory, the device's
    name for any other kind (building a device object per write costs more than the rest of the check)."""
    return t.get_device() if t.is_cuda else -1 if t.is_cpu else str(t.device)


def _span(t: Tensor):
    """``(memory key, first byte, end)`` of the memory behind ``t`` (views, .data, from_numpy); None: it has none."""
    try:
        u = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor without storage cannot overlap anything
        return None
    start = u.data_ptr()
    return _memory_key(t), start, start + u.nbytes()


def _overlaps_storage(value: Tensor, storage) -> bool:
    """Whether the memory behind ``value`` overlaps any tensor of the State's storage."""
    spans = _spans(storage)
    v = _span(value)
    if v is None or v[0] not in spans:
        return False
    starts, ends = spans[v[0]]
    i = bisect.bisect_left(starts, v[2])  # spans starting before value's end; the last one ends latest
    return i > 0 and ends[i - 1] > v[1]


def _disjoint_spans(storage) -> dict:
    """memory key -> (starts, ends) of the distinct storages behind the pools' tensors, sorted. Distinct storages
    never share memory, so the spans are disjoint and ends rise with starts."""
    spans = {s for p in storage.pools.values() for t in p.tensors.values()
             if (s := _span(t)) is not None and s[2] > s[1]}  # an empty storage holds no memory to overlap
    out: dict = {}
    for key, lo, hi in sorted(spans, key=lambda s: (str(s[0]), s[1])):
        starts, ends = out.setdefault(key, ([], []))
        starts.append(lo)
        ends.append(hi)
    return out


def write_step(pools, targets: list[Target]) -> None:
    """Scatter every target into its pool tensor (in place), outside autograd.

    On a GPU, when every layer of a pool writes the same rows (the usual case:
    all layers see the same tokens), the pool tensor gets one scatter launch for
    all its layers instead of one per layer.
    """
    groups: dict[tuple[str, str], list[Target]] = {}
    for t in targets:
        groups.setdefault((t.pool, t.tensor), []).append(t)
    with torch.no_grad():
        fused = _fused_kv(pools, groups)
        for (pool, tensor), ts in groups.items():
            if (pool, tensor) in fused:
                continue
            live = pools[pool].tensors[tensor]
            if live.dtype.is_floating_point and live.dtype.itemsize == 1:  # index_copy_ has no float8 kernels
                live = live.view(torch.uint8)
                ts = [Target(t.pool, t.tensor, t.layer_pos, t.index, t.value.view(torch.uint8), *rest(t))
                      for t in ts]
            row = ts[0].value.shape[1:]
            if live.is_cuda and _whole_pool(ts, live.shape[0]):
                from .kernels import scatter_rows

                scatter_rows(live.view(live.shape[0], -1, *row), ts[0].index, _stacked(ts))
                continue
            for t in ts:
                flat = live[t.layer_pos].view(-1, *row)
                index = t.index.long()
                if t.every_row:
                    flat.index_copy_(0, index, t.value)
                    continue
                keep = t.index >= 0
                if keep.all():
                    flat.index_copy_(0, index, t.value)
                else:
                    flat.index_copy_(0, index[keep], t.value[keep])


def rest(t: Target) -> tuple:
    """A target's fields after its value (kept when the value is reinterpreted)."""
    return tuple(t[Target._fields.index("value") + 1:])


def _stacked(ts: list[Target]):
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


def _whole_pool(ts: list[Target], num_layers: int) -> bool:
    return (len(ts) == num_layers and len({t.layer_pos for t in ts}) == num_layers
            and all(t.index is ts[0].index for t in ts))
