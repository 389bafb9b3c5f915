"""Chunked (WY / UT-transform) gated delta rule for prefill, GDN and KDA.

Inside a chunk of C tokens, with G_i = cumulative log decay from the chunk start
(scalar for GDN, [K] for KDA), entry state S0 and row vectors q_i, k_i:

    A_ij  = beta_i * sum_c k_ic k_jc exp(G_ic - G_jc)        j < i
    M     = I + A                                            unit lower triangular
    w     = M^-1 (beta * k * exp(G))        [C, K]
    u     = M^-1 (beta * v)                 [C, V]
    U     = u - w S0                        the delta-rule corrections of the chunk
    o_i   = scale * (q_i * exp(G_i)) S0 + sum_{j<=i} scale * (q_i . k_j exp(G_i - G_j)) U_j
    S_end = exp(G_last) * S0 + sum_j (k_j * exp(G_last - G_j))^T U_j

Four launches: a chunk-local cumsum of g, the intra-chunk matrices A and Aqk (every
chunk in parallel), the triangular solve giving w and u (every chunk in parallel), and
one sequential pass per (request, head, V block) that carries the state over chunks
and writes the outputs. Every exponent is kept <= 0 (decays are <= 1), so nothing
overflows: for KDA the off-diagonal 16x16 blocks of A are products of two factors
each taken relative to the first row of the later sub-chunk, and diagonal blocks are
built column by column with the exact pairwise decay.
"""

import torch

from ._triton import require_triton, tl, triton
from .gdn_common import (
    cdiv,
    check_gated_delta_args,
    check_out,
    dot_precision,
    inner_contiguous,
    l2norm,
    pow2,
    start_state,
    value_heads,
)
from .gdn_naive import gated_delta_chunked_seq


@triton.jit
def _chunk_bounds(cu_ptr, cseq_ptr, cidx_ptr, c, BT: tl.constexpr):
    seq = tl.load(cseq_ptr + c)
    idx = tl.load(cidx_ptr + c)
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    eos = tl.load(cu_ptr + seq + 1).to(tl.int64)
    return bos + idx * BT, eos


