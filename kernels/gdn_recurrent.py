"""Token-by-token gated delta rule (GDN and KDA) for decode and speculative verify.

Per value head, with state S [K, V] (key dim first):
    S_t = decay_t * S_{t-1}                   GDN: exp(g_t) scalar; KDA: diag(exp(g_t)), g_t [K]
    S_t = S_t + k_t^T (beta_t * (v_t - k_t S_t))
    o_t = scale * q_t S_t

The state is read from state_pool[slots[b]] and never written back: the new state goes
to a fresh tensor, a caller-given buffer, or caller-given rows of a pool (`out_rows`:
spare rows of a ring of state buffers, never the rows being read).
"""

import torch

from ._triton import require_triton, tl, triton
from .gdn_common import (
    cdiv,
    check_gated_delta_args,
    inner_contiguous,
    pow2,
    start_state,
    state_outputs,
    value_heads,
)
from .gdn_naive import gated_delta_recurrent_seq


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
    pool_ptr, slots_ptr, cu_ptr, o_ptr, out_ptr, out_rows_ptr,
    scale,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h,
    sp_n, sp_h, sp_k, sp_v,
    so_t, so_h,
    sx_n, sx_h, sx_k, sx_v,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    IS_KDA: tl.constexpr, PER_POS: tl.constexpr, L2NORM: tl.constexpr, OUT_ROWS: tl.constexpr,
):
    b = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    hk = hv // (HV // HK)
    bos = tl.load(cu_ptr + b).to(tl.int64)
    eos = tl.load(cu_ptr + b + 1).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)

    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    mkv = mk[:, None] & mv[None, :]

    # [BK, BV] slice of this head's state, fp32 whatever the pool dtype
    p_s = pool_ptr + slot * sp_n + hv * sp_h + rk[:, None] * sp_k + rv[None, :] * sp_v
    # slot < 0: fresh request, zero state; the test is made tensor-shaped because
    # TRITON_INTERPRET mishandles a bool tensor & a bool scalar
    live = (rk[:, None] * 0 + slot) >= 0
    S = tl.load(p_s, mask=mkv & live, other=0.0).to(tl.float32)

    for t in range(bos, eos):
        b_q = tl.load(q_ptr + t * sq_t + hk * sq_h + rk, mask=mk, other=0.0).to(tl.float32)
        b_k = tl.load(k_ptr + t * sk_t + hk * sk_h + rk, mask=mk, other=0.0).to(tl.float32)
        b_v = tl.load(v_ptr + t * sv_t + hv * sv_h + rv, mask=mv, other=0.0).to(tl.float32)
        b_beta = tl.load(beta_ptr + t * sb_t + hv * sb_h).to(tl.float32)
        S, b_o = _delta_token(S, b_q, b_k, b_v, b_beta, g_ptr + t * sg_t + hv * sg_h, rk, mk, scale,
                              IS_KDA=IS_KDA, L2NORM=L2NORM)
        tl.store(o_ptr + t * so_t + hv * so_h + rv, b_o.to(o_ptr.dtype.element_ty), mask=mv)
        if PER_POS:
            _store_state(out_ptr, out_rows_ptr, t, S, hv, rk, rv, mkv, sx_n, sx_h, sx_k, sx_v, OUT_ROWS)

    if not PER_POS:
        _store_state(out_ptr, out_rows_ptr, b.to(tl.int64), S, hv, rk, rv, mkv, sx_n, sx_h, sx_k, sx_v, OUT_ROWS)


@triton.jit
def _delta_token(S, b_q, b_k, b_v, b_beta, g_row, rk, mk, scale, IS_KDA: tl.constexpr, L2NORM: tl.constexpr):
    """One token of the gated delta rule on a [BK, BV] fp32 state tile: ``-> (new state, o [BV])``.

    ``g_row`` points at the token's log-decay of this head: one scalar (GDN) or one per key dim (KDA).
    The one recurrence both the recurrent and the fused decode kernels run."""
    if L2NORM:
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
    if IS_KDA:
        S = S * tl.exp(tl.load(g_row + rk, mask=mk, other=0.0).to(tl.float32))[:, None]
    else:
        S = S * tl.exp(tl.load(g_row).to(tl.float32))
    pred = tl.sum(S * b_k[:, None], axis=0)  # [BV] = k_t S
    u = (b_v - pred) * b_beta
    S = S + b_k[:, None] * u[None, :]
    return S, tl.sum(S * b_q[:, None], axis=0) * scale


