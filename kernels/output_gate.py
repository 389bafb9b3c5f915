"""The gates on a token mixer's output, one launch each over strided gates (Triton).

`gated_rms_norm_silu`: ``rms_norm(x) * weight * silu(z)`` per head, Gated DeltaNet's output norm, with
``z`` read where the input projection left it (a column slice: no copy to contiguous first).
`sigmoid_gate`: ``x * sigmoid(gate)``, gated attention's output gate, likewise.

Both round as the unfused torch ops do (`models.common.rms_norm` then the gate; ``torch.sigmoid`` then
the product), so they agree with them to the last bit but for the odd ulp of fp32 ``exp`` / ``sqrt``. Under
`fnattn.kernels.pdl` they launch with programmatic dependent launch: a launch after them may start as soon
as theirs has, which lets the output projection after them load its weights while they run.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from ._checks import check_finite_float, check_like
from ._triton import check_rows, gdc_launch_dependents, gdc_wait, next_pow2, pdl_launch, require_triton, tl, triton
from .invariant import invariant_on
from .launch import launch


@triton.jit
def _gated_norm_kernel(OUT, X, Z, W, sx_t, sx_h, sz_t, sz_h, eps, H, N, D: tl.constexpr, BLOCK: tl.constexpr,
                       ROWS: tl.constexpr, PDL: tl.constexpr):
    """Program p: head rows p * ROWS ... of the N = T * H (row t * H + h is head h of token t)."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    t, h = row // H, row % H
    d = tl.arange(0, BLOCK)
    ok = (row < N)[:, None] & (d < D)[None, :]
    if PDL:  # every input only after the launch before this one has finished
        gdc_wait()
        gdc_launch_dependents()
    w = tl.load(W + d, mask=d < D, other=0.0)[None, :]
    x = tl.load(X + (t * sx_t + h * sx_h)[:, None] + d[None, :], mask=ok, other=0.0).to(tl.float32)
    z = tl.load(Z + (t * sz_t + h * sz_h)[:, None] + d[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)
    normed = (x * rstd[:, None]).to(OUT.dtype.element_ty)  # rms_norm's roundings without an offset: before
    normed = (normed.to(tl.float32) * w.to(tl.float32)).to(OUT.dtype.element_ty)  # the weight, and after it
    gate = z / (1.0 + tl.exp(-z))  # silu in fp32
    tl.store(OUT + row[:, None] * D + d[None, :], (normed.to(tl.float32) * gate).to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _sigmoid_gate_kernel(OUT, X, G, sx_t, sx_h, sg_t, sg_h, H, N, D: tl.constexpr, BLOCK: tl.constexpr,
                         ROWS: tl.constexpr, PDL: tl.constexpr):
    """Program p: head rows p * ROWS ... of ``x * sigmoid(gate)``, as `_gated_norm_kernel` numbers them."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    t, h = row // H, row % H
    d = tl.arange(0, BLOCK)
    ok = (row < N)[:, None] & (d < D)[None, :]
    if PDL:  # inputs only after the launch before this one has finished
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(X + (t * sx_t + h * sx_h)[:, None] + d[None, :], mask=ok, other=0.0).to(tl.float32)
    g = tl.load(G + (t * sg_t + h * sg_h)[:, None] + d[None, :], mask=ok, other=0.0).to(tl.float32)
    s = (1.0 / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty)  # torch.sigmoid's rounding, then the product's
    tl.store(OUT + row[:, None] * D + d[None, :], (x * s.to(tl.float32)).to(OUT.dtype.element_ty), mask=ok)


def _check_pair(owner: str, x, gate, gate_name: str, kernel):
    check_rows(owner, "x", x, "[T, H, D]", kernel)
    check_like(f"{owner}: {gate_name}", gate, tuple(x.shape), x, "x")
    check_rows(owner, gate_name, gate, "[T, H, D]", kernel)


# Head rows a program takes once there are this many: at decode sizes one row a program spreads the few rows
# over as many SMs as it can; at prefill sizes (T * H ~ 10^5) one-warp programs of one row leave the SMs
# waiting on memory (the gated norm ran at ~0.6 TB/s at 8192 tokens), so each program takes ROWS_MANY rows.
MANY_ROWS = 1024
ROWS_MANY = 16


def _launch(kernel, x, *args):
    """A new contiguous ``[T, H, D]`` like ``x``, written by ``kernel[grid](out, *args, H, N)`` over its
    N = T * H head rows (not launched when it is empty)."""
    T, H, D = x.shape
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    n = T * H
    if out.numel():
        require_triton()
        pdl = pdl_launch(x.device)
        # in the invariant mode a row per program at every size: the programs' shape must not follow n
        rows = ROWS_MANY if n >= MANY_ROWS and not invariant_on() else 1
        warps = 4 if rows > 1 or D > 256 else 1
        launch(kernel, (triton.cdiv(n, rows),), (out, *args, H, n),
               dict(D=D, BLOCK=next_pow2(D), ROWS=rows, PDL=pdl, launch_pdl=pdl, num_warps=warps))
    return out


def gated_rms_norm_silu(x: Float[Tensor, "T H D"], z: Float[Tensor, "T H D"], weight: Float[Tensor, " D"],
                        eps: float) -> Float[Tensor, "T H D"]:
    """``x [T, H, D]`` (any strides but the last) -> ``rms_norm(x, weight, eps) * silu(z)`` per head
    (`models.common.rms_norm`'s roundings, then the gate in fp32, rounded once), a new contiguous
    ``[T, H, D]`` in ``x.dtype``; ``z`` like ``x`` (a column slice of a projection), ``weight [D]``."""
    _check_pair("gated_rms_norm_silu", x, z, "z", _gated_norm_kernel)
    check_like("gated_rms_norm_silu: weight", weight, (x.shape[2],), x, "x")
    check_finite_float("gated_rms_norm_silu: eps", eps)
    if eps < 0:
        raise ValueError(f"gated_rms_norm_silu: eps: expected >= 0, got {eps!r}")
    return _launch(_gated_norm_kernel, x, x, z, weight.contiguous(), x.stride(0), x.stride(1), z.stride(0),
                   z.stride(1), float(eps))


def sigmoid_gate(x: Float[Tensor, "T H D"], gate: Float[Tensor, "T H D"]) -> Float[Tensor, "T H D"]:
    """``x [T, H, D]`` (any strides but the last) -> ``x * sigmoid(gate)``, rounded as ``torch.sigmoid``
    then the product are: a new contiguous ``[T, H, D]`` in ``x.dtype``; ``gate`` like ``x``."""
    _check_pair("sigmoid_gate", x, gate, "gate", _sigmoid_gate_kernel)
    return _launch(_sigmoid_gate_kernel, x, x, gate, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1))


def gated_rms_norm_silu_ref(x: Float[Tensor, "T H D"], z: Float[Tensor, "T H D"], weight: Float[Tensor, " D"],
                            eps: float) -> Float[Tensor, "T H D"]:
    """The unfused ops: `models.common.rms_norm` (statistics in fp32, rounded before and after the weight),
    times ``silu(z)`` in fp32, rounded once."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return (normed.float() * torch.nn.functional.silu(z.float())).to(x.dtype)


def sigmoid_gate_ref(x: Float[Tensor, "T H D"], gate: Float[Tensor, "T H D"]) -> Float[Tensor, "T H D"]:
    return x * torch.sigmoid(gate)
