"""Workspace leases: scratch memory shared by the layers of a step.

A lease orders completion, it is not a lock: the next lease of a workspace
starts (on the device stream) only after the previous lease's device work has
finished. Release records a completion marker; the next lease waits on it.
A lease never released, or released twice, raises `LeaseError`.
"""

from __future__ import annotations

import torch

from .errors import LeaseError


class StreamSync:
    """Completion markers on the current device stream (no-ops on the CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._event = None

    def record(self):
        if self.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return None  # CPU work is complete when the call returns; a graph orders its own work
        # One event, recorded again at each release: a stream's wait takes the record made before it, and the
        # next lease waits before the next release records (building an event per step costs host time).
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(self.device))
        return self._event

    def wait(self, marker) -> None:
        if marker is not None and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.device).wait_event(marker)


class Lease:
    def __init__(self, workspace: "Workspace", number: int):
        self.workspace = workspace
        self.number = number
        self.released = False
        self.marker = None

    def buffer(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of uint8 scratch, valid until this lease is released."""
        if self.released:
            raise LeaseError(f"lease {self.number} was already released; its buffer is no longer yours")
        return self.workspace._scratch(nbytes)

    def cached(self, key, build):
        """A long-lived object (a library wrapper, a plan buffer) kept by the workspace."""
        if self.released:
            raise LeaseError(f"lease {self.number} was already released")
        if key not in self.workspace.objects:
            self.workspace.objects[key] = build()
        return self.workspace.objects[key]

    def release(self) -> None:
        if self.released:
            raise LeaseError(f"lease {self.number} of this workspace was released twice")
        self.marker = self.workspace.sync.record()
        self.released = True


class Workspace:
    def __init__(self, device: torch.device, *, sync: StreamSync | None = None):
        self.device = torch.device(device)
        self.sync = sync or StreamSync(self.device)
        self._last: Lease | None = None
        self._count = 0
        self._buf: torch.Tensor | None = None  # allocated on first use
        self.objects: dict = {}

    def lease(self) -> Lease:
        prev = self._last
        if prev is not None and not prev.released:
            raise LeaseError(
                f"lease {prev.number} of this workspace was never released; "
                "a session must exit before the next one starts"
            )
        if prev is not None:
            self.sync.wait(prev.marker)
        self._count += 1
        self._last = Lease(self, self._count)
        return self._last

    def _scratch(self, nbytes: int) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buf[:nbytes]
