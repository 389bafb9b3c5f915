"""Moving one request's state between States: prefill on one engine, decode on another.

`State.export_request` reads every storage tensor each storage-owning layer's
kind declared (`spec.config.storage(dtype)`) for one request into a
`RequestState`: per-token rows in token order ``[length, *row]`` (so page size
and page layout do not matter) and per-request rows (the request's current
ring row) ``[*row]``, with the cursor, a fingerprint of the layer specs and a
sha256 checksum. This module names no kind: whatever a kind declares travels.

`State.import_request` checks the whole payload against the receiving State
before it allocates anything, then admits, reserves and writes every row
through the apply's own scatter (`fnattn.apply.write_step`) in one step.

`send_request` / `recv_request` carry a payload between processes with
`torch.distributed` point-to-point: a header tensor (magic, byte count), then
the bytes of `RequestState.to_bytes`.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import Tensor

from . import rows
from .checks import fail
from .errors import PoolExhaustedError

FORMAT = "fnattn.RequestState/1"
_MAGIC = b"FNATTNRS"
_PREFIX = struct.Struct("<8sQ")  # magic, header length
_WIRE_MAGIC = 0x464E5253  # "FNRS": first element of the distributed header tensor
_SPACES = ("token", "request")
_MAX_DEPTH = 8  # how deep a header may nest lists and mappings (its own nest four deep)


class TransferTimeoutError(TimeoutError):
    """`recv_request` got no (complete) request from its sender in time: the sender died or never sent."""


# --------------------------------------------------------------------------- fingerprint of the specs


def _canon(value, path: str, dtypes: list):
    """A JSON-able canonical form of a config value; dtype-valued fields go to ``dtypes`` instead, so a
    layer's structure and its dtypes compare separately (a dtype difference can then be cast)."""
    if isinstance(value, torch.dtype):
        dtypes.append([path, _dtype_name(value)])
        return "<dtype>"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _canon(getattr(value, f.name), f"{path}.{f.name}", dtypes)
                  for f in dataclasses.fields(value)}
        return {"type": type(value).__qualname__, "fields": fields}
    if isinstance(value, (tuple, list)):
        return [_canon(v, f"{path}[{i}]", dtypes) for i, v in enumerate(value)]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return {"float": value.hex()}  # exact, and the same in every process
    return {"repr": repr(value)}


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def layer_signature(spec) -> dict:
    """``{"index", "kind", "structure", "dtypes"}`` of one layer spec: ``structure`` is a sha256 of its
    config fields (dtypes left out) and storage names, spaces and row shapes; ``dtypes`` lists the
    layer dtype, dtype-valued config fields and each storage tensor's dtype."""
    dtypes: list = [["dtype", _dtype_name(spec.dtype)]]
    config = _canon(spec.config, "config", dtypes)
    decls = spec.config.storage(spec.dtype)
    storage = [[d.name, d.space, list(d.shape)] for d in decls]
    dtypes += [[f"storage.{d.name}", _dtype_name(d.dtype)] for d in decls]
    structure = _sha({"kind": spec.kind, "config": config, "storage": storage})
    return {"index": spec.index, "kind": spec.kind, "structure": structure, "dtypes": dtypes}


