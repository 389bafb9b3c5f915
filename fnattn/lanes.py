"""Lanes: what a captured step reads and writes, declared once per model.

A model's `Manifest` names every tensor that crosses the boundary of a
captured step (its *lanes*): the replay inputs the runner copies into the
graph's static buffers before each replay (the tokens and the batch's tensors),
the tensors generated inside the graph (an index an in-graph kernel builds,
such as the indexer's top-k: never copied), and the outputs read after it.
Shapes are symbolic and bound per bucket:

    B  lanes (requests + pad lanes)      T  tokens (B * (1 + num_draft))
    W  block-table columns               R  recurrent rows written (B; T for verify)

plus any constant the manifest binds in ``dims`` (``V`` the vocabulary...).
A size may be ``"B+1"``. `check_lanes` validates a whole set of lane values
before any is copied and names the lane and the problem.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import Tensor

from .checks import fail

ROLES = ("input", "generated", "output")

#: The replay inputs every step has: the tokens and the batch's tensors, by Batch field name.
STEP_LANES = (
    ("tokens", ("T",), torch.int64),
    ("cu_seqlens", ("B+1",), torch.int32),
    ("cache_lens", ("B",), torch.int32),
    ("positions", ("T",), torch.int64),
    ("block_table", ("B", "W"), torch.int32),
    ("slot_mapping", ("T",), torch.int64),
    ("recurrent_slots", ("B",), torch.int64),
    ("recurrent_write_rows", ("R",), torch.int64),
)
BATCH_LANES = tuple(name for name, _, _ in STEP_LANES[1:])


class LaneError(ValueError):
    """A lane value that does not match the manifest (raised before any lane is copied)."""


@dataclass(frozen=True)
class Lane:
    name: str
    shape: tuple[str | int, ...]  # symbolic sizes, bound per bucket
    dtype: torch.dtype
    role: str  # "input" | "generated" | "output"

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            fail("Lane", "name", "an identifier", self.name)
        if not isinstance(self.shape, tuple) or not all(isinstance(d, (str, int)) and not isinstance(d, bool)
                                                        for d in self.shape):
            fail("Lane", "shape", "a tuple of sizes (ints or symbols such as 'T', 'B+1')", self.shape)
        if not isinstance(self.dtype, torch.dtype):
            fail("Lane", "dtype", "a torch.dtype", self.dtype)
        if self.role not in ROLES:
            fail("Lane", "role", f"one of {ROLES}", self.role)


@dataclass(frozen=True)
class Bucket:
    """The shape key of a captured step: phase, lanes, drafts per lane and block-table columns."""

    phase: str
    lanes: int
    num_draft: int
    columns: int

    @property
    def tokens(self) -> int:
        return self.lanes * (1 + self.num_draft)

    def sizes(self) -> dict[str, int]:
        return {"B": self.lanes, "T": self.tokens, "W": self.columns,
                "R": self.tokens if self.phase == "verify" else self.lanes}


def bucket_sizes(owner: str, name: str, sizes) -> tuple[int, ...]:
    """A runner's bucket sizes, checked: increasing positive ints (``-> as a tuple``)."""
    sizes = tuple(sizes) if not isinstance(sizes, (str, bytes)) else sizes
    if not sizes or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in sizes) \
            or list(sizes) != sorted(set(sizes)):
        fail(owner, name, "increasing positive ints", sizes)
    return sizes


def check_max_context(owner: str, max_context) -> None:
    if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int)
                                    or max_context < 1):
        fail(owner, "max_context", "None or a positive int", max_context)


