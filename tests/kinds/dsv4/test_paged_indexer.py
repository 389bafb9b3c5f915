"""DeepSeek-V4's CSA indexer through the paged Triton scores (`fnattn.kinds.dsv4.batched.paged_scores`) against
its torch form over gathered keys, in the interpreter: the cached entries are every ``m``-th row of the index-key
pages, the step's own entries every ``m``-th of its entry rows; decode steps and multi-token steps of requests of
different lengths, windows closing inside the step or not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from fnattn.kinds.dsv4.batched import (  # noqa: E402
    gathered_scores,
    ordered,
    paged_reasons,
    paged_scores,
    token_requests,
)


def step_case(cache_lens, new_lens, *, m=4, S=8, Hi=3, Di=16, spare_pages=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = len(cache_lens), sum(new_lens)
    M = max(-(-(c + n) // S) for c, n in zip(cache_lens, new_lens)) + spare_pages
    P = B * M + 1
    pool = torch.randn(P, S, Di, generator=g)
    pool[0] = float("nan")  # the null page: a read of it would show
    table = (torch.randperm(P - 1, generator=g)[: B * M] + 1).view(B, M).to(torch.int32)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(new_lens), 0).tolist()])
    pos = torch.cat([torch.arange(c, c + n) for c, n in zip(cache_lens, new_lens)])
    batch = SimpleNamespace(cache_lens=torch.tensor(cache_lens), block_table=table, page_size=S, num_requests=B,
                            cu_seqlens=cu, positions=pos)
    req = token_requests(batch)
    # the step's entry rows: a key at each closing token, zeros elsewhere (as the compressor writes them)
    closes = (pos + 1) % m == 0
    rows = torch.where(closes[:, None], torch.randn(T, Di, generator=g), torch.zeros(T, Di))
    q, w = torch.randn(T, Hi, Di, generator=g), torch.randn(T, Hi, generator=g)
    return SimpleNamespace(index_k=pool), batch, req, pos, q, w, rows, SimpleNamespace(head_dim=Di, topk=3), m


@pytest.mark.parametrize("cache_lens, new_lens", [([3, 0, 21], [1, 1, 1]), ([7, 12, 2], [1, 1, 1]),
                                                  ([0, 5], [9, 13]), ([6, 30], [4, 4])])
def test_paged_scores_are_the_gathered_ones(cache_lens, new_lens):
    args = step_case(cache_lens, new_lens)
    want = gathered_scores(*args)
    got = paged_scores(*args)
    assert got.shape == want.shape
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin)  # the same entries visible, nothing read from the null page
    assert torch.equal(fin.sum(dim=1), (args[3] + 1) // args[-1])  # a token sees (p + 1) // m entries
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5)
    assert torch.equal(ordered(got, 3), ordered(want, 3))


def test_the_torch_form_serves_where_the_kernel_cannot():
    views, batch, _, _, q, *_ = step_case([3], [1])
    assert q.is_cuda or any("CUDA" in r for r in paged_reasons(views, batch, q, 4))
    assert any("whole number of entries of 3" in r for r in paged_reasons(views, batch, q, 3))
