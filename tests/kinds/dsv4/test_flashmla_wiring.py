"""The FlashMLA path's wiring on the CPU: its row lists, parts and sink merge, with the kernel emulated.

`fnattn.kinds.dsv4.flashmla.kernel` is replaced by a torch version of
``flash_mla_sparse_fwd``'s contract (each query attends the rows its list
names in one flat array; natural-log LSE, -inf and a zero output without
rows). Everything else (which slots of the kv and comp pools, which rows of
the step, the merge with the sink) runs as on the
GPU and must give the reference's outputs and writes; decode (every request at
once, `fnattn.kinds.dsv4.batched`) also under the host-read guard, pad lanes included. The kernel itself is
compared on the H200 by tests/gpu/test_dsv4_flashmla_gpu.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import registry_scope, same_bits

import fnattn as fa
from fnattn.kinds.dsv4 import flashmla
from kinds.dsv4.test_reference import CONFIGS, Stream, new_state


def emulated_kernel(q, kv, idx, scale):
    T, H, D = q.shape
    rows = kv[idx.clamp(min=0)]  # [T, K, D]
    rows = torch.where((idx >= 0)[..., None], rows, torch.zeros_like(rows))  # the kernel never reads them
    logits = torch.einsum("thd,tkd->thk", q.float(), rows.float()) * scale
    logits = logits.masked_fill((idx < 0)[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [T, H]
    p = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("thk,tkd->thd", p, rows.float())
    return o, lse


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(flashmla, "kernel", emulated_kernel)
    with registry_scope():
        for phase in ("prefill", "decode", "verify"):
            def fn(spec, views, inputs, _phase=phase):
                return flashmla.sparse_step(spec, views, inputs, _phase)

            fa.register("dsv4", phase, "emulated_flashmla")(fn)
        yield


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("phase", ["prefill", "decode", "verify", "verify_replay"])
def test_emulated_flashmla_equals_reference(emulated, name, phase):
    """Every phase of the batched path (`fnattn.kinds.dsv4.batched`) under the host-read guard: requests of
    different lengths in a prefill, windows closing inside a verify."""
    from fnattn.lanes import no_host_reads

    c = CONFIGS[name]
    streams = {0: Stream(c, 40, 11), 1: Stream(c, 40, 12)}
    states = []
    ma = fa.ModelAttention((fa.LayerSpec(0, c, torch.float32),), prefer=["reference"])
    for _ in range(2):
        st, _ = new_state(c)
        st = st.reserve({0: 17, 1: 6})
        b = fa.Batch.prefill(st, {0: 17, 1: 6})
        with ma.session(st, b) as s:
            _, w = s.forward(0, streams[0].inputs([(streams[0], 0, 17), (streams[1], 0, 6)]))
        states.append(st.apply(fa.StepDeltas.collect(b, [w])))
    n = {"prefill": 5, "decode": 1, "verify": 4, "verify_replay": 4}[phase]
    counts = {0: n, 1: n + 4 if phase == "prefill" else n}
    outs = []
    for st, prefer in zip(states, ("reference", "emulated_flashmla")):
        st = st.reserve(counts)
        if phase == "prefill":
            batch = fa.Batch.prefill(st, counts)
        elif phase == "decode":
            batch = fa.Batch.decode(st, [0, 1])
        else:
            batch = fa.Batch.verify(st, [0, 1], num_draft=3,
                                    recovery="replay" if phase == "verify_replay" else "native")
        rows = [(streams[r], st.request(r).length, counts[r]) for r in batch.request_ids]
        m2 = fa.ModelAttention((fa.LayerSpec(0, c, torch.float32),), prefer=[prefer])
        x = streams[0].inputs(rows)
        with m2.session(st, batch) as s:
            if prefer == "reference":
                outs.append(s.forward(0, x))
            else:
                with no_host_reads():
                    outs.append(s.forward(0, x))
    (o_ref, w_ref), (o_fast, w_fast) = outs
    torch.testing.assert_close(o_fast.o, o_ref.o, atol=1e-5, rtol=0)
    if o_ref.topk_indices is not None:
        assert torch.equal(o_fast.topk_indices, o_ref.topk_indices)
    assert set(w_fast.values) == set(w_ref.values)
    for k in w_ref.values:  # the states and window rows are copies; a pooled entry may round differently
        if k in ("comp", "index_k"):
            torch.testing.assert_close(w_fast[k], w_ref[k], atol=1e-6, rtol=0)
        else:
            assert same_bits(w_fast[k], w_ref[k]), k
    assert (o_fast.replay is None) == (o_ref.replay is None)


def test_the_kernel_head_count_comes_from_the_config():
    spec = fa.LayerSpec(0, CONFIGS["csa"], torch.float32)
    reasons = flashmla.supports(spec, torch.device("cpu"))
    assert any("CUDA" in r for r in reasons) and any("512" in r for r in reasons)
    assert any("padded_heads" in r for r in reasons)  # 4 heads: the model must pad them
    padded = dataclasses.replace(CONFIGS["csa"], padded_heads=64)
    assert padded.heads == 64 and not any("padded_heads" in r for r in flashmla.supports(
        fa.LayerSpec(0, padded, torch.float32), torch.device("cpu")))
    with pytest.raises(ValueError, match="`padded_heads`"):
        dataclasses.replace(CONFIGS["csa"], padded_heads=CONFIGS["csa"].num_heads - 1)


def test_a_model_with_padded_heads_gives_the_same_logits():
    """The model pads queries (zeros) and sinks (-inf) to ``padded_heads`` and drops them from the output."""
    from fnattn.models.registry import family_named, random_checkpoint

    fam = family_named("deepseek_v4")
    cfg = fam.adapt(fam.tiny_config())
    logits = []
    for c in (cfg, dataclasses.replace(cfg, padded_heads=64)):
        params = fam.load(c, random_checkpoint(fam, c, seed=3))
        st = fa.State(c.specs, num_pages=16, page_size=8, max_requests=2).admit(0).reserve({0: 11})
        b = fa.Batch.prefill(st, {0: 11})
        with fa.ModelAttention(c.specs).session(st, b) as s:
            out, _ = fam.step(params, s, torch.arange(11) % c.vocab_size)
        logits.append(out)
    assert c.specs[1].config.heads == 64
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_reads_nothing_on_the_host_and_steps_like_the_reference(emulated, name):
    """Several decode steps across window boundaries, pad lanes included, under the host-read guard."""
    from fnattn.lanes import no_host_reads

    c = CONFIGS[name]
    streams = {0: Stream(c, 60, 13), 1: Stream(c, 60, 14)}
    ref = fa.ModelAttention((fa.LayerSpec(0, c, torch.float32),), prefer=["reference"])
    fast = fa.ModelAttention((fa.LayerSpec(0, c, torch.float32),), prefer=["emulated_flashmla"])
    states = []
    for _ in range(2):
        st, _ = new_state(c, requests=3)
        st = st.reserve({0: 9, 1: 2})
        b = fa.Batch.prefill(st, {0: 9, 1: 2})
        with ref.session(st, b) as s:
            _, w = s.forward(0, streams[0].inputs([(streams[0], 0, 9), (streams[1], 0, 2)]))
        states.append(st.apply(fa.StepDeltas.collect(b, [w])))
    for _ in range(9):
        outs = []
        for i, ma in enumerate((ref, fast)):
            st = states[i].reserve({0: 1, 1: 1})
            batch = fa.Batch.decode(st, [0, 1], pad_to=3)
            rows = [(streams[r] if r >= 0 else streams[0], st.request(r).length if r >= 0 else 0, 1)
                    for r in batch.request_ids]
            x = streams[0].inputs(rows)
            with ma.session(st, batch) as s:
                if i:
                    with no_host_reads():
                        out, w = s.forward(0, x)
                else:
                    out, w = s.forward(0, x)
            outs.append((out, w))
            states[i] = st.apply(fa.StepDeltas.collect(batch, [w]))
        (o_r, w_r), (o_f, w_f) = outs
        torch.testing.assert_close(o_f.o[:2], o_r.o[:2], atol=1e-5, rtol=0)
        if o_r.topk_indices is not None:
            assert torch.equal(o_f.topk_indices[:2], o_r.topk_indices[:2])
        for k in w_r.values:
            torch.testing.assert_close(w_f[k][:2], w_r[k][:2], atol=1e-6, rtol=0)
