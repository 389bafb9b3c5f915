"""GDN's gating in one launch: the log decay g and the write strength beta from the in_proj outputs a, b.

After the in_proj GEMM a Gated DeltaNet layer turns its per-head columns a and b into

    x    = a + dt_bias                                   fp32 (a promoted)
    g    = neg_decay * softplus(x)                       [T, H] fp32, neg_decay = -exp(A_log)
    beta = sigmoid(b)                                    [T, H] in b.dtype (fp32 math, then rounded)

In torch that is four elementwise launches a layer (add, softplus, mul, sigmoid), each
mostly launch overhead at decode sizes; here one program per block of rows x heads reads
a and b once (column slices of the GEMM output: any row stride) and writes both.

softplus follows torch's F.softplus: x * beta > threshold gives x, else
log1p(exp(x * beta)) / beta. exp and log1p are libdevice's (CUDA's expf / log1pf, what
torch's kernels call) and the divisions are IEEE-rounded (`div_rn`; Triton's plain `/`
is approximate in fp32), so the fp32 results agree with torch to an ulp or so (Triton
links libdevice flushing denormals: a |g| below 1.2e-38 may come out 0). Under
TRITON_INTERPRET=1 (no libdevice) exp is numpy's and log1p is computed from log.
Nothing is read back to the host and the outputs' sizes depend only on the shapes, so
the launch can be captured in a CUDA graph.
"""

import math

import torch
import torch.nn.functional as F

from ._triton import gdc_launch_dependents, gdc_wait, interpreted, next_pow2, pdl_launch, require_triton, tl, triton

