"""Shape checking: one dimension glossary and one switch.

Every public function that takes tensors is annotated with jaxtyping shapes
using the dimension names below. Whether those annotations are *checked* is
decided once, when a function is decorated: with ``FNATTN_CHECKS=1`` in the
environment (the test suite sets it) `checked` wraps the function with
``jaxtyped(typechecker=beartype)``; otherwise it returns the function itself,
so an unchecked call costs nothing.

Dimension glossary
------------------
=========  ==============================================================
``T``      new tokens in this step, all requests packed together
``Tl``     rows a step returns logits for: ``T``, or ``B`` when ``batch.logits_for == "last"``
``B``      requests in this step
``B1``     ``B + 1`` (cumulative offsets)
``Hq``     query heads
``Hkv``    key/value heads of full attention
``H``      heads of MLA, GDN value heads, KDA heads
``Hk``     GDN query/key heads
``D``      query/key head dim
``Dv``     value head dim
``R``      MLA latent rank (``kv_lora_rank``)
``Dr``     MLA rope dims
``Di``     indexer head dim
``K``      recurrent key dim; ``V`` recurrent value dim
``C``      conv channels; ``W1`` conv window length (``kernel - 1``)
``L``      layers in one pool
``P``      pages; ``S`` tokens per page; ``M`` pages per request (max)
``N``      recurrent state slots
=========  ==============================================================
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

#: Read once at import. Changing the environment later has no effect on
#: functions that were already decorated, by design.
CHECKS_ENABLED: bool = os.environ.get("FNATTN_CHECKS", "0") not in ("", "0", "false", "False")


def checked(fn: F) -> F:
    """Turn on jaxtyping + beartype checks for ``fn`` when ``FNATTN_CHECKS=1``."""
    if not CHECKS_ENABLED:
        return fn
    from beartype import beartype
    from jaxtyping import jaxtyped

    wrapped = jaxtyped(typechecker=beartype)(fn)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        # Checks are host-side Python; under torch.compile they would only
        # add graph breaks, so the traced function runs unchecked.
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        return wrapped(*args, **kwargs)

    run.__fnattn_checked__ = True
    return run  # type: ignore[return-value]


_STRIDED = torch.strided


def fail(owner: str, name: str, expected: str, actual: object) -> None:
    """Raise the one error format used for bad arguments and fields."""
    raise ValueError(f"{owner}: `{name}` must be {expected}, got {actual!r}")


def check_tensor(where: str, name: str, t, shape: tuple, dtype: torch.dtype, device) -> None:
    """``t`` is a dense tensor of exactly ``shape``, ``dtype`` and ``device`` (the error names it)."""
    # Every layer's inputs pass here every step: the usual case in one test, then each check naming what failed.
    if isinstance(t, torch.Tensor) and t.layout is _STRIDED and t.dtype is dtype and t.shape == shape \
            and t.device == device:
        return
    if not isinstance(t, torch.Tensor):
        fail(where, name, "a torch.Tensor", type(t).__name__)
    if t.layout != torch.strided:
        fail(where, name, "a dense (strided) tensor", t.layout)
    if t.shape != tuple(shape):  # torch.Size is a tuple: no copy of it to compare
        fail(where, name, f"shape {tuple(shape)}", tuple(t.shape))
    if t.dtype != dtype:
        fail(where, name, f"dtype {dtype}", t.dtype)
    if t.device != device:
        fail(where, name, f"a tensor on {device}", t.device)


def _fmt_shape(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def expect_shape(name: str, tensor: torch.Tensor, expected: Sequence[int | None]) -> None:
    """Raise ``ValueError`` unless ``tensor.shape`` matches ``expected``."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor of shape {_fmt_shape(expected)}, got {type(tensor).__name__}")
    actual = tuple(tensor.shape)
    ok = len(actual) == len(expected) and all(e is None or a == e for a, e in zip(actual, expected))
    if not ok:
        raise ValueError(f"{name}: expected shape {_fmt_shape(expected)}, got {_fmt_shape(actual)}")


def expect_float(name: str, tensor: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``tensor`` has a floating point dtype."""
    if not tensor.is_floating_point():
        raise ValueError(f"{name}: expected a floating point tensor, got dtype {tensor.dtype}")
