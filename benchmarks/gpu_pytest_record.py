"""Run pytest on the GPU machine and record every test's outcome as JSON (command, commit, device, and the
switches in force where `fnattn.switches` can give a snapshot of them).

    python benchmarks/gpu_pytest_record.py OUT.json -- tests/test_transfer.py -m gpu
"""

from __future__ import annotations

import json
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from tempfile import TemporaryDirectory

import pytest


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        print("usage: gpu_pytest_record.py OUT.json -- PYTEST_ARGS...", file=sys.stderr)
        return 2
    out, args = Path(argv[0]), argv[2:]
    with TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        rc = pytest.main([*args, f"--junitxml={xml}", "-q", "-p", "no:warnings"])
        cases = []
        for case in ET.parse(xml).getroot().iter("testcase"):
            status, why = "passed", None
            for tag in ("failure", "error", "skipped"):
                found = case.find(tag)
                if found is not None:
                    status = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    why = (found.get("message") or found.text or "")[:1500]
            if case.get("name") is None:  # the entry junit writes for an interrupted run: no test
                continue
            cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "status": status,
                          "seconds": float(case.get("time", 0)), **({"why": why} if why else {})})
    import torch

    import fnattn.switches
    from fnattn.bench import commit

    snapshot = getattr(fnattn.switches, "snapshot", None)

    doc = {"command": "python benchmarks/gpu_pytest_record.py OUT.json -- " + " ".join(args), "commit": commit(),
           "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__,
           **({"switches": snapshot()} if callable(snapshot) else {}),
           "exit_code": int(rc), **({"interrupted": True} if int(rc) == 2 else {}),
           **{s: sum(c["status"] == s for c in cases) for s in ("passed", "failed", "skipped")},
           "cases": cases}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return int(rc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
