"""The decode-step kernels compile for sm_90 here, without a GPU (`tests/kernels/hopper_compile.py`, in a
process of its own: the other kernel tests run under the Triton interpreter)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def _has_nvidia_backend() -> bool:
    return importlib.util.find_spec("triton.backends.nvidia") is not None


@pytest.mark.skipif(not _has_nvidia_backend(), reason="this Triton has no NVIDIA backend")
def test_decode_step_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("hopper_compile.py")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600,
                         cwd=Path(__file__).parents[2])
    lines = run.stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAILED")]
    assert run.returncode == 0 and not failed and len(lines) >= 10, run.stdout + run.stderr[-2000:]
