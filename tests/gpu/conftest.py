"""GPU parity tests: every fast backend against the reference, recorded as JSON.

Set FNATTN_GPU_RESULTS=path.json to write every compared case (shape, backend,
errors, pass/fail) with the command and commit that produced it.
"""

import json
import os
import sys
import time

import pytest

ROWS: list[dict] = []


def pytest_configure(config):
    # A time limit (SIGTERM) ends the run like Ctrl-C, so the finished cases are still written.
    import signal

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def _append(row: dict) -> None:
    # The record counts passes from "ok": a row without it is the test's mistake, named here, not a crash at the end.
    if not isinstance(row.get("ok"), bool):
        raise ValueError(f"record: row {row.get('case')!r} needs a bool 'ok', got {row.get('ok')!r}")
    ROWS.append(row)


@pytest.fixture
def record():
    return _append


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("FNATTN_GPU_RESULTS")
    if not path or not ROWS:
        return
    import torch

    from fnattn.bench import commit

    doc = {
        "command": "FNATTN_GPU_RESULTS=... " + " ".join(["pytest"] + sys.argv[1:]),
        "commit": commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "passed": sum(r["ok"] for r in ROWS),
        "failed": sum(not r["ok"] for r in ROWS),
        "cases": ROWS,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