def block_columns(state, max_context: int | None) -> int:
    """The block table's width of a captured step: pages for ``max_context`` tokens (default the whole pool)."""
    tokens = max_context or state.num_pages * state.page_size
    return -(-tokens // state.page_size)


@dataclass(frozen=True)
class Manifest:
    """Every lane of a model's captured step; ``dims`` binds the model's constant sizes (``V``, ``D``...)."""

    lanes: tuple[Lane, ...]
    dims: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "lanes", tuple(self.lanes))
        object.__setattr__(self, "dims", MappingProxyType(dict(self.dims)))
        names = [lane.name for lane in self.lanes]
        if not all(isinstance(lane, Lane) for lane in self.lanes) or len(set(names)) != len(names):
            fail("Manifest", "lanes", "Lane values with unique names", names)
        by_name = {lane.name: lane for lane in self.lanes}
        for name, shape, dtype in STEP_LANES:
            lane = by_name.get(name)
            if lane is None or (lane.shape, lane.dtype, lane.role) != (shape, dtype, "input"):
                fail("Manifest", f"lanes[{name!r}]", f"an input lane of shape {shape} and dtype {dtype} (every "
                     "step reads it)", None if lane is None else (lane.shape, lane.dtype, lane.role))
        if "logits" not in by_name or by_name["logits"].role != "output":
            fail("Manifest", "lanes", "an output lane 'logits'", names)
        for k, v in self.dims.items():
            if k in ("B", "T", "W", "R") or isinstance(v, bool) or not isinstance(v, int) or v < 1:
                fail("Manifest", f"dims[{k!r}]", "a positive int for a symbol other than B, T, W, R", v)
        for lane in self.lanes:
            for d in lane.shape:
                if isinstance(d, str):
                    _size(d, {"B": 1, "T": 1, "W": 1, "R": 1, **self.dims}, f"Manifest: lane {lane.name!r}")

    def role(self, role: str) -> tuple[Lane, ...]:
        cache = self.__dict__.setdefault("_roles", {})
        if role not in cache:
            cache[role] = tuple(lane for lane in self.lanes if lane.role == role)
        return cache[role]

    def shape(self, lane: Lane, bucket: Bucket) -> tuple[int, ...]:
        return self.shapes(bucket)[lane.name]

    def shapes(self, bucket: Bucket) -> Mapping[str, tuple[int, ...]]:
        """Every lane's shape in ``bucket`` (bound once per bucket: replays check against it)."""
        cache = self.__dict__.setdefault("_bound", {})
        if bucket not in cache:
            sizes = {**self.dims, **bucket.sizes()}
            cache[bucket] = {lane.name: tuple(d if isinstance(d, int) else _size(d, sizes, f"lane {lane.name!r}")
                                              for d in lane.shape) for lane in self.lanes}
        return cache[bucket]


def _size(symbol: str, sizes: Mapping[str, int], where: str) -> int:
    name, _, extra = symbol.partition("+")
    if name not in sizes or (extra and not extra.isdigit()):
        fail(where, "shape", f"sizes from {sorted(sizes)} (optionally '+n')", symbol)
    return sizes[name] + (int(extra) if extra else 0)


def step_manifest(*, vocab: int, hidden: int | None = None, hidden_dtype: torch.dtype = torch.float32,
                  generated: tuple[Lane, ...] = (), dims: Mapping[str, int] | None = None,
                  hidden_in: bool = False, logits: int | None = None) -> Manifest:
    """The lanes every model has (tokens, the batch's tensors, fp32 ``logits`` [T, L] and, with
    ``hidden``, the final-norm ``hidden`` [T, D] a draft model reads) plus the model's ``generated`` lanes.
    ``V`` is the vocabulary (the tokens' range); ``L`` the logits' columns: ``logits``, or ``V`` (a draft whose
    head keeps fewer rows has fewer, `models.mtp.DraftModel.with_vocab`).
    ``hidden_in``: a draft model's step, which also reads a ``hidden_in`` [T, D] input (the target's hidden
    state of each token, or the draft's own from its last proposal); needs ``hidden``."""
    if logits is not None and (isinstance(logits, bool) or not isinstance(logits, int) or not 1 <= logits <= vocab):
        fail("step_manifest", "logits", f"None or an int in 1..{vocab} (the vocabulary)", logits)
    lanes = [Lane(n, s, d, "input") for n, s, d in STEP_LANES]
    lanes.append(Lane("logits", ("T", "L"), torch.float32, "output"))
    sizes = {"V": vocab, "L": vocab if logits is None else logits, **(dims or {})}
    if hidden_in and hidden is None:
        fail("step_manifest", "hidden", "the hidden size when hidden_in is set (a draft step returns its hidden)",
             hidden)
    if hidden is not None:
        sizes["D"] = hidden
        lanes.append(Lane("hidden", ("T", "D"), hidden_dtype, "output"))
    if hidden_in:
        lanes.append(Lane("hidden_in", ("T", "D"), hidden_dtype, "input"))
    return Manifest(tuple(lanes) + tuple(generated), sizes)


