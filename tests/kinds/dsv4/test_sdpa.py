"""The CPU DeepSeek-V4 backend (``sdpa``: the reference's keys and mask through torch's fused SDPA kernel)
against the reference. The oracle tests in test_reference.py run through it too: it is the CPU default."""

from __future__ import annotations

import pytest
import torch

import fnattn as fa
from fnattn.kinds.dsv4 import sdpa
from fnattn.kinds.dsv4.math import attend_sinks
from kinds.dsv4.test_reference import CONFIGS, Stream, new_state


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("n, K", [(1, 3), (6, 17)])
def test_attention_is_attend_sinks(sinks, n, K):
    g = torch.Generator().manual_seed(n * K)
    H, D = 3, 16
    q, keys = torch.randn(n, H, D, generator=g), torch.randn(K, D, generator=g)
    bias = torch.zeros(n, K).masked_fill(torch.rand(n, K, generator=g) < 0.4, float("-inf"))
    bias[:, 0] = 0.0  # every token sees a key, as every token sees itself in a model
    s = torch.randn(H, generator=g) if sinks else None
    torch.testing.assert_close(sdpa.attend_sinks_sdpa(q, keys, bias, s, scale=0.25),
                               attend_sinks(q, keys, bias, s, scale=0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_step_equals_the_reference_step(name, phase):
    """Sliding, CSA and HCA layers after a prefix: outputs, top-k and every write as the reference's."""
    c = CONFIGS[name]
    streams = {0: Stream(c, 40, 5), 1: Stream(c, 40, 6)}
    st, _ = new_state(c)
    st = st.reserve({0: 17, 1: 9})
    first = fa.Batch.prefill(st, {0: 13, 1: 5})
    ref = fa.ModelAttention(st.specs, prefer=("reference",))
    with ref.session(st, first) as s:
        _, w = s.forward(0, streams[0].inputs([(streams[0], 0, 13), (streams[1], 0, 5)]))
    st = st.apply(fa.StepDeltas.collect(first, [w]))
    counts = {0: 4, 1: 4} if phase == "prefill" else {0: 1, 1: 1}
    batch = fa.Batch.prefill(st, counts) if phase == "prefill" else fa.Batch.decode(st, [0, 1])
    inputs = streams[0].inputs([(streams[r], st.request(r).length, counts[r]) for r in batch.request_ids])
    results = {}
    for backend in ("reference", sdpa.NAME):
        ma = fa.ModelAttention(st.specs, prefer=(backend,), phases=(phase,))
        assert ma.backend(0, phase).name == backend
        with ma.session(st, batch) as s:
            results[backend] = s.forward(0, inputs)
    (ro, rw), (go, gw) = results["reference"], results[sdpa.NAME]
    torch.testing.assert_close(go.o, ro.o, rtol=1e-5, atol=1e-5)
    assert (go.topk_indices is None) == (ro.topk_indices is None)
    if ro.topk_indices is not None:
        assert torch.equal(go.topk_indices, ro.topk_indices)
    assert set(gw.values) == set(rw.values) and all(torch.equal(gw[k], rw[k]) for k in rw.values)


def test_it_serves_cpu_prefill_and_decode_and_refuses_a_gpu():
    spec = fa.LayerSpec(0, CONFIGS["csa"], torch.float32)
    ma = fa.ModelAttention([spec])
    assert ma.backend(0, "prefill").name == ma.backend(0, "decode").name == sdpa.NAME
    assert ma.backend(0, "verify").name == "reference"
    assert sdpa.supports(spec, torch.device("cuda")) and not sdpa.supports(spec, torch.device("cpu"))
