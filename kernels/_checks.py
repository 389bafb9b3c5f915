"""Argument checks the kernel modules share: each error names the argument, what was expected and what came."""

import torch


def check_like(name: str, t, shape, ref: torch.Tensor, ref_name: str) -> None:
    """``t`` is a tensor of ``shape`` (None: any) in ``ref``'s dtype and on its device."""
    if not isinstance(t, torch.Tensor) or (shape is not None and tuple(t.shape) != tuple(shape)):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected shape {shape}, got {got}")
    if t.dtype != ref.dtype:
        raise ValueError(f"{name}: expected dtype {ref.dtype} ({ref_name}'s), got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name}: expected device {ref.device} ({ref_name}'s), got {t.device}")


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are views of one storage (on one device; empty tensors share nothing)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return False
    # Where each storage begins, from the view's own pointer and offset: asked before every decode-step GEMV,
    # and `untyped_storage()` builds a Python object for each tensor.
    return a.data_ptr() - a.storage_offset() * a.element_size() == b.data_ptr() - b.storage_offset() * b.element_size()


def check_finite_float(name: str, value) -> None:
    """``value`` is a finite Python number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        raise ValueError(f"{name}: expected a finite Python float, got {value!r}")
