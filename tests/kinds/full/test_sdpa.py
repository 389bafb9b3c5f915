"""The CPU SDPA backend against the reference: prefill with and without a cached prefix, decode and verify
batches of several requests, sliding windows, GQA ratios, fp32 and bf16; outputs, LSE and the storage rows
the step leaves (through `fnattn.probe`). Also: it is the CPU default, and refuses what it does not do."""

import pytest
import torch
from helpers import full_inputs, full_spec, full_state_with, phase_batch

import fnattn as fa
from fnattn.registry import lookup

CASES = [  # (phase, cached per request, new per request)
    ("prefill", [0], 9), ("prefill", [0, 0, 0], 5), ("prefill", [7, 0, 12], 6), ("decode", [5, 1, 17], 1),
    ("verify", [6, 9], 4),
]


@pytest.mark.parametrize("phase, cached, new", CASES)
@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_sdpa_matches_the_reference(phase, cached, new, hq, hkv, window, dtype, tol):
    spec = full_spec(0, hq=hq, hkv=hkv, d=16, sliding_window=window, dtype=dtype)
    st = full_state_with(spec, cached)
    counts = {r: new for r in range(len(cached))}
    st = st.reserve(counts)
    b = phase_batch(st, phase, counts)
    inputs = full_inputs(spec, b.num_tokens, gen=torch.Generator().manual_seed(5))
    report = fa.probe(spec, state=st, batch=b, inputs=inputs, backends=["sdpa"])
    (row,) = report.rows
    assert row.max_rel <= tol, f"sdpa vs reference: max rel {row.max_rel:.2e}"


def test_sdpa_is_the_cpu_default_before_the_reference():
    spec = full_spec(0, hq=8, hkv=2, d=16)
    ma = fa.ModelAttention([spec])
    for phase in ("prefill", "decode", "verify"):
        assert ma.backend(0, phase).name == "sdpa"


@pytest.mark.parametrize("opts, reason", [({"softcap": 2.0}, "softcap"), ({"sinks": True}, "sinks"),
                                          ({"dv": 8}, "head_dim_v")])
def test_sdpa_leaves_to_the_reference_what_the_fused_kernel_cannot_do(opts, reason):
    spec = full_spec(0, hq=4, hkv=2, d=16, **opts)
    reasons = lookup("full", "decode", "sdpa").supports(spec, torch.device("cpu"))
    assert any(reason in r for r in reasons), reasons
    assert fa.ModelAttention([spec]).backend(0, "decode").name == "reference"
