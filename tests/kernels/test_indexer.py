"""The paged DSA indexer kernel against its torch reference and the per-request indexer math."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels.indexer import (  # noqa: E402
    configured,
    indexer_scores_paged,
    indexer_scores_paged_ref,
    indexer_topk,
    indexer_topk_ref,
)

from fnattn.kinds.sparse_mla.indexer import indexer_scores, topk_indices  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(cached, new, *, Hi=4, Di=32, S=4, dtype=torch.float32, seed=0, spare_pages=1):
    """Requests with ``cached[b]`` cached keys in shuffled pages and ``new[b]`` new tokens."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    B, T = len(cached), sum(new)
    M = max(-(-(c + n) // S) for c, n in zip(cached, new)) + spare_pages
    P = B * M + 1
    perm = torch.randperm(P - 1, generator=g) + 1  # page 0 stays unused, as a State's null page
    block_table = perm[: B * M].reshape(B, M).to(torch.int32)
    cache_k = r(P, S, Di)
    cache_k[0] = float("nan")  # a read of the null page would show
    q, w, new_k = r(T, Hi, Di), r(T, Hi).float(), r(T, Di)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(new), 0)), dtype=torch.int32)
    req = torch.repeat_interleave(torch.arange(B), torch.tensor(new))
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)])
    args = (q, w, cache_k, new_k, block_table.to(DEVICE), req.to(DEVICE), torch.tensor(cached, dtype=torch.int32,
            device=DEVICE), cu.to(DEVICE), positions.to(DEVICE))
    return args, (cached, new, S)


def per_request(args, layout, topk):
    """The per-request reference math (`fnattn.kinds.sparse_mla.indexer`) on the same keys."""
    q, w, cache_k, new_k, bt = args[:5]
    cached, new, S = layout
    scores, picks, t0 = [], [], 0
    for b, (c, n) in enumerate(zip(cached, new)):
        flat = cache_k[bt[b].long()].flatten(0, 1)[:c]
        keys = torch.cat((flat, new_k[t0:t0 + n]))
        s = indexer_scores(q[t0:t0 + n], w[t0:t0 + n], keys)
        scores.append(s)
        picks.append(topk_indices(s, n_cached=c, topk=topk))
        t0 += n
    return scores, torch.cat(picks)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
@pytest.mark.parametrize("cached, new", [([0], [5]), ([3, 0, 9], [1, 1, 1]), ([5, 2], [3, 4]), ([7], [1])])
def test_scores_match_reference_and_math(dtype, tol, cached, new):
    args, layout = case(cached, new, dtype=dtype)
    scale = args[0].shape[-1] ** -0.5
    ref = indexer_scores_paged_ref(*args, scale=scale)
    got = indexer_scores_paged(*args, scale=scale)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert torch.equal(torch.isinf(got), torch.isinf(ref))  # the causal limit, exactly
    fin = torch.isfinite(ref)
    assert not torch.isnan(got).any()
    err = (got[fin] - ref[fin]).abs().max() / ref[fin].abs().max().clamp_min(1e-6)
    assert err <= tol, f"max rel err {err:.3e}"
    # the paged scores restricted to each token's visible positions are the per-request math's
    scores, _ = per_request(args, layout, topk=4)
    t0 = 0
    for (c, n), s in zip(zip(*layout[:2]), scores):
        for i in range(n):
            vis = c + i + 1
            assert torch.allclose(ref[t0 + i, :vis], s[i, :vis].float(), rtol=tol, atol=tol)
            assert torch.isinf(ref[t0 + i, vis:]).all()
        t0 += n


def as_set(picks):
    """Each row's positions in ascending order (-1 first): the picks as a set."""
    return picks.sort(dim=-1).values


