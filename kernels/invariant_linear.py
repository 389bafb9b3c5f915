"""``y = x @ w.T (+ bias)`` whose every row is the same bits however many rows share the call (Triton).

A library GEMM picks its tiles, its split over K and sometimes its algorithm from the row count: a decode
step's one-row product and a verify's four-row product of the same row sum over K in different orders, and
round differently. Here the launch never looks at the row count: every program takes ``BLOCK_M`` rows (the
rows it does not have are masked loads of zeros, which touch no other row's sum) and one ``BLOCK_N`` slab of
``w``, and walks K in ``BLOCK_K`` steps from 0 up, one ``tl.dot`` a step, accumulating in fp32; the bias is
added to the fp32 sum and the result rounded once. Only the grid grows with M. So a row's result depends on
its own values and ``w`` alone: the batch-invariant matmul of the invariant mode (`fnattn.kernels.invariant`),
used for the models' projections on CUDA while the mode is on (`models.norm_rope.row_linear`).

The tile is fixed (`TILE`): no table by row count, no split-K. At decode sizes that costs against the tuned
GEMV (`fnattn.kernels.skinny_linear`), which splits K for a few rows; ``fnattn bench invariance`` reports the
mode's cost on the whole step.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from ._triton import check_rows, interpreted, require_triton, tl, triton

# One tile for every call: the property rests on it not changing with M (16 rows: the smallest dot tile).
TILE = {"block_m": 16, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3}


@triton.jit
def _invariant_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, s_xm, s_wn, s_ym,
                             HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm, cm = rows < M, cols < N
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # always from 0 up, in the same steps: the order of every row's sum
        km = (k0 + kk) < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * s_xm + (k0 + kk)[None, :], mask=rm[:, None] & km[None, :],
                    other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * s_wn + (k0 + kk)[None, :], mask=cm[:, None] & km[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * s_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rm[:, None] & cm[None, :])


def invariant_linear(x: Float[Tensor, "*B K"], w: Float[Tensor, "N K"],
                     bias: Float[Tensor, " N"] | None = None) -> Float[Tensor, "*B N"]:
    """``F.linear(x, w, bias)`` over ``x [..., K]`` and ``w [N, K]`` (the same dtype, bf16 / fp16 / fp32), each row
    computed alone in a fixed order (module docstring); fp32 inputs get an fp32 dot, not TF32's."""
    require_triton()
    owner = "invariant_linear"
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    check_rows(owner, "x", rows, "[M, K]", _invariant_linear_kernel)
    check_rows(owner, "w", w, "[N, K]", _invariant_linear_kernel)
    M, K = rows.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"{owner}: w: expected [N, {K}] (x's last dim), got {tuple(w.shape)}")
    if w.dtype != x.dtype or w.device != x.device:
        raise ValueError(f"{owner}: w: expected x's dtype and device ({x.dtype}, {x.device}), got "
                         f"{w.dtype}, {w.device}")
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"{owner}: bias: expected [{N}] {x.dtype} on {x.device}, got {tuple(bias.shape)} "
                         f"{bias.dtype} on {bias.device}")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        t = TILE
        grid = (triton.cdiv(M, t["block_m"]), triton.cdiv(N, t["block_n"]))
        _invariant_linear_kernel[grid](
            rows, w, bias if bias is not None else y, y, M, N, K, rows.stride(0), w.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=t["block_m"], BLOCK_N=t["block_n"], BLOCK_K=t["block_k"],
            **({} if interpreted(_invariant_linear_kernel) else {"num_warps": t["num_warps"],
                                                                  "num_stages": t["num_stages"]}))
    return y.view(*x.shape[:-1], N)
