"""Optional triton import shared by the kernel modules.

Kernel modules must import without triton so that their pure-torch references
stay usable on machines without it; a kernel called there raises ImportError.
"""

import functools

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

    class _Anything:
        """Stands in for `triton` / `tl` at import time (decorators, annotations)."""

        def __getattr__(self, name):
            return _Anything()

        def __call__(self, *args, **kwargs):
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return _MissingKernel(args[0].__name__)
            return _Anything()

    class _MissingKernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            require_triton()

        def __call__(self, *args, **kwargs):
            require_triton()

    triton = _Anything()
    tl = _Anything()


def require_triton():
    if not HAS_TRITON:
        raise ImportError(
            "this kernel needs triton (pip install triton); "
            "the *_ref functions beside it work without it"
        )


def next_pow2(n):
    return 1 << max(0, int(n) - 1).bit_length()


@functools.cache
def num_sms(device_index):
    """SM count of a CUDA device; an H100/H200-like 132 when there is none."""
    import torch

    if device_index is None or not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count
