"""Switches: a default that a ``with`` block sets for its duration, blocks nesting (the last one set wins).

A switch is a list whose last element is in force: ``[default]`` at import, one more element per open
block (`switched`). The fast paths keep theirs beside the code they steer (`fnattn.models.fused`, the sparse
MLA backend, `fnattn.kernels.pdl`); the one context manager lives in `fnattn.kernels` (which imports nothing
from fnattn), in a module that imports neither torch nor triton.
"""

from .kernels._switch import switched

__all__ = ["switched"]
