"""DeepSeek-V4's invariant Triton backend (``triton``, interpreted here in fp32) against the reference in every
phase, and its reason to exist: in the invariant mode a token's output is the same bits in a verify, in decode
steps beside another request and in decode steps alone, and whichever rows of the step precede it."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from helpers import same_bits

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import fnattn as fa  # noqa: E402
import fnattn.switches  # noqa: E402
from fnattn.registry import lookup  # noqa: E402
from kinds.dsv4.test_reference import CONFIGS, Stream, new_state  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU states, the kernels interpreted; on CUDA "
                                "tests/gpu/test_invariant_gpu.py runs the model's layers")
PHASES = ("prefill", "decode", "verify")
K = 3  # drafts of a verify


def lifted():
    """The backend for every phase with its device check lifted (the kernels run interpreted on the CPU)."""
    return tuple(dataclasses.replace(lookup("dsv4", p, "triton"), supports=lambda spec, device: []) for p in PHASES)


def prefilled(c, streams, counts, ma):
    st, _ = new_state(c, requests=len(streams))
    st = st.reserve(counts)
    b = fa.Batch.prefill(st, counts)
    with ma.session(st, b) as s:
        _, w = s.forward(0, streams[0].inputs([(streams[r], 0, n) for r, n in counts.items()]))
    return st.apply(fa.StepDeltas.collect(b, [w]))


def run(st, ma, streams, batch, *, apply=True):
    """One step of the layer; ``-> (output, writes, the state after it or None)``."""
    rows = [(streams[r], st.request(r).length, n) for r, n in zip(batch.request_ids, batch.host_new_lens)]
    with ma.session(st, batch) as s:
        out, w = s.forward(0, streams[0].inputs(rows))
    return out, w, st.apply(fa.StepDeltas.collect(batch, [w])) if apply else None


def test_it_serves_only_the_invariant_mode_on_cuda():
    spec = fa.LayerSpec(0, CONFIGS["csa"], torch.bfloat16)
    backend = lookup("dsv4", "decode", "triton")
    cuda = torch.device("cuda")
    assert "serves the invariant mode, which is off" in " ".join(backend.supports(spec, cuda))
    with fnattn.switches.set(invariant=True):
        assert "serves the invariant mode" not in " ".join(backend.supports(spec, cuda))
        assert backend.supports(spec, torch.device("cpu"))  # a CUDA device is needed
    assert backend.invariant and backend.capturable
    assert lookup("dsv4", "prefill", "triton").invariant


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("phase", ["prefill", "decode", "verify", "verify_replay"])
def test_every_phase_matches_the_reference(name, phase):
    c = CONFIGS[name]
    streams = {0: Stream(c, 40, 11), 1: Stream(c, 40, 12)}
    with fnattn.switches.set(invariant=True):
        ref = fa.ModelAttention((fa.LayerSpec(0, c, torch.float32),), prefer=["reference"])
        fast = fa.ModelAttention((fa.LayerSpec(0, c, torch.float32),), prefer=lifted())
        assert fast.backend(0, "decode").name == "triton"
        n = {"prefill": 5, "decode": 1, "verify": K + 1, "verify_replay": K + 1}[phase]
        counts = {0: n, 1: n + 4 if phase == "prefill" else n}
        outs = []
        for ma in (ref, fast):
            st = prefilled(c, streams, {0: 17, 1: 6}, ref).reserve(counts)
            if phase == "prefill":
                batch = fa.Batch.prefill(st, counts)
            elif phase == "decode":
                batch = fa.Batch.decode(st, [0, 1])
            else:
                batch = fa.Batch.verify(st, [0, 1], num_draft=K,
                                        recovery="replay" if phase == "verify_replay" else "native")
            outs.append(run(st, ma, streams, batch, apply=False))
        (o_ref, w_ref, _), (o_fast, w_fast, _) = outs
    assert o_fast.o.shape == o_ref.o.shape and torch.isfinite(o_fast.o).all()
    torch.testing.assert_close(o_fast.o, o_ref.o, atol=1e-5, rtol=1e-5)
    if o_ref.topk_indices is not None:
        assert torch.equal(o_fast.topk_indices, o_ref.topk_indices)
    assert set(w_fast.values) == set(w_ref.values)
    for k in w_ref.values:  # window rows and states are copies; a pooled entry rounds in the mode's own order
        if k in ("comp", "index_k"):
            torch.testing.assert_close(w_fast[k], w_ref[k], atol=1e-6, rtol=1e-6)
        else:
            assert same_bits(w_fast[k], w_ref[k]), k
    assert (o_fast.replay is None) == (o_ref.replay is None)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_token_is_the_same_bits_in_a_verify_and_in_decode_steps_together_or_alone(name):
    """Request 0 has 17 cached tokens and request 1 has 6: the K + 1 tokens of a verify cross window and
    compression boundaries, and each is compared with the same token decoded beside request 1 and alone."""
    c = CONFIGS[name]
    streams = {0: Stream(c, 40, 21), 1: Stream(c, 40, 22)}
    with fnattn.switches.set(invariant=True):
        ma = fa.ModelAttention((fa.LayerSpec(0, c, torch.float32),), prefer=lifted())
        assert {ma.backend(0, p).name for p in PHASES} == {"triton"}
        st = prefilled(c, streams, {0: 17, 1: 6}, ma).reserve({0: K + 1, 1: K + 1})
        verified, _, _ = run(st, ma, streams, fa.Batch.verify(st, [0, 1], num_draft=K), apply=False)
        together, alone = prefilled(c, streams, {0: 17, 1: 6}, ma), prefilled(c, {0: streams[0]}, {0: 17}, ma)
        for i in range(K + 1):
            st = together.reserve({0: 1, 1: 1})
            out_t, _, together = run(st, ma, streams, fa.Batch.decode(st, [0, 1]))
            st = alone.reserve({0: 1})
            out_a, _, alone = run(st, ma, streams, fa.Batch.decode(st, [0]))
            for b in (0, 1):
                assert torch.equal(verified.o[b * (K + 1) + i], out_t.o[b]), (i, b)
                if c.indexer is not None:
                    assert torch.equal(verified.topk_indices[b * (K + 1) + i], out_t.topk_indices[b]), (i, b)
            assert torch.equal(out_a.o[0], out_t.o[0]), i


def test_the_cuda_pooling_of_the_mode_is_the_pooling_and_a_window_ignores_the_others():
    """`batched.pool_fixed_order` (what the mode pools with on CUDA, interpreted here) against torch's softmax
    and sum, and each window's entry the same bits whether 1 or 7 windows are pooled."""
    from fnattn.kinds.dsv4.batched import pool_fixed_order

    g = torch.Generator().manual_seed(3)
    kv, gate = torch.randn(7, 8, 24, generator=g), torch.randn(7, 8, 24, generator=g)
    gate[:, :3] = float("-inf")  # positions before 0 weigh nothing
    got = pool_fixed_order(kv, gate)
    want = (kv * gate.softmax(dim=1)).sum(dim=1)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for r in range(7):
        assert torch.equal(pool_fixed_order(kv[r:r + 1], gate[r:r + 1])[0], got[r])
