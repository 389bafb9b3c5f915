"""Transfer payloads and checkpoints are plain values.

Users move a `RequestState` over whatever they have (a file, a queue,
`torch.distributed.send_object_list`, Ray) and keep `Checkpoint`s around: both
pickle, deep-copy and survive `torch.save` / `torch.load(weights_only=True)`
byte for byte, and a payload's checksum is still verified when it is imported.
Payloads no transport could have produced (a header nested without end,
tensors on the meta device) are refused with an error naming the argument.
"""

from __future__ import annotations

import copy
import io
import json
import pickle
import struct
import subprocess
import sys

import pytest
import torch
from helpers import (
    assert_refused,
    full_inputs,
    full_spec,
    gdn_spec,
    nan_state,
    recurrent_inputs,
    run,
    same_bits,
)

import fnattn as fa
from fnattn.transfer import RequestState

SPECS = (full_spec(0), gdn_spec(1))
PROMPT = 6


def prefilled(rid=3):
    st = nan_state(SPECS).admit(rid).reserve({rid: PROMPT})
    batch = fa.Batch.prefill(st, {rid: PROMPT})
    _, deltas = run(fa.ModelAttention(SPECS), st, batch,
                    {0: full_inputs(SPECS[0], PROMPT), 1: recurrent_inputs(SPECS[1], PROMPT)})
    return st.apply(deltas)


