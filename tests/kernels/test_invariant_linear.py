"""invariant_linear: a row's product is the same bits alone and among any number of other rows, and it is
F.linear's product (fp32 accumulation) to rounding."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels.invariant_linear import (  # noqa: E402
    CHUNK_K,
    TILE,
    expert_tiles,
    invariant_grouped_linear,
    invariant_linear,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter's bf16 dot is wrong: bf16 only where a GPU runs it
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_a_row_is_the_same_bits_whatever_shares_the_call(dtype, bias):
    """... and whether K's chunks ran as programs of their own (split) or in the tile's program."""
    N, K = 70, CHUNK_K * 2 + 150  # neither a multiple of the tile: masked columns, a partial last chunk and step
    rows = 2 * TILE["block_m"] + 3  # more than one program of rows, the last one partial
    x, w = randn(rows, K, dtype=dtype, seed=1), randn(N, K, dtype=dtype, seed=2) / K ** 0.5
    b = randn(N, dtype=dtype, seed=3) if bias else None
    every = invariant_linear(x, w, b, split=False)
    assert torch.equal(invariant_linear(x, w, b, split=True), every)
    for m, split in ((1, True), (2, False), (5, True), (TILE["block_m"], None), (TILE["block_m"] + 1, True),
                     (rows, None)):
        part = invariant_linear(x[:m], w, b, split=split)
        assert torch.equal(part, every[:m]), (m, split)
    for i in (0, 7, rows - 1):  # alone, as a decode step computes it
        assert torch.equal(invariant_linear(x[i:i + 1], w, b)[0], every[i])
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(every.float(), want, rtol=tol, atol=tol)


def test_leading_dims_and_refusals():
    x, w = randn(2, 3, 40, dtype=torch.float32, seed=4), randn(24, 40, dtype=torch.float32, seed=5)
    y = invariant_linear(x, w)
    assert y.shape == (2, 3, 24)
    assert torch.equal(y.reshape(6, 24), invariant_linear(x.reshape(6, 40), w))
    with pytest.raises(ValueError, match="w: expected \\[N, 40\\]"):
        invariant_linear(x, randn(24, 41, dtype=torch.float32, seed=6))
    with pytest.raises(ValueError, match="w: expected x's dtype"):
        invariant_linear(x, w.half())
    with pytest.raises(ValueError, match="bias: expected \\[24\\]"):
        invariant_linear(x, w, torch.zeros(23, device=DEVICE))
    assert invariant_linear(x[:0], w).shape == (0, 3, 24)
    with pytest.raises(ValueError, match="split: expected None or a bool"):
        invariant_linear(x, w, split="yes")


def test_row_mean_squares_is_the_mean_and_ignores_the_rows_beside():
    """The invariant mode's RMSNorm statistics on CUDA (`models.norm_rope.row_mean_squares`): torch's mean of the
    squares to rounding, and a row's value the same bits alone, in a [T, C] batch and in a [T, H, C] head view."""
    from fnattn.models.norm_rope import row_mean_squares

    x = randn(6, 4, 40, dtype=torch.float32, seed=7)
    every = row_mean_squares(x)
    assert every.shape == (6, 4, 1)
    torch.testing.assert_close(every, x.pow(2).mean(-1, keepdim=True), rtol=1e-5, atol=1e-6)
    for t in (0, 3, 5):
        assert torch.equal(row_mean_squares(x[t:t + 1]), every[t:t + 1])
        assert torch.equal(row_mean_squares(x[t, 1]), every[t, 1])


