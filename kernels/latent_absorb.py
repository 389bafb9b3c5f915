"""MLA's absorbed query in one launch: ``[q_nope W_UK, q_pe]`` per head, ``[T, H, R + Dr]``.

In a decode step the product is bound by reading ``W_UK`` (``[H, Dn, R]``, 16.8 MB at 128 heads): a
batched GEMM over 64 tokens reads it at under half the device's bandwidth, and copying ``q_pe`` beside
its result is a second launch through a strided destination. Here each program owns one head and one
tile of ``R``: it loads its weight tile once, runs every token block through it and stores straight
into the result's columns; the programs of the first tile copy the head's ``q_pe`` as well.
"""

import torch

from ._triton import next_pow2, require_triton, tl, triton


@triton.jit
def _absorb_query_kernel(
    QN, QP, W, OUT, T, H, Dn, R, Dr,
    sqn_t, sqn_h, sqp_t, sqp_h, sw_h, sw_d, so_t, so_h,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    r = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    w = tl.load(W + h * sw_h + d[:, None] * sw_d + r[None, :], mask=(d[:, None] < Dn) & (r[None, :] < R),
                other=0.0)  # [BLOCK_D, BLOCK_R]
    p = tl.arange(0, BLOCK_P)
    for t0 in range(0, T, BLOCK_T):
        t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        t_ok = t < T
        qn = tl.load(QN + t[:, None] * sqn_t + h * sqn_h + d[None, :], mask=t_ok[:, None] & (d[None, :] < Dn),
                     other=0.0)  # [BLOCK_T, BLOCK_D]
        acc = tl.dot(qn, w)  # fp32 [BLOCK_T, BLOCK_R]
        tl.store(OUT + t[:, None] * so_t + h * so_h + r[None, :], acc.to(OUT.dtype.element_ty),
                 mask=t_ok[:, None] & (r[None, :] < R))
        if tile == 0:
            pe_ok = t_ok[:, None] & (p[None, :] < Dr)
            pe = tl.load(QP + t[:, None] * sqp_t + h * sqp_h + p[None, :], mask=pe_ok)
            tl.store(OUT + t[:, None] * so_t + h * so_h + R + p[None, :], pe, mask=pe_ok)


def absorb_query_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``[q_nope W_UK, q_pe]``: ``q_nope [T, H, Dn]``, ``q_pe [T, H, Dr]``, ``w_uk [H, Dn, R]`` ->
    ``[T, H, R + Dr]`` in ``q_nope``'s dtype (the product accumulated in fp32)."""
    qa = torch.einsum("thd,hdr->thr", q_nope.float(), w_uk.float()).to(q_nope.dtype)
    return torch.cat([qa, q_pe.to(q_nope.dtype)], dim=-1)


def _check(q_nope, q_pe, w_uk):
    for name, t, dims in (("q_nope", q_nope, 3), ("q_pe", q_pe, 3), ("w_uk", w_uk, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"absorb_query: {name}: expected a {dims}-d tensor, got {got}")
        if t.stride(-1) != 1:
            raise ValueError(f"absorb_query: {name}: expected a unit stride on the last dim, got strides {t.stride()}")
    T, H, Dn = q_nope.shape
    if tuple(q_pe.shape[:2]) != (T, H):
        raise ValueError(f"absorb_query: q_pe: expected shape [T, H, Dr] = ({T}, {H}, Dr), got {tuple(q_pe.shape)}")
    if tuple(w_uk.shape[:2]) != (H, Dn):
        raise ValueError(f"absorb_query: w_uk: expected shape [H, Dn, R] = ({H}, {Dn}, R), got {tuple(w_uk.shape)}")
    for name, t in (("q_pe", q_pe), ("w_uk", w_uk)):
        if t.dtype != q_nope.dtype or t.device != q_nope.device:
            raise ValueError(f"absorb_query: {name}: expected {q_nope.dtype} on {q_nope.device} (q_nope's), got "
                             f"{t.dtype} on {t.device}")


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor, *, block_r: int = 128,
                 num_warps: int = 4) -> torch.Tensor:
    """`absorb_query_ref` in one launch (a new ``[T, H, R + Dr]`` tensor; nothing written into the
    arguments). ``block_r``: the columns of ``R`` one program owns (a power of two, >= 16)."""
    require_triton()
    _check(q_nope, q_pe, w_uk)
    if block_r < 16 or block_r & (block_r - 1):
        raise ValueError(f"absorb_query: block_r: expected a power of two >= 16, got {block_r!r}")
    T, H, Dn = q_nope.shape
    R, Dr = w_uk.shape[2], q_pe.shape[2]
    out = torch.empty((T, H, R + Dr), dtype=q_nope.dtype, device=q_nope.device)
    if T == 0:
        return out
    block_r = min(block_r, max(16, next_pow2(R)))
    grid = (H, triton.cdiv(R, block_r))
    _absorb_query_kernel[grid](
        q_nope, q_pe, w_uk, out, T, H, Dn, R, Dr,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), w_uk.stride(0), w_uk.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_T=max(16, min(64, next_pow2(T))), BLOCK_D=max(16, next_pow2(Dn)), BLOCK_R=block_r,
        BLOCK_P=max(16, next_pow2(Dr)), num_warps=num_warps)
    return out
