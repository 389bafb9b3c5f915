"""benchmarks/host_profile.py on the tiny model: decode and prefill steps profiled on the host (the census of
host waits needs CUDA and is not run here)."""

import sys

import pytest
from helpers import benchmark_module


def _module():
    return benchmark_module("host_profile")


@pytest.mark.parametrize("mode, head, hot", [
    ([], "tiny B1 ctx64 decode: eager", "run_step"), (["--prefill"], "tiny prefill B1 P64: eager", "run_step"),
    (["--prefill", "--captured"], "tiny captured prefill B1 P64: captured", "prefill_graph.py")])
def test_a_tiny_profile_names_its_steps_and_the_hot_functions(mode, head, hot, monkeypatch, capsys):
    import torch

    torch.set_num_threads(1)
    monkeypatch.setattr(sys, "argv", ["host_profile.py", "--shape", "tiny", "--prompt", "64", "--steps", "2",
                                      "--rows", "5", *mode])
    _module().main()
    out = capsys.readouterr().out
    assert f"qwen3_5 {head} step" in out and "2 steps" in out
    assert "Ordered by: internal time" in out and "Ordered by: cumulative time" in out
    assert hot in out  # the driver's step (or the prefill runner's) is in the cumulative list


def test_stubbed_launches_time_the_cuda_paths_host_work_on_this_cpu():
    """--stub-launches runs in a process of its own (it stubs the interpreter's kernels for good): the tiny
    model's eager decode through the Triton backends and fused paths, every launch counted, none run."""
    import os
    import re
    import subprocess

    import torch

    if torch.cuda.is_available():
        pytest.skip("--stub-launches is for a machine without CUDA")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "benchmarks/host_profile.py", "--shape", "tiny", "--prompt", "32",
                           "--steps", "1", "--rows", "3", "--stub-launches"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r"stubbed launches: eager step ([\d.]+) ms .*?, (\d+) launches a step", done.stdout)
    assert found and float(found[1]) > 0 and int(found[2]) > 0, done.stdout[:2000]
    assert "skinny_linear" in done.stdout or "fused.py" in done.stdout  # the CUDA paths' wrappers ran
    refused = subprocess.run([sys.executable, "benchmarks/host_profile.py", "--shape", "tiny", "--stub-launches",
                              "--prefill"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--stub-launches: expected" in refused.stderr