def fingerprint(layers) -> str:
    """sha256 over every layer's signature: equal exactly when the specs are (in any process)."""
    return _sha([[s["index"], s["structure"], s["dtypes"]] for s in layers])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_of(name, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        fail(where, "payload", "tensor dtypes named like torch dtypes (e.g. 'float32')", name)
    return dtype


# --------------------------------------------------------------------------- the value


@dataclass(frozen=True)
class RequestState:
    """One request's state, portable between States, devices and processes.

    ``tensors[(layer, name)]`` is ``[length, *row]`` for per-token storage and
    ``[*row]`` for per-request storage, on the CPU, in the order of
    ``header["tensors"]``. ``header`` holds everything else (request id,
    cursor, layer signatures, fingerprint, checksum) as plain JSON values, so
    ``(header, tensors)`` is also the flat form for other transports.
    """

    header: Mapping
    tensors: Mapping[tuple[int, str], Tensor]

    @property
    def request_id(self) -> int:
        return self.header["request_id"]

    @property
    def length(self) -> int:
        return self.header["length"]

    @property
    def fingerprint(self) -> str:
        return self.header["fingerprint"]

    @property
    def checksum(self) -> str:
        return self.header["checksum"]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def verify(self, where: str = "RequestState.verify") -> None:
        """Recompute fingerprint and checksum; ValueError naming ``payload`` if either is off."""
        _check_header(self.header, where)
        if set(self.tensors) != {(e["layer"], e["name"]) for e in self.header["tensors"]}:
            fail(where, "payload", f"tensors {[(e['layer'], e['name']) for e in self.header['tensors']]}",
                 sorted(self.tensors))
        for e in self.header["tensors"]:
            t = self.tensors[(e["layer"], e["name"])]
            want = (tuple(e["shape"]), _dtype_of(e["dtype"], where))
            # A meta tensor has a shape and no bytes: nothing to checksum or import.
            if not isinstance(t, Tensor) or t.layout != torch.strided or (tuple(t.shape), t.dtype) != want \
                    or t.device.type == "meta":
                fail(where, f"payload.tensors[{e['layer']}, {e['name']!r}]", f"a dense {want[1]} tensor of "
                     f"shape {want[0]} holding its values (not on the meta device)",
                     (getattr(t, "dtype", type(t).__name__), tuple(getattr(t, "shape", ())),
                      getattr(t, "device", None)))
        if fingerprint(self.header["layers"]) != self.header["fingerprint"]:
            fail(where, "payload", "a fingerprint matching its layer signatures (the header is corrupt)",
                 self.header["fingerprint"])
        got = _checksum(self.header, [self.tensors[(e["layer"], e["name"])] for e in self.header["tensors"]])
        if got != self.header["checksum"]:
            fail(where, "payload", f"bytes matching its checksum {self.header['checksum'][:16]}... (the payload "
                 "is corrupt)", f"checksum {got[:16]}...")

    # ------------------------------------------------------------- plain values
    def __reduce__(self):
        # pickle, copy.deepcopy and torch.save store a payload as its flat form (JSON values and tensors), which
        # `torch.load(weights_only=True)` accepts; loading rebuilds it through `from_flat`, so the checksum is
        # checked again there (a mapping proxy, the immutable header, could not be pickled at all).
        return _from_flat, self.flat()

    # ------------------------------------------------------------- bytes
    def flat(self) -> tuple[dict, list[Tensor]]:
        """``(header, tensors in header order)``: JSON values and contiguous CPU tensors."""
        return json.loads(json.dumps(dict(self.header))), [
            self.tensors[(e["layer"], e["name"])].contiguous() for e in self.header["tensors"]]

    @staticmethod
    def from_flat(header: dict, tensors: list[Tensor]) -> RequestState:
        """The inverse of `flat`; checks the header, every tensor and the checksum."""
        where = "RequestState.from_flat"
        _check_header(header, where)
        if not isinstance(tensors, (list, tuple)) or len(tensors) != len(header["tensors"]):
            fail(where, "tensors", f"a list of {len(header['tensors'])} tensors", type(tensors).__name__)
        value = RequestState(_frozen(header), MappingProxyType(
            {(e["layer"], e["name"]): t for e, t in zip(header["tensors"], tensors)}))
        value.verify(where)
        return value

    def to_bytes(self) -> bytes:
        """magic, header length (u64), header JSON, then every tensor's bytes in header order."""
        header, tensors = self.flat()
        head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        return b"".join([_PREFIX.pack(_MAGIC, len(head)), head, *(_raw(t).numpy().tobytes() for t in tensors)])

    @staticmethod
    def from_bytes(data: bytes | bytearray | memoryview) -> RequestState:
        """Parse `to_bytes` output; a truncated, padded, malformed or corrupt payload is refused."""
        where = "RequestState.from_bytes"
        if not isinstance(data, (bytes, bytearray, memoryview)):
            fail(where, "payload", "bytes", type(data).__name__)
        data = memoryview(data).cast("B")
        if len(data) < _PREFIX.size:
            fail(where, "payload", f"at least {_PREFIX.size} bytes (truncated)", f"{len(data)} bytes")
        magic, head_len = _PREFIX.unpack_from(data)
        if magic != _MAGIC:
            fail(where, "payload", f"bytes starting with {_MAGIC!r} (a RequestState)", bytes(magic))
        body_at = _PREFIX.size + head_len
        if body_at > len(data):
            fail(where, "payload", f"a {head_len}-byte header after the prefix (truncated)", f"{len(data)} bytes")
        try:
            header = json.loads(bytes(data[_PREFIX.size:body_at]).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            fail(where, "payload", "a JSON header (the header is corrupt)", str(e))
        except RecursionError:
            fail(where, "payload", f"a JSON header nested at most {_MAX_DEPTH} deep (the header is corrupt)",
                 "a header nested deeper than the parser goes")
        _check_header(header, where)
        sizes = [math.prod(e["shape"]) * _dtype_of(e["dtype"], where).itemsize for e in header["tensors"]]
        if body_at + sum(sizes) != len(data):
            fail(where, "payload", f"{body_at + sum(sizes)} bytes (header + tensors)"
                 + (" (truncated)" if body_at + sum(sizes) > len(data) else ""), f"{len(data)} bytes")
        tensors, at = [], body_at
        for e, n in zip(header["tensors"], sizes):
            # frombuffer refuses an empty buffer; a request of length 0 has empty per-token tensors
            raw = torch.frombuffer(bytearray(data[at:at + n]), dtype=torch.uint8)\
                if n else torch.empty(0, dtype=torch.uint8)
            tensors.append(raw.view(_dtype_of(e["dtype"], where)).view(e["shape"]))
            at += n
        return RequestState.from_flat(header, tensors)


def _from_flat(header: dict, tensors: list[Tensor]) -> RequestState:
    """What a pickled payload is rebuilt with. Its name is part of every stored payload: keep it."""
    return RequestState.from_flat(header, tensors)


# A payload saved with torch.save loads with torch.load(weights_only=True) once this module is imported
# (`fnattn.RequestState`, `State` or `Checkpoint` named; `fnattn` loads its names on first use).
torch.serialization.add_safe_globals([_from_flat])


def _raw(t: Tensor) -> Tensor:
    """The bytes of a contiguous CPU tensor as uint8 (any dtype, NaN payloads included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _checksum(header: Mapping, tensors) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({k: v for k, v in header.items() if k != "checksum"}, sort_keys=True,
                        separators=(",", ":")).encode())
    for t in tensors:
        h.update(_raw(t.cpu()).numpy().tobytes())
    return h.hexdigest()


def _frozen(header: dict) -> Mapping:
    return MappingProxyType(json.loads(json.dumps(header)))


def _is_int(x, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _depth_over(value, limit: int) -> bool:
    """Whether JSON-like ``value`` nests lists / mappings more than ``limit`` deep (walked without recursion)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (Mapping, list, tuple)):
            if depth == limit:
                return True
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, Mapping) else v))
    return False


