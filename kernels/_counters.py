"""Arrival counters for kernels whose last program to finish a tile does the tile's last step (Triton).

A split-K GEMV's last piece of a column tile sums the partials (`skinny_linear`): it counts its pieces'
arrivals in an int32 that is zero between launches.
"""

import torch

COUNTERS = 4096  # tiles a launch may count (a split projection's column tiles: a few hundred at most)
_counters: dict = {}


def tile_counters(device: torch.device, tiles: int):
    """The int32 arrival counters, zero between launches, that a launch on the current stream uses (one per
    tile whose pieces it counts); None when ``tiles`` is more than `COUNTERS` (the launch's caller then
    finishes apart: a second kernel sums or merges).

    Every kernel that counts zeroes its counters again before it ends, and reads them only after its PDL
    wait (the launch before it has finished), so the kernels on a stream share one buffer.

    One buffer per device and stream: launches on one stream run one after another, so they can share it;
    launches on two streams at once must not. A graph captured on a stream keeps that stream's buffer (its
    replays are ordered by the stream they are launched on: replay two graphs captured on one stream on two
    streams at once and they would share it). Created on first use (a memset, captured if the first use is).
    """
    if tiles > COUNTERS:
        return None
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    c = _counters.get(key)
    if c is None:
        c = _counters[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return c