def routing(T, k, E, seed, crowd=None):
    """[T, k] distinct experts per token; ``crowd``: every token's first pick (one expert with many pairs)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if crowd is not None:  # crowd first in every row, still k distinct experts
        for row in ids:
            j = (row == crowd).nonzero()
            row[int(j[0, 0]) if len(j) else 0] = row[0].clone()
            row[0] = crowd
    return ids.to(DEVICE)


@pytest.mark.parametrize("T, k, E, crowd", [(1, 2, 4, None), (7, 2, 5, 3), (40, 3, 6, 1), (33, 1, 1, 0),
                                            (5, 4, 64, None)])
def test_expert_tiles_hold_every_pair_once_in_tiles_of_one_expert(T, k, E, crowd):
    """The tile table of pairs sorted by expert: each real tile one expert's pairs, at most a dot tile of them,
    every pair in exactly one tile; the table's length a bound of P and E alone; the rest marked -1."""
    ids = routing(T, k, E, seed=T, crowd=crowd)
    picked, _ = ids.reshape(-1).sort(stable=True)
    expert, lo, hi = expert_tiles(picked, E)
    P, m = picked.numel(), TILE["block_m"]
    assert expert.numel() == max(1, min(P, P // m + min(E, P)))
    held = torch.zeros(P, dtype=torch.int64)
    for e, a, b in zip(expert.tolist(), lo.tolist(), hi.tolist()):
        if e < 0:
            continue
        assert 0 < b - a <= m and (picked[a:b] == e).all()
        held[a:b] += 1
    assert (held == 1).all()
    real = expert >= 0
    assert real[: int(real.sum())].all()  # the real tiles first


DTYPE_G = torch.float32 if DEVICE == "cpu" else torch.bfloat16


def test_grouped_rows_are_each_rows_product():
    """Each tile's rows are `invariant_linear`'s product of the same rows (the interpreter's dot, numpy's, may
    round a row by its place in the tile: there the comparison keeps the places); on a GPU each pair's row is
    the bits of its token alone, whatever else routed to its expert."""
    E, N, K, T, k = 5, 80, CHUNK_K + 44, 20, 2
    x, w = randn(T, K, dtype=DTYPE_G, seed=11), randn(E, N, K, dtype=DTYPE_G, seed=12) / K ** 0.5
    ids = routing(T, k, E, seed=13, crowd=3)  # expert 3: 20 pairs, two tiles
    picked, order = ids.reshape(-1).sort(stable=True)
    tiles = expert_tiles(picked, E)
    y = invariant_grouped_linear(x, w, tiles, order // k)
    for e, a, b in zip(*[v.tolist() for v in tiles]):
        if e >= 0:
            assert torch.equal(y[a:b], invariant_linear(x[order[a:b] // k], w[e])), (e, a, b)
    if DEVICE == "cuda":
        for p in range(picked.numel()):
            t = int(order[p]) // k
            assert torch.equal(y[p], invariant_linear(x[t:t + 1], w[int(picked[p])])[0]), p
    rows = randn(T * k, K, dtype=DTYPE_G, seed=14)  # src None: pair p takes row p
    y = invariant_grouped_linear(rows, w, tiles)
    for e, a, b in zip(*[v.tolist() for v in tiles]):
        if e >= 0:
            assert torch.equal(y[a:b], invariant_linear(rows[a:b], w[e])), (e, a, b)


def test_grouped_refusals():
    x, w = randn(4, 32, dtype=torch.float32, seed=14), randn(3, 16, 32, dtype=torch.float32, seed=15)
    tiles = expert_tiles(torch.tensor([0, 1, 1, 2], device=DEVICE), 3)
    with pytest.raises(ValueError, match=r"invariant_grouped_linear: w: expected \[E, N, 32\]"):
        invariant_grouped_linear(x, randn(3, 16, 31, dtype=torch.float32, seed=16), tiles)
    with pytest.raises(ValueError, match="tiles: expected three int32"):
        invariant_grouped_linear(x, w, tuple(t.long() for t in tiles))
    with pytest.raises(ValueError, match="src: expected an int"):
        invariant_grouped_linear(x, w, tiles, torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match=r"expert_tiles: picked: expected an int \[P\] tensor"):
        expert_tiles(torch.zeros(4, device=DEVICE), 3)
    with pytest.raises(ValueError, match="expert_tiles: num_experts: expected an int >= 1, got 0"):
        expert_tiles(torch.tensor([0, 1], device=DEVICE), 0)
    with pytest.raises(ValueError, match="each expert's rows contiguous"):
        invariant_grouped_linear(x, torch.zeros(3, 16, 40, device=DEVICE)[:, :, :32], tiles)


def test_invariant_moe_is_the_experts_sum_and_a_tokens_result_its_own(monkeypatch):
    """`models.common.invariant_moe` (the mode's MoE on CUDA): each token's SwiGLU experts weighted and summed,
    as the loop over experts gives it to rounding; on a GPU a token's row is the same bits alone, and in a long
    prefill's passes of `GROUPED_TOKENS` tokens."""
    from fnattn.models import common

    invariant_moe, moe_sum = common.invariant_moe, common.moe_sum

    E, D, inner, T, k = 6, 48, 40, 9, 2
    x = randn(T, D, dtype=DTYPE_G, seed=21)
    gate_up = randn(E, 2 * inner, D, dtype=DTYPE_G, seed=22) / D ** 0.5
    down = randn(E, D, inner, dtype=DTYPE_G, seed=23) / inner ** 0.5
    ids = routing(T, k, E, seed=24, crowd=2)
    weights = torch.rand(T, k, generator=torch.Generator().manual_seed(25)).to(DEVICE)

    def run(e, xs):
        g, u = (xs.float() @ gate_up[e].float().T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * u) @ down[e].float().T

    def combine(y, w):
        return y * w

    got = invariant_moe(x, ids, weights, gate_up, down, combine, limit=None)
    want = moe_sum(x.float(), ids, weights, E, run, combine)
    tol = 1e-4 if DTYPE_G == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    clipped = invariant_moe(x, ids, weights, gate_up, down, combine, limit=0.05)
    assert not torch.equal(clipped, got)
    monkeypatch.setattr(common, "GROUPED_TOKENS", 4)
    passes = invariant_moe(x, ids, weights, gate_up, down, combine, limit=None)  # 4 + 4 + 1 tokens
    if DEVICE == "cuda":
        assert torch.equal(passes, got)
    torch.testing.assert_close(passes.float(), want, rtol=tol, atol=tol)
    if DEVICE == "cuda":
        for t in (0, 4, T - 1):
            alone = invariant_moe(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], gate_up, down, combine)
            assert torch.equal(alone[0], got[t]), t