@triton.jit
def _chunk_cumsum_kernel(
    g_ptr, gc_ptr, cu_ptr, cseq_ptr, cidx_ptr,
    sg_t, sg_h, sc_t, sc_h,
    K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, IS_KDA: tl.constexpr,
):
    t0, eos = _chunk_bounds(cu_ptr, cseq_ptr, cidx_ptr, tl.program_id(0), BT)
    hv = tl.program_id(1)
    rt = t0 + tl.arange(0, BT)
    mt = rt < eos
    if IS_KDA:
        rk = tl.arange(0, BK)
        m = mt[:, None] & (rk < K)[None, :]
        x = tl.load(g_ptr + rt[:, None] * sg_t + hv * sg_h + rk[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(gc_ptr + rt[:, None] * sc_t + hv * sc_h + rk[None, :], tl.cumsum(x, axis=0), mask=m)
    else:
        x = tl.load(g_ptr + rt * sg_t + hv * sg_h, mask=mt, other=0.0).to(tl.float32)
        tl.store(gc_ptr + rt * sc_t + hv * sc_h, tl.cumsum(x, axis=0), mask=mt)


@triton.jit
def _chunk_intra_kernel(
    q_ptr, k_ptr, gc_ptr, beta_ptr, akk_ptr, aqk_ptr, cu_ptr, cseq_ptr, cidx_ptr,
    scale,
    sq_t, sq_h, sk_t, sk_h, sc_t, sc_h, sb_t, sb_h, sa_t, sa_h,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_KDA: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # one program: rows of sub-chunk `ib` of one chunk, one value head
    t0, eos = _chunk_bounds(cu_ptr, cseq_ptr, cidx_ptr, tl.program_id(0), BT)
    ib = tl.program_id(1)
    hv = tl.program_id(2)
    hk = hv // (HV // HK)
    ii = tl.arange(0, BC)
    rk = tl.arange(0, BK)
    mk = rk < K
    row0 = t0 + ib * BC
    ri = row0 + ii
    mi = ri < eos
    mik = mi[:, None] & mk[None, :]
    b_q = tl.load(q_ptr + ri[:, None] * sq_t + hk * sq_h + rk[None, :], mask=mik, other=0.0)  # [BC, BK]
    b_k = tl.load(k_ptr + ri[:, None] * sk_t + hk * sk_h + rk[None, :], mask=mik, other=0.0)  # [BC, BK]
    b_beta = tl.load(beta_ptr + ri * sb_t + hv * sb_h, mask=mi, other=0.0).to(tl.float32)  # [BC]
    DT = b_k.dtype

    if IS_KDA:
        G_i = tl.load(gc_ptr + ri[:, None] * sc_t + hv * sc_h + rk[None, :], mask=mik, other=0.0)  # [BC, BK]
        # decays of earlier sub-chunks are taken relative to this sub-chunk's first row
        m_n = mk & ((rk * 0 + row0) < eos)
        g_n = tl.load(gc_ptr + row0 * sc_t + hv * sc_h + rk, mask=m_n, other=0.0)  # [BK]
        q_n = (b_q.to(tl.float32) * tl.exp(G_i - g_n[None, :])).to(DT)
        k_n = (b_k.to(tl.float32) * tl.exp(G_i - g_n[None, :])).to(DT)
        for jb in range(0, ib):
            rj = t0 + jb * BC + ii
            mjk = (rj < eos)[:, None] & mk[None, :]
            k_j = tl.load(k_ptr + rj[:, None] * sk_t + hk * sk_h + rk[None, :], mask=mjk, other=0.0)
            G_j = tl.load(gc_ptr + rj[:, None] * sc_t + hv * sc_h + rk[None, :], mask=mjk, other=0.0)
            k_j = tl.trans((k_j.to(tl.float32) * tl.exp(g_n[None, :] - G_j)).to(DT))  # [BK, BC]
            a_kk = tl.dot(k_n, k_j, input_precision=DOT_PREC)
            a_qk = tl.dot(q_n, k_j, input_precision=DOT_PREC)
            cols = jb * BC + ii
            p = ri[:, None] * sa_t + hv * sa_h + cols[None, :]
            tl.store(akk_ptr + p, a_kk * b_beta[:, None], mask=mi[:, None])
            tl.store(aqk_ptr + p, (a_qk * scale).to(aqk_ptr.dtype.element_ty), mask=mi[:, None])

        a_kk = tl.zeros([BC, BC], dtype=tl.float32)
        a_qk = tl.zeros([BC, BC], dtype=tl.float32)
        kf = b_k.to(tl.float32)
        qf = b_q.to(tl.float32)
        for j in range(0, BC):
            m_j = mk & ((rk * 0 + row0 + j) < eos)
            k_j = tl.load(k_ptr + (row0 + j) * sk_t + hk * sk_h + rk, mask=m_j, other=0.0).to(tl.float32)
            G_j = tl.load(gc_ptr + (row0 + j) * sc_t + hv * sc_h + rk, mask=m_j, other=0.0)
            # rows before j would need exp of a positive number: give them 0 and drop them
            keep = (ii[:, None] >= j) & mi[:, None]
            e = tl.exp(tl.where(keep, G_i - G_j[None, :], 0.0)) * k_j[None, :]  # [BC, BK]
            kk = tl.sum(kf * e, axis=1)
            qk = tl.sum(qf * e, axis=1)
            sel = ii[None, :] == j
            a_kk = tl.where(sel & (ii[:, None] > j), kk[:, None], a_kk)
            a_qk = tl.where(sel & (ii[:, None] >= j), qk[:, None], a_qk)
    else:
        # scalar decay: the whole chunk is one block (BC == BT)
        G_i = tl.load(gc_ptr + ri * sc_t + hv * sc_h, mask=mi, other=0.0)  # [BT]
        causal = (ii[:, None] >= ii[None, :]) & mi[:, None]
        decay = tl.where(causal, tl.exp(tl.where(causal, G_i[:, None] - G_i[None, :], 0.0)), 0.0)
        kt = tl.trans(b_k)
        a_kk = tl.dot(b_k, kt, input_precision=DOT_PREC) * decay
        a_kk = tl.where(ii[:, None] > ii[None, :], a_kk, 0.0)
        a_qk = tl.dot(b_q, kt, input_precision=DOT_PREC) * decay

    cols = ib * BC + ii
    p = ri[:, None] * sa_t + hv * sa_h + cols[None, :]
    tl.store(akk_ptr + p, a_kk * b_beta[:, None], mask=mi[:, None])
    tl.store(aqk_ptr + p, (a_qk * scale).to(aqk_ptr.dtype.element_ty), mask=mi[:, None])


@triton.jit
def _chunk_solve_kernel(
    k_ptr, v_ptr, gc_ptr, beta_ptr, akk_ptr, w_ptr, u_ptr, cu_ptr, cseq_ptr, cidx_ptr,
    sk_t, sk_h, sv_t, sv_h, sc_t, sc_h, sb_t, sb_h, sa_t, sa_h, sw_t, sw_h, su_t, su_h,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_KDA: tl.constexpr, DOT_PREC: tl.constexpr,
):
    t0, eos = _chunk_bounds(cu_ptr, cseq_ptr, cidx_ptr, tl.program_id(0), BT)
    hv = tl.program_id(1)
    hk = hv // (HV // HK)
    r = tl.arange(0, BT)
    rt = t0 + r
    mt = rt < eos

    # Z = ((I + A)^-1)^T by forward substitution, X_i = e_i - sum_{j<i} A_ij X_j, kept
    # transposed so each step reduces along a row (cheap) instead of down a column;
    # row i of A is reloaded from memory (L1) rather than cut out of a register tile
    Z = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, BT):
        m_i = (r < i) & ((r * 0 + t0 + i) < eos)
        a_i = tl.load(akk_ptr + (t0 + i) * sa_t + hv * sa_h + r, mask=m_i, other=0.0)  # [BT] A[i, :]
        z_i = tl.where(r == i, 1.0, 0.0) - tl.sum(Z * a_i[None, :], axis=1)  # [BT] X[i, :]
        Z = tl.where(r[None, :] == i, z_i[:, None], Z)
    DT = k_ptr.dtype.element_ty
    X = tl.trans(Z).to(DT)

    b_beta = tl.load(beta_ptr + rt * sb_t + hv * sb_h, mask=mt, other=0.0).to(tl.float32)  # [BT]
    if not IS_KDA:
        eg = tl.exp(tl.load(gc_ptr + rt * sc_t + hv * sc_h, mask=mt, other=0.0))  # [BT]
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        m = mt[:, None] & (rk < K)[None, :]
        b_k = tl.load(k_ptr + rt[:, None] * sk_t + hk * sk_h + rk[None, :], mask=m, other=0.0)
        if IS_KDA:
            G = tl.load(gc_ptr + rt[:, None] * sc_t + hv * sc_h + rk[None, :], mask=m, other=0.0)
            kb = b_k.to(tl.float32) * (b_beta[:, None] * tl.exp(G))
        else:
            kb = b_k.to(tl.float32) * (b_beta * eg)[:, None]
        b_w = tl.dot(X, kb.to(DT), input_precision=DOT_PREC)  # [BT, BK]
        tl.store(w_ptr + rt[:, None] * sw_t + hv * sw_h + rk[None, :], b_w.to(w_ptr.dtype.element_ty), mask=m)
    for v0 in range(0, V, BV):
        rv = v0 + tl.arange(0, BV)
        m = mt[:, None] & (rv < V)[None, :]
        b_v = tl.load(v_ptr + rt[:, None] * sv_t + hv * sv_h + rv[None, :], mask=m, other=0.0)
        vb = (b_v.to(tl.float32) * b_beta[:, None]).to(DT)
        b_u = tl.dot(X, vb, input_precision=DOT_PREC)  # [BT, BV]
        tl.store(u_ptr + rt[:, None] * su_t + hv * su_h + rv[None, :], b_u.to(u_ptr.dtype.element_ty), mask=m)


@triton.jit
def _chunk_state_kernel(
    q_ptr, k_ptr, gc_ptr, w_ptr, u_ptr, aqk_ptr, o_ptr,
    pool_ptr, slots_ptr, out_ptr, cu_ptr,
    scale,
    sq_t, sq_h, sk_t, sk_h, sc_t, sc_h, sw_t, sw_h, su_t, su_h, sa_t, sa_h, so_t, so_h,
    sp_n, sp_h, sp_k, sp_v, sx_n, sx_h, sx_k, sx_v,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_KDA: tl.constexpr, DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    hk = hv // (HV // HK)
    bos = tl.load(cu_ptr + b).to(tl.int64)
    eos = tl.load(cu_ptr + b + 1).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    r = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    mkv = mk[:, None] & mv[None, :]

    # tensor-shaped slot test: TRITON_INTERPRET mishandles a bool tensor & a bool scalar
    live = (rk[:, None] * 0 + slot) >= 0
    p_s = pool_ptr + slot * sp_n + hv * sp_h + rk[:, None] * sp_k + rv[None, :] * sp_v
    S = tl.load(p_s, mask=mkv & live, other=0.0).to(tl.float32)  # [BK, BV]

    DT = w_ptr.dtype.element_ty
    for t0 in range(bos, eos, BT):
        rt = t0 + r
        mt = rt < eos
        mtk = mt[:, None] & mk[None, :]
        mtv = mt[:, None] & mv[None, :]
        S_d = S.to(DT)
        b_w = tl.load(w_ptr + rt[:, None] * sw_t + hv * sw_h + rk[None, :], mask=mtk, other=0.0)  # [BT, BK]
        b_u = tl.load(u_ptr + rt[:, None] * su_t + hv * su_h + rv[None, :], mask=mtv, other=0.0)  # [BT, BV]
        U = (b_u.to(tl.float32) - tl.dot(b_w, S_d, input_precision=DOT_PREC)).to(DT)  # [BT, BV]

        # output: the entry state seen through the decayed query, plus the chunk's own tokens
        b_q = tl.load(q_ptr + rt[:, None] * sq_t + hk * sq_h + rk[None, :], mask=mtk, other=0.0)
        if IS_KDA:
            G = tl.load(gc_ptr + rt[:, None] * sc_t + hv * sc_h + rk[None, :], mask=mtk, other=0.0)  # [BT, BK]
            qg = (b_q.to(tl.float32) * tl.exp(G)).to(DT)
        else:
            G = tl.load(gc_ptr + rt * sc_t + hv * sc_h, mask=mt, other=0.0)  # [BT]
            qg = (b_q.to(tl.float32) * tl.exp(G)[:, None]).to(DT)
        causal = mt[:, None] & (r[None, :] <= r[:, None])
        b_a = tl.load(aqk_ptr + rt[:, None] * sa_t + hv * sa_h + r[None, :], mask=causal, other=0.0)  # [BT, BT]
        b_o = tl.dot(qg, S_d, input_precision=DOT_PREC) * scale
        b_o += tl.dot(b_a.to(DT), U, input_precision=DOT_PREC)
        tl.store(o_ptr + rt[:, None] * so_t + hv * so_h + rv[None, :], b_o.to(o_ptr.dtype.element_ty), mask=mtv)

        # state at the chunk's end
        last = tl.minimum(t0 + BT, eos) - 1
        b_k = tl.load(k_ptr + rt[:, None] * sk_t + hk * sk_h + rk[None, :], mask=mtk, other=0.0)
        if IS_KDA:
            g_last = tl.load(gc_ptr + last * sc_t + hv * sc_h + rk, mask=mk, other=0.0)  # [BK]
            kg = (b_k.to(tl.float32) * tl.exp(g_last[None, :] - G)).to(DT)
            S = S * tl.exp(g_last)[:, None]
        else:
            g_last = tl.load(gc_ptr + last * sc_t + hv * sc_h)
            kg = (b_k.to(tl.float32) * tl.exp(g_last - G)[:, None]).to(DT)
            S = S * tl.exp(g_last)
        S += tl.dot(tl.trans(kg), U, input_precision=DOT_PREC)

    p_x = out_ptr + b.to(tl.int64) * sx_n + hv * sx_h + rk[:, None] * sx_k + rv[None, :] * sx_v
    tl.store(p_x, S.to(out_ptr.dtype.element_ty), mask=mkv)


def chunk_indices(cu_seqlens, chunk_size):
    """(request, chunk-in-request) of every chunk, as two [num_chunks] int32 tensors.

    Needs one host sync for the chunk count; prefill can afford it.
    """
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    n = (lens + chunk_size - 1) // chunk_size  # [B]
    total = int(n.sum())
    seq = torch.repeat_interleave(torch.arange(n.numel(), device=n.device), n, output_size=total)
    first = torch.cumsum(n, 0) - n
    idx = torch.arange(total, device=n.device) - first[seq]
    return seq.to(torch.int32), idx.to(torch.int32)


def gated_delta_chunked(
    q, k, v, g, beta, state_pool, slots, cu_seqlens, *,
    scale, chunk_size=64, out_states=None, use_qk_l2norm=False, chunks=None, block_v=None,
):
    """Chunked gated delta rule (prefill) for all requests of a packed step.

    Same tensors as gated_delta_recurrent: q, k [T, Hk, K]; v [T, HV, V];
    g [T, HV] (GDN) or [T, HV, K] (KDA); beta [T, HV]; state_pool [N, HV, K, V];
    slots [B] (< 0: zero initial state); cu_seqlens [B+1] int32.
    Returns (o [T, HV, V] in v.dtype, final_states [B, HV, K, V]), the states in
    `out_states` when given, else in a new tensor of state_pool.dtype.
    Assumes g <= 0 (a decay); chunk_size is a power of two >= 16.
    `chunks`: chunk_indices(cu_seqlens, chunk_size), computed once per step and shared
    by every layer to avoid a host sync per call.
    """
    require_triton()
    T, Hk, HV, K, V, B, is_kda = check_gated_delta_args(q, k, v, g, beta, state_pool, slots, cu_seqlens)
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size: expected a power of two >= 16, got {chunk_size}")
    if out_states is None:
        out_states = torch.empty(B, HV, K, V, dtype=state_pool.dtype, device=q.device)
    else:
        check_out("out_states", out_states, (B, HV, K, V), q.device)
    o = torch.empty(T, HV, V, dtype=v.dtype, device=q.device)
    if B == 0:
        return o, out_states
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q, k, v, g = (inner_contiguous(x) for x in (q, k, v, g))
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")

    BT = chunk_size
    BK = pow2(K)
    dev = q.device
    prec = dot_precision(q.dtype)
    # w, u, Aqk feed tensor-core dots, so they are kept in the activation dtype
    inter = q.dtype
    cseq, cidx = chunk_indices(cu_seqlens, BT) if chunks is None else chunks
    NTC = cseq.numel()
    if cseq.shape != cidx.shape or cseq.dtype != torch.int32 or cidx.dtype != torch.int32:
        raise ValueError(
            f"chunks: expected two [num_chunks] int32 tensors from chunk_indices, got "
            f"{tuple(cseq.shape)} {cseq.dtype} and {tuple(cidx.shape)} {cidx.dtype}"
        )

    if NTC > 0:
        gc = torch.empty(g.shape, dtype=torch.float32, device=dev)  # [T, HV] or [T, HV, K]
        _chunk_cumsum_kernel[(NTC, HV)](
            g, gc, cu_seqlens, cseq, cidx, g.stride(0), g.stride(1), gc.stride(0), gc.stride(1),
            K=K, BT=BT, BK=BK, IS_KDA=is_kda,
        )

        BC = 16 if is_kda else BT
        akk = torch.empty(T, HV, BT, dtype=torch.float32, device=dev)
        aqk = torch.empty(T, HV, BT, dtype=inter, device=dev)
        _chunk_intra_kernel[(NTC, BT // BC, HV)](
            q, k, gc, beta, akk, aqk, cu_seqlens, cseq, cidx, float(scale),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), gc.stride(0), gc.stride(1),
            beta.stride(0), beta.stride(1), akk.stride(0), akk.stride(1),
            HK=Hk, HV=HV, K=K, BT=BT, BC=BC, BK=BK, IS_KDA=is_kda, DOT_PREC=prec,
        )

        w = torch.empty(T, HV, K, dtype=inter, device=dev)
        u = torch.empty(T, HV, V, dtype=inter, device=dev)
        _chunk_solve_kernel[(NTC, HV)](
            k, v, gc, beta, akk, w, u, cu_seqlens, cseq, cidx,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), gc.stride(0), gc.stride(1),
            beta.stride(0), beta.stride(1), akk.stride(0), akk.stride(1),
            w.stride(0), w.stride(1), u.stride(0), u.stride(1),
            HK=Hk, HV=HV, K=K, V=V, BT=BT, BK=min(BK, 64), BV=min(pow2(V), 64),
            IS_KDA=is_kda, DOT_PREC=prec, num_warps=8,
        )
    else:
        # no tokens at all: the state pass still copies the initial states out
        gc = torch.zeros(1, 1, 1, dtype=torch.float32, device=dev)
        w = u = aqk = torch.zeros(1, 1, 1, dtype=inter, device=dev)

    if block_v is None:
        # the state pass is sequential over chunks: narrow V tiles give more programs and
        # keep the [K, BV] state plus the [BT, K] tiles of a chunk within registers
        block_v = min(pow2(V), 32)
    _chunk_state_kernel[(B, HV, cdiv(V, block_v))](
        q, k, gc, w, u, aqk, o, state_pool, slots, out_states, cu_seqlens, float(scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), gc.stride(0), gc.stride(1),
        w.stride(0), w.stride(1), u.stride(0), u.stride(1), aqk.stride(0), aqk.stride(1),
        o.stride(0), o.stride(1), *state_pool.stride(), *out_states.stride(),
        HK=Hk, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=block_v, IS_KDA=is_kda, DOT_PREC=prec,
        # fp32 operands would overflow shared memory with a deeper load pipeline
        num_warps=8, num_stages=1 if q.dtype == torch.float32 else 2,
    )
    return o, out_states


def gated_delta_chunked_ref(
    q, k, v, g, beta, state_pool, slots, cu_seqlens, *,
    scale, chunk_size=64, use_qk_l2norm=False,
):
    """The chunked algorithm in plain fp32 torch (gdn_naive.gated_delta_chunked_seq), one
    request at a time. It shares no numerical trick with the kernel: pairwise decays are
    exact exponentials of differences and the triangular system is solved by torch."""
    T, Hk, HV, K, V, B, is_kda = check_gated_delta_args(q, k, v, g, beta, state_pool, slots, cu_seqlens)
    q, k = value_heads(q, k, HV, use_qk_l2norm)
    outs, finals = [], []
    cu = cu_seqlens.tolist()
    for b, slot in enumerate(slots.tolist()):
        S0 = start_state(state_pool, slot)
        r = slice(cu[b], cu[b + 1])
        o, s = gated_delta_chunked_seq(q[r], k[r], v[r], g[r], beta[r], S0, scale=scale, chunk_size=chunk_size)
        outs.append(o)
        finals.append(s[None])
    o = torch.cat(outs) if outs else q.new_zeros((T, HV, V), dtype=torch.float32)
    empty = q.new_zeros((0, HV, K, V), dtype=torch.float32)
    return o.to(v.dtype), torch.cat(finals or [empty]).to(state_pool.dtype)