def _check_header(h, where: str) -> None:
    """Every header field present, of the right type: parsing never fails later on a bad value."""
    # First, and without recursion: hashing, copying or printing a value nested without end would overflow
    # the stack (a header is nested four deep).
    if _depth_over(h, _MAX_DEPTH):
        fail(where, "payload", f"a header nested at most {_MAX_DEPTH} deep (the header is corrupt)",
             f"a header nested deeper than {_MAX_DEPTH}")
    keys = {"format", "request_id", "length", "fingerprint", "layers", "tensors", "checksum"}
    if not isinstance(h, Mapping) or set(h) != keys:
        fail(where, "payload", f"a header with the fields {sorted(keys)}",
             sorted(h) if isinstance(h, Mapping) else type(h).__name__)
    if h["format"] != FORMAT:
        fail(where, "payload", f"format {FORMAT!r}", h["format"])
    for name in ("request_id", "length"):
        if not _is_int(h[name]):
            fail(where, f"payload.{name}", "a non-negative int", h[name])
    for name in ("fingerprint", "checksum"):
        if not (isinstance(h[name], str) and len(h[name]) == 64 and all(c in "0123456789abcdef" for c in h[name])):
            fail(where, f"payload.{name}", "a sha256 hex digest", h[name])
    layers = h["layers"]
    if not isinstance(layers, list) or not all(
            isinstance(s, Mapping) and set(s) == {"index", "kind", "structure", "dtypes"} and _is_int(s["index"])
            and isinstance(s["kind"], str) and isinstance(s["structure"], str) and isinstance(s["dtypes"], list)
            and all(isinstance(d, list) and len(d) == 2 and all(isinstance(x, str) for x in d) for d in s["dtypes"])
            for s in layers):
        fail(where, "payload.layers", "a list of layer signatures {index, kind, structure, dtypes}", layers)
    tensors = h["tensors"]
    if not isinstance(tensors, list) or not all(
            isinstance(e, Mapping) and set(e) == {"layer", "name", "space", "dtype", "shape"}
            and _is_int(e["layer"]) and isinstance(e["name"], str) and e["space"] in _SPACES
            and isinstance(e["shape"], list) and all(_is_int(n) for n in e["shape"])
            and (e["space"] == "request" or (e["shape"] and e["shape"][0] == h["length"]))
            for e in tensors):
        fail(where, "payload.tensors", "a list of {layer, name, space, dtype, shape} (per-token shapes "
             "starting with the length)", tensors)
    for e in tensors:
        _dtype_of(e["dtype"], where)
    if len({(e["layer"], e["name"]) for e in tensors}) != len(tensors):
        fail(where, "payload.tensors", "one entry per (layer, name)", [(e["layer"], e["name"]) for e in tensors])


