"""latent_attention_invariant and latent_values (MLA's latent layer in the invariant mode) against their references,
and the property they exist for: a token's result is the same bits whatever else its launch holds (interpreted in
fp32 on the CPU; bf16 on CUDA)."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels.latent_invariant import (  # noqa: E402
    ascending_picks,
    latent_attention_invariant,
    latent_attention_invariant_ref,
    latent_values,
    latent_values_ref,
    request_of_token,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
TOL = 2e-5 if DTYPE == torch.float32 else 2e-2
R, DR, H, S = 32, 16, 3, 4  # latent rank, rope dims, heads, page size


def pool(cached: list[int], seed=0):
    """A paged pool of every request's cached rows (NaN elsewhere: a stray read shows), its block table and
    cache lengths; each request's pages after the previous one's, leaving room for new tokens."""
    g = torch.Generator().manual_seed(seed)
    per = [-(-(c + 8) // S) for c in cached]
    cache = torch.full((sum(per) + 1, S, R + DR), float("nan"))
    table = torch.zeros(len(cached), max(per), dtype=torch.int32)
    start = 1  # page 0 is the null page
    for b, (c, n) in enumerate(zip(cached, per)):
        table[b, :n] = torch.arange(start, start + n, dtype=torch.int32)
        for j in range(c):
            cache[start + j // S, j % S] = torch.randn(R + DR, generator=g)
        start += n
    return cache.to(DTYPE).to(DEVICE), table.to(DEVICE), torch.tensor(cached, dtype=torch.int32, device=DEVICE)


def step(cached: list[int], new: list[int], seed=1):
    """Queries and new rows of ``new[b]`` tokens for each request: ``-> (q, rows, positions, cu_seqlens)``."""
    g = torch.Generator().manual_seed(seed)
    T = sum(new)
    q = torch.randn(T, H, R + DR, generator=g).to(DTYPE).to(DEVICE)
    rows = torch.randn(T, R + DR, generator=g).to(DTYPE).to(DEVICE)
    positions = torch.tensor([c + i for c, n in zip(cached, new) for i in range(n)], device=DEVICE)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return q, rows, positions, cu


def attend(cache, table, lens, q, rows, positions, cu, **tiles):
    return latent_attention_invariant(q, cache, rows, table, lens, positions, request_of_token(cu, q.shape[0]),
                                      kv_rank=R, scale=0.3, **tiles)


@pytest.mark.parametrize("cached, new", [([0], [5]), ([7, 0, 37], [1, 1, 1]), ([9, 33], [4, 4]), ([3, 70], [6, 1])])
def test_matches_the_reference(cached, new):
    cache, table, lens = pool(cached)
    q, rows, positions, cu = step(cached, new)
    o, lse = attend(cache, table, lens, q, rows, positions, cu)
    want_o, want_lse = latent_attention_invariant_ref(q, cache, rows, table, lens, positions,
                                                      request_of_token(cu, q.shape[0]), kv_rank=R, scale=0.3)
    assert o.shape == (q.shape[0], H, R) and o.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(o, want_o, atol=TOL, rtol=TOL)
    torch.testing.assert_close(lse, want_lse, atol=TOL, rtol=TOL)


def _last_token(prompt, queries, cached_0, others=(), **tiles):
    """Request 0's prompt (``prompt [P, R + DR]`` rows, ``queries [P, H, R + DR]``) with its first ``cached_0``
    rows in the pool and the rest new, beside ``others`` [(cached, new)]: its last token's ``(o, lse)``."""
    P = prompt.shape[0]
    cached = [cached_0, *(c for c, _ in others)]
    cache, table, lens = pool(cached, seed=9)
    for j in range(cached_0):  # request 0's cached rows are its prompt's
        cache[int(table[0, j // S]), j % S] = prompt[j]
    q, rows = [queries[cached_0:]], [prompt[cached_0:]]
    for c, n in others:
        other_q, other_rows, _, _ = step([c], [n], seed=c)
        q.append(other_q)
        rows.append(other_rows)
    new = [P - cached_0, *(n for _, n in others)]
    positions = torch.tensor([c + i for c, n in zip(cached, new) for i in range(n)], device=DEVICE)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    o, lse = attend(cache, table, lens, torch.cat(q), torch.cat(rows), positions, cu, **tiles)
    return o[P - cached_0 - 1], lse[P - cached_0 - 1]


def _prompt(P, seed=5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(P, R + DR, generator=g).to(DTYPE).to(DEVICE),
            torch.randn(P, H, R + DR, generator=g).to(DTYPE).to(DEVICE))


def test_a_token_is_the_same_bits_in_a_prefill_a_verify_a_decode_and_beside_others():
    """Request 0's prompt of 11 tokens prefilled at once; the same prompt as 7 cached rows and a verify of 4;
    as 10 cached rows and a decode of 1, alone and beside two other requests: its last token's output and
    LSE are the same bits every time (the tiles follow positions, not the launch)."""
    prompt, queries = _prompt(11)
    runs = [_last_token(prompt, queries, c, others) for c, others in
            [(0, ()), (7, ()), (10, ()), (10, [(5, 2), (40, 1)]), (7, [(33, 4)])]]
    for o, lse in runs[1:]:
        assert torch.equal(o, runs[0][0]) and torch.equal(lse, runs[0][1])


@settings(max_examples=10, deadline=None)
@given(P=st.integers(1, 40), split=st.floats(0, 1), others=st.lists(st.tuples(st.integers(0, 50),
                                                                            st.integers(1, 5)), max_size=3))
def test_a_token_s_bits_follow_nothing_but_its_context(P, split, others):
    """Whatever part of its prompt is cached and whatever requests share the launch, a token is the bits of
    its decode alone (the prompt's other tokens cached)."""
    prompt, queries = _prompt(P, seed=P)
    o, lse = _last_token(prompt, queries, int(split * (P - 1)), others)
    want_o, want_lse = _last_token(prompt, queries, P - 1)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)


#: Keys in splits of 16 (tiles of 8) interpreted, of 32 (tiles of 16, the least a tensor-core dot takes) on CUDA:
#: the contexts here span several splits either way.
SPLITS = dict(block_n=8, split_keys=16) if DEVICE == "cpu" else dict(block_n=16, split_keys=32)


@settings(max_examples=5, deadline=None)
@given(P=st.integers(1, 60), split=st.floats(0, 1), launch=st.sampled_from([None, False, True]),
       others=st.lists(st.tuples(st.integers(0, 50), st.integers(1, 5)), max_size=3))
def test_a_token_s_bits_follow_nothing_but_its_context_across_splits(P, split, launch, others):
    """Keys in several splits, the splits in one program or each in its own and merged by a second launch,
    whatever shares the step: the bits of its decode alone, its splits walked in one program."""
    prompt, queries = _prompt(P, seed=P)
    o, lse = _last_token(prompt, queries, int(split * (P - 1)), others, split=launch, **SPLITS)
    want_o, want_lse = _last_token(prompt, queries, P - 1, split=False, **SPLITS)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)


def picks_of(positions, k, seed):
    """``k`` picks per token among the positions it sees (fewer where it sees fewer: -1), in random order."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for pos in positions.tolist():
        seen = torch.randperm(pos + 1, generator=g)[:k]
        rows.append(torch.cat([seen, torch.full((k - len(seen),), -1)])[torch.randperm(k, generator=g)])
    return torch.stack(rows).to(DEVICE)


@pytest.mark.parametrize("cached, new, k", [([0], [5], 4), ([7, 0, 37], [1, 1, 1], 8), ([9, 33], [4, 4], 40)])
def test_sparse_picks_match_the_reference(cached, new, k):
    cache, table, lens = pool(cached)
    q, rows, positions, cu = step(cached, new)
    picks = ascending_picks(picks_of(positions, k, seed=2))
    req = request_of_token(cu, q.shape[0])
    o, lse = latent_attention_invariant(q, cache, rows, table, lens, positions, req, kv_rank=R, scale=0.3,
                                        indices=picks)
    want_o, want_lse = latent_attention_invariant_ref(q, cache, rows, table, lens, positions, req, kv_rank=R,
                                                      scale=0.3, indices=picks)
    torch.testing.assert_close(o, want_o, atol=TOL, rtol=TOL)
    torch.testing.assert_close(lse, want_lse, atol=TOL, rtol=TOL)


def test_a_sparse_token_is_the_same_bits_whatever_its_launch_holds_and_none_picked_is_empty():
    cache, table, lens = pool([37, 21])
    q, rows, positions, cu = step([37, 21], [4, 4])
    picks = ascending_picks(picks_of(positions, 16, seed=6))
    req = request_of_token(cu, 8)
    o, lse = latent_attention_invariant(q, cache, rows, table, lens, positions, req, kv_rank=R, scale=0.3,
                                        indices=picks)
    # token 2 of request 0 alone in a launch of its own (request 0's first three rows come with it: its keys)
    o1, lse1 = latent_attention_invariant(q[:3], cache, rows[:3], table, lens, positions[:3], req[:3], kv_rank=R,
                                          scale=0.3, indices=picks[:3])
    assert torch.equal(o1[2], o[2]) and torch.equal(lse1[2], lse[2])
    none = torch.full_like(picks, -1)
    o0, lse0 = latent_attention_invariant(q, cache, rows, table, lens, positions, req, kv_rank=R, scale=0.3,
                                          indices=none)
    assert torch.equal(o0, torch.zeros_like(o0)) and bool(torch.isneginf(lse0).all())


@pytest.mark.parametrize("cached, new", [([40], [3]), ([7, 0, 37], [1, 1, 1]), ([3, 70], [6, 1])])
def test_splits_match_the_reference_and_where_they_run_changes_no_bit(cached, new):
    """Dense and sparse, keys in several splits: the reference's result, and the same bits whether one program
    walks a token's splits or each runs alone; a sparse row widened with pads (a wider pick table) too."""
    cache, table, lens = pool(cached)
    q, rows, positions, cu = step(cached, new)
    req = request_of_token(cu, q.shape[0])
    picks = ascending_picks(picks_of(positions, 40, seed=4))
    wide = torch.cat([picks, torch.full((picks.shape[0], 24), -1, dtype=picks.dtype, device=DEVICE)], 1)
    results = {}
    for name, indices in (("dense", None), ("picks", picks), ("wide", wide)):
        want_o, want_lse = latent_attention_invariant_ref(q, cache, rows, table, lens, positions, req, kv_rank=R,
                                                          scale=0.3, indices=indices)
        runs = [latent_attention_invariant(q, cache, rows, table, lens, positions, req, kv_rank=R, scale=0.3,
                                           indices=indices, split=launch, **SPLITS) for launch in (False, True)]
        torch.testing.assert_close(runs[0][0], want_o, atol=TOL, rtol=TOL)
        torch.testing.assert_close(runs[0][1], want_lse, atol=TOL, rtol=TOL)
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
        results[name] = runs[0]
    assert torch.equal(results["wide"][0], results["picks"][0]) and torch.equal(results["wide"][1], results["picks"][1])


def test_ascending_picks_keeps_each_row_s_set_with_the_pads_last():
    picks = torch.tensor([[5, -1, 2, 9], [-1, -1, 0, 3]])
    assert ascending_picks(picks).tolist() == [[2, 5, 9, -1], [0, 3, -1, -1]]
    with pytest.raises(ValueError, match="ascending_picks: picks: expected a \\[T, K\\] int32 or int64 tensor"):
        ascending_picks(picks.float())


def test_values_match_the_reference_and_a_row_ignores_the_rows_beside_it():
    g = torch.Generator().manual_seed(3)
    o_lat = torch.randn(37, H, R, generator=g).to(DEVICE)
    w_uv = (torch.randn(H, 24, R, generator=g) * R ** -0.5).to(DTYPE).to(DEVICE)
    got = latent_values(o_lat, w_uv)
    assert got.shape == (37, H, 24) and got.dtype == DTYPE
    torch.testing.assert_close(got.float(), latent_values_ref(o_lat, w_uv).float(), atol=TOL, rtol=TOL)
    for rows in (slice(5, 6), slice(30, 37), slice(0, 17)):
        assert torch.equal(latent_values(o_lat[rows], w_uv), got[rows])


def test_bad_arguments_name_themselves():
    cache, table, lens = pool([3])
    q, rows, positions, cu = step([3], [2])
    req = request_of_token(cu, 2)
    with pytest.raises(ValueError, match="new: expected shape"):
        latent_attention_invariant(q, cache, rows[:1], table, lens, positions, req, kv_rank=R, scale=1.0)
    with pytest.raises(ValueError, match="kv_rank: expected an int"):
        latent_attention_invariant(q, cache, rows, table, lens, positions, req, kv_rank=R + DR + 1, scale=1.0)
    with pytest.raises(ValueError, match="block_table: expected dtype torch.int32"):
        latent_attention_invariant(q, cache, rows, table.long(), lens, positions, req, kv_rank=R, scale=1.0)
    with pytest.raises(ValueError, match="split_keys: expected a positive multiple of block_n \\(32\\), got 48"):
        latent_attention_invariant(q, cache, rows, table, lens, positions, req, kv_rank=R, scale=1.0, split_keys=48)
    with pytest.raises(ValueError, match="block_n: expected a power of two >= 1 on cpu, got 12"
                       if DEVICE == "cpu" else "block_n: expected a power of two >= 16 on cuda, got 8"):
        latent_attention_invariant(q, cache, rows, table, lens, positions, req, kv_rank=R, scale=1.0,
                                   block_n=12 if DEVICE == "cpu" else 8, split_keys=48)
    with pytest.raises(ValueError, match="split: expected None or a bool, got 1"):
        latent_attention_invariant(q, cache, rows, table, lens, positions, req, kv_rank=R, scale=1.0, split=1)
    with pytest.raises(ValueError, match="w_uv: expected shape"):
        latent_values(torch.zeros(2, H, R, device=DEVICE), torch.zeros(H, 8, R + 1, device=DEVICE))
