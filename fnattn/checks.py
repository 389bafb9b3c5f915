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
from collections.abc import Callable
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

    return run  # type: ignore[return-value]


def fail(owner: str, name: str, expected: str, actual: object) -> None:
    """Raise the one error format used for bad arguments and fields."""
    raise ValueError(f"{owner}: `{name}` must be {expected}, got {actual!r}")