# --------------------------------------------------------------------------- export


def token_slots(state, request, length: int) -> list[int]:
    """Flat cache slot (page * S + offset) of the request's tokens 0..length-1 (`fnattn.rows`)."""
    return rows.token_slots(request.pages, length, state.page_size)


def export_request(state, request_id: int) -> RequestState:
    """Copy every declared storage row of one request (and its cursor) off the State, to the CPU."""
    where = "State.export_request"
    if isinstance(request_id, bool) or not isinstance(request_id, int):
        fail(where, "request_id", "an int request id", request_id)
    req = state.request(request_id)  # checks the handle is live and the id admitted
    slots = torch.tensor(token_slots(state, req, req.length), dtype=torch.long, device=state.device)
    row = state.recurrent_row(request_id)
    tensors = {}
    for spec in state.specs:
        for d in spec.config.storage(spec.dtype):
            _, live = state.storage.tensor_of(spec.index, d.name)
            if d.space == "token":
                value = live.reshape(-1, *d.shape).index_select(0, slots)
            else:
                value = live[row]
            tensors[(spec.index, d.name)] = value.to("cpu", copy=True).contiguous()
    return request_state(state.specs, request_id, req.length, tensors)


def request_state(specs, request_id: int, length: int, tensors: Mapping[tuple[int, str], Tensor]) -> RequestState:
    """A `RequestState` of layers ``specs`` from ``tensors[(layer, name)]`` (CPU, in the declared shapes):
    what `export_request` builds, for payloads assembled elsewhere (e.g. the heads of several TP ranks)."""
    entries, values = [], {}
    for spec in specs:
        for d in spec.config.storage(spec.dtype):
            t = tensors.get((spec.index, d.name))
            want = ((length,) if d.space == "token" else ()) + tuple(d.shape)
            if not isinstance(t, Tensor) or t.device.type != "cpu" or (tuple(t.shape), t.dtype) != (want, d.dtype):
                fail("request_state", f"tensors[{spec.index}, {d.name!r}]", f"a CPU {d.dtype} tensor of shape {want}",
                     (getattr(t, "dtype", type(t).__name__), tuple(getattr(t, "shape", ()))))
            values[(spec.index, d.name)] = t.contiguous()
            entries.append({"layer": spec.index, "name": d.name, "space": d.space, "dtype": _dtype_name(d.dtype),
                            "shape": list(t.shape)})
    layers = [layer_signature(s) for s in specs]
    header = {"format": FORMAT, "request_id": request_id, "length": length, "fingerprint": fingerprint(layers),
              "layers": layers, "tensors": entries, "checksum": ""}
    header["checksum"] = _checksum(header, list(values.values()))
    if len(values) != len(tensors):
        fail("request_state", "tensors", f"only the storage the layers declare ({sorted(values)})", sorted(tensors))
    return RequestState(_frozen(header), MappingProxyType(values))


