"""benchmarks/conv_short_tiles.py under the interpreter: each case's token tile with the switch off and on, the
same bits, NaN times without CUDA; bad sizes refused by name."""

import json

import pytest
from helpers import run_benchmark

pytest.importorskip("triton")


def _run(*args):
    return run_benchmark("conv_short_tiles", *args)


def test_each_case_compares_the_tiles_bit_for_bit(tmp_path):
    out = tmp_path / "conv.json"
    done = _run("--batch", "2", "--channels", "256", "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert [r["per_position_states"] for r in rows] == [True, False]
    assert all(r["same_bits"] and r["token_tile_on"] == 4 and r["token_tile_off"] == 16 for r in rows)
    assert len(json.loads(out.read_text())["records"]) == 2


def test_bad_sizes_are_refused_by_name():
    done = _run("--tokens", "0")
    assert done.returncode == 2 and "--batch, --tokens, --channels: expected values >= 1" in done.stderr