@pytest.mark.parametrize("topk", [1, 3, 64])
def test_topk_matches_per_request_selection(topk):
    args, layout = case([6, 0, 11], [2, 3, 1], Hi=5, Di=24, S=4)
    scale = args[0].shape[-1] ** -0.5
    _, want = per_request(args, layout, topk)
    assert torch.equal(indexer_topk_ref(*args, scale=scale, topk=topk), want)
    assert torch.equal(as_set(indexer_topk(*args, scale=scale, topk=topk)), as_set(want))  # in its own order


def test_bad_shapes_are_refused():
    args, _ = case([2], [1])
    bad = list(args)
    bad[3] = bad[3][:, :-1]
    with pytest.raises(ValueError, match="new_k"):
        indexer_scores_paged_ref(*bad, scale=1.0)
    with pytest.raises(ValueError, match="topk"):
        indexer_topk_ref(*args, scale=1.0, topk=0)


@pytest.mark.parametrize("tile", [dict(block_n=16, split=64), dict(block_n=32, split=32, num_warps=8),
                                  dict(block_n=16, split=16, keys_major=0), dict(block_n=128, num_stages=2)])
def test_other_tiles_score_as_the_default(tile):
    """`configured`: more positions a dot, several dots a program with the token's queries loaded once, the dot
    with heads as its rows; a program's range may hold cached, new and unseen positions, the last program's
    blocks past N are masked, the causal limit holds in every block."""
    args, _ = case([37, 0, 5], [2, 3, 1], Hi=5, Di=24, S=4, spare_pages=3)
    scale = args[0].shape[-1] ** -0.5
    want = indexer_scores_paged(*args, scale=scale)
    with configured(**tile):
        got = indexer_scores_paged(*args, scale=scale)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fields, message", [
    (dict(block_m=16), "configured: block_m: expected one of block_n, split, num_warps, num_stages, keys_major"),
    (dict(block_n=8), "configured: block_n: expected a power of two in 16..256, got 8"),
    (dict(block_n=512), "configured: block_n: expected a power of two in 16..256, got 512"),
    (dict(split=48), r"configured: split: expected 0 or a power of two >= block_n=128, got 48"),
    (dict(block_n=64, split=32), r"configured: split: expected 0 or a power of two >= block_n=64, got 32"),
    (dict(keys_major=2), "configured: keys_major: expected an int in 0..1, got 2"),
    (dict(num_stages=0), "configured: num_stages: expected an int in 1..8, got 0"),
    (dict(num_warps=True), "configured: num_warps: expected a power of two in 1..64, got True"),
])
def test_configured_refuses_a_bad_tile_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        with configured(**fields):
            pass


def fp8_case(cached, new, **kw):
    """`case`'s keys stored as float8 e4m3 with a per-key fp32 scale (cached and new), q kept in fp32."""
    args, layout = case(cached, new, **kw)
    q, w, cache_k, new_k = args[:4]
    finite = torch.nan_to_num(cache_k, nan=0.0)
    cache_scale = finite.abs().amax(-1, keepdim=True).clamp_min(1e-3) / 448  # [P, S, 1]
    cache_8 = (finite / cache_scale).to(torch.float8_e4m3fn)
    new_scale = new_k.abs().amax(-1, keepdim=True) / 448  # [T, 1]
    new_8 = (new_k / new_scale).to(torch.float8_e4m3fn)
    return (q, w, cache_8, new_8, *args[4:]), dict(cache_scale=cache_scale, new_scale=new_scale), layout


