"""What the standalone GPU check scripts share: recording a case, and the run that writes the report.

Each script passes its own parity and timing functions; a failing case is a
FAIL row, never a crash, and a time limit (SIGTERM) still writes the rows
finished so far.
"""

import argparse
import json
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import triton


def record(results, kernel, case, fn, *, errors=(), fmt=".3e", widths=(24, 60)):
    """Run one case ``fn() -> dict``, append its row and print it with the ``errors`` fields."""
    t0 = time.time()
    try:
        row = dict(kernel=kernel, case=case, **fn())
    except Exception as e:  # one failing case must not stop the rest
        row = dict(kernel=kernel, case=case, passed=False, error=f"{type(e).__name__}: {e}",
                   trace=traceback.format_exc(limit=3))
    row["seconds"] = round(time.time() - t0, 3)
    results.append(row)
    status = "PASS" if row.get("passed") else "FAIL"
    errs = " ".join(f"{k}={row[k]:{fmt}}" for k in errors if k in row)
    print(f"{status} {kernel:{widths[0]}s} {case:{widths[1]}s} {errs} {row.get('error', '')}", flush=True)


def main(description, parity, timing, *, flags=()):
    """Parse ``--out``, ``--skip-parity``, ``--skip-timing`` and ``flags`` ((flag, help) pairs),
    run ``parity(rows)`` and ``timing(rows, args)``, write the JSON report; exit 1 on a FAIL row."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="path of the JSON results")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    for flag, help_text in flags:
        ap.add_argument(flag, action="store_true", help=help_text)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    torch.manual_seed(0)
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, parity=[], timing=[])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    try:
        if not args.skip_parity:
            parity(report["parity"])
        if not args.skip_timing:
            timing(report["timing"], args)
    finally:
        failed = [r for r in report["parity"] if not r.get("passed")]
        report["summary"] = dict(parity_cases=len(report["parity"]), parity_failed=len(failed))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"parity: {len(report['parity']) - len(failed)}/{len(report['parity'])} PASS; wrote {args.out}")
    sys.exit(1 if failed else 0)
