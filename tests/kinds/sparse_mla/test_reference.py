"""The reference sparse-MLA backend (MLA over the DSA indexer's top-k) against Hugging Face.

The peers are the DeepSeek-V3.2 attention + indexer ("v32") and GLM-MoE-DSA's
full + shared layer pair ("glm": layer 1 reuses layer 0's top-k). The model
and the checks shared with dense MLA are in ``tests/kinds/mla/harness.py``.
"""

from __future__ import annotations

import pytest
import torch
from hf_mla import TOPK, Di, Dr, Hi, R

import fnattn as fa

from ..mla.harness import (
    check_accept_keeps_only_accepted_rows,
    check_bad_inputs_name_the_field,
    check_chunked_prefill_equals_one_shot,
    check_inputs_and_views_bit_identical_after_every_call,
    check_nan_in_unused_pages_never_reaches_outputs,
    check_prefill_runs_expanded_decode_and_verify_absorbed,
    check_prefill_verify_and_decode_agree,
    check_two_requests_prefill_then_decode_match_hf,
    forward_one,
)

SPARSE = ("v32", "glm")

# --------------------------------------------------------------------------- #
# parity with Hugging Face
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("kind", SPARSE)
def test_two_requests_prefill_then_decode_match_hf(kind):
    model, st, results, hf = check_two_requests_prefill_then_decode_match_hf(kind)
    if kind == "glm":
        for _, outs, _ in results:
            assert isinstance(outs[1][1], fa.SparseAttentionOutput)
            assert torch.equal(outs[1][1].topk_indices, outs[0][1].topk_indices)
        # the shared layer owns no index keys: it neither caches nor writes them
        assert "index_k" not in st.views(1) and st.views(0).index_k is not None
        assert not hf[0].cache.layers[1].is_indexer_initialized


@pytest.mark.parametrize("kind", SPARSE)
def test_chunked_prefill_equals_one_shot(kind):
    check_chunked_prefill_equals_one_shot(kind)


# --------------------------------------------------------------------------- #
# expanded (prefill) vs absorbed (decode, verify); acceptance
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("kind", SPARSE)
def test_prefill_verify_and_decode_agree(kind):
    check_prefill_verify_and_decode_agree(kind)


def test_accept_keeps_only_accepted_rows():
    check_accept_keeps_only_accepted_rows("glm", writes_of_layer={0: ["index_k", "latent"], 1: ["latent"]})


# --------------------------------------------------------------------------- #
# purity
# --------------------------------------------------------------------------- #


def test_inputs_and_views_bit_identical_after_every_call():
    check_inputs_and_views_bit_identical_after_every_call("glm")


def test_nan_in_unused_pages_never_reaches_outputs():
    check_nan_in_unused_pages_never_reaches_outputs("v32")


# --------------------------------------------------------------------------- #
# bad inputs, forms
# --------------------------------------------------------------------------- #


def bad_cases():
    z = torch.zeros
    yield 0, "index_q", dict(index_q=None)
    yield 0, "index_w", dict(index_w=None)
    yield 0, "index_k", dict(index_k=None)
    yield 0, "index_k", dict(index_k=z(6, Di - 1))
    yield 0, "index_q", dict(index_q=z(6, Hi + 1, Di))
    yield 0, "topk_indices", dict(topk_indices=z(6, TOPK, dtype=torch.int64))
    yield 0, "sparse", dict(sparse=None)
    yield 0, "latent", dict(latent=z(5, R + Dr))
    yield 1, "topk_indices", dict(topk_indices=None)
    yield 1, "topk_indices", dict(topk_indices=z(6, TOPK + 1, dtype=torch.int64))
    yield 1, "topk_indices", dict(topk_indices=z(6, TOPK, dtype=torch.int32))
    yield 1, "index_q", dict(index_q=z(6, Hi, Di))
    yield 1, "index_k", dict(index_k=z(6, Di))
    future = torch.full((6, TOPK), -1, dtype=torch.int64)
    future[2, 1] = 3  # token 2 may not select position 3 (causal)
    yield 1, "topk_indices", dict(topk_indices=future)


def test_bad_inputs_name_the_field():
    model, st, batch, good = check_bad_inputs_name_the_field("glm", list(bad_cases()))
    plain = fa.MLAInputs(**{f: getattr(good[0], f) for f in ("q_nope", "q_pe", "latent", "w_uk", "w_uv")})
    with pytest.raises(ValueError, match="`inputs`.*SparseMLAInputs"):
        forward_one(model, st, batch, 0, plain)


def test_prefill_runs_expanded_decode_and_verify_absorbed(monkeypatch):
    check_prefill_runs_expanded_decode_and_verify_absorbed("glm", monkeypatch)
