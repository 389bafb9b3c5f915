"""Request transfer between two processes over torch.distributed (gloo, loopback, bounded time).

One spawn of three processes: rank 0 prefills and sends the request, rank 1
receives, imports and decodes. Then rank 1 waits for a second request from
rank 0, which has exited, and for one from rank 2, alive but silent: both
must end in a clear timeout error with nothing allocated.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fnattn as fa
from fnattn.transfer import recv_request, send_request

FAMILY = "qwen3_5"  # hybrid: per-token (full attention) and per-request (GDN) storage both travel
DEADLINE = 60.0  # the whole spawn, in seconds
RECV_TIMEOUT = 3.0
SILENT_TIMEOUT = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(device="cpu"):
    from test_transfer import Model  # the tests' directory is on the spawned process's path too

    return Model(FAMILY, device=device)


def _follow(model):
    from test_transfer import prompt

    return prompt(model, 3, seed=1)  # the tokens both sides decode after the prompt


def _sender(model, out):
    from test_transfer import sender

    a, _ = sender(model)
    payload = a.export_request(7)
    send_request(payload, 1)
    _, out["want"] = model.decode(a, 7, _follow(model))
    out["checksum"] = payload.checksum


def _receiver(model, out, device):
    from helpers import bookkeeping, snapshot, unchanged
    from test_transfer import receiver

    b = receiver(model, device=device)  # bytes come through host memory, rows go to ``device``
    payload = recv_request(0, timeout=RECV_TIMEOUT)
    b, rid = b.import_request(payload)
    b, got = model.decode(b, rid, _follow(model))
    out["got"] = got.cpu()
    out.update(rid=rid, checksum=payload.checksum)
    snap, book = snapshot(b), bookkeeping(b)
    # rank 0 exits after its one send, without the request this receiver waits for now
    out["exited"] = _expect_timeout(0, RECV_TIMEOUT)
    # rank 2 is alive but never sends: a plain timeout. (A gloo timeout closes the connection to that
    # peer, so each case needs its own peer.)
    out["silent"] = _expect_timeout(2, SILENT_TIMEOUT)
    out["untouched"] = unchanged(b, snap) and bookkeeping(b) == book and b.is_live


def _expect_timeout(src: int, timeout: float) -> tuple[str, float]:
    """``-> (the error's message, seconds waited)`` of a `recv_request` that should time out."""
    start = time.monotonic()
    try:
        recv_request(src, timeout=timeout)
        message = "received a request"
    except fa.TransferTimeoutError as e:
        message = str(e)
    return message, time.monotonic() - start


def _worker(rank: int, port: int, result_dir: str, device: str) -> None:
    torch.set_num_threads(1)
    out: dict = {}
    done = os.path.join(result_dir, "receiver_done")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                                timeout=datetime.timedelta(seconds=20))
        if rank == 0:
            _sender(_model(), out)
        elif rank == 1:
            _receiver(_model(device), out, device)
        else:  # the silent peer: stays connected, sends nothing, until the receiver is done
            stop = time.monotonic() + DEADLINE
            while not os.path.exists(done) and time.monotonic() < stop:
                time.sleep(0.05)
    except Exception as e:  # reported to the test instead of a bare exit code
        out["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    if rank == 1:
        open(done, "w").close()
    # No destroy_process_group: peers leaving abruptly is the point of the test.
    os._exit(0)


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def two_processes(request, tmp_path_factory):
    """``-> (rank 0's results, rank 1's results, the receiver's device)``."""
    result_dir = tmp_path_factory.mktemp("transfer_dist")
    ctx = mp.start_processes(_worker, args=(_free_port(), str(result_dir), request.param), nprocs=3, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + DEADLINE
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"the two processes did not finish within {DEADLINE} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = []
    for rank in (0, 1):
        with open(result_dir / f"rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return (*results, request.param)


def test_a_request_sent_to_another_process_decodes_the_same_logits(two_processes):
    sent, got, device = two_processes
    assert "error" not in sent and "error" not in got, (sent.get("error"), got.get("error"))
    assert got["rid"] == 7 and got["checksum"] == sent["checksum"]
    tol = 1e-6 if device == "cpu" else 2e-3  # a GPU receiver decodes with other kernels
    torch.testing.assert_close(got["got"], sent["want"], atol=tol, rtol=0 if device == "cpu" else tol)


def test_a_receiver_whose_sender_exits_or_stays_silent_times_out_and_allocates_nothing(two_processes):
    _, got, _ = two_processes
    for case, src, limit in (("exited", 0, RECV_TIMEOUT), ("silent", 2, SILENT_TIMEOUT)):
        message, waited = got[case]
        assert message.startswith(f"recv_request: no header from rank {src} within timeout={limit} s"), message
        assert "the sender died or never sent; nothing was allocated" in message
        assert waited < limit + 5, (case, waited)
    assert got["silent"][1] >= 0.9 * SILENT_TIMEOUT  # it did wait for the sender
    assert got["untouched"]
