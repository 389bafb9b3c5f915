"""The workspace's completion markers on CUDA: one event, recorded again at each release, still orders the
next lease after the last one's work when the two run on different streams."""

import pytest
import torch

from fnattn.workspace import Workspace

pytestmark = pytest.mark.gpu


def test_reused_event_orders_a_lease_on_another_stream(record):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ws = Workspace(torch.device("cuda"))
    flag = torch.zeros(1, device="cuda")
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    seen = []
    for i in range(4):
        with torch.cuda.stream(first):
            lease = ws.lease()
            torch.cuda._sleep(20_000_000)  # tens of ms: long past the other stream's clone, unless it waits
            flag.fill_(i + 1)
            lease.release()
        with torch.cuda.stream(second):
            after = ws.lease()  # waits on the marker the release above recorded
            got = flag.clone()
            after.release()
        torch.cuda.synchronize()
        seen.append(got.item())
    ok = seen == [1.0, 2.0, 3.0, 4.0]
    record({"case": "workspace lease on a second stream after a release on the first, 4 rounds, one event",
            "seen": seen, "ok": ok})
    assert ok, seen