# --------------------------------------------------------------------------- import


def _check_specs(state, payload: RequestState, cast: bool, where: str) -> None:
    mine = {s["index"]: s for s in (layer_signature(s) for s in state.specs)}
    theirs = {s["index"]: s for s in payload.header["layers"]}
    if set(mine) != set(theirs):
        fail(where, "payload", f"a request of a model with layers {sorted(mine)} (fingerprint "
             f"{fingerprint(list(mine.values()))[:16]}...)", f"layers {sorted(theirs)}")
    for i in sorted(mine):
        a, b = mine[i], theirs[i]
        if (a["kind"], a["structure"]) != (b["kind"], b["structure"]):
            fail(where, "payload", f"layer {i} of this State's spec ({a['kind']}, structure {a['structure'][:16]}...)"
                 " (a spec mismatch)", f"{b['kind']}, structure {b['structure'][:16]}...")
        if a["dtypes"] != b["dtypes"] and not cast:
            diff = [(x, y) for x, y in zip(a["dtypes"], b["dtypes"]) if x != y]
            fail(where, "payload", f"layer {i} in this State's dtypes (a dtype mismatch: pass cast=True to "
                 f"convert) {[x for x, _ in diff]}", [y for _, y in diff])


def _values(state, payload: RequestState, cast: bool, where: str) -> list[tuple[int, str, str, Tensor]]:
    """(layer, name, space, value on the State's device in its dtype) for every tensor the State expects."""
    out = []
    for spec in state.specs:
        for d in spec.config.storage(spec.dtype):
            key = (spec.index, d.name)
            if key not in payload.tensors:
                fail(where, "payload", f"layer {spec.index}'s storage {d.name!r}", sorted(payload.tensors))
            t = payload.tensors[key]
            want = ((payload.length,) if d.space == "token" else ()) + d.shape
            if tuple(t.shape) != want:
                fail(where, f"payload.tensors[{key}]", f"shape {want}", tuple(t.shape))
            if t.dtype != d.dtype and not cast:
                fail(where, f"payload.tensors[{key}]", f"dtype {d.dtype} (pass cast=True to convert)", t.dtype)
            # A copy: the storage never shares memory with a value the caller still holds.
            out.append((spec.index, d.name, d.space, t.to(device=state.device, dtype=d.dtype, copy=True)))
    if len(out) != len(payload.tensors):
        fail(where, "payload", f"only the storage this State's layers declare ({len(out)} tensors)",
             f"{len(payload.tensors)} tensors")
    return out


def import_request(state, payload, *, request_id: int | None = None, cast: bool = False):
    """Check ``payload`` against ``state`` entirely, then admit, reserve and write it: ``-> (State, rid)``
    (`State.import_request`)."""
    return state.import_request(payload, request_id=request_id, cast=cast)


