"""Switches: a default that a ``with`` block sets for its duration, blocks nesting (the last one set wins).

A switch is a list whose last element is in force: ``[default]`` at import, one more element per open
block. The fast paths keep theirs beside the code they steer (`fnattn.models.fused`, the sparse MLA
backend); `fnattn.kernels` keeps its own (it imports nothing from fnattn).
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def switched(stack: list, name: str, enabled):
    """Within this block ``stack[-1]`` is ``enabled`` (a bool: anything else is refused, naming ``name``)."""
    if not isinstance(enabled, bool):
        raise ValueError(f"{name}: expected True or False, got {enabled!r}")
    stack.append(enabled)
    try:
        yield
    finally:
        stack.pop()
