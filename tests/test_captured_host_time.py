"""benchmarks/captured_host_time.py: a captured step's host time on any machine (graphs that launch nothing)."""

import json

from helpers import run_benchmark


def test_it_counts_a_speculative_steps_host_work_against_a_decode_steps(tmp_path):
    out = tmp_path / "host.json"
    done = run_benchmark("captured_host_time", "--batch", "1", "2", "--steps", "10", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    records = json.loads(out.read_text())["records"]
    assert [r["batch"] for r in records] == [1, 2]
    for r in records:
        assert r["decode_us"] > 0 and r["speculative_us"] > 0
        # k = 3: two proposal replays, the verify and the catch-up, each more than a decode step's own work
        assert r["speculative_calls"] > 2 * r["decode_calls"] > 0
        assert r["speculative_ops"] > r["decode_ops"] > 0


def test_a_bad_count_exits_2_naming_it():
    done = run_benchmark("captured_host_time", "--draft", "0")
    assert done.returncode == 2 and "--draft" in done.stderr and "Traceback" not in done.stderr
