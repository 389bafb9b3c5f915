"""The switch context manager the kernels' `pdl` and fnattn's fast-path switches share (`fnattn.switches`).

Importing it imports neither torch nor triton."""

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
