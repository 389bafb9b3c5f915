import os
import subprocess
import sys

import pytest
import torch
from jaxtyping import Float
from torch import Tensor

from fnattn.checks import CHECKS_ENABLED, checked
from fnattn.cli import main


def test_demo_runs_and_explains(capsys):
    assert main(["demo", "--tokens", "4", "--prompt", "hi"]) == 0
    out = capsys.readouterr().out
    assert "generated 4 tokens" in out and "tokens/s" in out
    assert "backend" in out and "sdpa" in out and "pages free after release: " in out


def test_demo_rejects_bad_token_count():
    with pytest.raises(SystemExit):
        main(["demo", "--tokens", "0"])


def test_checks_are_on_in_tests_and_catch_shape_mismatch():
    assert CHECKS_ENABLED

    @checked
    def add(a: Float[Tensor, "T H"], b: Float[Tensor, "T H"]) -> Float[Tensor, "T H"]:
        return a + b

    add(torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(Exception, match="T"):
        add(torch.zeros(2, 3), torch.zeros(3, 3))


def test_checks_off_return_the_function_itself():
    code = ("from fnattn.checks import checked\n"
            "f = lambda x: x\n"
            "assert checked(f) is f\n")
    env = {**os.environ, "FNATTN_CHECKS": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_demo_mtp_prints_acceptance_and_tokens_per_step(capsys):
    assert main(["demo", "--mtp", "2", "--tokens", "6", "--recovery", "replay"]) == 0
    out = capsys.readouterr().out
    assert "mean accepted drafts per step" in out and "tokens per step" in out
    assert "random weights, so few or no drafts are accepted" in out  # 0 accepted is expected here, and said
    with pytest.raises(SystemExit):
        main(["demo", "--mtp", "-1"])


def test_demo_samples_with_a_seed_plain_and_speculative(capsys):
    def ids(*argv):
        assert main(["demo", "--tokens", "8", *argv]) == 0
        out = capsys.readouterr().out
        return [line for line in out.splitlines() if line.startswith("generated ")][0]

    for mtp in ([], ["--mtp", "2"]):
        a, b = ids(*mtp, "--temperature", "0.9", "--seed", "4"), ids(*mtp, "--temperature", "0.9", "--seed", "4")
        assert a == b and a != ids(*mtp)  # the seed repeats it; greedy differs
    assert main(["demo", "--tokens", "4", "--temperature", "1"]) == 0
    assert "sampled, batch 1)" in capsys.readouterr().out


def test_demo_family_reads_the_prompt_and_logs_progress_without_carriage_returns(capsys):
    assert main(["demo", "--model", "qwen3_5", "--tokens", "3", "--prompt", "ab"]) == 0
    out = capsys.readouterr()
    assert "'ab' as token ids [97, 98]" in out.out
    assert "\r" not in out.err and "decode 3/3" in out.err


def test_version_and_one_line_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("fnattn ")
    with pytest.raises(SystemExit) as e:
        main(["demo", "--tokens", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--tokens" in err
