"""Tensor parallelism over ``torch.distributed``: the group, the all-reduce, head-block splits.

A model sharded over ``tp`` ranks runs the same step function on every rank
with the rank's slice of the weights and a config holding the rank's head
counts, so its layer specs (and the State pools built from them) hold only
the rank's heads. Projections into the heads are split by output rows
(column-parallel, no communication); projections out of them by input
columns (row-parallel): each rank's output is a partial sum that
`all_reduce` adds up. Everything else is replicated.

`all_reduce` reads the group of the step being run (`active`), so a model
step calls it unconditionally at its row-parallel outputs: outside an active
group, or in a group of one, it returns its argument untouched (tp = 1 costs
nothing). The model-side sharding (which checkpoint tensor splits how, per
family) is `fnattn.models.tp`; this module names no kind and no model.

`Segment` / `shard` / `unshard` cut one tensor axis laid out as consecutive
segments of equal blocks (heads of a head dim, or the q | k | v blocks of a
conv's channels) into the rank's blocks of each segment, and put rank slices
back together (for request transfer between TP degrees).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .checks import fail

__all__ = ["Segment", "TPGroup", "active", "all_reduce", "current", "init_from_env", "launch", "local_units",
           "shard", "unshard"]

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TPGroup:
    """``size`` ranks of one tensor-parallel group; this process is ``rank``.

    ``group`` is the ``torch.distributed`` process group the all-reduce runs
    in (None: the default group); ``backend`` is its backend ("gloo",
    "nccl"), None for a group of one that never communicates.
    """

    size: int
    rank: int
    group: Any = None
    backend: str | None = None

    def __post_init__(self):
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            fail("TPGroup", "size", "a positive int", self.size)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            fail("TPGroup", "rank", f"an int in [0, {self.size})", self.rank)
        if self.size > 1 and self.backend is None:
            fail("TPGroup", "backend", "the process group's backend (a group of several ranks communicates)", None)

    @staticmethod
    def single() -> TPGroup:
        return TPGroup(1, 0)

    @staticmethod
    def of(group=None) -> TPGroup:
        """The TP group of an initialised ``torch.distributed`` process group (None: the default one)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            fail("TPGroup.of", "group", "an initialised torch.distributed process group", None)
        return TPGroup(dist.get_world_size(group), dist.get_rank(group), group, dist.get_backend(group))


def init_from_env(size: int, *, backend: str | None = None, timeout_s: float = 300.0) -> TPGroup:
    """The ``size``-rank group of a ``torchrun`` launch: initialises the default process group from
    torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) unless it is
    already initialised. ``backend`` None: NCCL where CUDA is available, else gloo. On CUDA each rank
    takes device ``LOCAL_RANK``. ``size`` must equal the world size (one TP group per launch).

    NVLink multicast (NCCL's NVLS) stays off unless the caller set ``NCCL_NVLS_ENABLE``: the all-reduces
    here are small, and multicast needs driver support the machines may not have.
    """
    import torch.distributed as dist

    where = "tp.init_from_env"
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        fail(where, "size", "a positive int", size)
    if size == 1 and not dist.is_initialized():
        return TPGroup.single()
    if not dist.is_initialized():
        missing = [k for k in TORCHRUN_ENV if not os.environ.get(k)]
        if missing:
            fail(where, "environment", f"torchrun's {', '.join(TORCHRUN_ENV)} (launch with torchrun "
                 f"--nproc-per-node {size})", f"{', '.join(missing)} unset")
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            fail(where, "size", f"the launch's WORLD_SIZE={world}", size)
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    group = TPGroup.of()
    if group.size != size:
        fail(where, "size", f"the process group's world size {group.size}", size)
    return group


def launch(size: int, device: str = "cpu") -> tuple[TPGroup, str]:
    """``(group, the rank's device)`` for a ``torchrun --nproc-per-node size`` launch on ``device``
    ("cpu": gloo; "cuda": NCCL, rank r on ``cuda:LOCAL_RANK``). ValueError with one line for a launch
    that is not torchrun's, of another size, or a device that does not fit it."""
    missing = [k for k in TORCHRUN_ENV if not os.environ.get(k)]
    if missing:
        raise ValueError(f"needs a torchrun launch (torchrun --nproc-per-node {size} -m fnattn ...): "
                         f"{', '.join(missing)} not set")
    if os.environ["WORLD_SIZE"] != str(size):
        raise ValueError(f"torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']} processes, not {size}")
    cuda = str(device).startswith("cuda")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        if ":" in str(device) or local >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: give --device cuda (rank r takes cuda:LOCAL_RANK of the "
                             f"{torch.cuda.device_count()} devices)")
        device = f"cuda:{local}"
    return init_from_env(size, backend="nccl" if cuda else "gloo"), device


_ACTIVE: contextvars.ContextVar[TPGroup | None] = contextvars.ContextVar("fnattn_tp", default=None)


@contextlib.contextmanager
def active(group: TPGroup | None):
    """Run the body with ``group`` as the group `all_reduce` reduces over (None: no reduction)."""
    if group is not None and not isinstance(group, TPGroup):
        fail("tp.active", "group", "a TPGroup or None", type(group).__name__)
    token = _ACTIVE.set(group)
    try:
        yield group
    finally:
        _ACTIVE.reset(token)


