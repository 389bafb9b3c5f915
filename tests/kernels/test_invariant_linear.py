"""invariant_linear: a row's product is the same bits alone and among any number of other rows, and it is
F.linear's product (fp32 accumulation) to rounding."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels.invariant_linear import CHUNK_K, TILE, invariant_linear  # noqa: E402

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
