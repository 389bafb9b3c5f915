"""Staging: a captured step's batch lanes built straight into the graph's buffers, one host copy per dtype.

Building a `Batch` the plain way makes one device tensor per field: seven small
host-to-device copies from pageable memory, each of which the host waits on,
before a replay can even be launched. A `Staging` holds, for one bucket, one
pinned host buffer per dtype (int32: ``cu_seqlens``, ``cache_lens``,
``block_table``; int64: the rest) and its device twin, carved into the batch's
lanes. The builder writes a batch's values into the pinned buffers and starts
one non-blocking copy per dtype; the batch's tensors are views of the device
buffers, which are the graph's own input buffers, so nothing is copied again.

A staged batch lives until the next batch is built into the same staging (the
views are overwritten then): `fnattn.graph.StepRunner` builds one per step and
hands none out. Before the pinned buffers are rewritten, the previous copy out
of them must have run: the host waits on that copy's event (the step before the
previous one has then finished on the device, so the host stays at most one
step ahead). On the CPU the host buffer is the device buffer: no copy at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch
from torch import Tensor

from .checks import fail


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
        for dtype, names in groups.items():
            sizes = [_numel(shapes[n]) for n in names]
            total = max(1, sum(sizes))
            host = torch.zeros(total, dtype=dtype, pin_memory=pinned)
            dev = torch.zeros(total, dtype=dtype, device=device) if pinned else host
            array = host.numpy()
            for name, size, start in zip(names, sizes, itertools.accumulate(sizes, initial=0)):
                self.views[name] = dev[start:start + size].view(shapes[name])
                self._slices[name] = (array, start, size)
            self._pairs.append((host, dev))
        self._copied: torch.cuda.Event | None = None

    def write(self, values: Mapping[str, list]) -> dict[str, Tensor]:
        """Write every lane's host values (flat, or rows of a 2-D lane) and start the copies;
        ``-> the device views`` (lane -> tensor)."""
        if set(values) != set(self._slices):
            fail("Staging.write", "values", f"the lanes {sorted(self._slices)}", sorted(values))
        flat = {}
        for name, v in values.items():
            v = list(itertools.chain.from_iterable(v)) if v and isinstance(v[0], (list, tuple)) else v
            if len(v) != self._slices[name][2]:
                fail("Staging.write", f"values[{name!r}]", f"{self._slices[name][2]} values (its staged shape "
                     f"{tuple(self.views[name].shape)})", len(v))
            flat[name] = v
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffers are still the source of the last copy until then
        for name, v in flat.items():
            array, start, size = self._slices[name]
            array[start:start + size] = v
        if self.device.type == "cuda":
            for host, dev in self._pairs:
                dev.copy_(host, non_blocking=True)
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()
        return self.views


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = ["Staging"]
