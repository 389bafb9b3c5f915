"""The tile overrides the kernels' ``configured`` blocks share (sweeps and A/B timings pick tiles with them).

Importing it imports neither torch nor triton."""

import contextlib


@contextlib.contextmanager
def overridden(stack: list, fields: dict, ranges: dict):
    """Within this block ``stack[-1]`` holds ``fields`` over the enclosing block's. ``ranges`` maps each field a
    kernel takes to ``(lo, hi, power_of_two)``; any other field, or a value out of its range, is refused,
    naming it."""
    for name, v in fields.items():
        if name not in ranges:
            raise ValueError(f"configured: {name}: expected one of {', '.join(ranges)}")
        lo, hi, pow2 = ranges[name]
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi or (pow2 and v & (v - 1)):
            want = f"a power of two in {lo}..{hi}" if pow2 else f"an int in {lo}..{hi}"
            raise ValueError(f"configured: {name}: expected {want}, got {v!r}")
    stack.append({**stack[-1], **fields})
    try:
        yield
    finally:
        stack.pop()
