"""Staging: a batch's lanes reach the GPU as one buffer per dtype, filled by one non-blocking copy each.

One device tensor per field would be seven small host-to-device copies from
pageable memory, each of which the host waits on. `packed` builds a one-off
batch's lanes as views of a fresh device buffer per dtype (int32: ``cu_seqlens``,
``cache_lens``, ``block_table``; int64: the rest), copied from pinned memory.

For a captured step the graph's own buffers receive them. A `Staging` holds,
for one bucket, one pinned host buffer per dtype and its device twin, carved
into the batch's lanes. The builder writes a batch's values into the pinned
buffers and starts one non-blocking copy per dtype; the batch's tensors are
views of the device buffers, which are the graph's own input buffers, so
nothing is copied again.

A staged batch lives until the next batch is built into the same staging (the
views are overwritten then): `fnattn.graph.StepRunner` builds one per step and
hands none out. The staging counts what it writes (`Staging.generation`), so an
earlier batch built into it is known to be overwritten: its tensors are the same
objects, and writes through the host arrays move no version counter.

Before the pinned buffers are rewritten, the previous copy out of them must
have run: the host waits on that copy's event (the step before the previous
one has then finished on the device, so the host stays at most one step
ahead). On the CPU the host buffer is the device buffer: no copy at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch
from torch import Tensor

from .checks import fail


class Generation:
    """How many times a staging was written; a batch built into it keeps the value it was written with."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = 0


class Staging:
    """Pinned host buffers and their device twins for ``shapes`` (lane name -> shape) of ``dtypes``."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, torch.dtype],
                 device: torch.device):
        device = torch.device(device)
        groups: dict[torch.dtype, list[str]] = {}
        for name in shapes:
            groups.setdefault(dtypes[name], []).append(name)
        pinned = device.type == "cuda"
        self.device = device
        self.views: dict[str, Tensor] = {}  # lane -> its device view, shaped
        self._slices: dict[str, tuple[object, int, int]] = {}  # lane -> (host array, start, numel)
        self._pairs: list[tuple[Tensor, Tensor]] = []  # (host, device) buffer per dtype
        self._groups: list[tuple[object, tuple[str, ...], int]] = []  # (host array, its lanes in order, values)
        for dtype, names in groups.items():
            sizes = [_numel(shapes[n]) for n in names]
            total = max(1, sum(sizes))
            host = torch.zeros(total, dtype=dtype, pin_memory=pinned)
            dev = torch.zeros(total, dtype=dtype, device=device) if pinned else host
            array = host.numpy()
            for name, size, start in zip(names, sizes, itertools.accumulate(sizes, initial=0)):
                self.views[name] = dev[start:start + size].view(shapes[name])
                self._slices[name] = (array, start, size)
            self._groups.append((array, tuple(names), sum(sizes)))
            self._pairs.append((host, dev))
        self._copied: torch.cuda.Event | None = None
        self.generation = Generation()

    def write(self, values: Mapping[str, list]) -> dict[str, Tensor]:
        """Write every lane's host values (flat, or rows of a 2-D lane) and start the copies;
        ``-> the device views`` (lane -> tensor)."""
        if set(values) != set(self._slices):
            fail("Staging.write", "values", f"the lanes {sorted(self._slices)}", sorted(values))
        flat = {}
        for name, v in values.items():
            v = _flat(v)
            if len(v) != self._slices[name][2]:
                fail("Staging.write", f"values[{name!r}]", f"{self._slices[name][2]} values (its staged shape "
                     f"{tuple(self.views[name].shape)})", len(v))
            flat[name] = v
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffers are still the source of the last copy until then
        self.generation.value += 1  # from here on the batch built last no longer holds its rows
        for array, names, size in self._groups:  # one conversion a dtype: its lanes lie end to end
            if size:
                array[:size] = list(itertools.chain.from_iterable(flat[name] for name in names))
        if self.device.type == "cuda":
            for host, dev in self._pairs:
                dev.copy_(host, non_blocking=True)
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()
        return self.views


def packed(values: Mapping[str, list], dtypes: Mapping[str, torch.dtype], device: torch.device, *,
           pin: bool = True) -> dict[str, Tensor]:
    """A one-off batch's lanes (host values: flat, or rows of a 2-D lane) as views of one fresh device buffer
    per dtype, each filled by one non-blocking copy from pinned memory (``pin``). The pinned block is not
    reused before its copy has run: torch's host allocator tracks it."""
    out: dict[str, Tensor] = {}
    for dtype in dict.fromkeys(dtypes[n] for n in values):
        names = [n for n in values if dtypes[n] == dtype]
        rows = [_flat(values[n]) for n in names]
        host = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=dtype, pin_memory=pin)
        flat = host.to(device, non_blocking=True)
        start = 0
        for name, row in zip(names, rows):
            view = flat[start:start + len(row)]
            two_d = values[name] and isinstance(values[name][0], (list, tuple))
            out[name] = view.view(len(values[name]), -1) if two_d else view
            start += len(row)
    return out


def to_device(values, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list as a device tensor without making the host wait: on CUDA one non-blocking copy from
    pinned memory (a plain ``torch.tensor(values, device=cuda)`` copies from pageable memory, and the host
    then waits for every launch queued before it), elsewhere the tensor itself."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _flat(values: list) -> list:
    """A lane's host values as one flat list (a 2-D lane's rows joined)."""
    return list(itertools.chain.from_iterable(values)) if values and isinstance(values[0], (list, tuple)) else values


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = ["Generation", "Staging", "packed", "to_device"]
