"""Merging partial attention results by their log-sum-exp (Triton).

Two partial results over disjoint key sets combine as (docs/layout.md)
    lse = logaddexp(lse1, lse2)
    o   = o1 * exp(lse1 - lse) + o2 * exp(lse2 - lse)
A part with lse == -inf attended nothing: its o is ignored (it may hold
anything), and when both are -inf the result is o = 0, lse = -inf. The `*_ref`
functions state it through `attention_naive.merge_states`, the one torch form.
"""

import math

import torch

from ._triton import gdc_launch_dependents, gdc_wait, next_pow2, pdl_launch, require_triton, tl, triton
from .attention_naive import merge_states
from .launch import launch


@triton.jit
def _merge_two_kernel(
    O1, L1, O2, L2, OUT, LSE_OUT, rows,
    so1, so2, so,
    DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    r_ok = r < rows
    r64 = r.to(tl.int64)
    dv = tl.arange(0, DV_PAD)
    mask = r_ok[:, None] & (dv < DV)[None, :]
    l1 = tl.load(L1 + r64, mask=r_ok, other=float("-inf"))
    l2 = tl.load(L2 + r64, mask=r_ok, other=float("-inf"))
    m = tl.maximum(l1, l2)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w1 = tl.exp(l1 - m_safe)
    w2 = tl.exp(l2 - m_safe)
    total = w1 + w2
    o1 = tl.load(O1 + r64[:, None] * so1 + dv[None, :], mask=mask, other=0.0).to(tl.float32)
    o2 = tl.load(O2 + r64[:, None] * so2 + dv[None, :], mask=mask, other=0.0).to(tl.float32)
    # A zero weight must not let a NaN/inf in an unused o through.
    o = tl.where(w1[:, None] > 0, o1, 0.0) * w1[:, None] + tl.where(w2[:, None] > 0, o2, 0.0) * w2[:, None]
    o = o / tl.where(total > 0, total, 1.0)[:, None]
    lse = tl.where(total > 0, m_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    tl.store(OUT + r64[:, None] * so + dv[None, :], o.to(OUT.dtype.element_ty), mask=mask)
    tl.store(LSE_OUT + r64, lse, mask=r_ok)


@triton.jit
def _merge_splits_kernel(
    O_PART, LSE_PART, SINKS, OUT, LSE, num_splits,
    sop_t, sop_h, sop_s, slp_t, slp_h, so_t, so_h, sl_t, sl_h,
    DV: tl.constexpr, DV_PAD: tl.constexpr, NS_PAD: tl.constexpr, HAS_SINK: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # inputs are read only after the launch before this one has finished
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, NS_PAD)
    s_ok = s < num_splits
    dv = tl.arange(0, DV_PAD)
    lse_s = tl.load(LSE_PART + t * slp_t + h * slp_h + s, mask=s_ok, other=float("-inf"))  # [NS]
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)  # [NS]; 0 for splits that attended nothing
    total = tl.sum(w, 0)
    o_s = tl.load(
        O_PART + t * sop_t + h * sop_h + s[:, None] * sop_s + dv[None, :],
        mask=s_ok[:, None] & (dv < DV)[None, :], other=0.0,
    )  # [NS, DV_PAD]
    o = tl.sum(tl.where(w[:, None] > 0, o_s, 0.0) * w[:, None], 0)  # [DV_PAD]
    if HAS_SINK:
        denom = total + tl.exp(tl.load(SINKS + h) - m_safe)
    else:
        denom = tl.where(total > 0, total, 1.0)
    tl.store(OUT + t * so_t + h * so_h + dv, (o / denom).to(OUT.dtype.element_ty), mask=dv < DV)
    lse = tl.where(total > 0, m_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    tl.store(LSE + t * sl_t + h * sl_h, lse)


def merge_splits(o_part, lse_part, o, lse, *, sinks=None):
    """Merge split-K partials into `o` / `lse` (fresh outputs of the caller).

    o_part [T, H, NS, Dv] fp32, lse_part [T, H, NS] fp32, o [T, H, Dv],
    lse [T, H] fp32, sinks [H] fp32 applied once here. Internal to the
    attention kernels: o and lse are the caller's own new buffers.
    """
    require_triton()
    T, H, NS, Dv = o_part.shape
    if T == 0 or H == 0:
        return o, lse
    pdl = pdl_launch(o.device)
    launch(_merge_splits_kernel, (T, H), (
        o_part, lse_part, sinks if sinks is not None else lse_part, o, lse, NS,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        o.stride(0), o.stride(1), lse.stride(0), lse.stride(1),
    ), dict(DV=Dv, DV_PAD=next_pow2(Dv), NS_PAD=next_pow2(NS), HAS_SINK=sinks is not None,
            num_warps=4, PDL=pdl, launch_pdl=pdl))
    return o, lse


def _check_pair(o1, lse1, o2, lse2):
    for name, t in (("o1", o1), ("lse1", lse1), ("o2", o2), ("lse2", lse2)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if o1.dim() < 1 or tuple(lse1.shape) != tuple(o1.shape[:-1]):
        raise ValueError(f"lse1: expected shape o1.shape[:-1] = {tuple(o1.shape[:-1])}, "
                         f"got {tuple(lse1.shape)}")
    if o2.shape != o1.shape:
        raise ValueError(f"o2: expected shape {tuple(o1.shape)} (o1's), got {tuple(o2.shape)}")
    if lse2.shape != lse1.shape:
        raise ValueError(f"lse2: expected shape {tuple(lse1.shape)} (lse1's), got {tuple(lse2.shape)}")
    if o2.dtype != o1.dtype:
        raise ValueError(f"o2: expected dtype {o1.dtype} (o1's), got {o2.dtype}")
    for name, t in (("lse1", lse1), ("lse2", lse2)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name}: expected dtype torch.float32, got {t.dtype}")
    for name, t in (("lse1", lse1), ("o2", o2), ("lse2", lse2)):
        if t.device != o1.device:
            raise ValueError(f"{name}: expected device {o1.device} (o1's), got {t.device}")


def merge_attention_states(o1, lse1, o2, lse2):
    """Merge two partial attention results over disjoint key sets.

    o1, o2 [..., Dv] (e.g. [T, H, Dv]); lse1, lse2 [...] fp32 natural log.
    Returns new tensors o [..., Dv] in o1's dtype and lse [...] fp32.
    """
    require_triton()
    _check_pair(o1, lse1, o2, lse2)
    Dv = o1.shape[-1]
    o = torch.empty_like(o1, memory_format=torch.contiguous_format)
    lse = torch.empty_like(lse1, memory_format=torch.contiguous_format)
    rows = lse1.numel()
    if rows == 0 or Dv == 0:
        return o, lse
    o1r, o2r = o1.reshape(rows, Dv), o2.reshape(rows, Dv)
    if o1r.stride(-1) != 1:
        o1r = o1r.contiguous()
    if o2r.stride(-1) != 1:
        o2r = o2r.contiguous()
    dv_pad = next_pow2(Dv)
    block_r = max(1, min(64, 4096 // dv_pad))
    _merge_two_kernel[(triton.cdiv(rows, block_r),)](
        o1r, lse1.reshape(rows).contiguous(), o2r, lse2.reshape(rows).contiguous(),
        o, lse, rows, o1r.stride(0), o2r.stride(0), Dv,
        DV=Dv, DV_PAD=dv_pad, BLOCK_R=block_r, num_warps=4,
    )
    return o, lse


def merge_attention_states_ref(o1, lse1, o2, lse2):
    """Reference for `merge_attention_states` (`attention_naive.merge_states`), in fp32; o in o1's dtype."""
    o, lse = merge_states(o1, lse1, o2, lse2)
    return o.to(o1.dtype), lse


@triton.jit
def own_row_weights(lc, s, empty):
    """A cached part's natural-log LSE ``lc`` and the own row's score ``s`` -> ``(m, wc, wn)``: the two parts'
    weights over ``exp(m)``. A cached part marked ``empty`` (no key: its output may hold anything) weighs 0;
    with both parts empty (a sparse token that left its own row out too) ``m`` is 0 and both weights 0."""
    lc = tl.where(empty, float("-inf"), lc)
    m = tl.maximum(lc, s)
    m = tl.where(m == float("-inf"), 0.0, m)
    return m, tl.exp(lc - m), tl.exp(s - m)


@triton.jit
def no_cached_key(lc):
    """Where kernels mark a query without a cached key: LSE +inf (FlashMLA) or undefined (NaN)."""
    return (lc != lc) | (lc == float("inf"))


@triton.jit
def _merge_new_token_kernel(
    O_C, L_C, Q, K, V, OUT, LSE_OUT, CACHE_LENS, ALLOWED,
    sm_scale, softcap, lse_scale,
    soc_b, soc_h, slc_b, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, so_b, so_h,
    G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_LENS: tl.constexpr, HAS_ALLOWED: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kvh = h // G
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    q = tl.load(Q + b * sq_b + h * sq_h + d, mask=d < D, other=0.0).to(tl.float32)
    k = tl.load(K + b * sk_b + kvh * sk_h + d, mask=d < D, other=0.0).to(tl.float32)
    s = tl.sum(q * k, 0) * sm_scale
    if SOFTCAP:
        s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)  # tanh
    if HAS_ALLOWED:  # a token that did not pick its own row keeps the cached part alone
        s = tl.where(tl.load(ALLOWED + b) != 0, s, float("-inf"))
    lc = tl.load(L_C + b * slc_b + h) * lse_scale  # the cached part's LSE, natural log
    empty = no_cached_key(lc)  # as is a request whose cache is empty
    if HAS_LENS:
        empty = empty | (tl.load(CACHE_LENS + b) == 0)
    m, wc, wn = own_row_weights(lc, s, empty)
    oc = tl.load(O_C + b * soc_b + h * soc_h + dv, mask=dv < DV, other=0.0).to(tl.float32)
    oc = tl.where(wc > 0, oc, 0.0)  # an empty cached part may hold anything
    v = tl.load(V + b * sv_b + kvh * sv_h + dv, mask=dv < DV, other=0.0).to(tl.float32)
    w = wc + wn
    o = (oc * wc + v * wn) / tl.where(w > 0, w, 1.0)
    tl.store(OUT + b * so_b + h * so_h + dv, o.to(OUT.dtype.element_ty), mask=dv < DV)
    tl.store(LSE_OUT + b * tl.num_programs(1) + h, tl.where(w > 0, m + tl.log(w), float("-inf")))


def merge_new_token(o_c, lse_c, q, k_new, v_new, *, scale, softcap=0.0, lse_base2=False, cache_lens=None,
                    allowed=None):
    """Fold each request's own new token into the attention over its cache, in one launch.

    o_c [B, Hq, Dv] and lse_c [B, Hq] fp32: attention of each decode query over
    its cached tokens (lse in base 2 when ``lse_base2``, as FlashInfer reports
    it); q [B, Hq, D]; k_new [B, Hkv, D]; v_new [B, Hkv, Dv]: the token the query
    is (not in the cache). Returns o [B, Hq, Dv] in o_c's dtype and lse [B, Hq]
    fp32 in natural log, as if the new token had been in the cache.

    A cached part is empty (its o_c ignored) where lse_c is -inf, +inf or NaN (how
    kernels mark a query without keys), and with ``cache_lens`` [B] int32 where
    the request's cache length is 0. With ``allowed`` [B] bool, a query where it is False does not attend its
    new token (a sparse layer's top-k that left it out): the cached part alone, in natural log (zero output
    and -inf when that part is empty too).
    """
    require_triton()
    B, Hq, D = q.shape
    Hkv, Dv = k_new.shape[1], v_new.shape[2]
    for name, t, shape in (("o_c", o_c, (B, Hq, Dv)), ("lse_c", lse_c, (B, Hq)), ("k_new", k_new, (B, Hkv, D)),
                           ("v_new", v_new, (B, Hkv, Dv))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (q's), got {t.device}")
    if Hq % Hkv:
        raise ValueError(f"k_new: expected a head count dividing q's {Hq}, got {Hkv}")
    if lse_c.dtype != torch.float32:
        raise ValueError(f"lse_c: expected dtype torch.float32, got {lse_c.dtype}")
    for name, t in (("o_c", o_c), ("q", q), ("k_new", k_new), ("v_new", v_new)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a unit stride on the last dim, got strides {t.stride()}")
    if cache_lens is not None and (tuple(cache_lens.shape) != (B,) or cache_lens.device != q.device
                                   or cache_lens.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"cache_lens: expected [{B}] int32 on {q.device}, got shape {tuple(cache_lens.shape)} "
                         f"{cache_lens.dtype} on {cache_lens.device}")
    if allowed is not None and (tuple(allowed.shape) != (B,) or allowed.device != q.device
                                or allowed.dtype not in (torch.bool, torch.int8)):
        raise ValueError(f"allowed: expected [{B}] bool on {q.device}, got shape {tuple(allowed.shape)} "
                         f"{allowed.dtype} on {allowed.device}")
    lse_c = lse_c.contiguous()
    o = torch.empty(B, Hq, Dv, dtype=o_c.dtype, device=q.device)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    if B == 0:
        return o, lse
    _merge_new_token_kernel[(B, Hq)](
        o_c, lse_c, q, k_new, v_new, o, lse, lse if cache_lens is None else cache_lens,
        lse if allowed is None else allowed.contiguous().view(torch.int8),
        float(scale), float(softcap), math.log(2.0) if lse_base2 else 1.0,
        o_c.stride(0), o_c.stride(1), lse_c.stride(0), q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1), o.stride(0), o.stride(1),
        G=Hq // Hkv, D=D, D_PAD=next_pow2(D), DV=Dv, DV_PAD=next_pow2(Dv), SOFTCAP=softcap > 0,
        HAS_LENS=cache_lens is not None, HAS_ALLOWED=allowed is not None, num_warps=1,
    )
    return o, lse


def merge_new_token_ref(o_c, lse_c, q, k_new, v_new, *, scale, softcap=0.0, lse_base2=False, cache_lens=None,
                        allowed=None):
    """Reference for `merge_new_token`: the new token's own score and value, merged by LSE."""
    g = q.shape[1] // k_new.shape[1]
    s = torch.einsum("bhd,bhd->bh", q.float(), k_new.float().repeat_interleave(g, dim=1)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if allowed is not None:
        s = s.masked_fill(~allowed.bool()[:, None], float("-inf"))
    lse_c = lse_c.float() * (math.log(2.0) if lse_base2 else 1.0)
    empty = torch.isnan(lse_c) | torch.isposinf(lse_c)
    if cache_lens is not None:
        empty = empty | (cache_lens == 0)[:, None]
    lse_c = lse_c.masked_fill(empty, float("-inf"))
    v = v_new.float().repeat_interleave(g, dim=1)
    o, lse = merge_states(o_c, lse_c, v, s)
    return o.to(o_c.dtype), lse
