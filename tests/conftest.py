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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
