"""State: storage for every layer, the allocator and the per-request cursors.

A `State` is a *handle*: preallocated storage tensors shared between handles,
plus immutable host bookkeeping (pages, slots, cursors). Every operation that
changes anything returns a new handle and makes the old one stale: using it
raises `StaleStateError`. With ``inplace=False`` the change goes to a copy of
the storage instead, and the old handle stays valid (for notebooks and tests).

Storage is grouped into pools: all layers whose storage has the same shape
share one tensor with the layer as its leading axis (docs/layout.md), so the
once-per-step apply can write a whole pool at once.

Page 0 and recurrent slot 0 are the null page and the null slot: never handed
to a request, they are what the pad lanes of a bucketed batch read and write
(`Batch.decode(..., pad_to=...)`), so padding can never touch a live row.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import astuple, dataclass, replace
from types import MappingProxyType

import torch
from torch import Tensor

from . import batch as _batch
from . import pages
from .apply import validate_step, write_step
from .checkpoints import check_restore
from .checks import fail
from .cursor import CursorAdvance
from .deltas import StepDeltas
from .errors import DoubleApplyError, PoolExhaustedError, StaleDeltasError, StaleStateError
from .request import Request
from .spec import LayerSpec
from .staging import to_device
from .storage import Pool, Storage, allocate
from .transfer import RequestState  # also lets torch.load(weights_only=True) rebuild payloads

_versions = itertools.count(1)
_APPLIED_KEPT = 64  # applied step ids a storage remembers
_admissions = itertools.count(1)
_serials = itertools.count(1)  # orders checkpoints and rollbacks

#: The page and the recurrent slot no request holds: pad lanes read and write only these.
NULL_PAGE = 0
NULL_SLOT = 0


class Views(Mapping):
    """Views of the storage one layer owns, by the names its kind declared (``views.k``, ``views.ssm``).

    Token rows are ``[P, S, *row]`` (page, offset); request rows are
    ``[N * ring, *row]``, row ``pos * N + slot`` (see `State.recurrent_row`).
    Backends never write them, with one exception: a batch with a ring hands
    out spare recurrent rows (`Batch.recurrent_write_rows`) that no request
    reads, which a backend may fill with the step's new states in place of
    returning them.
    """

    __slots__ = ("_tensors",)

    def __init__(self, tensors: Mapping[str, Tensor]):
        object.__setattr__(self, "_tensors", MappingProxyType(dict(tensors)))

    def __getattr__(self, name: str) -> Tensor:
        tensors = object.__getattribute__(self, "_tensors")
        if name in tensors:
            return tensors[name]
        raise AttributeError(f"Views: this layer owns no storage named {name!r} (it owns {sorted(tensors)})")

    def __setattr__(self, name, value):
        raise AttributeError("Views are read-only")

    def __getitem__(self, name: str) -> Tensor:
        return self._tensors[name]

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return "Views(" + ", ".join(f"{n}={tuple(t.shape)}" for n, t in self._tensors.items()) + ")"


@dataclass(frozen=True)
class Checkpoint:
    """A value holding what is needed to roll requests back to this moment.

    Paged caches are append-only below a request's cursor, so rolling them back
    only needs the cursor; recurrent and conv state is overwritten by every
    step, so its rows are copied.
    """

    requests: tuple[Request, ...]
    recurrent: Mapping[tuple[str, str], Tensor]  # (pool, tensor) -> [L, n_requests, ...] copies
    lineage: int = 0  # the State (storage) it was taken from
    serial: int = 0  # when it was taken, against the requests' rollbacks

    def __reduce__(self):
        # pickle, copy.deepcopy and torch.save store a checkpoint as tuples of ints and tensors, which
        # `torch.load(weights_only=True)` accepts (a mapping proxy could not be pickled at all).
        requests = tuple(astuple(r) for r in self.requests)
        recurrent = tuple((pool, name, t) for (pool, name), t in self.recurrent.items())
        return _checkpoint_from_values, (requests, recurrent, self.lineage, self.serial)


def _checkpoint_from_values(requests: tuple, recurrent: tuple, lineage: int, serial: int) -> Checkpoint:
    """What a pickled checkpoint is rebuilt with (`State.restore` checks it). Its name is part of every stored
    checkpoint: keep it."""
    return Checkpoint(tuple(Request(*fields) for fields in requests),
                      MappingProxyType({(pool, name): t for pool, name, t in recurrent}), lineage, serial)


# A checkpoint saved with torch.save loads with torch.load(weights_only=True) once this module is imported
# (`fnattn.State` or `fnattn.Checkpoint` named; `fnattn` loads its names on first use).
torch.serialization.add_safe_globals([_checkpoint_from_values])


def _check_decls(spec: LayerSpec) -> None:
    from .declare import StorageDecl

    decls = spec.config.storage(spec.dtype)
    if not isinstance(decls, tuple) or not all(isinstance(d, StorageDecl) for d in decls):
        fail(f"{type(spec.config).__name__}.storage", "return",
             "a tuple of fnattn.per_token(...) / fnattn.per_request(...) declarations", decls)
    names = [d.name for d in decls]
    if len(set(names)) != len(names):
        fail(f"{type(spec.config).__name__}.storage", "return", "declarations with unique names", names)


class State:
    """Storage, allocator and cursors for all layers of a model.

    Recurrent (GDN/KDA) storage keeps a ring of ``recurrent_ring`` rows per
    request slot; ``Request.ring_pos`` names the row holding the current state.
    A step writes the new states into rows of the ring that are not current
    (`Batch.recurrent_write_rows`), so a fast backend can write them there
    directly, and the apply then only moves ``ring_pos``: the new state is
    never copied. ``recurrent_ring=1`` keeps one row per slot, overwritten by
    the apply. Verify needs ``1 + num_draft + 1`` rows to keep every draft
    position's state in place; with fewer it falls back to copying.
    """

    def __init__(
        self,
        specs: Iterable[LayerSpec],
        *,
        num_pages: int,
        page_size: int = 16,
        max_requests: int = 8,
        device: str | torch.device = "cpu",
        fill: float = 0.0,
        recurrent_ring: int = 2,
        prefix_checkpoints: bool = False,
    ):
        specs = tuple(specs)
        for name, value in (("num_pages", num_pages), ("page_size", page_size), ("max_requests", max_requests),
                            ("recurrent_ring", recurrent_ring)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                fail("State", name, "a positive int", value)
        if not specs or not all(isinstance(s, LayerSpec) for s in specs):
            fail("State", "specs", "a non-empty sequence of LayerSpec", specs)
        if isinstance(fill, bool) or not isinstance(fill, (int, float)):
            fail("State", "fill", "a number (NaN shows stray reads in tests)", fill)
        if not isinstance(prefix_checkpoints, bool):
            fail("State", "prefix_checkpoints", "a bool", prefix_checkpoints)
        for spec in specs:
            _check_decls(spec)
        indices = [s.index for s in specs]
        if len(set(indices)) != len(indices):
            fail("State", "specs", "layer specs with unique indices", indices)
        device = torch.device(device)
        if device.type == "meta":  # shapes without bytes: nothing could be read, checkpointed or exported
            fail("State", "device", "a device that holds the storage's values (cpu, cuda, ...), not meta", device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # tensors report their index
        self.specs: tuple[LayerSpec, ...] = specs
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_requests = max_requests
        self.recurrent_ring = recurrent_ring
        # Copies of recurrent rows at page boundaries, (request, length) -> {(pool, tensor): rows} (`pages`)
        self.prefix_checkpoints = prefix_checkpoints
        self._boundary: Mapping[tuple[int, int], Mapping] = MappingProxyType({})
        # layer -> {view name: space}: what the apply expects every step to write
        self.storage_spaces = MappingProxyType({
            s.index: MappingProxyType({d.name: d.space for d in s.config.storage(s.dtype)}) for s in specs})
        self.device = device
        self._version = next(_versions)
        pools, layer_pools = allocate(specs, num_pages=num_pages + 1, page_size=page_size,
                                      num_slots=(max_requests + 1) * recurrent_ring, fill=fill, device=device)
        self._storage = Storage(pools, layer_pools, self._version, ())
        self.has_recurrent = any(p.index_space == "request" for p in pools.values())
        self._requests: Mapping[int, Request] = MappingProxyType({})
        self._free_pages: tuple[int, ...] = tuple(range(1, num_pages + 1))  # page 0 is the null page
        self._free_slots: tuple[int, ...] = tuple(range(1, max_requests + 1))  # slot 0 is the null slot
        self._shared: Mapping[int, int] = MappingProxyType({})  # page -> holders, for pages held by >= 2
        self._spec_by_layer = {s.index: s for s in specs}

    # ----------------------------------------------------------------- handles
    def check_live(self, where: str = "") -> None:
        """Raise `StaleStateError` (naming ``where``, if given) unless this handle is its storage's live one."""
        if self._storage.live_version != self._version:
            raise StaleStateError(
                f"{where}{': ' if where else ''}this State handle (version {self._version}) was replaced by version "
                f"{self._storage.live_version}; use the handle returned by the last "
                "apply/admit/reserve/release/restore"
            )

    _check_live = check_live  # the name State's own methods call

    def _successor(self, *, requests=None, free_pages=None, free_slots=None, storage=None, applied=None,
                   shared=None, boundary=None) -> "State":
        new = object.__new__(State)
        new.__dict__.update(self.__dict__)
        new._version = next(_versions)
        if storage is None:
            storage = self._storage
        storage.live_version = new._version
        if applied is not None:
            storage.applied_steps = applied
        new._storage = storage
        if requests is not None:
            new._requests = MappingProxyType(dict(requests))
        if free_pages is not None:
            new._free_pages = tuple(free_pages)
        if free_slots is not None:
            new._free_slots = tuple(free_slots)
        if shared is not None:
            new._shared = MappingProxyType(dict(shared))
        if boundary is not None:
            new._boundary = MappingProxyType(dict(boundary))
        return new

    @property
    def version(self) -> int:
        self._check_live()
        return self._version

    @property
    def is_live(self) -> bool:
        return self._storage.live_version == self._version

    # ------------------------------------------------------------- inspection
    def spec(self, layer: int) -> LayerSpec:
        if layer not in self._spec_by_layer:
            fail("State", "layer", f"one of {sorted(self._spec_by_layer)}", layer)
        return self._spec_by_layer[layer]

    def request(self, request_id: int) -> Request:
        self._check_live()
        if request_id not in self._requests:
            fail("State", "request_id", f"an admitted request (admitted: {sorted(self._requests)})", request_id)
        return self._requests[request_id]

    @property
    def requests(self) -> Mapping[int, Request]:
        self._check_live()
        return self._requests

    @property
    def free_pages(self) -> int:
        self._check_live()
        return len(self._free_pages)

    @property
    def free_slots(self) -> int:
        self._check_live()
        return len(self._free_slots)

    def refcount(self, page: int) -> int:
        """How many requests hold ``page`` (0: free; more than 1: a shared prefix page)."""
        self._check_live()
        if isinstance(page, bool) or not isinstance(page, int) or not 1 <= page <= self.num_pages:
            fail("State.refcount", "page", f"an int in 1..{self.num_pages} (page 0 is the null page)", page)
        return 0 if page in self._free_pages else self._shared.get(page, 1)

    @property
    def shared_pages(self) -> Mapping[int, int]:
        """Pages held by more than one request -> how many hold them."""
        self._check_live()
        return self._shared

    def boundary_checkpoints(self, request_id: int) -> tuple[int, ...]:
        """Page-boundary lengths with a copy of the request's recurrent state (``prefix_checkpoints``)."""
        self.request(request_id)
        return tuple(sorted(n for r, n in self._boundary if r == request_id))

    @property
    def pools(self) -> Mapping[str, Pool]:
        self._check_live()
        return MappingProxyType(self._storage.pools)

    def recurrent_row(self, request_id: int, ring_pos: int | None = None) -> int:
        """The storage row of a request's recurrent state (its current ring row by default)."""
        req = self.request(request_id)
        pos = req.ring_pos if ring_pos is None else ring_pos
        if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos < self.recurrent_ring:
            fail("State.recurrent_row", "ring_pos", f"an int in 0..{self.recurrent_ring - 1}", pos)
        return pos * self.slots_per_ring + req.slot

    @property
    def slots_per_ring(self) -> int:
        """Recurrent slots in one ring position: the null slot and one per request (row = pos * this + slot)."""
        return self.max_requests + 1

    def views(self, layer: int) -> Views:
        """The storage of one layer, as views (no copies)."""
        self._check_live()
        if isinstance(layer, bool) or not isinstance(layer, int):
            fail("State.views", "layer", "an int layer index", layer)
        self.spec(layer)
        # The pools' tensors are fixed for the life of a storage, so are a layer's views of them: built once.
        storage = self._storage
        return storage.keep_views(layer, lambda: Views({
            t: tensor[pool.position(layer)] for name in storage.layer_pools[layer]
            for pool in (storage.pools[name],) for t, tensor in pool.tensors.items()}))

    @property
    def storage(self) -> Storage:
        """The tensors this handle shares with its lineage (`fnattn.storage.Storage`): pools, lineage, ring lending
        and the values derived from the pools alone."""
        self._check_live()
        return self._storage

    @property
    def lineage(self) -> int:
        """Identifies the storage this handle belongs to (a copy-mode apply starts a new one)."""
        return self._storage.lineage

    # ------------------------------------------------------------- allocation
    def admit(self, request_id: int, *, prefix_of: int | None = None, tokens: int | None = None) -> "State":
        """Admit a new request with an empty cache; takes one recurrent slot.

        ``prefix_of=other``: the request starts with the first ``tokens`` (default: all) cached tokens of
        request ``other``, its cursor at ``tokens``. It shares ``other``'s full pages below that (reference
        counted; no request ever writes into a shared page) and gets a fresh page holding a copy of the
        rows of a partial last page (copy-on-admit). With recurrent layers ``tokens`` must be ``other``'s
        length (its current recurrent state is copied into the new request's slot) or, with
        ``prefix_checkpoints=True``, a page boundary ``other`` keeps a checkpoint for (`boundary_checkpoints`;
        that copy goes into the slot, and the new request holds ``other``'s checkpoints up to ``tokens``).
        """
        self._check_live()
        if isinstance(request_id, bool) or not isinstance(request_id, int) or request_id < 0:
            fail("State.admit", "request_id", "a non-negative int", request_id)
        if request_id in self._requests:
            fail("State.admit", "request_id", "an id not already admitted", request_id)
        if not self._free_slots:
            raise PoolExhaustedError(
                f"State.admit: no free request slot for request {request_id} "
                f"(max_requests={self.max_requests}, all in use)"
            )
        if prefix_of is None:
            if tokens is not None:
                fail("State.admit", "tokens", "None without prefix_of (the prefix length of another request)",
                     tokens)
        else:
            return self._admit_prefix(request_id, prefix_of, tokens)
        slot, *rest = self._free_slots
        reqs = dict(self._requests)
        reqs[request_id] = Request(request_id, slot, (), 0, admission=next(_admissions))
        return self._successor(requests=reqs, free_slots=rest)

    def _admit_prefix(self, request_id: int, prefix_of: int, tokens) -> "State":
        other, n, shared, tail, saved = pages.prefix_plan(self, self._boundary, request_id, prefix_of, tokens)
        slot, *rest = self._free_slots
        free = list(self._free_pages)
        page = free.pop(0) if tail else None
        # Every check passed: the copies go to a free page and a free slot, which no request reads.
        pages.copy_prefix(self, other, n, slot, page, saved)
        reqs = dict(self._requests)
        reqs[request_id] = Request(request_id, slot, shared + ((page,) if tail else ()), n,
                                   admission=next(_admissions))
        return self._successor(requests=reqs, free_slots=rest, free_pages=free,
                               shared=pages.share(self._shared, shared),
                               boundary=pages.inherit_boundaries(self._boundary, prefix_of, request_id, n))

    def reserve(self, counts: Mapping[int, int]) -> "State":
        """Make room for ``counts[r]`` more tokens after each request's cursor."""
        self._check_live()
        if not isinstance(counts, Mapping):
            fail("State.reserve", "counts", "a mapping request id -> token count", counts)
        reqs = dict(self._requests)
        need = {}
        for rid, n in counts.items():
            req = reqs.get(rid) if isinstance(rid, int) else None
            if req is None:
                req = self.request(rid)  # names what is wrong
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                fail("State.reserve", f"counts[{rid}]", "a non-negative int", n)
            pages = math.ceil((req.length + n) / self.page_size)
            need[rid] = max(0, pages - len(req.pages))
        total = sum(need.values())
        if total > len(self._free_pages):
            raise PoolExhaustedError(
                f"State.reserve: {total} more pages needed for requests "
                f"{ {r: n for r, n in need.items() if n} }, only {len(self._free_pages)} free "
                f"(num_pages={self.num_pages}, page_size={self.page_size})"
            )
        free = list(self._free_pages)
        for rid, n in need.items():
            if n:
                taken, free = free[:n], free[n:]
                reqs[rid] = reqs[rid].with_pages(reqs[rid].pages + tuple(taken))
        return self._successor(requests=reqs, free_pages=free)

    def release(self, request_id: int) -> "State":
        """Free the slot and every page of a finished or aborted request no other request holds."""
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            fail("State.release", "request_id", "an int request id", request_id)
        req = self.request(request_id)
        reqs = dict(self._requests)
        del reqs[request_id]
        free_pages, shared = pages.unshare(self._free_pages, self._shared, req.pages)
        free_slots = tuple(sorted(self._free_slots + (req.slot,)))
        return self._successor(requests=reqs, free_pages=free_pages, free_slots=free_slots, shared=shared,
                               boundary=pages.drop_boundaries(self._boundary, request_id))

    # --------------------------------------------------------------- transfer
    def export_request(self, request_id: int) -> RequestState:
        """One request's storage rows (every kind's declared tensors), cursor, spec fingerprint and
        checksum, as a portable CPU value (`fnattn.transfer`). Changes nothing."""
        from .transfer import export_request

        return export_request(self, request_id)

    def import_request(self, payload, *, request_id: int | None = None,
                       cast: bool = False) -> "tuple[State, int]":
        """Check ``payload`` (a `RequestState` or its bytes) entirely, then admit, reserve and write it in
        one step: ``-> (new State, request id)``. Refused (this handle unchanged and live) on a spec or
        dtype mismatch (``cast=True`` converts dtypes), a bad checksum, a malformed payload, an id already
        admitted, or too few free pages or slots (`PoolExhaustedError`)."""
        from .transfer import write_payload

        new, rid, length = write_payload(self, payload, request_id=request_id, cast=cast)
        reqs = dict(new._requests)
        reqs[rid] = replace(reqs[rid], length=length, ring_pos=0)
        return new._successor(requests=reqs), rid

    # ------------------------------------------------------------------ apply
    def apply(self, deltas: StepDeltas, *, inplace: bool = True, layers: Collection[int] | None = None) -> "State":
        """Check a whole step against the batch and this State, then write it and advance cursors.

        Every storage-owning layer must write exactly its declared tensors,
        for exactly the rows the batch gives it (`fnattn.apply`); nothing is
        written unless all of it is valid. ``inplace=False`` writes a copy of
        the storage and keeps this handle valid. ``layers``: only these layers'
        writes are checked and written (`fnattn.probe` applies one layer's);
        None, every layer.
        """
        layers = self._step_checks(deltas, "State.apply", layers)
        if not isinstance(inplace, bool):
            fail("State.apply", "inplace", "a bool", inplace)
        plan = validate_step(self, deltas, layers=layers)
        storage = self._storage if inplace else self._storage.cloned(self._storage.live_version)
        write_step(storage.pools, plan)
        return self._advance(deltas.cursor, deltas.step_id, storage)

    def write(self, deltas: StepDeltas, *, defer_replay: bool = False, main_written: bool = False) -> None:
        """The device half of `apply`: check the step as `apply` does and write its rows into this handle's
        storage, in place; no cursor moves and the handle stays live (`advance` is the host half).

        For a step split around a captured graph (`fnattn.graph`): inside it, ``defer_replay=True`` writes a
        replay-mode verify's own rows before its acceptance is known; after it, ``main_written=True`` checks
        the acceptance's cursor and writes only the replay's recurrent rows (`fnattn.apply.validate_step`).
        """
        self._step_checks(deltas, "State.write", None)
        write_step(self._storage.pools, validate_step(self, deltas, defer_replay=defer_replay,
                                                      main_written=main_written))

    def advance(self, cursor: CursorAdvance, step_id: int) -> "State":
        """The host half of `apply`, once the step's rows are in this handle's storage (`write`, or a captured
        graph's replay of it): move the cursors by ``cursor``, record ``step_id`` as applied; ``-> the new
        handle`` (this one becomes stale)."""
        self._check_live("State.advance")
        if not isinstance(cursor, CursorAdvance):
            fail("State.advance", "cursor", "a CursorAdvance (StepDeltas.cursor)", type(cursor).__name__)
        if step_id in self._storage.applied_steps:
            raise DoubleApplyError(f"State.advance: step {step_id} was already applied")
        return self._advance(cursor, step_id, self._storage)

    def _step_checks(self, deltas, where: str, layers):
        """What `apply` and `write` check before `validate_step`: a live handle, deltas of this version
        not yet applied, and ``layers`` (``-> as a set``, or None)."""
        self._check_live(where)
        if not isinstance(deltas, StepDeltas):
            fail(where, "deltas", "a StepDeltas", type(deltas).__name__)
        if deltas.step_id in self._storage.applied_steps:
            raise DoubleApplyError(f"{where}: the deltas of step {deltas.step_id} were already applied")
        if deltas.state_version != self._version:
            raise StaleDeltasError(
                f"{where}: `deltas` were computed against state version {deltas.state_version}, "
                f"this state is version {self._version}"
            )
        if layers is not None:
            if isinstance(layers, (str, bytes, Mapping)) or not isinstance(layers, Collection) \
                    or not set(layers) <= set(self._spec_by_layer):
                fail(where, "layers", f"None or a collection of this State's layers {sorted(self._spec_by_layer)}",
                     layers)
            layers = set(layers)
        return layers

    def _advance(self, c, step_id: int, storage) -> "State":
        """Move the cursors of a step whose rows are written in ``storage`` (this handle's, or a copy's)."""
        reqs = dict(self._requests)
        ring = c.ring if c.ring is not None else (None,) * len(c.request_ids)
        for rid, n, pos in zip(c.request_ids, c.counts, ring):
            req = reqs[rid]
            reqs[rid] = req.moved(req.length + n, req.ring_pos if pos is None else pos)
        # The last steps applied to this lineage, for `DoubleApplyError`: an older step's deltas have an older
        # state version and are refused as stale. A bounded window, so a long run copies no growing set a step.
        applied = (*self._storage.applied_steps[1 - _APPLIED_KEPT:], step_id)
        new = self._successor(requests=reqs, storage=storage, applied=applied)
        kept = pages.new_boundaries(new, reqs, c.request_ids)
        if kept:
            new._boundary = MappingProxyType({**new._boundary, **kept})
        return new

    # ----------------------------------------------------------- checkpoints
    def checkpoint(self, request_ids: Iterable[int]) -> Checkpoint:
        """Capture cursors and recurrent state of some requests, as a value."""
        self._check_live()
        if isinstance(request_ids, (str, bytes, Mapping)) or not isinstance(request_ids, Iterable):
            fail("State.checkpoint", "request_ids", "an iterable of request ids", request_ids)
        ids = tuple(request_ids)
        if len(set(ids)) != len(ids):
            fail("State.checkpoint", "request_ids", "unique ids", ids)
        reqs = tuple(self.request(r) for r in ids)
        copies = {}
        recurrent = [pool for pool in self._storage.pools.values() if pool.index_space == "request"]
        if recurrent:  # a State of attention layers only (an MTP draft's) copies nothing: no launch either
            slots = to_device([self.recurrent_row(r.id) for r in reqs], torch.long, self.device)
            for pool in recurrent:
                for t, tensor in pool.tensors.items():
                    copies[(pool.name, t)] = tensor.index_select(1, slots).clone()
        return Checkpoint(reqs, MappingProxyType(copies), lineage=self._storage.lineage, serial=next(_serials))

    def restore(self, checkpoint: Checkpoint) -> "State":
        """Roll requests back to a checkpoint. Validates fully before writing."""
        self._check_live()
        where = "State.restore"
        if not isinstance(checkpoint, Checkpoint):
            fail(where, "checkpoint", "a Checkpoint", type(checkpoint).__name__)
        if checkpoint.lineage != self._storage.lineage:
            fail(where, "checkpoint", f"a checkpoint of this State (lineage {self._storage.lineage})",
                 f"lineage {checkpoint.lineage}")
        expected = check_restore(self, checkpoint, where)
        # Back into the ring row the request had then: every row of its ring is its own.
        if checkpoint.recurrent:
            slots = to_device([r.ring_pos * self.slots_per_ring + r.slot for r in checkpoint.requests], torch.long,
                              self.device)
            with torch.no_grad():
                for key, saved in checkpoint.recurrent.items():
                    expected[key].index_copy_(1, slots, saved)
        serial = next(_serials)
        reqs, boundary = dict(self._requests), self._boundary
        for old in checkpoint.requests:
            boundary = pages.drop_boundaries(boundary, old.id, above=old.length)
            reqs[old.id] = reqs[old.id].rolled_back(serial, old.length, old.ring_pos)
        return self._successor(requests=reqs, boundary=boundary)

    def __repr__(self) -> str:
        live = "live" if self.is_live else "stale"
        return (f"State(v{self._version}, {live}, layers={len(self.specs)}, pools={list(self._storage.pools)}, "
                f"requests={ {r.id: r.length for r in self._requests.values()} }, "
                f"free_pages={len(self._free_pages)}/{self.num_pages})")


_batch.accept_states_of(State)  # the batch builders take this class's handles
