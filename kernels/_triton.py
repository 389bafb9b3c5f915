"""Optional triton import shared by the kernel modules.

Kernel modules must import without triton so that their pure-torch references
stay usable on machines without it; a kernel called there raises ImportError.
"""

import functools

from ._switch import declare, switched

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

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
    gdc_wait = gdc_launch_dependents = _Anything()


def require_triton():
    if not HAS_TRITON:
        raise ImportError(
            "this kernel needs triton (pip install triton); "
            "the *_ref functions beside it work without it"
        )


def interpreted(kernel) -> bool:
    """Whether ``kernel`` runs in Triton's interpreter (TRITON_INTERPRET=1 when it was defined): CPU tensors,
    no libdevice."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_runnable(owner: str, name: str, t, kernel) -> None:
    """``t`` can go to ``kernel``: a CUDA tensor, or any when the kernel is interpreted (TRITON_INTERPRET=1
    when it was defined)."""
    if t.device.type != "cuda" and not interpreted(kernel):
        raise ValueError(f"{owner}: {name}: expected a CUDA tensor (or TRITON_INTERPRET=1), got device {t.device}")


def check_rows(owner: str, name: str, t, layout: str, kernel) -> None:
    """``t`` is a bf16 / fp16 / fp32 tensor of ``layout``'s dims (``"[T, D]"``), with a unit stride along its
    last dim (its rows may be strided), that ``kernel`` can take (`check_runnable`)."""
    import torch

    dims = layout.count(",") + 1
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{owner}: {name}: expected a {layout} tensor, got {got}")
    if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{owner}: {name}: expected dtype bfloat16, float16 or float32, got {t.dtype}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{owner}: {name}: expected unit stride along its last dim, got strides {t.stride()}")
    check_runnable(owner, name, t, kernel)


def next_pow2(n):
    return 1 << max(0, int(n) - 1).bit_length()


@functools.cache
def num_sms(device_index):
    """SM count of a CUDA device; an H100/H200-like 132 when there is none."""
    import torch

    if device_index is None or not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# On: the whole Qwen3.5-0.8B graph step on the H200 took 1285 us against 1437 without at batch 1 and 1521 against
# 1668 at batch 8, the variants' steps interleaved (benchmarks/results/bench_switches_ab_dd3d3d6.json; off took
# 1.10x / 1.09x as long at de9b969, bench_switches_ab.json); replays under it are the plain step's bits
# (tests/gpu_results/graph_pdl_gpu.json, graph_pdl_kimi_gpu.json).
_PDL = declare(
    "pdl", True, __name__,
    on="fnattn's decode kernels launch with programmatic dependent launch where the device has it (Hopper on)",
    off="each kernel launches after the one before it ends",
    why="the whole Qwen3.5-0.8B graph step on the H200 took 0.89x / 0.91x as long with it at batch 1 / 8, "
        "the same bits; off is the plain launch order, for comparison and devices without PDL")


def pdl(enabled: bool):
    """Within this block the kernels here launch with programmatic dependent launch (on by default) where
    the device has it (`pdl_supported`): a launch may start while the one before it on the stream finishes,
    load what no launch writes (weights), then wait (``gdc_wait``) for its inputs. A graph captured inside
    keeps the overlap: the capture records the launches' programmatic edges."""
    return switched(_PDL, "pdl", enabled)


def pdl_launch(device) -> bool:
    """Whether a kernel launched now on ``device`` launches with PDL (`pdl` on, and `pdl_supported`)."""
    return _PDL[-1] and pdl_supported(device)


def pdl_supported(device) -> bool:
    """Whether kernels on ``device`` may be launched with programmatic dependent launch (PDL): a CUDA device
    of compute capability 9.0 or later (Hopper), not the interpreter (which has no grid dependency control).

    A kernel launched so may start while the launch before it is still finishing; it must call ``gdc_wait()``
    before it reads anything an earlier launch writes, or writes anything at all."""
    if getattr(device, "type", None) != "cuda":
        return False
    if device.index is None:
        import torch

        return _pdl_on_cuda(torch.cuda.current_device())
    return _pdl_on_cuda(device.index)


@functools.cache  # asked before every decode-step launch: the answer for a device does not change
def _pdl_on_cuda(device_index: int) -> bool:
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capability(device_index) >= (9, 0)


@functools.cache
def _capability(device_index):
    import torch

    return torch.cuda.get_device_capability(device_index)
