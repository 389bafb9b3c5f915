"""The CPU MLA backend (``sdpa``: prefill in the expanded form, decode in the absorbed form, through torch's
fused SDPA kernel) against the reference."""

from __future__ import annotations

import pytest
import torch

import fnattn as fa
from fnattn.kinds.mla import sdpa
from fnattn.kinds.mla.math import mla_expanded
from kinds.mla.fast_cases import compare, filled_state, mla_config

SMALL = dict(R=16, Dr=8, Dn=8, Dv=12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [None, "fp8_e4m3"])
def test_prefill_with_and_without_a_prefix_equals_the_reference(dtype, cache_dtype):
    """Requests with 0 / 5 / 64 / 130 cached rows and 1 / 9 / 70 / 3 new ones, unused storage NaN: the outputs,
    the log-sum-exps and the rows written are the reference's."""
    specs = [fa.LayerSpec(0, mla_config(H=3, **SMALL, cache_dtype=cache_dtype, cache_scale=0.5), dtype)]
    st = filled_state(specs, [0, 5, 64, 130], page_size=16, extra=80)
    batch = fa.Batch.prefill(st, {0: 1, 1: 9, 2: 70, 3: 3})
    (row,) = compare(specs, st, batch, sdpa.NAME)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert row["finite"] and row["writes_equal"], row
    assert row["o_rel"] <= tol and row["lse_abs"] <= 1e-4, row


@pytest.mark.parametrize("n_cached, n", [(0, 1), (0, 17), (7, 1), (33, 20)])
def test_expanded_sdpa_is_mla_expanded(n_cached, n):
    g = torch.Generator().manual_seed(n_cached + n)
    H, Dn, Dr, R, Dv = 2, 16, 8, 32, 12
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    args = (r(n, H, Dn), r(n, H, Dr), r(n_cached + n, R + Dr), r(H, Dn, R, scale=0.1), r(H, Dv, R, scale=0.1))
    got = sdpa.expanded_sdpa(*args, scale=0.2, n_cached=n_cached)
    want = mla_expanded(*args, scale=0.2, n_cached=n_cached)
    assert got[0].shape == (n, H, Dv) and got[1].shape == (n, H)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [None, "fp8_e4m3"])
def test_decode_of_a_batch_equals_the_reference(dtype, cache_dtype):
    """Caches of 0 / 1 / 15 / 16 / 130 rows (a fresh request, page edges, several pages) decoded in one call,
    two pad lanes on the null page, unused storage NaN: the live lanes' outputs and LSEs, and the rows
    written, are the reference's."""
    specs = [fa.LayerSpec(0, mla_config(H=3, **SMALL, cache_dtype=cache_dtype, cache_scale=0.5), dtype)]
    st = filled_state(specs, [0, 1, 15, 16, 130], page_size=16, extra=4)
    batch = fa.Batch.decode(st, [4, 0, 2, 1, 3], pad_to=7)
    live = torch.arange(batch.num_tokens) < len(batch.live_ids)
    (row,) = compare(specs, st, batch, sdpa.NAME, live=live)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert row["finite"] and row["writes_equal"], row
    assert row["o_rel"] <= tol and row["lse_abs"] <= 1e-4, row


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_verify_equals_the_reference(sparse, k):
    """``k`` drafts a request after caches of 0 / 5 / 40 rows, causal among the step's tokens (and, sparse, to
    the selected positions): the outputs, LSEs, selections and rows written are the reference's."""
    from kinds.mla.fast_cases import sparse_specs

    if sparse:
        specs = sparse_specs(topk=8, Hi=2, Di=16, shared=True, dtype=torch.float32, H=3, **SMALL)
    else:
        specs = [fa.LayerSpec(0, mla_config(H=3, **SMALL), torch.float32)]
    st = filled_state(specs, [0, 5, 40], page_size=16, extra=8)
    batch = fa.Batch.verify(st, [1, 0, 2], num_draft=k)
    for row in compare(specs, st, batch, sdpa.NAME):
        assert row["finite"] and row["writes_equal"] and row.get("topk_mismatch", 0.0) == 0.0, row
        assert row["o_rel"] <= 1e-5 and row["lse_abs"] <= 1e-4, row


def test_it_serves_every_cpu_phase_and_refuses_a_gpu():
    spec = fa.LayerSpec(0, mla_config(H=2, **SMALL), torch.float32)
    ma = fa.ModelAttention([spec])
    assert {ma.backend(0, p).name for p in ("prefill", "decode", "verify")} == {sdpa.NAME}
    assert sdpa.supports(spec, torch.device("cuda")) and not sdpa.supports(spec, torch.device("cpu"))


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("topk", [4, 64])
def test_sparse_prefill_equals_the_reference(shared, topk):
    """DeepSeek-V3.2 (the layer's own indexer) and GLM-5 (a second layer reusing its top-k): with a top-k
    smaller than most contexts and one larger than all, prefixes of 0 / 5 / 40 rows: the outputs, LSEs, the
    selected positions and the rows written are the reference's."""
    from kinds.mla.fast_cases import sparse_specs

    specs = sparse_specs(topk=topk, Hi=2, Di=16, shared=shared, dtype=torch.float32, H=3, **SMALL)
    st = filled_state(specs, [0, 5, 40], page_size=16, extra=24)
    batch = fa.Batch.prefill(st, {0: 9, 1: 1, 2: 20})
    for row in compare(specs, st, batch, sdpa.NAME):
        assert row["finite"] and row["writes_equal"] and row["topk_mismatch"] == 0.0, row
        assert row["o_rel"] <= 1e-5 and row["lse_abs"] <= 1e-4, row


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("topk", [4, 64])
def test_sparse_decode_of_a_batch_equals_the_reference(shared, topk):
    """One call for the batch, each token masked to its selected positions (its own new row among them when
    picked), caches of 0 / 3 / 16 / 40 rows and a pad lane: the live lanes' outputs, LSEs and selections and
    the rows written are the reference's."""
    from kinds.mla.fast_cases import sparse_specs

    specs = sparse_specs(topk=topk, Hi=2, Di=16, shared=shared, dtype=torch.float32, H=3, **SMALL)
    st = filled_state(specs, [0, 3, 16, 40], page_size=16, extra=4)
    batch = fa.Batch.decode(st, [2, 0, 3, 1], pad_to=5)
    live = torch.arange(batch.num_tokens) < len(batch.live_ids)
    for row in compare(specs, st, batch, sdpa.NAME, live=live):
        assert row["finite"] and row["writes_equal"] and row["topk_mismatch"] == 0.0, row
        assert row["o_rel"] <= 1e-5 and row["lse_abs"] <= 1e-4, row
