"""The store side of `skinny_linear`'s kernel: the residual add, the tile's store (plain or SwiGLU's
activation) and the split-K partials' reduce kernel (Triton).

Kept apart from the kernel's body so each file stays readable; `skinny_linear` is the only user.
"""

from __future__ import annotations

from ._triton import tl, triton


@triton.jit
def _add_residual(total, R, SQ, U, UW, u_offset, m, n, m_ok, mask, pid_n, n_tiles, N, srm, dtype: tl.constexpr,
                  SQUARES: tl.constexpr):
    """The tile's fp32 sums plus its residual: rounded once (by the store), or with ``SQUARES`` as the unfused
    ``residual + linear(x, w)`` rounds, with the rows' sums of squares of the result stored at
    ``SQ[m, pid_n]`` and the result times ``u_offset + UW`` (the next RMSNorm's scale), rounded, in ``U``."""
    r = tl.load(R + m.to(tl.int64)[:, None] * srm + n[None, :], mask=mask, other=0.0).to(tl.float32)
    if not SQUARES:
        return total + r
    s = (total.to(dtype).to(tl.float32) + r).to(dtype).to(tl.float32)  # [BM, BN]; 0 outside the mask
    tl.store(SQ + m * n_tiles + pid_n, tl.sum(s * s, axis=1), mask=m_ok)
    uw = tl.load(UW + n, mask=n < N, other=0.0).to(tl.float32)  # [BN]
    tl.store(U + m.to(tl.int64)[:, None] * N + n[None, :], (s * (u_offset + uw[None, :])).to(dtype), mask=mask)
    return s


@triton.jit
def _store_tile(Y, y_at, acc, m, m_ok, mask, pid_n, N, sym, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """The tile's fp32 sums rounded into ``Y``; with ``SWIGLU`` (gate and up products alternating) the
    products are rounded as the GEMV stores them, then ``silu(gate)`` and the product are rounded as
    `norm_act.silu_and_mul` rounds them, into ``BLOCK_N / 2`` columns of ``Y [M, N / 2]``."""
    if SWIGLU:
        y = acc.to(Y.dtype.element_ty).to(tl.float32)
        g, u = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_N // 2, 2)))  # [BM, BN / 2] each
        s = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
        c = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)  # [BN / 2]
        tl.store(Y + m.to(tl.int64)[:, None] * sym + c[None, :], (s * u).to(Y.dtype.element_ty),
                 mask=m_ok[:, None] & (c < N // 2)[None, :])
    else:
        tl.store(y_at, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _skinny_gemv_splitk_reduce(P, Y, R, M, N, sym, srm, SPLIT_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                               BLOCK: tl.constexpr, WIDEN: tl.constexpr):
    """``Y[m] = sum_s P[s, m] (+ R[m])`` in fp32, in split order, the residual last, rounded once (to ``R``'s
    dtype, x's, then widened to fp32 under ``WIDEN``)."""
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(P + (s * M + row).to(tl.int64) * N + n, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        acc += tl.load(R + row.to(tl.int64) * srm + n, mask=ok, other=0.0).to(tl.float32)
    if WIDEN:
        acc = acc.to(R.dtype.element_ty).to(tl.float32)
    tl.store(Y + row.to(tl.int64) * sym + n, acc.to(Y.dtype.element_ty), mask=ok)