def current() -> TPGroup | None:
    """The group of the step being run, or None outside one."""
    return _ACTIVE.get()


def all_reduce(x: Tensor) -> Tensor:
    """The sum of ``x`` over the active group's ranks: a row-parallel projection's output made whole.

    The identity outside an active group or in a group of one. Reduces in place when ``x`` is
    contiguous: pass a fresh projection output that nothing else holds. Every rank ends with the same
    bits (NCCL and gloo all-reduces hand each rank one copy of the sum), so replicated work after it
    (routing, sampling) agrees across ranks. NCCL all-reduces can be captured in a CUDA graph.
    """
    group = _ACTIVE.get()
    if group is None or group.size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    dist.all_reduce(x, group=group.group)
    return x


# --------------------------------------------------------------------------- splitting an axis by blocks


@dataclass(frozen=True)
class Segment:
    """``units`` consecutive blocks of ``size`` elements along an axis (e.g. 8 heads of 128 dims).

    Split over ``tp`` ranks, rank r takes blocks ``[r u, (r + 1) u)`` with ``u = units / tp``.
    ``replicate=True`` allows fewer blocks than ranks when ``tp`` is a multiple of ``units``: then
    each rank takes one block, block ``r // (tp / units)`` (GQA key/value heads shared by the query
    heads of several ranks). ``field`` names the config field ``units`` comes from, for errors.
    """

    units: int
    size: int
    field: str = "units"
    replicate: bool = False

    def __post_init__(self):
        for name in ("units", "size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                fail("Segment", name, "a positive int", v)

    def blocks(self, tp: int, rank: int) -> tuple[int, int]:
        """``(first block, block count)`` of ``rank``'s part."""
        n = local_units(self.units, tp, field=self.field, replicate=self.replicate)
        if self.units < tp:
            return rank // (tp // self.units), 1
        return rank * n, n

    def owners(self, tp: int) -> list[int]:
        """The ranks whose parts, in order, hold every block once."""
        if self.units < tp and self.replicate:
            return list(range(0, tp, tp // self.units))
        return list(range(tp))


def local_units(units: int, tp: int, *, field: str, replicate: bool = False, where: str = "tp") -> int:
    """Blocks per rank: ``units / tp``; 1 for a replicated segment of fewer blocks than ranks.

    ValueError naming ``field`` when ``units`` does not split evenly over ``tp`` ranks.
    """
    if units % tp == 0:
        return units // tp
    if replicate and units < tp and tp % units == 0:
        return 1
    also = " (or a divisor of tp, replicated)" if replicate else ""
    fail(where, field, f"a multiple of tp={tp}{also}", units)


def _check_axis(where: str, x: Tensor, dim: int, segments: Sequence[Segment], per_rank: bool, tp: int):
    if not 0 <= dim < x.dim():
        fail(where, "dim", f"an axis of a {x.dim()}-d tensor", dim)
    want = sum(s.units * s.size for s in segments) if not per_rank else \
        sum(local_units(s.units, tp, field=s.field, replicate=s.replicate) * s.size for s in segments)
    if x.shape[dim] != want:
        fail(where, f"shape[{dim}]", f"{want} (the segments {[(s.units, s.size) for s in segments]}"
             f"{' per rank' if per_rank else ''})", x.shape[dim])


def shard(x: Tensor, dim: int, segments: Sequence[Segment], tp: int, rank: int) -> Tensor:
    """``rank``'s blocks of every segment along ``dim``, concatenated in segment order (a new tensor)."""
    _check_axis("tp.shard", x, dim, segments, False, tp)
    parts, at = [], 0
    for s in segments:
        first, n = s.blocks(tp, rank)
        parts.append(x.narrow(dim, at + first * s.size, n * s.size))
        at += s.units * s.size
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0].clone(memory_format=torch.contiguous_format)


def unshard(parts: Sequence[Tensor], dim: int, segments: Sequence[Segment]) -> Tensor:
    """The inverse of `shard`: ``parts[r]`` is rank r's tensor, ``len(parts)`` the TP degree.

    A replicated segment is taken once from each block's first owner; its other copies must be
    equal (bit for bit), or the parts are not of one model and ValueError says so.
    """
    tp = len(parts)
    if tp < 1:
        fail("tp.unshard", "parts", "at least one rank's tensor", tp)
    for r, p in enumerate(parts):
        _check_axis(f"tp.unshard parts[{r}]", p, dim, segments, True, tp)
    out, at = [], 0
    for s in segments:
        n = local_units(s.units, tp, field=s.field, replicate=s.replicate) * s.size
        pieces = [p.narrow(dim, at, n) for p in parts]
        if s.units < tp:
            for r in range(tp):
                owner = s.blocks(tp, r)[0] * (tp // s.units)
                if not torch.equal(pieces[r], pieces[owner]):
                    fail("tp.unshard", f"parts[{r}]", f"the same replicated {s.field} block as rank {owner}",
                         "different values")
        out += [pieces[r] for r in s.owners(tp)]
        at += n
    return torch.cat(out, dim=dim)
