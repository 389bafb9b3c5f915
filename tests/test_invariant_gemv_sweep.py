"""benchmarks/invariant_gemv_sweep.py on a tiny shape under the interpreter: the mode's config first, then the
grid's, each with its row-bits check and one time per row count (NaN without CUDA), and the plan's arguments
refused by name."""

import json

import pytest
from helpers import run_benchmark

pytest.importorskip("triton")


def _run(*args):
    return run_benchmark("invariant_gemv_sweep", *args)


def test_each_candidate_is_checked_and_timed_at_each_row_count(tmp_path):
    out = tmp_path / "sweep.json"
    done = _run("--shapes", "64x128", "--rows", "1", "3", "20", "--block-n", "32", "64", "--warps", "4",
                "--stages", "2", "--dtype", "float16", "--out", str(out))
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["case"] == "invariant gemv sweep 64x128" and line["current_keeps_row_bits"] is True
    record = json.loads(out.read_text())["records"][0]
    cands = record["candidates"]
    assert cands[0] == record["current"] and cands[0]["config"]["dot"] and cands[0]["config"]["early"] == 1
    assert {(c["config"]["block_n"], c["config"]["num_stages"]) for c in cands[1:]} == {(32, 2), (64, 2)}
    assert all(c["keeps_row_bits"] and set(c["us"]) == {"1", "3", "20"} for c in cands)
    assert record["best"] is None  # nothing timed without CUDA: no config is called best


def test_bad_arguments_are_refused_by_name():
    done = _run("--shapes", "64by128")
    assert done.returncode == 2 and "--shapes: expected NxK (e.g. 7168x1024), got '64by128'" in done.stderr
    done = _run("--warps", "0")
    assert done.returncode == 2 and "--warps: expected values >= 1, got [0]" in done.stderr