@pytest.mark.parametrize("tile", [{}, dict(block_n=16, split=64), dict(block_n=16, split=16, keys_major=0)])
@pytest.mark.parametrize("cached, new", [([0], [5]), ([3, 0, 9], [1, 1, 1]), ([5, 2], [3, 4])])
def test_fp8_keys_score_as_their_scaled_values(cached, new, tile):
    """FP8 keys: the kernel reads them as stored and scales each key's score; the reference does the same, and
    both equal the scores of the dequantized keys (the scale is positive, so it leaves the relu)."""
    args, scales, _ = fp8_case(cached, new)
    scale = args[0].shape[-1] ** -0.5
    ref = indexer_scores_paged_ref(*args, scale=scale, **scales)
    with configured(**tile):
        got = indexer_scores_paged(*args, scale=scale, **scales)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), fin)
    torch.testing.assert_close(got[fin], ref[fin], rtol=1e-5, atol=1e-5)
    q, w, cache_8, new_8 = args[:4]
    plain = (q, w, cache_8.float() * scales["cache_scale"], new_8.float() * scales["new_scale"], *args[4:])
    dequantized = indexer_scores_paged_ref(*plain, scale=scale)
    torch.testing.assert_close(ref[fin], dequantized[fin], rtol=1e-5, atol=1e-5)
    picks = indexer_topk(*args, scale=scale, topk=4, **scales)
    assert torch.equal(as_set(picks), as_set(indexer_topk_ref(*args, scale=scale, topk=4, **scales)))


def test_fp8_keys_need_their_scales_and_plain_keys_refuse_them():
    args, scales, _ = fp8_case([3], [2])
    with pytest.raises(ValueError, match=r"cache_scale: expected a float32 tensor of shape \(\d+, 4, 1\) with FP8 "
                                         r"keys, got None"):
        indexer_scores_paged_ref(*args, scale=1.0)
    with pytest.raises(ValueError, match=r"new_scale: expected a float32 tensor of shape \(2, 1\)"):
        indexer_scores_paged(*args, scale=1.0, cache_scale=scales["cache_scale"], new_scale=scales["new_scale"][:1])
    plain, _ = case([3], [2])
    with pytest.raises(ValueError, match="cache_scale / new_scale: expected None with torch.float32 keys"):
        indexer_scores_paged(*plain, scale=1.0, **scales)


def test_radix_select_where_it_cannot_serve():
    """`radix_topk` names why it cannot select (top-k other than 2048, a CPU tensor, no sgl_kernel);
    `indexer_topk(radix=True)` keeps ``torch.topk`` there, with the same picks."""
    from fnattn.kernels.indexer import radix_reasons, radix_topk

    args, layout = case([6, 0, 11], [2, 3, 1], Hi=5, Di=24, S=4)
    scale = args[0].shape[-1] ** -0.5
    scores = indexer_scores_paged_ref(*args, scale=scale)
    reasons = radix_reasons(scores, 3)
    assert any("2048" in r for r in reasons)
    with pytest.raises(ValueError, match="radix_topk: .*2048"):
        radix_topk(scores, args[-1], 3)
    if not torch.cuda.is_available():
        assert any("CUDA" in r for r in radix_reasons(scores, 2048))
    want = indexer_topk_ref(*args, scale=scale, topk=3)
    assert torch.equal(as_set(indexer_topk(*args, scale=scale, topk=3, radix=True)), as_set(want))
    with pytest.raises(ValueError, match="radix: expected True or False, got 'yes'"):
        indexer_topk(*args, scale=scale, topk=3, radix="yes")


@pytest.mark.parametrize("K", [5, 200])
def test_sort_positions_orders_each_row_latest_first(K):
    """The radix select's picks come in the order its threads arrive; `sort_positions` makes them one order
    (latest first, -1 last) in one launch, the same as torch's sort."""
    from fnattn.kernels.indexer import sort_positions

    g = torch.Generator().manual_seed(K)
    picked = torch.stack([torch.randperm(3 * K, generator=g)[:K] for _ in range(3)]).to(torch.int32)
    picked[1, K // 2:] = -1  # a row with fewer visible positions than K
    picked = picked.to(DEVICE)
    want = picked.long().sort(dim=-1, descending=True).values
    assert torch.equal(sort_positions(picked), want)
    with pytest.raises(ValueError, match=r"picked: expected \[T, K\] int32 rows of unit stride, got \(3, \d+\) "
                                         r"torch.int64"):
        sort_positions(picked.long())