def saved_and_loaded(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


COPIES = {
    "deepcopy": copy.deepcopy,
    "copy": copy.copy,
    "pickle": lambda v: pickle.loads(pickle.dumps(v)),
    "torch.save": saved_and_loaded,
}


@pytest.mark.parametrize("how", COPIES)
def test_a_payload_copies_pickles_and_torch_saves_byte_for_byte(how):
    st = prefilled()
    payload = st.export_request(3)
    back = COPIES[how](payload)
    assert isinstance(back, RequestState)
    assert back.to_bytes() == payload.to_bytes()
    if how != "copy":  # a copy of its own: writing into it leaves the original alone
        assert all(back.tensors[k].data_ptr() != t.data_ptr() for k, t in payload.tensors.items())
    # Still immutable from the user's side.
    with pytest.raises(TypeError):
        back.header["length"] = 0
    with pytest.raises(TypeError):
        back.tensors[(1, "ssm")] = torch.zeros(1)
    receiver, rid = nan_state(SPECS).admit(0).import_request(back)
    assert receiver.export_request(rid).to_bytes() == payload.to_bytes()


def test_a_tampered_round_tripped_payload_is_refused_on_import():
    payload = saved_and_loaded(prefilled().export_request(3))
    payload.tensors[(1, "ssm")].view(-1)[0] += 1  # the tensors are the caller's: the checksum guards them
    receiver = nan_state(SPECS).admit(0)
    assert_refused(receiver, lambda: receiver.import_request(payload), "checksum")
    # The saved form carries the checksum: one changed hex digit of it is refused when it is loaded.
    good = prefilled().export_request(3)
    digit = good.checksum[0]
    forged = pickle.dumps(good).replace(good.checksum.encode(), (("0" if digit != "0" else "1")
                                                                 + good.checksum[1:]).encode())
    with pytest.raises(ValueError, match="payload.*checksum"):
        pickle.loads(forged)


@pytest.mark.parametrize("how", COPIES)
def test_a_checkpoint_copies_pickles_and_torch_saves(how):
    st = prefilled()
    ck = st.checkpoint([3])
    back = COPIES[how](ck)
    assert isinstance(back, fa.Checkpoint)
    assert back.requests == ck.requests and (back.lineage, back.serial) == (ck.lineage, ck.serial)
    assert list(back.recurrent) == list(ck.recurrent)
    assert all(same_bits(back.recurrent[k], t) for k, t in ck.recurrent.items())
    with pytest.raises(TypeError):
        back.recurrent[next(iter(ck.recurrent))] = torch.zeros(1)
    want = st.export_request(3).to_bytes()
    st = st.reserve({3: 1})
    batch = fa.Batch.decode(st, [3])
    _, deltas = run(fa.ModelAttention(SPECS), st, batch,
                    {0: full_inputs(SPECS[0], 1), 1: recurrent_inputs(SPECS[1], 1, seed=1)})
    st = st.apply(deltas).restore(back)
    assert st.export_request(3).to_bytes() == want


def test_another_process_loads_them_with_weights_only_after_naming_a_public_class(tmp_path):
    """`import fnattn` loads its names on first use: naming `fnattn.RequestState` (for a payload), `State` or
    `Checkpoint` (for both; a checkpoint only restores into the State it was taken of) is all
    `torch.load(weights_only=True)` needs to rebuild them in another process."""
    st = prefilled()
    torch.save(st.export_request(3), tmp_path / "payload.pt")
    torch.save([st.export_request(3), st.checkpoint([3])], tmp_path / "both.pt")
    # One process, names in turn: RequestState, whose payload then loads; State, after which both load.
    code = (
        "import sys, torch\n"
        "import fnattn as fa\n"
        "fa.RequestState\n"
        "payload = torch.load(sys.argv[1] + '/payload.pt', weights_only=True)\n"
        "fa.State\n"
        "again, checkpoint = torch.load(sys.argv[1] + '/both.pt', weights_only=True)\n"
        "assert isinstance(checkpoint, fa.Checkpoint) and again.to_bytes() == payload.to_bytes()\n"
        "sys.stdout.buffer.write(payload.to_bytes())\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout == st.export_request(3).to_bytes()


# --------------------------------------------------------------------------- what no transport produces


def nested_header_bytes(payload, depth):
    """``payload.to_bytes()`` with a layer's dtype list replaced by ``depth`` nested lists."""
    data = payload.to_bytes()
    n = struct.unpack_from("<8sQ", data)[1]
    header = json.loads(data[16:16 + n])
    header["layers"][0]["dtypes"] = None
    head = json.dumps(header).replace("null", "[" * depth + "]" * depth).encode()
    return struct.pack("<8sQ", b"FNATTNRS", len(head)) + head + data[16 + n:]


def deep(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


def test_a_deeply_nested_header_is_refused_naming_the_payload():
    payload = prefilled().export_request(3)
    receiver = nan_state(SPECS).admit(0)
    bad = nested_header_bytes(payload, 100_000)
    assert_refused(receiver, lambda: receiver.import_request(bad), r"`payload`.*nested")
    with pytest.raises(ValueError, match=r"`payload`.*nested"):
        RequestState.from_bytes(nested_header_bytes(payload, 50))
    header, tensors = payload.flat()
    header["layers"][0]["dtypes"] = deep(100_000)
    with pytest.raises(ValueError, match=r"`payload`.*nested"):
        RequestState.from_flat(header, tensors)
    forged = RequestState({**payload.header, "layers": [{**payload.header["layers"][0], "dtypes": deep(100_000)}]},
                          payload.tensors)
    assert_refused(receiver, lambda: receiver.import_request(forged), r"`payload`.*nested")
    # A header a little off (no nesting at all) is refused by the same check of its layer signatures.
    header["layers"][0]["dtypes"] = [["dtype", 5]]
    with pytest.raises(ValueError, match=r"`payload.layers`"):
        RequestState.from_flat(header, tensors)


def test_meta_tensors_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"`device`.*meta"):
        fa.State(SPECS, num_pages=4, device="meta")
    payload = prefilled().export_request(3)
    header, tensors = payload.flat()
    ssm = [(e["layer"], e["name"]) for e in header["tensors"]].index((1, "ssm"))
    with pytest.raises(ValueError, match=r"`payload.tensors\[1, 'ssm'\]`.*meta"):
        RequestState.from_flat(header, [t.to("meta") if i == ssm else t for i, t in enumerate(tensors)])
    forged = RequestState(payload.header, {k: t.to("meta") for k, t in payload.tensors.items()})
    receiver = nan_state(SPECS).admit(0)
    assert_refused(receiver, lambda: receiver.import_request(forged), r"`payload.tensors\[0, 'k'\]`.*meta")
    with pytest.raises(ValueError, match=r"`tensors\[0, 'k'\]`"):
        fa.transfer.request_state(SPECS, 3, PROMPT, {k: t.to("meta") for k, t in payload.tensors.items()})
