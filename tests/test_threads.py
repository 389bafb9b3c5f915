"""The CPU thread policy: FNATTN_THREADS wins, else half the usable cores; bad values name the variable;
the CLI applies it and exits 2 with one line on a bad value; importing fnattn leaves torch's threads alone."""

import subprocess
import sys

import pytest
import torch

from fnattn.threads import apply_thread_policy, thread_count, usable_cores


def test_the_variable_wins_and_the_default_is_half_the_usable_cores():
    assert thread_count({"FNATTN_THREADS": "3"}) == 3
    assert thread_count({}) == max(1, usable_cores() // 2)
    assert thread_count({"FNATTN_THREADS": " "}) == max(1, usable_cores() // 2)


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5"])
def test_a_bad_value_names_the_variable(bad):
    with pytest.raises(ValueError, match="FNATTN_THREADS"):
        thread_count({"FNATTN_THREADS": bad})


def test_apply_sets_torch_threads():
    before = torch.get_num_threads()
    try:
        assert apply_thread_policy({"FNATTN_THREADS": "1"}) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_import_does_not_touch_threads_and_the_cli_refuses_a_bad_value():
    code = ("import torch; torch.set_num_threads(2); import fnattn, fnattn.models.qwen3_5, fnattn.threads; "
            "print(torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "2"
    r = subprocess.run([sys.executable, "-m", "fnattn", "demo", "--tokens", "1"], capture_output=True, text=True,
                       env={"FNATTN_THREADS": "zero", "PATH": ""})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "FNATTN_THREADS" in r.stderr
