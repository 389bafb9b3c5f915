"""The GPU suites' table (benchmarks/gpu_suites.py), checked without a GPU: every committed record is rewritten by
one suite, every GPU test file is run by one, each suite fits one device call, and a part past its time limit is
stopped with its output kept."""

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_suites", ROOT / "benchmarks" / "gpu_suites.py")
suites = importlib.util.module_from_spec(_spec)
sys.modules["gpu_suites"] = suites  # its dataclasses look their module up there
_spec.loader.exec_module(suites)

PARTS = [(name, part) for name, suite in suites.SUITES.items() for part in suite.parts]


def test_every_listed_record_is_committed_or_marked_new():
    for name, path in suites.records().items():
        committed = (ROOT / path).exists()
        assert committed or name in suites.NEW, f"{path}: no committed copy, and not marked new"
        assert not (committed and name in suites.NEW), f"{path} is committed now: drop its new mark"
    assert suites.NEW <= set(suites.records()), "a new mark names no suite's record"


def test_every_committed_record_is_written_by_a_suite():
    written = set(suites.records().values())
    for folder in (suites.GPU_RESULTS, suites.RESULTS):
        for path in sorted((ROOT / folder).iterdir()):
            assert f"{folder}/{path.name}" in written, f"{folder}/{path.name}: no suite writes it"


def test_each_record_is_written_by_one_part():
    names = [name for _, part in PARTS for name in part.records()]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_every_gpu_test_file_is_run_by_a_suite():
    run = {word for _, part in PARTS for word in shlex.split(part.command)}
    for path in sorted((ROOT / "tests" / "gpu").glob("test_*.py")):
        assert f"tests/gpu/{path.name}" in run, f"tests/gpu/{path.name}: no suite runs it"


def test_every_path_a_part_names_exists():
    for name, part in PARTS:
        for word in shlex.split(part.command):
            if word.startswith(("tests/", "benchmarks/")):
                assert (ROOT / word).exists(), f"suite {name}: {word} does not exist"


def test_every_bench_part_parses_as_fnattn_bench():
    from fnattn.bench.cli import add_arguments

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    bench = shlex.split(suites.BENCH)
    for name, part in PARTS:
        words = shlex.split(part.command)
        if words[:len(bench)] == bench:
            args = parser.parse_args(words[len(bench):])
            assert args.out.startswith("{out}/"), f"suite {name}: {part.command}"


def test_each_suite_fits_one_device_call():
    for name, suite in suites.SUITES.items():
        # a fresh machine spends the rest installing the wheels and starting
        assert suite.limit_s() <= suites.DEVICE_LIMIT_S - 30, f"suite {name}: {suite.limit_s()} s of limits"


def test_list_names_every_suite_and_record_from_bash():
    done = subprocess.run(["bash", "benchmarks/gpu_suites.sh", "--list"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    for name in suites.SUITES:
        assert f"\n{name}  (" in f"\n{done.stdout}", name
    for path in suites.records().values():
        assert path in done.stdout, path


@pytest.mark.parametrize("argv", [[], ["parity", "no-such-suite"], ["--place"]])
def test_a_wrong_call_is_refused_before_anything_runs(argv, tmp_path):
    done = subprocess.run(["bash", "benchmarks/gpu_suites.sh", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "OUT": str(tmp_path)})
    assert done.returncode == 2 and "usage: gpu_suites.sh" in done.stderr
    assert not any(tmp_path.iterdir())


def test_a_part_past_its_limit_is_stopped_and_its_output_kept(tmp_path):
    part = suites.Part(1, "python -c \"import time; print('started', flush=True); time.sleep(60)\"")
    begun = time.monotonic()
    rc = suites.run_part(part, tmp_path, tmp_path / "session.log")
    assert time.monotonic() - begun < 15
    assert rc != 0
    log = (tmp_path / "session.log").read_text()
    assert "started" in log and "past its limit of 1 s" in log


def test_a_part_that_ignores_sigterm_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(suites, "GRACE_S", 0.5)
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
                "time.sleep(60)")
    begun = time.monotonic()
    rc = suites.run_part(suites.Part(1, f"python -c {shlex.quote(stubborn)}"), tmp_path, tmp_path / "log")
    assert time.monotonic() - begun < 15 and rc == -9


def test_a_part_gets_its_environment_and_output_folder(tmp_path):
    part = suites.Part(30, "python -c \"import os, sys; open(sys.argv[1], 'w').write(os.environ['WHERE'])\" "
                           "{out}/x.json", {"WHERE": "{out}/y"})
    assert part.records() == ["x.json", "y"]
    assert suites.run_part(part, tmp_path, tmp_path / "log") == 0
    assert (tmp_path / "x.json").read_text() == f"{tmp_path}/y"


def test_stamp_gives_a_record_the_switches_its_writer_did_not(tmp_path):
    bare, stamped = tmp_path / "bare.json", tmp_path / "stamped.json"
    bare.write_text(json.dumps({"command": "c"}))
    stamped.write_text(json.dumps({"command": "c", "switches": {"pdl": False}}))
    for path in (bare, stamped, tmp_path / "absent.json"):
        suites.stamp(path, {"pdl": True})
    assert json.loads(bare.read_text()) == {"command": "c", "switches": {"pdl": True}}
    assert json.loads(stamped.read_text())["switches"] == {"pdl": False}
    suites.stamp(bare, None)  # no snapshot to give: the record is left as it is
    assert json.loads(bare.read_text())["switches"] == {"pdl": True}


def test_switch_snapshot_is_the_registry_s_where_it_has_one(monkeypatch):
    import fnattn.switches

    monkeypatch.setattr(fnattn.switches, "snapshot", lambda: {"pdl": True}, raising=False)
    assert suites.switch_snapshot() == {"pdl": True}
    monkeypatch.delattr(fnattn.switches, "snapshot")
    assert suites.switch_snapshot() is None


def test_run_refuses_without_a_commit_to_name(tmp_path, monkeypatch):
    monkeypatch.setattr(suites, "commit", lambda: None)
    assert suites.run(["parity"], tmp_path / "out") == 2
    assert not (tmp_path / "out").exists()


def test_place_copies_each_found_record_over_its_committed_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(suites, "ROOT", tmp_path)
    for folder in (suites.GPU_RESULTS, suites.RESULTS):
        (tmp_path / folder).mkdir(parents=True)
    found = tmp_path / "fetched"
    found.mkdir()
    (found / "graph_gpu.json").write_text("{}")
    (found / "bench_prefill.json").write_text("[]")
    (found / "stray.json").write_text("{}")
    assert suites.place(found) == 0
    assert (tmp_path / suites.GPU_RESULTS / "graph_gpu.json").read_text() == "{}"
    assert (tmp_path / suites.RESULTS / "bench_prefill.json").read_text() == "[]"
    assert not (tmp_path / suites.RESULTS / "stray.json").exists()

