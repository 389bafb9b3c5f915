"""What the skinny GEMV's tests share (tests/kernels/test_skinny_linear.py, test_skinny_folds.py): seeded
inputs on the test device and the tolerance the kernel is held to. Imports torch only, so a test can set
TRITON_INTERPRET before it imports the kernels."""

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def close(y, ref, dtype):
    assert y.dtype == ref.dtype == dtype and y.shape == ref.shape
    tol = TOL[dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


def lopsided(M, K, dtype, seed):
    """Rows whose first 40 columns are ten times the rest: statistics over a split-K piece alone would be far
    from the whole row's."""
    x = randn(M, K, seed=seed)
    x[:, :40] *= 10
    return x.to(dtype)