try:
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - no triton: the kernel raises ImportError before it is traced
    libdevice = tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 1024  # elements per program: T=4096, H=16 -> 64 programs


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    # tl.exp lowers to the approximate ex2.approx (a few ulp at |x| ~ 20); libdevice's is CUDA's expf
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _log1p(e, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log1p(e)
    else:
        # the interpreter has no libdevice: log1p(e) = log(u) * e / (u - 1), u = 1 + e (exact where u == 1)
        u = 1.0 + e
        exact = (u == 1.0) | (e > 3.0e38)  # e tiny (log1p(e) = e) or inf
        return tl.where(exact, e, tl.log(u) * (e / tl.where(exact, 1.0, u - 1.0)))


@triton.jit
def log_decay(a, dt_bias, neg_decay, sp_beta, sp_threshold, LIBDEVICE: tl.constexpr):
    """``neg_decay * softplus(a + dt_bias)`` in fp32 (F.softplus's beta / threshold), elementwise."""
    x = a.to(tl.float32) + dt_bias
    xb = x * sp_beta
    one = tl.full(x.shape, 1.0, tl.float32)  # div_rn takes tensors on both sides (the interpreter needs it)
    big = xb > sp_threshold  # softplus(x) = x there; exp's argument is capped so that it does not overflow for nothing
    e = _exp(tl.where(big, sp_threshold, xb), LIBDEVICE)
    return neg_decay * tl.where(big, x, tl.math.div_rn(_log1p(e, LIBDEVICE), one * sp_beta))


@triton.jit
def write_strength(b, LIBDEVICE: tl.constexpr):
    """``sigmoid(b)`` in fp32, elementwise (an IEEE division)."""
    one = tl.full(b.shape, 1.0, tl.float32)
    return tl.math.div_rn(one, 1.0 + _exp(-b.to(tl.float32), LIBDEVICE))


@triton.jit
def gate_columns(y, m, n, m_ok, G, BETA, ND, DTB, col, H, sp_beta, sp_threshold, LIBDEVICE: tl.constexpr):
    """A GEMM epilogue: of the rounded output tile ``y [BM, BN]`` (rows ``m``, columns ``n``), columns
    ``[col, col + H)`` are GDN's b and ``[col + H, col + 2H)`` its a; write ``beta [M, H]`` and ``g [M, H]``
    from them as `_gating_kernel` does (F.softplus's defaults)."""
    hb = n - col  # [BN]
    ha = hb - H
    is_b = (hb >= 0) & (hb < H)
    is_a = (ha >= 0) & (ha < H)
    beta = write_strength(y, LIBDEVICE)
    tl.store(BETA + m[:, None] * H + hb[None, :], beta.to(BETA.dtype.element_ty), mask=m_ok[:, None] & is_b[None, :])
    dtb = tl.load(DTB + ha, mask=is_a, other=0.0)
    nd = tl.load(ND + ha, mask=is_a, other=0.0)
    g = log_decay(y, dtb[None, :], nd[None, :], sp_beta, sp_threshold, LIBDEVICE)
    tl.store(G + m[:, None] * H + ha[None, :], g, mask=m_ok[:, None] & is_a[None, :])


@triton.jit
def _gating_kernel(
    a_ptr, b_ptr, nd_ptr, dtb_ptr, g_ptr, beta_ptr,
    T, H, sa_t, sa_h, sb_t, sb_h, s_nd, s_dtb,
    sp_beta, sp_threshold,
    BT: tl.constexpr, BH: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr,
):
    rt = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    rh = tl.program_id(1) * BH + tl.arange(0, BH)
    mt = rt < T
    mh = rh < H
    m = mt[:, None] & mh[None, :]

    if PDL:  # inputs are read only after the launch before this one has finished (dt_bias and the decay too:
        gdc_wait()  # a model may compute them in the step)
        gdc_launch_dependents()
    dtb = tl.load(dtb_ptr + rh * s_dtb, mask=mh, other=0.0)
    nd = tl.load(nd_ptr + rh * s_nd, mask=mh, other=0.0)
    a = tl.load(a_ptr + rt[:, None] * sa_t + rh[None, :] * sa_h, mask=m, other=0.0)  # [BT, BH]
    g = log_decay(a, dtb[None, :], nd[None, :], sp_beta, sp_threshold, LIBDEVICE)
    tl.store(g_ptr + rt[:, None] * H + rh[None, :], g, mask=m)

    b = tl.load(b_ptr + rt[:, None] * sb_t + rh[None, :] * sb_h, mask=m, other=0.0)
    beta = write_strength(b, LIBDEVICE)
    tl.store(beta_ptr + rt[:, None] * H + rh[None, :], beta.to(beta_ptr.dtype.element_ty), mask=m)


def _check_number(name, v, *, nonzero=False):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or (nonzero and v == 0):
        want = "a non-zero real number" if nonzero else "a real number (not NaN)"
        raise ValueError(f"{name}: expected {want}, got {v!r}")
    return float(v)


def _check_args(a, b, neg_decay, dt_bias, beta_dtype, softplus_beta, softplus_threshold):
    """-> (T, H, beta_dtype, softplus_beta, softplus_threshold)."""
    for name, t in (("a", a), ("b", b), ("neg_decay", neg_decay), ("dt_bias", dt_bias)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise ValueError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if a.dim() != 2 or a.shape[1] < 1:
        raise ValueError(f"a: expected [T, H] with H >= 1, got shape {tuple(a.shape)}")
    T, H = a.shape
    if tuple(b.shape) != (T, H):
        raise ValueError(f"b: expected [T, H] = {(T, H)} like a, got shape {tuple(b.shape)}")
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name}: expected dtype float16, bfloat16 or float32, got {t.dtype}")
    for name, t in (("neg_decay", neg_decay), ("dt_bias", dt_bias)):
        if tuple(t.shape) != (H,):
            raise ValueError(f"{name}: expected [H] = [{H}], got shape {tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise ValueError(f"{name}: expected dtype float32, got {t.dtype}")
    for name, t in (("b", b), ("neg_decay", neg_decay), ("dt_bias", dt_bias)):
        if t.device != a.device:
            raise ValueError(f"{name}: expected device {a.device} (a's), got {t.device}")
    if beta_dtype is None:
        beta_dtype = b.dtype
    elif beta_dtype not in _DTYPES:
        raise ValueError(f"beta_dtype: expected None, torch.float16, torch.bfloat16 or torch.float32, "
                         f"got {beta_dtype!r}")
    return (T, H, beta_dtype, _check_number("softplus_beta", softplus_beta, nonzero=True),
            _check_number("softplus_threshold", softplus_threshold))


def gdn_gating(a, b, neg_decay, dt_bias, *, beta_dtype=None, softplus_beta=1.0, softplus_threshold=20.0):
    """``(g, beta)`` of a GDN layer in one launch.

    a, b [T, H] (float16 / bfloat16 / float32, any strides: column slices of the in_proj output);
    neg_decay = -exp(A_log) [H] and dt_bias [H], float32.
    Returns g = neg_decay * softplus(a + dt_bias) [T, H] float32 and beta = sigmoid(b) [T, H] in
    ``beta_dtype`` (default b.dtype), both fresh and contiguous. softplus_beta / softplus_threshold
    are F.softplus's beta / threshold.
    """
    require_triton()
    T, H, beta_dtype, sp_beta, sp_threshold = _check_args(a, b, neg_decay, dt_bias, beta_dtype,
                                                          softplus_beta, softplus_threshold)
    on_cpu = interpreted(_gating_kernel)  # TRITON_INTERPRET=1: CPU tensors, no libdevice
    if a.device.type != "cuda" and not on_cpu:
        raise ValueError(f"a: expected a CUDA tensor (or TRITON_INTERPRET=1 for CPU tensors), got device {a.device}")
    g = torch.empty(T, H, dtype=torch.float32, device=a.device)  # [T, H]
    beta = torch.empty(T, H, dtype=beta_dtype, device=a.device)  # [T, H]
    if T == 0:
        return g, beta
    BH = min(next_pow2(H), 128)
    BT = min(next_pow2(T), max(1, _BLOCK // BH))
    pdl = pdl_launch(a.device)
    _gating_kernel[(triton.cdiv(T, BT), triton.cdiv(H, BH))](
        a, b, neg_decay, dt_bias, g, beta,
        T, H, a.stride(0), a.stride(1), b.stride(0), b.stride(1), neg_decay.stride(0), dt_bias.stride(0),
        sp_beta, sp_threshold,
        BT=BT, BH=BH, LIBDEVICE=not on_cpu, num_warps=1 if BT * BH <= 128 else 4, PDL=pdl, launch_pdl=pdl,
    )
    return g, beta


def gdn_gating_ref(a, b, neg_decay, dt_bias, *, beta_dtype=None, softplus_beta=1.0, softplus_threshold=20.0):
    """Same contract as gdn_gating, in torch: the four elementwise ops a GDN layer's projection runs."""
    T, H, beta_dtype, sp_beta, sp_threshold = _check_args(a, b, neg_decay, dt_bias, beta_dtype,
                                                          softplus_beta, softplus_threshold)
    g = neg_decay * F.softplus(a.float() + dt_bias, beta=sp_beta, threshold=sp_threshold)  # [T, H] fp32
    # torch's sigmoid of a half / bf16 tensor computes in fp32 and rounds, as the kernel does
    beta = torch.sigmoid(b) if beta_dtype == b.dtype else torch.sigmoid(b.float()).to(beta_dtype)
    return g, beta
