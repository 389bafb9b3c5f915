"""benchmarks/gemv_row_tiles.py on a tiny shape under the interpreter: one JSON line a shape, each width's bits
against the first's, and the mode's row tile as it was afterwards."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


def test_each_width_reports_its_bits_and_the_row_tile_is_restored():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    code = ("import runpy, sys; sys.argv = ['gemv_row_tiles.py', '--rows', '20', '--shapes', '40x128',"
            " '--dtype', 'float16']; from fnattn.kernels import skinny_linear as m\n"
            "try:\n    runpy.run_path('benchmarks/gemv_row_tiles.py', run_name='__main__')\n"
            "except SystemExit:\n    pass\nprint(m.INVARIANT_ROWS)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    line, restored = out.stdout.strip().splitlines()
    record = json.loads(line)
    assert (record["N"], record["K"], record["rows"]) == (40, 128, 20)
    assert set(record["widths"]) == {"16", "32", "64"}
    assert record["widths"]["16"]["same_bits_as_first"] is True
    assert restored == "16"


def test_folds_report_their_bits_at_each_width():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    code = ("import runpy, sys; sys.argv = ['gemv_row_tiles.py', '--rows', '20', '--shapes', '64x128',"
            " '--dtype', 'float16', '--widths', '16', '32', '--folds']\n"
            "try:\n    runpy.run_path('benchmarks/gemv_row_tiles.py', run_name='__main__')\n"
            "except SystemExit:\n    pass")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    record = json.loads(out.stdout.strip().splitlines()[-1])
    folds = record["widths"]["16"]["folds_same_bits_as_first"]
    assert set(folds) == {"norm", "rms", "add_squares", "silu_mul", "residual", "swiglu", "gating"}
    assert all(folds.values())  # the first width against itself
    assert set(record["widths"]["32"]["folds_same_bits_as_first"]) == set(folds)
