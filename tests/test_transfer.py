"""Request transfer (fnattn.transfer): prefill on one State, decode on another.

Every model family decodes the same logits after a hand-off as without one;
a kind the transfer code never names (docs/variants/gated_linear.py) moves
too; every corrupted, truncated or mismatched payload is refused with both
States byte-identical afterwards.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import re
import sys
import types

import pytest
import torch
from fnattn.models.registry import random_model
from helpers import assert_refused, bookkeeping, registry_scope, same_bits, snapshot, unchanged

import fnattn as fa
from fnattn.models import tiny
from fnattn.transfer import RequestState

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAMILIES = ("tiny", "qwen3_5", "qwen3_next", "deepseek_v3", "deepseek_v32", "glm5", "kimi_linear")
PROMPT = 9
DECODE = 3


class Model:
    """specs, vocab and ``step(session, tokens) -> (logits, deltas)`` of one family's tiny random model."""

    def __init__(self, name: str, dtype=torch.float32, device="cpu"):
        if name == "tiny":
            cfg = tiny.TinyConfig(hidden_size=32, num_layers=2, num_q_heads=4, head_dim=8, intermediate_size=64,
                                  dtype=dtype)
            params = tiny.init_params(cfg, device=device)
            self.specs, self.vocab = tiny.layer_specs(cfg), cfg.vocab_size
            self.step = lambda s, t: tiny.step(params, s, t)
        else:
            m = random_model(name, seed=1, dtype=dtype, device=device)
            self.specs, self.vocab = m.specs, m.config.vocab_size
            self.step = lambda s, t: m.step(m.params, s, t)
        self.attn = fa.ModelAttention(self.specs, device=device)

    def run(self, state, batch, tokens):
        with self.attn.session(state, batch) as s:
            logits, deltas = self.step(s, torch.tensor(tokens, device=state.device))
        return state.apply(deltas), logits

    def prefill(self, state, rid, tokens):
        state = state.reserve({rid: len(tokens)})
        return self.run(state, fa.Batch.prefill(state, {rid: len(tokens)}), tokens)

    def decode(self, state, rid, tokens):
        """Feed ``tokens`` one decode step each; ``-> (state, logits of every step)``."""
        out = []
        for t in tokens:
            state = state.reserve({rid: 1})
            state, logits = self.run(state, fa.Batch.decode(state, [rid]), [t])
            out.append(logits)
        return state, torch.cat(out)


