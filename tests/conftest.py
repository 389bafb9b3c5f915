"""Test-suite setup: shape checks on (decided at decoration time, so set first)."""

import os

os.environ.setdefault("FNATTN_CHECKS", "1")

import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each worker of `pytest -n 2` takes one core: two torch threads per worker on two cores would contend.
    torch.set_num_threads(1)

if not torch.cuda.is_available():
    # Triton reads this when a kernel module is first imported: set it before any test imports one.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _row_independent_interpreted_dot():
    """The interpreter's ``tl.dot`` is numpy's matmul, and OpenBLAS's sgemm kernels for some CPUs (AMD Zen among
    them) round a row differently by where it sits in the product, which a GPU's MMA does not: the invariance
    tests would then test the BLAS build. Each output element here is the same sequential fp32 sum over K."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = interpreter.InterpreterBuilder
    fp8_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return fp8_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        products = a.data.astype(acc)[..., :, :, None] * b.data.astype(acc)[..., None, :, :]  # [.., M, K, N]
        return interpreter.TensorHandle(products.sum(axis=-2, dtype=acc) + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
    del np


if os.environ.get("TRITON_INTERPRET") == "1":
    _row_independent_interpreted_dot()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
