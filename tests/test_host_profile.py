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
