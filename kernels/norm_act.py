"""The small ops between a decoder layer's projections, as kernels that hand the stream over early (Triton).

`add_rms_norm_`: the residual add and the next RMSNorm in one launch, written in place (the sum into
``residual``, the normed rows into ``y``), as FlashInfer's fused add + RMSNorm does. `silu_and_mul`:
SwiGLU's activation, ``silu(gate) * up``.

Both round as the unfused torch ops do (`models.common.rms_norm` of the rounded sum; ``F.silu`` then the
product). The point of having them besides FlashInfer's: under `fnattn.kernels.pdl` each calls
``gdc_launch_dependents`` right after its ``gdc_wait``, where FlashInfer's kernels hand over at their end,
so the GEMV after one can launch while it runs and stream its weights meanwhile (a GEMV asks L2 for its
weight slab before it waits with `SkinnyConfig.prefetch`).
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from ._checks import check_finite_float, check_like, shares_storage
from ._triton import check_rows, gdc_launch_dependents, gdc_wait, next_pow2, pdl_launch, require_triton, tl, triton


@triton.jit
def _add_rms_norm_kernel(Y, R, W, sy, sr, eps, offset, D: tl.constexpr, BLOCK: tl.constexpr,
                         OFFSET: tl.constexpr, PDL: tl.constexpr):
    """Program t: ``R[t] = R[t] + Y[t]`` (rounded), ``Y[t] = rms_norm(R[t])``."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    ok = d < D
    if PDL:  # every input only after the launch before this one has finished; the next may start now
        gdc_wait()
        gdc_launch_dependents()
    y = tl.load(Y + t * sy + d, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(R + t * sr + d, mask=ok, other=0.0).to(tl.float32)
    x = (r + y).to(R.dtype.element_ty)  # the residual stream keeps the rounded sum, and is normed as rounded
    tl.store(R + t * sr + d, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(W + d, mask=ok, other=0.0).to(tl.float32)
    if OFFSET:  # rms_norm's roundings: with an offset, one (after the scale); without, before and after it
        h = xf * rstd * (offset + w)
    else:
        h = (xf * rstd).to(Y.dtype.element_ty).to(tl.float32) * w
    tl.store(Y + t * sy + d, h.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _silu_and_mul_kernel(X, OUT, sx, inner, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (t, block): ``OUT[t] = silu(X[t, :inner]) * X[t, inner:]`` over one block of columns."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < inner
    if PDL:  # inputs only after the launch before this one has finished; the next may start now
        gdc_wait()
        gdc_launch_dependents()
    g = tl.load(X + t * sx + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(X + t * sx + inner + c, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty)  # F.silu's rounding, then the product's
    tl.store(OUT + t * inner + c, (s.to(tl.float32) * u).to(OUT.dtype.element_ty), mask=ok)


def add_rms_norm_(y: Float[Tensor, "T D"], residual: Float[Tensor, "T D"], weight: Float[Tensor, " D"], eps: float,
                  offset: float = 0.0) -> tuple[Float[Tensor, "T D"], Float[Tensor, "T D"]]:
    """``residual += y`` (rounded to its dtype) and ``y = rms_norm(residual, weight, eps, offset)`` in place,
    both ``[T, D]`` (rows may be strided, unit inner stride, apart from each other): ``-> (residual, y)``."""
    check_rows("add_rms_norm_", "y", y, "[T, D]", _add_rms_norm_kernel)
    check_like("add_rms_norm_: residual", residual, tuple(y.shape), y, "y")
    check_rows("add_rms_norm_", "residual", residual, "[T, D]", _add_rms_norm_kernel)
    check_like("add_rms_norm_: weight", weight, (y.shape[1],), y, "y")
    for name, v in (("eps", eps), ("offset", offset)):
        check_finite_float(f"add_rms_norm_: {name}", v)
    if eps < 0:
        raise ValueError(f"add_rms_norm_: eps: expected >= 0, got {eps!r}")
    if shares_storage(y, residual):
        raise ValueError("add_rms_norm_: residual: expected a buffer apart from y's, got one sharing y's storage")
    T, D = y.shape
    if T == 0 or D == 0:
        return residual, y
    require_triton()
    pdl = pdl_launch(y.device)
    _add_rms_norm_kernel[(T,)](y, residual, weight.contiguous(), y.stride(0), residual.stride(0), float(eps),
                               float(offset), D=D, BLOCK=next_pow2(D), OFFSET=offset != 0.0, PDL=pdl,
                               launch_pdl=pdl, num_warps=8 if D >= 4096 else 4 if D >= 1024 else 1)
    return residual, y


def silu_and_mul(gate_up: Float[Tensor, "T I2"]) -> Float[Tensor, "T I"]:
    """``gate_up [T, 2I]`` (gate | up; rows may be strided, unit inner stride) -> ``silu(gate) * up``, a new
    contiguous ``[T, I]`` in its dtype."""
    check_rows("silu_and_mul", "gate_up", gate_up, "[T, D]", _silu_and_mul_kernel)
    T, width = gate_up.shape
    if width % 2:
        raise ValueError(f"silu_and_mul: gate_up: expected an even last dim (gate | up), got {width}")
    inner = width // 2
    out = torch.empty((T, inner), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    require_triton()
    block = min(1024, next_pow2(inner))
    pdl = pdl_launch(gate_up.device)
    _silu_and_mul_kernel[(T, triton.cdiv(inner, block))](gate_up, out, gate_up.stride(0), inner, BLOCK=block,
                                                         PDL=pdl, launch_pdl=pdl, num_warps=4)
    return out


def add_rms_norm_ref(y: Float[Tensor, "T D"], residual: Float[Tensor, "T D"], weight: Float[Tensor, " D"], eps: float,
                     offset: float = 0.0) -> tuple[Float[Tensor, "T D"], Float[Tensor, "T D"]]:
    """The unfused ops, out of place: ``-> (residual + y, rms_norm(that sum))`` with `models.common.rms_norm`'s
    roundings (this package imports nothing from fnattn; a test holds the two equal)."""
    x = residual + y
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return x, (h * (offset + weight.float())).to(x.dtype)
    return x, h.to(x.dtype) * weight


def silu_and_mul_ref(gate_up: Float[Tensor, "T I2"]) -> Float[Tensor, "T I"]:
    g, u = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u