def check_lanes(manifest: Manifest, bucket: Bucket, values: Mapping[str, Tensor], device: torch.device,
                role: str = "input") -> None:
    """Every lane of ``role`` present, of its bucket's shape, dtype and device, dense; lanes that are views of
    one storage laid out without gaps or overlap. Raises `LaneError` naming the lane; copies nothing."""
    lanes = manifest.role(role)
    shapes = manifest.shapes(bucket)
    if len(values) != len(lanes) or any(name not in shapes for name in values):
        extra = sorted(set(values) - {lane.name for lane in lanes})
        if extra:
            raise LaneError(f"lanes {extra}: not {role} lanes of this manifest (they are "
                            f"{[lane.name for lane in lanes]}; generated lanes are never copied)")
    storages: dict[int, list[tuple[str, Tensor]]] = {}
    shared = False
    for lane in lanes:
        v = values.get(lane.name)
        if v is None:
            raise LaneError(f"lane {lane.name!r}: missing ({role} lanes: {[x.name for x in lanes]})")
        if not isinstance(v, Tensor) or v.layout != torch.strided:
            raise LaneError(f"lane {lane.name!r}: expected a dense tensor, got {type(v).__name__}")
        want = shapes[lane.name]
        if v.shape != want:
            raise LaneError(f"lane {lane.name!r}: expected shape {want} (bucket {bucket.lanes} lanes, "
                            f"{bucket.tokens} tokens, {bucket.columns} columns), got {tuple(v.shape)}")
        if v.dtype != lane.dtype:
            raise LaneError(f"lane {lane.name!r}: expected dtype {lane.dtype}, got {v.dtype}")
        if v.device != device:
            raise LaneError(f"lane {lane.name!r}: expected a tensor on {device}, got {v.device}")
        if v.numel():
            group = storages.setdefault(v.untyped_storage().data_ptr(), [])
            group.append((lane.name, v))
            shared = shared or len(group) > 1
    if shared:
        _check_shared_storage(storages)


def _check_shared_storage(groups: Mapping[int, list[tuple[str, Tensor]]]) -> None:
    """Lanes carved out of one buffer (grouped by storage) must each be contiguous and must not overlap."""
    for views in groups.values():
        if len(views) < 2:
            continue
        spans = []
        for name, v in views:
            if not v.is_contiguous():
                raise LaneError(f"lane {name!r}: a view onto the storage of lanes {[n for n, _ in views]} must be "
                                f"contiguous, got strides {v.stride()} for shape {tuple(v.shape)}")
            start = v.storage_offset() * v.element_size()
            spans.append((start, start + v.numel() * v.element_size(), name))
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise LaneError(f"lane {b!r}: overlaps lane {a!r} in their shared storage")


def check_out(out: Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """An ``out=`` buffer: the shape and dtype of what it receives, rows packed (no padding between rows)."""
    if not isinstance(out, Tensor):
        raise LaneError(f"out: expected a tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise LaneError(f"out: expected shape {shape}, {dtype} on {device}, got {tuple(out.shape)}, {out.dtype} "
                        f"on {out.device}")
    packed = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    if out.numel() and list(out.stride()) != packed:
        raise LaneError(f"out: expected packed rows (strides {tuple(packed)}), got strides {out.stride()}: rows "
                        "with padding between them would receive the wrong values")


# ------------------------------------------------------------ static-shape steps
_static = contextvars.ContextVar("fnattn_static_shapes", default=False)
_checking = contextvars.ContextVar("fnattn_debug_checks", default=False)


@contextlib.contextmanager
def _on(flag: contextvars.ContextVar):
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


def static_shapes():
    """Inside: a step must read no device value on the host (models pick their sync-free paths)."""
    return _on(_static)


def in_static_step() -> bool:
    return _static.get()


_HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere", "unique",
               "unique_consecutive", "numpy", "masked_select", "nonzero_static"}


class HostReadError(RuntimeError):
    """A step read a device value on the host (a sync on a GPU, and a graph that cannot be captured)."""


def debug_check():
    """fnattn's own debug checks (``FNATTN_CHECKS=1``) may read values back: they never run in a capture."""
    return _on(_checking)


class _NoHostReads(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        if _checking.get():
            return func(*args, **kwargs)
        bool_index = name == "__getitem__" and _has_bool_index(args[1] if len(args) > 1 else None)
        if name in _HOST_READS or bool_index or (name == "where" and len(args) + len(kwargs) == 1):
            what = "boolean-mask indexing" if bool_index else f"`{name}`"
            raise HostReadError(f"{what} inside a step reads a device value on the host: a captured step takes "
                                "every host number from the Batch and every shape from its bucket")
        return func(*args, **kwargs)


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, Tensor) and i.dtype == torch.bool for i in items)


@contextlib.contextmanager
def no_host_reads():
    """Fail with `HostReadError` on ``.item()``, ``.tolist()``, ``bool(t)``, ``nonzero``, mask indexing...:
    the CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``."""
    with _NoHostReads():
        yield
