"""The reference MLA backend through the real path, against Hugging Face's DeepseekV3Attention.

The model around it and the checks it shares with sparse MLA are in `harness.py`;
this file runs them on the dense variants ("v3", and "v3_yarn_no_q_lora": YaRN
rope, no q LoRA, attention bias) and adds what only dense MLA has.
"""

from __future__ import annotations

import pytest
import torch
from hf_mla import Dn, Dr, Dv, H, R, hf_cache_rows

from .harness import (
    DENSE,
    HFRequest,
    Model,
    check_accept_keeps_only_accepted_rows,
    check_bad_inputs_name_the_field,
    check_chunked_prefill_equals_one_shot,
    check_inputs_and_views_bit_identical_after_every_call,
    check_nan_in_unused_pages_never_reaches_outputs,
    check_prefill_runs_expanded_decode_and_verify_absorbed,
    check_prefill_verify_and_decode_agree,
    check_two_requests_prefill_then_decode_match_hf,
    hidden,
    request_cache,
    run_steps,
)

# --------------------------------------------------------------------------- #
# parity with Hugging Face
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("kind", DENSE)
def test_two_requests_prefill_then_decode_match_hf(kind):
    _, st, _, _ = check_two_requests_prefill_then_decode_match_hf(kind)
    assert "index_k" not in st.views(0)  # dense MLA caches its latent rows only


def test_chunked_prefill_equals_one_shot():
    check_chunked_prefill_equals_one_shot("v3")


def test_bf16_matches_hf_loosely():
    model = Model("v3", dtype=torch.bfloat16, seed=6)
    xs = hidden(model, {0: 13}, seed=7)
    st, results = run_steps(model, model.state().admit(0), xs, [{0: 12}, {0: 1}],
                            phase_of=lambda i: "prefill" if i == 0 else "decode")
    hf = HFRequest(model)
    for batch, outs, done in results:
        ours, att = outs[0]
        assert att.o.dtype == torch.bfloat16 and att.lse.dtype == torch.float32
        (want,), _ = hf.step([xs[0][0][done[0]:done[0] + batch.num_tokens]])
        torch.testing.assert_close(ours, want, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(request_cache(st, 0, 0), hf_cache_rows(hf.cache))


# --------------------------------------------------------------------------- #
# expanded (prefill) vs absorbed (decode, verify); acceptance
# --------------------------------------------------------------------------- #


def test_prefill_verify_and_decode_agree():
    check_prefill_verify_and_decode_agree("v3")


def test_accept_keeps_only_accepted_rows():
    check_accept_keeps_only_accepted_rows("v3", writes_of_layer={0: ["latent"]})


# --------------------------------------------------------------------------- #
# purity
# --------------------------------------------------------------------------- #


def test_inputs_and_views_bit_identical_after_every_call():
    check_inputs_and_views_bit_identical_after_every_call("v3")


def test_nan_in_unused_pages_never_reaches_outputs():
    check_nan_in_unused_pages_never_reaches_outputs("v3")


# --------------------------------------------------------------------------- #
# bad inputs, forms
# --------------------------------------------------------------------------- #


def test_bad_inputs_name_the_field():
    z = torch.zeros
    check_bad_inputs_name_the_field("v3", [
        (0, "q_nope", dict(q_nope=z(6, H + 1, Dn))),
        (0, "q_pe", dict(q_pe=z(6, H, Dr, dtype=torch.float64))),
        (0, "latent", dict(latent=z(6, R))),
        (0, "w_uk", dict(w_uk=z(H, Dn, R + 1))),
        (0, "w_uv", dict(w_uv=z(H, Dv + 1, R))),
    ])


def test_prefill_runs_expanded_decode_and_verify_absorbed(monkeypatch):
    check_prefill_runs_expanded_decode_and_verify_absorbed("v3", monkeypatch)
