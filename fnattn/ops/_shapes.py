"""Shape validation shared by the functional ops.

``expect_shape`` raises a ``ValueError`` naming the argument, the expected shape
and the actual one. ``None`` in an expected shape accepts any size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["expect_shape", "expect_float"]


def _fmt(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def expect_shape(name: str, tensor: torch.Tensor, expected: Sequence[int | None]) -> None:
    """Raise ``ValueError`` unless ``tensor.shape`` matches ``expected``."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor of shape {_fmt(expected)}, got {type(tensor).__name__}")
    actual = tuple(tensor.shape)
    ok = len(actual) == len(expected) and all(e is None or a == e for a, e in zip(actual, expected))
    if not ok:
        raise ValueError(f"{name}: expected shape {_fmt(expected)}, got {_fmt(actual)}")


def expect_float(name: str, tensor: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``tensor`` has a floating point dtype."""
    if not tensor.is_floating_point():
        raise ValueError(f"{name}: expected a floating point tensor, got dtype {tensor.dtype}")