@triton.jit
def _store_state(out_ptr, out_rows_ptr, r, S, hv, rk, rv, mkv, sx_n, sx_h, sx_k, sx_v, OUT_ROWS: tl.constexpr):
    """State row r goes to out[r], or with OUT_ROWS to out[out_rows[r]] (skipped when < 0)."""
    if OUT_ROWS:
        row = tl.load(out_rows_ptr + r).to(tl.int64)
        mkv = mkv & ((rk[:, None] * 0 + row) >= 0)
    else:
        row = r
    p_x = out_ptr + row * sx_n + hv * sx_h + rk[:, None] * sx_k + rv[None, :] * sx_v
    tl.store(p_x, S.to(out_ptr.dtype.element_ty), mask=mkv)


def gated_delta_recurrent(
    q, k, v, g, beta, state_pool, slots, cu_seqlens, *,
    scale, per_position_states=False, out_states=None, out_rows=None, use_qk_l2norm=False, block_v=None,
    num_warps=None,
):
    """Gated delta rule, one token after another, for all requests of a packed step.

    q, k [T, Hk, K]; v [T, HV, V]; g [T, HV] (GDN) or [T, HV, K] (KDA), log decay;
    beta [T, HV]; state_pool [N, HV, K, V]; slots [B]; cu_seqlens [B+1] int32.

    Returns (o [T, HV, V] in v.dtype, states): states is [B, HV, K, V] (after each
    request's last token) or, with per_position_states, [T, HV, K, V] (after every
    token). States are written to `out_states` when given (any float dtype, any
    strides), else to a new tensor of state_pool.dtype. With `out_rows` ([B] or
    [T] int64), `out_states` is a pool [N', HV, K, V] and state r goes to row
    out_rows[r] (none when < 0): a caller's spare ring rows, written in place.
    Those rows must not be ones `slots` reads. state_pool itself is read only.
    block_v / num_warps override the tile (for tuning sweeps).
    """
    require_triton()
    T, Hk, HV, K, V, B, is_kda = check_gated_delta_args(q, k, v, g, beta, state_pool, slots, cu_seqlens)
    rows = T if per_position_states else B
    out_states = state_outputs(out_states, out_rows, rows, HV, K, V, state_pool, q.device, "state")
    o = torch.empty(T, HV, V, dtype=v.dtype, device=q.device)
    if B == 0:
        return o, out_states

    q, k, v, g = (inner_contiguous(x) for x in (q, k, v, g))
    BK = pow2(K)
    # [K, 64] fp32 state tiles at 4 warps moved the most bytes on the H200 (K = 128: 3.8 TB/s at
    # B256, against 3.3 with 32-wide tiles; `fnattn bench gdn-decode-sweep`); K = 256 halves the tile
    # to keep the state in registers
    BV = block_v or min(pow2(V), 32 if BK >= 256 else 64)
    grid = (B, HV, cdiv(V, BV))
    _recurrent_kernel[grid](
        q, k, v, g, beta, state_pool, slots, cu_seqlens, o, out_states,
        out_rows if out_rows is not None else slots,
        float(scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        *state_pool.stride(),
        o.stride(0), o.stride(1),
        *out_states.stride(),
        HK=Hk, HV=HV, K=K, V=V, BK=BK, BV=BV,
        IS_KDA=is_kda, PER_POS=bool(per_position_states), L2NORM=bool(use_qk_l2norm),
        OUT_ROWS=out_rows is not None, **({"num_warps": num_warps} if num_warps else {}),
    )
    return o, out_states


def gated_delta_recurrent_ref(
    q, k, v, g, beta, state_pool, slots, cu_seqlens, *,
    scale, per_position_states=False, use_qk_l2norm=False,
):
    """Same contract as gated_delta_recurrent (states in state_pool.dtype):
    gdn_naive.gated_delta_recurrent_seq (fp32) request by request."""
    T, Hk, HV, K, V, B, is_kda = check_gated_delta_args(q, k, v, g, beta, state_pool, slots, cu_seqlens)
    q, k = value_heads(q, k, HV, use_qk_l2norm)
    outs, states = [], []
    cu = cu_seqlens.tolist()
    for b, slot in enumerate(slots.tolist()):
        S0 = start_state(state_pool, slot)
        r = slice(cu[b], cu[b + 1])
        o, s = gated_delta_recurrent_seq(q[r], k[r], v[r], g[r], beta[r], S0, scale=scale,
                                         per_position_states=per_position_states)
        outs.append(o)
        states.append(s if per_position_states else s[None])
    o = torch.cat(outs) if outs else q.new_zeros((T, HV, V), dtype=torch.float32)
    empty = q.new_zeros((0, HV, K, V), dtype=torch.float32)
    return o.to(v.dtype), torch.cat(states or [empty]).to(state_pool.dtype)
