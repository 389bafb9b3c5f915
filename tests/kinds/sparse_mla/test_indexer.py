"""DSA indexer selection: the score formula and top-k semantics (causal, the current
token included, ``-1`` padding) and the ``allowed`` mask built from it.

The indexer's queries and keys from checkpoint weights, GLM-5 top-k sharing and
parity with transformers' attention modules are in ``tests/test_model_dsa_layer.py``."""

from __future__ import annotations

import pytest
import torch
from hf_mla import Di, Hi

from fnattn.kinds.sparse_mla.indexer import indexer_scores, topk_indices, topk_mask

# --------------------------------------------------------------------------- #
# top-k and scores
# --------------------------------------------------------------------------- #


def test_topk_is_causal_and_includes_current_token():
    n_cached, T = 3, 4
    scores = torch.arange(n_cached + T, dtype=torch.float32).repeat(T, 1)  # later keys score higher
    idx = topk_indices(scores, n_cached=n_cached, topk=2)
    assert idx.dtype == torch.int64
    assert idx.tolist() == [[n_cached + i, n_cached + i - 1] for i in range(T)]


def test_topk_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    n_cached, T, k = 5, 6, 4
    scores = torch.randn(T, n_cached + T, generator=g)
    idx = topk_indices(scores, n_cached=n_cached, topk=k)
    for i in range(T):
        visible = list(range(n_cached + i + 1))
        best = sorted(visible, key=lambda j: -float(scores[i, j]))[:k]
        assert idx[i].tolist() == best


def test_topk_pads_with_minus_one_when_few_visible():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(5, 5, generator=g)
    idx = topk_indices(scores, n_cached=0, topk=4)
    assert idx[0].tolist() == [0, -1, -1, -1]
    assert sorted(idx[2].tolist()) == [-1, 0, 1, 2]
    assert -1 not in idx[3].tolist() and sorted(idx[3].tolist()) == [0, 1, 2, 3]
    assert -1 not in idx[4].tolist()
    wide = topk_indices(scores, n_cached=0, topk=9)
    assert wide.shape == (5, 9)
    for i in range(5):
        assert sorted(j for j in wide[i].tolist() if j >= 0) == list(range(i + 1))


def test_topk_bad_arguments():
    with pytest.raises(ValueError, match="n_cached"):
        topk_indices(torch.zeros(3, 5), n_cached=1, topk=2)
    with pytest.raises(ValueError, match="topk"):
        topk_indices(torch.zeros(3, 5), n_cached=2, topk=0)
    with pytest.raises(ValueError, match=r"scores: expected shape \[\*, \*\], got \[3\]"):
        topk_indices(torch.zeros(3), n_cached=2, topk=2)


def test_topk_mask():
    idx = torch.tensor([[2, -1], [0, 3]])
    mask = topk_mask(idx, n_keys=4)
    assert mask.tolist() == [[False, False, True, False], [True, False, False, True]]
    with pytest.raises(ValueError, match="indices"):
        topk_mask(torch.tensor([[4]]), n_keys=4)
    with pytest.raises(ValueError, match="indices"):
        topk_mask(torch.tensor([[-2]]), n_keys=4)


def test_indexer_scores_formula():
    g = torch.Generator().manual_seed(2)
    q, w, keys = torch.randn(3, Hi, Di, generator=g), torch.randn(3, Hi, generator=g), torch.randn(7, Di, generator=g)
    scores = indexer_scores(q, w, keys)
    expected = torch.zeros(3, 7)
    for t in range(3):
        for j in range(7):
            expected[t, j] = sum(w[t, h] * max(float(q[t, h] @ keys[j]) * Di**-0.5, 0.0) for h in range(Hi))
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"keys: expected shape \[\*, 16\], got \[7, 15\]"):
        indexer_scores(q, w, torch.zeros(7, Di - 1))
