"""Shared capability checks for accelerator backends (reasons, never exceptions)."""

from __future__ import annotations

import importlib.util

import torch


def package_missing(name: str) -> list[str]:
    return [] if importlib.util.find_spec(name) is not None else [f"package {name!r} is not installed"]


def needs_cuda(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return [f"needs a CUDA device, the model runs on {device.type}"]
    if not torch.cuda.is_available():
        return ["CUDA is not available"]
    return []


def needs_dtype(spec, allowed=(torch.bfloat16, torch.float16)) -> list[str]:
    return [] if spec.dtype in allowed else [f"dtype {spec.dtype} not in {allowed}"]
