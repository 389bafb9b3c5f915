"""Attention's per-head q / k RMSNorm and rotate-half rope in one launch; v made contiguous in the same one.

Gated full attention (Qwen3.5) slices q, k and v out of one qkv GEMM output, then normalizes each q and
k head (RMSNorm over the head dim, ``1 + weight`` scale) and rotates their first ``Dr`` dims (rope).
Unfused that is a q norm, a k norm and a rope launch, and at more than one token a copy of each of q, k
(a norm kernel wants rows of one stride: a head of a wider GEMM row is not) and v (the attention kernels
want contiguous heads): six launches a layer. Here one program per (token, head) reads its row once,
whatever the strides of the token and head dims, and writes it contiguous: q and k normalized and
rotated, v copied.

Roundings, as `models.common.rms_norm` (``offset``) then `models.common.apply_rope` compute them:
statistics in fp32, ``x * rstd * (offset + weight)`` rounded once to the input dtype; that value up to
fp32, rotated with the fp32 ``cos`` / ``sin`` (``rot * cos + rotate_half(rot) * sin``), rounded once.
The mean of squares is a tree sum over the row (torch sums in its own order) and the rotation may fuse
into FMAs, so the two agree to an ulp of fp32 before the rounding: to the dtype's rounding, not bit
for bit. Nothing is read back to the host: the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from ._checks import check_finite_float, check_like
from ._triton import gdc_launch_dependents, gdc_wait, next_pow2, pdl_launch, require_triton, tl, triton
from .launch import launch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _norm_rope_row(src, dst, W, COS, SIN, eps, offset, D: tl.constexpr, DR: tl.constexpr,
                   BLOCK: tl.constexpr):
    d = tl.arange(0, BLOCK)
    ok = d < D
    half = DR // 2
    partner = tl.where(d < half, d + half, d - half)  # rotate_half's other element, for d < DR
    rot = d < DR
    x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(W + d, mask=ok, other=0.0).to(tl.float32)
    h = (x * rstd * (offset + w)).to(dst.dtype.element_ty)  # rms_norm's one rounding
    xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
    wp = tl.load(W + partner, mask=rot, other=0.0).to(tl.float32)
    hp = (xp * rstd * (offset + wp)).to(dst.dtype.element_ty)
    c = tl.load(COS + d, mask=rot, other=0.0).to(tl.float32)
    s = tl.load(SIN + d, mask=rot, other=0.0).to(tl.float32)
    sign = tl.where(d < half, -1.0, 1.0)
    rotated = (h.to(tl.float32) * c + sign * hp.to(tl.float32) * s).to(dst.dtype.element_ty)
    tl.store(dst + d, tl.where(rot, rotated, h), mask=ok)


@triton.jit
def _qk_norm_rope_kernel(Q, K, V, QO, KO, VO, QW, KW, COS, SIN,
                         sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sc_t, ss_t, eps, offset,
                         HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                         DR: tl.constexpr, BLOCK: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    """Program (t, r): row r of token t, q heads first, then k heads, then v heads."""
    if PDL:  # inputs are read only after the launch before this one has finished
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1)
    cos = COS + t * sc_t
    sin = SIN + t * ss_t
    if r < HQ:
        _norm_rope_row(Q + t * sq_t + r * sq_h, QO + (t * HQ + r) * D, QW, cos, sin, eps, offset, D, DR, BLOCK)
    elif r < HQ + HKV:
        h = r - HQ
        _norm_rope_row(K + t * sk_t + h * sk_h, KO + (t * HKV + h) * D, KW, cos, sin, eps, offset, D, DR, BLOCK)
    else:
        h = r - HQ - HKV
        d = tl.arange(0, BLOCK_V)
        ok = d < DV
        row = tl.load(V + t * sv_t + h * sv_h + d, mask=ok)
        tl.store(VO + (t * HKV + h) * DV + d, row, mask=ok)


def _check(q, k, v, q_weight, k_weight, cos, sin, eps, offset):
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name}: expected a [T, H, D] tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    T, _, D = q.shape
    if q.dtype not in _DTYPES:
        raise ValueError(f"q: expected dtype float16, bfloat16 or float32, got {q.dtype}")
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k: expected shape [{T}, Hkv, {D}] (q's tokens and head dim), got {tuple(k.shape)}")
    operands = [("k", k, None), ("q_weight", q_weight, (D,)), ("k_weight", k_weight, (D,))]
    if v is not None:
        if not isinstance(v, torch.Tensor) or v.dim() != 3 or v.shape[:2] != k.shape[:2]:
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"v: expected shape [{T}, {k.shape[1]}, Dv] (k's tokens and heads), got {got}")
        operands.append(("v", v, None))
    for name, t, shape in operands:
        check_like(name, t, shape, q, "q")
    for name, t in (("q", q), ("k", k), ("v", v), ("q_weight", q_weight), ("k_weight", k_weight)):
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected unit stride along its last dim, got strides {t.stride()}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != T:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a [{T}, Dr] tensor (q's tokens), got {got}")
        if not t.dtype.is_floating_point or t.device != q.device:
            raise ValueError(f"{name}: expected a floating tensor on {q.device}, got {t.dtype} on {t.device}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name}: expected unit stride along its last dim, got strides {t.stride()}")
    Dr = cos.shape[1]
    if sin.shape != cos.shape:
        raise ValueError(f"sin: expected cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if Dr % 2 or Dr > D:
        raise ValueError(f"cos: expected an even number of rope dims <= the head dim {D}, got {Dr}")
    for name, val in (("eps", eps), ("offset", offset)):
        check_finite_float(name, val)
    if eps < 0:
        raise ValueError(f"eps: expected >= 0, got {eps!r}")


def qk_norm_rope(q: Float[Tensor, "T Hq D"], k: Float[Tensor, "T Hkv D"], v: Float[Tensor, "T Hkv Dv"] | None,
                 q_weight: Float[Tensor, " D"], k_weight: Float[Tensor, " D"], cos: Float[Tensor, "T Dr"],
                 sin: Float[Tensor, "T Dr"], *, eps: float, offset: float = 1.0
                 ) -> tuple[Float[Tensor, "T Hq D"], Float[Tensor, "T Hkv D"], Float[Tensor, "T Hkv Dv"] | None]:
    """``q [T, Hq, D]``, ``k [T, Hkv, D]`` -> each head RMS-normalized (scale ``offset + weight``, weights
    ``[D]``), its first ``Dr`` dims rotated by ``cos`` / ``sin`` ``[T, Dr]`` (rotate-half), contiguous;
    ``v [T, Hkv, Dv]`` (or None) copied contiguous: ``-> (q, k, v)``. Inputs may have any strides but a
    unit one along the last dim (column slices of one GEMM output)."""
    _check(q, k, v, q_weight, k_weight, cos, sin, eps, offset)
    T, Hq, D = q.shape
    Hkv, Dr = k.shape[1], cos.shape[1]
    qo = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((T, Hkv, D), dtype=q.dtype, device=q.device)
    vo = None if v is None else torch.empty(v.shape, dtype=v.dtype, device=v.device)
    rows = Hq + Hkv + (0 if v is None else Hkv)
    if T == 0 or rows == 0 or D == 0:
        return qo, ko, vo
    require_triton()
    Dv = 1 if v is None else v.shape[2]
    vv = q if v is None else v  # stands in for the pointer when there is no v: no program reads it
    pdl = pdl_launch(q.device)
    launch(_qk_norm_rope_kernel, (T, rows), (
        q, k, vv, qo, ko, qo if vo is None else vo, q_weight, k_weight, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1), cos.stride(0),
        sin.stride(0), float(eps), float(offset)), dict(HQ=Hq, HKV=Hkv, D=D, DV=Dv, DR=Dr, BLOCK=next_pow2(D),
        BLOCK_V=next_pow2(Dv), num_warps=4 if D >= 256 else 2, PDL=pdl, launch_pdl=pdl))
    return qo, ko, vo


def qk_norm_rope_ref(q: Float[Tensor, "T Hq D"], k: Float[Tensor, "T Hkv D"], v: Float[Tensor, "T Hkv Dv"] | None,
                     q_weight: Float[Tensor, " D"], k_weight: Float[Tensor, " D"], cos: Float[Tensor, "T Dr"],
                     sin: Float[Tensor, "T Dr"], *, eps: float, offset: float = 1.0
                     ) -> tuple[Float[Tensor, "T Hq D"], Float[Tensor, "T Hkv D"], Float[Tensor, "T Hkv Dv"] | None]:
    """The truth of `qk_norm_rope`, in torch: `models.common.rms_norm` then `models.common.apply_rope`'s
    roundings (this package imports nothing from fnattn; a test holds the three equal)."""
    _check(q, k, v, q_weight, k_weight, cos, sin, eps, offset)
    Dr = cos.shape[1]
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]

    def one(x, w):
        xf = x.float()
        h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.float())).to(x.dtype)
        rot = h[..., :Dr].float()
        half = torch.cat((-rot[..., Dr // 2:], rot[..., :Dr // 2]), dim=-1)
        return torch.cat(((rot * c + half * s).to(x.dtype), h[..., Dr:]), dim=-1)

    return one(q, q_weight), one(k, k_weight), None if v is None else v.contiguous()