def write_payload(state, payload, *, request_id: int | None, cast: bool):
    """The checks and writes of `State.import_request`: ``-> (handle, request id, length)``, the handle with the
    request admitted, its pages reserved and its rows written; `State` then moves its cursor to ``length``."""
    from .apply import Target, write_step

    where = "State.import_request"
    state.check_live()
    if isinstance(payload, (bytes, bytearray, memoryview)):
        payload = RequestState.from_bytes(payload)
    if not isinstance(payload, RequestState):
        fail(where, "payload", "a RequestState (or its to_bytes())", type(payload).__name__)
    if not isinstance(cast, bool):
        fail(where, "cast", "a bool", cast)
    payload.verify(where)
    rid = payload.request_id if request_id is None else request_id
    if isinstance(rid, bool) or not isinstance(rid, int) or rid < 0:
        fail(where, "request_id", "a non-negative int", rid)
    if rid in state.requests:
        fail(where, "request_id", f"an id not already admitted (admitted: {sorted(state.requests)})", rid)
    _check_specs(state, payload, cast, where)
    values = _values(state, payload, cast, where)
    pages = math.ceil(payload.length / state.page_size)
    if state.free_slots < 1 or state.free_pages < pages:
        raise PoolExhaustedError(
            f"{where}: request {rid} needs 1 request slot and {pages} pages for {payload.length} tokens "
            f"(page_size={state.page_size}); {state.free_slots} slots and {state.free_pages} pages are free")
    # Every check passed: the allocation and the writes below cannot fail.
    new = state.admit(rid).reserve({rid: payload.length})
    req = new.request(rid)
    token_rows = torch.tensor(token_slots(new, req, payload.length), dtype=torch.long, device=new.device)
    # The request's cursor moves to ring position 0 (`State.import_request`): its state goes to that row.
    state_rows = torch.tensor([new.recurrent_row(rid, 0)], dtype=torch.long, device=new.device)
    storage = new.storage
    targets = []
    for layer, name, space, value in values:
        pool, _ = storage.tensor_of(layer, name)
        index, value = (token_rows, value) if space == "token" else (state_rows, value.unsqueeze(0))
        if index.numel():
            targets.append(Target(pool.name, name, pool.position(layer), index, value))
    write_step(storage.pools, targets)
    return new, rid, payload.length


# --------------------------------------------------------------------------- torch.distributed


def _wire_device(group) -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


def send_request(payload: RequestState, dst: int, group=None) -> None:
    """Send ``payload`` to rank ``dst``: an int64 header ``[magic, nbytes]``, then the bytes."""
    import torch.distributed as dist

    if not isinstance(payload, RequestState):
        fail("send_request", "payload", "a RequestState", type(payload).__name__)
    if isinstance(dst, bool) or not isinstance(dst, int) or dst < 0:
        fail("send_request", "dst", "a rank (non-negative int)", dst)
    data = payload.to_bytes()
    device = _wire_device(group)
    dist.send(torch.tensor([_WIRE_MAGIC, len(data)], dtype=torch.int64, device=device), dst, group=group)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), dst, group=group)


def _recv(tensor: Tensor, src: int, group, timeout: float, what: str) -> None:
    """Receive into ``tensor`` within ``timeout`` s, or raise `TransferTimeoutError`.

    gloo raises on a timeout, and on a peer that closed its connection, either when posting the
    receive (already closed) or when waiting for it; after either the connection to ``src`` is gone.
    """
    import torch.distributed as dist

    fail_msg = (f"recv_request: no {what} from rank {src} within timeout={timeout} s (the sender died or never "
                "sent; nothing was allocated)")
    try:
        done = dist.irecv(tensor, src, group=group).wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        raise TransferTimeoutError(f"{fail_msg}: {e}") from None
    if done is False:
        raise TransferTimeoutError(fail_msg)


def recv_request(src: int, group=None, *, timeout: float = 60.0,
                 max_bytes: int = 1 << 40) -> RequestState:
    """Receive a payload `send_request` sent from rank ``src``; `TransferTimeoutError` after ``timeout``
    seconds without it. Nothing is imported here: pass the result to `State.import_request`."""
    if isinstance(src, bool) or not isinstance(src, int) or src < 0:
        fail("recv_request", "src", "a rank (non-negative int)", src)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        fail("recv_request", "timeout", "a positive number of seconds", timeout)
    device = _wire_device(group)
    head = torch.zeros(2, dtype=torch.int64, device=device)
    _recv(head, src, group, timeout, "header")
    magic, n = head.tolist()
    if magic != _WIRE_MAGIC or not 0 < n <= max_bytes:
        fail("recv_request", "payload", f"a header [{_WIRE_MAGIC}, 1..{max_bytes}] from send_request", [magic, n])
    body = torch.empty(n, dtype=torch.uint8, device=device)
    _recv(body, src, group, timeout, "payload bytes")
    return RequestState.from_bytes(body.cpu().numpy().tobytes())


__all__ = ["RequestState", "TransferTimeoutError", "export_request", "fingerprint", "import_request",
           "layer_signature", "recv_request", "request_state", "send_request"]