def prompt(model, n=PROMPT, seed=0):
    return torch.randint(0, model.vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def sender(model, *, rid=7, page_size=4, n=PROMPT):
    st = fa.State(model.specs, num_pages=12, page_size=page_size, max_requests=2, recurrent_ring=2).admit(rid)
    st, logits = model.prefill(st, rid, prompt(model, n))
    return st, logits


def receiver(model, **kw):
    """A NaN-filled State with another page size and ring, one request already in it (so the import
    lands in another slot and other pages than the sender's)."""
    kw = {"num_pages": 10, "page_size": 8, "max_requests": 3, "recurrent_ring": 3, **kw}
    st = fa.State(model.specs, fill=float("nan"), **kw).admit(0)
    return st.reserve({0: 5})


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_after_transfer_equals_decode_without(family):
    model = Model(family)
    a, last = sender(model)
    follow = [int(last[-1].argmax())] + prompt(model, DECODE - 1, seed=1)
    _, want = model.decode(a, 7, follow)

    a, _ = sender(model)
    snap, book = snapshot(a), bookkeeping(a)
    payload = RequestState.from_bytes(a.export_request(7).to_bytes())  # through bytes, as between hosts
    assert unchanged(a, snap) and bookkeeping(a) == book, "export changed the sender"
    b, rid = receiver(model).import_request(payload)
    assert rid == 7 and b.request(7).length == PROMPT
    b, got = model.decode(b, 7, follow)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_payload_is_independent_of_page_size_layout_and_slot():
    model = Model("qwen3_5")
    a4, _ = sender(model, page_size=4)
    a16, _ = sender(model, page_size=16)
    assert a4.export_request(7).to_bytes() == a16.export_request(7).to_bytes()
    # Imported, then exported again from other pages, slot and ring: the same bytes.
    b, _ = receiver(model).import_request(a4.export_request(7))
    assert b.export_request(7).to_bytes() == a4.export_request(7).to_bytes()
    b, rid = b.import_request(a4.export_request(7), request_id=9)
    assert rid == 9 and b.request(9).slot != b.request(7).slot


def test_length_zero_and_page_boundary_requests_transfer():
    model = Model("qwen3_5")
    for n in (0, 4, 8):  # nothing cached; exactly one and two full pages of the sender
        a = fa.State(model.specs, num_pages=4, page_size=4, max_requests=1).admit(3)
        if n:
            a, _ = model.prefill(a, 3, prompt(model, n))
        b, _ = receiver(model).import_request(a.export_request(3))
        assert b.request(3).length == n and len(b.request(3).pages) == -(-n // 8)
        assert b.export_request(3).to_bytes() == a.export_request(3).to_bytes()


# --------------------------------------------------------------------------- a kind the transfer code never names


def gated_linear():
    spec = importlib.util.spec_from_file_location("gated_linear", ROOT / "docs" / "variants" / "gated_linear.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gated_linear"] = module
    spec.loader.exec_module(module)
    return module


def test_a_one_file_kind_transfers():
    with registry_scope():
        gl = gated_linear()
        spec = fa.LayerSpec(0, gl.GatedLinearConfig(num_heads=2, head_k_dim=4, head_v_dim=3), torch.float32)
        attn = fa.ModelAttention([spec])
        gen = torch.Generator().manual_seed(0)

        def inputs(T):
            return gl.GatedLinearInputs(q=torch.randn(T, 2, 4, generator=gen), k=torch.randn(T, 2, 4, generator=gen),
                                        v=torch.randn(T, 2, 3, generator=gen), g=-torch.rand(T, 2, generator=gen))

        def step(state, batch, inp):
            with attn.session(state, batch) as s:
                out, w = s.forward(0, inp)
            return state.apply(fa.StepDeltas.collect(batch, [w])), out.o

        first, then = inputs(6), inputs(1)
        a = fa.State([spec], num_pages=4, page_size=4, max_requests=1).admit(0).reserve({0: 7})
        a, _ = step(a, fa.Batch.prefill(a, {0: 6}), first)
        payload = a.export_request(0)
        assert [(e["layer"], e["name"], e["space"]) for e in payload.header["tensors"]] == [(0, "state", "request")]
        _, want = step(a, fa.Batch.decode(a, [0]), then)
        b = fa.State([spec], num_pages=2, page_size=8, max_requests=2, recurrent_ring=3, fill=float("nan"))
        b, _ = b.admit(5).import_request(payload)
        b = b.reserve({0: 1})
        _, got = step(b, fa.Batch.decode(b, [0]), then)
        assert same_bits(got, want)


# --------------------------------------------------------------------------- the refusals


@pytest.fixture(scope="module")
def hybrid():
    """A Qwen3.5 sender after a prefill (GDN per-request rows and full-attention per-token rows)."""
    model = Model("qwen3_5")
    a, _ = sender(model, n=6)
    return model, a, a.export_request(7)


def refused(model, payload, match, error=ValueError, *, state=None, **kw):
    b = receiver(model, **(state or {}))
    assert_refused(b, lambda: b.import_request(payload, **kw), match, error)


def regions(data: bytes):
    """(name, start, end) of every part of a payload's bytes: prefix, each header field, each tensor."""
    n = int.from_bytes(data[8:16], "little")
    head = data[16:16 + n].decode()
    parts = [("magic", 0, 8), ("header length", 8, 16)]
    for key in json.loads(head):
        at = head.index(f'"{key}":') + 16
        parts.append((f"header {key}", at, at + len(key) + 8))
    at = 16 + n
    payload = RequestState.from_bytes(data)
    for e in payload.header["tensors"]:
        size = payload.tensors[(e["layer"], e["name"])].nbytes
        parts.append((f"tensor {e['layer']}.{e['name']}", at, at + size))
        at += size
    return parts, 16 + n


def flipped(data: bytes, at: int, bit: int = 0) -> bytes:
    out = bytearray(data)
    out[at] ^= 1 << bit
    return bytes(out)


def test_a_bit_flip_anywhere_is_refused(hybrid):
    model, a, payload = hybrid
    data = payload.to_bytes()
    parts, body = regions(data)
    snap, book = snapshot(a), bookkeeping(a)
    # Every byte of the prefix and the header, three bits each: parsing or the checksum refuses it.
    for at in range(body):
        for bit in (0, 3, 6):
            with pytest.raises(ValueError, match="payload"):
                RequestState.from_bytes(flipped(data, at, bit))
    for name, lo, hi in parts:
        for at in sorted({lo, (lo + hi) // 2, hi - 1}):
            bad = flipped(data, at, 5)
            with pytest.raises(ValueError, match="payload") as info:
                RequestState.from_bytes(bad)
            if name.startswith("tensor"):
                assert "checksum" in str(info.value), name
        refused(model, bad, "payload")  # the bytes handed to the receiver directly
    assert unchanged(a, snap) and bookkeeping(a) == book


def test_a_tampered_value_is_refused(hybrid):
    model, _, payload = hybrid
    header, tensors = payload.flat()
    tensors[1] = tensors[1].clone()
    tensors[1].view(-1)[0] += 1
    with pytest.raises(ValueError, match="checksum"):
        RequestState.from_flat(header, tensors)
    forged = RequestState(payload.header, dict(zip(payload.tensors, tensors)))
    refused(model, forged, "checksum")
    for key, value in (("length", 5), ("request_id", 8), ("format", "fnattn.RequestState/0")):
        refused(model, RequestState({**payload.header, key: value}, payload.tensors), "payload")


def test_truncated_or_padded_bytes_are_refused(hybrid):
    model, _, payload = hybrid
    data = payload.to_bytes()
    parts, body = regions(data)
    cuts = {0, 1, 7, 8, 15, 16, body // 2, body - 1, body, len(data) - 1} | {lo for _, lo, _ in parts[2:]}
    for cut in sorted(cuts):
        with pytest.raises(ValueError, match="payload"):
            RequestState.from_bytes(data[:cut])
    refused(model, data[:body + 3], "truncated")
    refused(model, data + b"\0", "payload")


def test_wrong_spec_dtype_id_or_room_is_refused_then_cast_accepted(hybrid):
    model, a, payload = hybrid
    full = model.specs[-1]  # the same kinds and shapes, one config value off: what the values mean differs
    other = model.specs[:-1] + (dataclasses.replace(full, config=dataclasses.replace(full.config, scale=0.5)),)
    refused(types.SimpleNamespace(specs=other), payload, "spec mismatch")
    refused(Model("tiny"), payload, "layers")
    refused(model, payload, "request_id", request_id=0)  # the receiver's own request
    refused(model, payload, "request_id", request_id=-1)
    refused(model, payload, "cast", cast=1)
    refused(model, "not a payload", "payload")
    refused(model, payload, "request slot", fa.PoolExhaustedError, state={"max_requests": 1})
    refused(model, payload, "pages", fa.PoolExhaustedError, state={"num_pages": 1})

    bf16 = Model("qwen3_5", dtype=torch.bfloat16)
    refused(bf16, payload, "dtype mismatch")
    b, rid = receiver(bf16).import_request(payload, cast=True)
    back = b.export_request(rid)
    for key, t in payload.tensors.items():
        assert same_bits(back.tensors[key], t.to(back.tensors[key].dtype)), key


def test_stale_handles_are_refused(hybrid):
    model, _, payload = hybrid
    b = receiver(model)
    b.admit(1)  # replaces b
    with pytest.raises(fa.StaleStateError):
        b.import_request(payload)
    with pytest.raises(fa.StaleStateError):
        b.export_request(0)


@pytest.mark.gpu
def test_cpu_gpu_round_trip_keeps_every_byte(hybrid):
    model, _, payload = hybrid
    g = fa.State(model.specs, num_pages=4, page_size=8, max_requests=2, device="cuda", fill=float("nan"))
    g, rid = g.import_request(payload)
    back = g.export_request(rid)
    assert back.to_bytes() == payload.to_bytes()
    c, _ = receiver(model).import_request(back)
    assert c.export_request(rid).to_bytes() == payload.to_bytes()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ("qwen3_5", "kimi_linear", "deepseek_v32"))
def test_prefill_on_cpu_decode_on_gpu(family):
    cpu, gpu = Model(family), Model(family, device="cuda")
    a, last = sender(cpu)
    follow = [int(last[-1].argmax())] + prompt(cpu, DECODE - 1, seed=1)
    _, want = cpu.decode(a, 7, follow)
    a, _ = sender(cpu)
    b = fa.State(gpu.specs, num_pages=10, page_size=8, max_requests=3, recurrent_ring=3, device="cuda")
    b, rid = b.import_request(a.export_request(7))
    _, got = gpu.decode(b, rid, follow)
    torch.testing.assert_close(got.cpu(), want, atol=2e-3, rtol=2e-3)  # other kernels, not other bits


def test_the_docs_hand_off_runs_and_the_twin_pages_show_the_same_code():
    pages = [ROOT / "docs" / name for name in ("transfer.md", "transfer.zh.md")]
    english, chinese = ([b for b in re.findall(r"```python\n(.*?)```", p.read_text(), flags=re.DOTALL)] for p in pages)
    assert english and english == chinese
    namespace = {"__name__": "transfer_page"}
    for block in english:
        exec(compile(block, str(pages[0]), "exec"), namespace)
    dec, rid = namespace["dec"], namespace["rid"]
    assert dec.request(rid).length == 12 + 4 and dec.page_size == 16
