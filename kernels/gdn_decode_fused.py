"""One-launch GDN / KDA decode: the conv step, the q/k/v split, the q/k l2 norm and the gated delta rule.

The unfused decode is two launches (`gdn_conv.causal_conv1d`, then
`gdn_recurrent.gated_delta_recurrent`) with the conv output [T, C] going through
memory between them. Here one program per (request, value head, V tile) convolves
the channels it needs straight from the request's conv window and its new token,
and runs the one-token update of its state tile:

    z[c]   = [window[c, 0..W-2], x[c]]                  (window: conv_state_pool[slot])
    y[c]   = act(bias[c] + sum_w weight[c, w] z[c][w])  rounded to x.dtype, like the conv output
    q, k   = y[q | k channels of key head hv // (HV // Hk)], l2-normalised
    v      = y[v channels of value head hv]
    S      = decay S + k^T (beta (v - k S));  o = scale q S

with the decay exp(g) a scalar per head (GDN, g [T, HV]) or a vector over the key
dim (KDA, g [T, HV, K]). Each request has exactly one new token (T == B). The new
window z[c][1..W-1] is written once per channel: q/k channels by the first value head
of their key head's group at V tile 0, v channels by the program that convolves them.
slots < 0 read zeros for both the window and the state. The pools are only read; the
new states go to a fresh tensor, or with `out_rows` to rows of a caller's pool (spare
ring rows, never ones `slots` reads).
"""

import torch

from ._switch import declare, switched
from ._triton import gdc_launch_dependents, gdc_wait, num_sms, pdl_launch, require_triton, tl, triton
from .gdn_common import cdiv, check_gated_delta_args, check_out, check_varlen, inner_contiguous, pow2, state_outputs
from .gdn_conv import causal_conv1d_ref
from .gdn_recurrent import _delta_token, _store_state, gated_delta_recurrent_ref
from .invariant import invariant_on
from .launch import launch

_FILL_DEVICE = declare(
    "fill_device", True, __name__,
    on="`gated_delta_decode_fused`'s default V tile halves (down to 16 columns) while its grid has fewer "
       "programs than the device has SMs",
    off="the usual V tile (64 columns, 32 at key dims >= 256)",
    why="the whole Qwen3.5-0.8B graph step on the H200 took 0.980x / 0.995x as long with it at batch 1 / 8; "
        "outputs may differ from the usual tile's in the last bits")
_NARROWEST_V = 16


def fill_device(enabled: bool):
    """Within this block `gated_delta_decode_fused`'s default V tile halves (down to 16 columns) while its
    grid has fewer programs than the device has SMs: at batch 1 with 16 value heads the usual 64 columns make
    32 programs for 132 SMs, each reading a 32 KiB state tile. Each program convolves and normalizes its
    key head's q and k itself, so narrower tiles repeat that work; the state is still read once. A tile's
    layout sets the order of the sums over K, so outputs and states may differ from the usual tile's in
    the last bits (tests/gpu/test_gdn_decode_fused_gpu.py). On by default: on, the whole Qwen3.5-0.8B graph
    step on the H200 took 0.980x as long at batch 1 and 0.995x at batch 8 (``benchmarks/model_ab.py
    --toggle fill_device``, benchmarks/results/bench_epilogues_ab.json); alone the kernel took 9.54 us
    against 9.98 at batch 1 (16 columns, 4 warps; bench_gdn_decode_sweep_b1_8.json)."""
    return switched(_FILL_DEVICE, "fill_device", enabled)


_STATE_FIRST = declare(
    "state_first", True, __name__,
    on="the fused GDN decode, launched with PDL, reads its state tile, conv window and batch rows before it "
       "waits for the launch before it (grids of at most two programs an SM)",
    off="it reads everything after the wait",
    why="the whole Qwen3.5-0.8B graph step on the H200 took 0.982x / 0.988x as long with it at batch 1 / 8 "
        "(1.021x at batch 128 over every grid, hence the grid bound), the same bits")
_STATE_FIRST_PROGRAMS_PER_SM = 2  # larger grids read after the wait (slower otherwise at batch 128)


def state_first(enabled: bool):
    """Within this block `gated_delta_decode_fused`, launched with PDL, reads what no launch of its step writes
    before it waits for the launch before it: the request's rows of the batch, its state tile and conv window
    (written by the step before) and the conv weight, and sums the window's taps. Only x, g and beta (the input
    projection's outputs) are read after the wait, and every write comes after it. This holds because every
    fnattn kernel waits before it lets the next launch start, so when this one starts every launch but the one
    just before it has finished. The same arithmetic in the same order: the same bits on the H200
    (tests/gpu_results/state_first_gpu.json). It applies to grids of at most two programs an SM: on, for
    every grid, the whole Qwen3.5-0.8B graph step took 0.982x as long at batch 1 (128 programs) and 0.988x
    at batch 8 (256; ``benchmarks/model_ab.py --toggle state_first``, bench_merge_state_ab.json at 092036d),
    but 1.002x at batch 32 (1024) and 1.021x at batch 128 (4096; bench_state_first_large_ab.json at
    f8138d1, paired by round). On by default."""
    return switched(_STATE_FIRST, "state_first", enabled)


def default_block_v(B: int, HV: int, V: int, BK: int, sms: int) -> int:
    """The V tile without ``block_v``: `gated_delta_recurrent`'s (32 columns at key dims >= 256, else 64,
    at most V's power of two), narrowed under `fill_device` until ``B * HV`` rows of tiles fill ``sms`` — but
    not in the invariant mode, where a request's bits must not follow the batch's size."""
    bv = min(pow2(V), 32 if BK >= 256 else 64)
    if _FILL_DEVICE[-1] and not invariant_on():
        while bv > _NARROWEST_V and B * HV * cdiv(V, bv) < sms:
            bv //= 2
    return bv


@triton.jit
def _window_taps(w_ptr, cpool_ptr, slot, rc, mc, sw_c, sw_w, sc_n, sc_c, sc_w, W: tl.constexpr, BC: tl.constexpr):
    """The conv sum of channels rc over the first W-1 taps (the request's window), fp32, in tap order: what
    `_conv_finish` adds the new token's tap to. Reads only the weight and the window pool."""
    live = mc & ((rc * 0 + slot) >= 0)  # tensor-shaped: TRITON_INTERPRET mishandles bool tensor & bool scalar
    acc = tl.zeros([BC], dtype=tl.float32)
    for w in tl.static_range(W - 1):
        val = tl.load(cpool_ptr + slot * sc_n + rc * sc_c + w * sc_w, mask=live, other=0.0).to(tl.float32)
        acc += val * tl.load(w_ptr + rc * sw_c + w * sw_w, mask=mc, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _conv_finish(
    acc, x_ptr, w_ptr, bias_ptr, cpool_ptr, win_ptr, t, slot, b, rc, mc, store,
    sx_t, sw_c, sw_w, sc_n, sc_c, sc_w, sn_n, sn_c, sn_w,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    """Conv output of channels rc for token t from `_window_taps`'s sum (fp32, rounded to x's dtype first, as
    the two-launch path stores it); with `store` (a [BC] mask) the new window of those channels goes to
    win[b]: the old window's taps 1..W-2 (read again, from cache) and the new token."""
    live = mc & ((rc * 0 + slot) >= 0)
    x = tl.load(x_ptr + t * sx_t + rc, mask=mc, other=0.0).to(tl.float32)
    acc += x * tl.load(w_ptr + rc * sw_c + (W - 1) * sw_w, mask=mc, other=0.0).to(tl.float32)
    for w in tl.static_range(1, W - 1):
        val = tl.load(cpool_ptr + slot * sc_n + rc * sc_c + w * sc_w, mask=live, other=0.0)
        tl.store(win_ptr + b * sn_n + rc * sn_c + (w - 1) * sn_w, val.to(win_ptr.dtype.element_ty), mask=store)
    tl.store(win_ptr + b * sn_n + rc * sn_c + (W - 2) * sn_w, x.to(win_ptr.dtype.element_ty), mask=store)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rc, mask=mc, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    return acc.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _fused_decode_kernel(
    x_ptr, w_ptr, bias_ptr, cpool_ptr, g_ptr, beta_ptr,
    pool_ptr, slots_ptr, cu_ptr, o_ptr, out_ptr, out_rows_ptr, win_ptr,
    scale,
    sx_t, sw_c, sw_w, sc_n, sc_c, sc_w, sg_t, sg_h, sb_t, sb_h,
    sp_n, sp_h, sp_k, sp_v,
    so_t, so_h,
    sx_n, sx_h, sx_k, sx_v,
    sn_n, sn_c, sn_w,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, IS_KDA: tl.constexpr, L2NORM: tl.constexpr,
    OUT_ROWS: tl.constexpr, PDL: tl.constexpr, STATE_FIRST: tl.constexpr,
):
    if PDL and not STATE_FIRST:  # inputs are read only after the launch before this one has finished
        gdc_wait()
        gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    hk = hv // (HV // HK)
    t = tl.load(cu_ptr + b).to(tl.int64)  # the request's one new token
    slot = tl.load(slots_ptr + b).to(tl.int64)

    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    mkv = mk[:, None] & mv[None, :]
    cq, ck, cv = hk * K + rk, (HK + hk) * K + rk, 2 * HK * K + hv * V + rv  # the q / k / v channels

    # What no launch of this step writes: the batch's rows, the state and window pools (the step before
    # wrote them), the conv weight. Under STATE_FIRST it streams in while the launch before finishes.
    p_s = pool_ptr + slot * sp_n + hv * sp_h + rk[:, None] * sp_k + rv[None, :] * sp_v
    live = (rk[:, None] * 0 + slot) >= 0
    S = tl.load(p_s, mask=mkv & live, other=0.0).to(tl.float32)  # [BK, BV]
    a_q = _window_taps(w_ptr, cpool_ptr, slot, cq, mk, sw_c, sw_w, sc_n, sc_c, sc_w, W=W, BC=BK)
    a_k = _window_taps(w_ptr, cpool_ptr, slot, ck, mk, sw_c, sw_w, sc_n, sc_c, sc_w, W=W, BC=BK)
    a_v = _window_taps(w_ptr, cpool_ptr, slot, cv, mv, sw_c, sw_w, sc_n, sc_c, sc_w, W=W, BC=BV)
    if PDL and STATE_FIRST:  # x, g and beta are the launch before's outputs; every write comes after this
        gdc_wait()
        gdc_launch_dependents()

    # q/k channels are convolved by every program of their key head; one of them writes their window
    first = (rk * 0 + (hv % (HV // HK)) + vb) == 0
    b_q = _conv_finish(a_q, x_ptr, w_ptr, bias_ptr, cpool_ptr, win_ptr, t, slot, b, cq, mk, mk & first,
                       sx_t, sw_c, sw_w, sc_n, sc_c, sc_w, sn_n, sn_c, sn_w, W=W, HAS_BIAS=HAS_BIAS, SILU=SILU)
    b_k = _conv_finish(a_k, x_ptr, w_ptr, bias_ptr, cpool_ptr, win_ptr, t, slot, b, ck, mk, mk & first,
                       sx_t, sw_c, sw_w, sc_n, sc_c, sc_w, sn_n, sn_c, sn_w, W=W, HAS_BIAS=HAS_BIAS, SILU=SILU)
    b_v = _conv_finish(a_v, x_ptr, w_ptr, bias_ptr, cpool_ptr, win_ptr, t, slot, b, cv, mv, mv,
                       sx_t, sw_c, sw_w, sc_n, sc_c, sc_w, sn_n, sn_c, sn_w, W=W, HAS_BIAS=HAS_BIAS, SILU=SILU)

    # the recurrent kernel's own one-token update (`_delta_token`)
    b_beta = tl.load(beta_ptr + t * sb_t + hv * sb_h).to(tl.float32)
    S, b_o = _delta_token(S, b_q, b_k, b_v, b_beta, g_ptr + t * sg_t + hv * sg_h, rk, mk, scale,
                          IS_KDA=IS_KDA, L2NORM=L2NORM)
    tl.store(o_ptr + t * so_t + hv * so_h + rv, b_o.to(o_ptr.dtype.element_ty), mask=mv)
    _store_state(out_ptr, out_rows_ptr, b, S, hv, rk, rv, mkv, sx_n, sx_h, sx_k, sx_v, OUT_ROWS)


def _check_fused_args(x, conv_weight, conv_bias, conv_state_pool, g, beta, state_pool, slots, cu_seqlens,
                      num_k_heads, head_k_dim, activation):
    """-> (T, Hk, HV, K, V, W, is_kda); the shapes of gated_delta_recurrent's q/k/v are derived from x."""
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, C], got shape {tuple(x.shape)}")
    T, C = x.shape
    if beta.dim() != 2 or beta.shape[0] != T or beta.shape[1] < 1:
        raise ValueError(f"beta: expected [T={T}, HV], got shape {tuple(beta.shape)}")
    Hk, K, HV = int(num_k_heads), int(head_k_dim), beta.shape[1]
    if Hk < 1 or K < 1 or HV % Hk:
        raise ValueError(f"num_k_heads / head_k_dim: expected >= 1 with HV={HV} a multiple of num_k_heads, "
                         f"got num_k_heads={Hk}, head_k_dim={K}")
    rest = C - 2 * Hk * K
    if rest <= 0 or rest % HV:
        raise ValueError(f"x: expected C = 2 * num_k_heads * head_k_dim + HV * V = {2 * Hk * K} + {HV} * V "
                         f"channels (q | k | v), got C={C}")
    V = rest // HV
    if conv_weight.dim() != 2 or conv_weight.shape[0] != C or conv_weight.shape[1] < 2:
        raise ValueError(f"conv_weight: expected [C={C}, W] with W >= 2, got shape {tuple(conv_weight.shape)}")
    W = conv_weight.shape[1]
    if conv_bias is not None and tuple(conv_bias.shape) != (C,):
        raise ValueError(f"conv_bias: expected [C={C}] or None, got shape {tuple(conv_bias.shape)}")
    if conv_state_pool.dim() != 3 or tuple(conv_state_pool.shape[1:]) != (C, W - 1):
        raise ValueError(f"conv_state_pool: expected [N, C, W-1] = [N, {C}, {W - 1}], "
                         f"got shape {tuple(conv_state_pool.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation: expected 'silu', 'swish' or None, got {activation!r}")
    for name, t in (("conv_weight", conv_weight), ("conv_bias", conv_bias), ("conv_state_pool", conv_state_pool)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: expected device {x.device}, got {t.device}")
    B = check_varlen(slots, cu_seqlens, T, x.device)
    if B != T:
        raise ValueError(f"cu_seqlens: expected one new token per request (decode: T == B), got T={T} tokens "
                         f"for B={B} requests")
    # the recurrence's own checks, on shapes only (q/k/v as views of x)
    q = x[:, : Hk * K].view(T, Hk, K)  # views (`Tensor.unflatten` is a Python function: host time a step)
    v = x[:, 2 * Hk * K :].view(T, HV, V)
    is_kda = check_gated_delta_args(q, q, v, g, beta, state_pool, slots, cu_seqlens)[-1]
    return T, Hk, HV, K, V, W, is_kda


def gated_delta_decode_fused(
    x, conv_weight, conv_bias, conv_state_pool, g, beta, state_pool, slots, cu_seqlens, *,
    num_k_heads, head_k_dim, scale, activation="silu", use_qk_l2norm=True,
    out_states=None, out_rows=None, out_windows=None, block_v=None, num_warps=None,
):
    """Decode step of GDN / KDA in one launch: conv + act, q/k/v split, q/k l2 norm, gated delta rule.

    x [T, C] conv input (q | k | v channels, C = 2 * Hk * K + HV * V, Hk = num_k_heads, K = head_k_dim);
    conv_weight [C, W]; conv_bias [C] or None; conv_state_pool [N, C, W-1]; g [T, HV] (GDN) or
    [T, HV, K] (KDA), log decay; beta [T, HV]; state_pool [N', HV, K, V]; slots [B] (< 0: zero window
    and state); cu_seqlens [B+1] int32 with one token per request (T == B).

    Returns (o [T, HV, V] in x.dtype, states, windows). states is [B, HV, K, V] in state_pool.dtype,
    or `out_states` when given; with `out_rows` [B] int64 `out_states` is a pool and state b goes to
    row out_rows[b] (none when < 0), rows `slots` must not read. windows [B, C, W-1] (the new conv
    windows) is in conv_state_pool.dtype, or `out_windows`. block_v / num_warps override the tile.
    """
    require_triton()
    T, Hk, HV, K, V, W, is_kda = _check_fused_args(x, conv_weight, conv_bias, conv_state_pool, g, beta,
                                                    state_pool, slots, cu_seqlens, num_k_heads, head_k_dim,
                                                    activation)
    B, C = T, x.shape[1]
    out_states = state_outputs(out_states, out_rows, B, HV, K, V, state_pool, x.device, "request")
    if out_windows is None:
        out_windows = torch.empty(B, C, W - 1, dtype=conv_state_pool.dtype, device=x.device)
    else:
        check_out("out_windows", out_windows, (B, C, W - 1), x.device)
    o = torch.empty(T, HV, V, dtype=x.dtype, device=x.device)
    if B == 0:
        return o, out_states, out_windows

    x, g = inner_contiguous(x), inner_contiguous(g)
    BK = pow2(K)
    sms = num_sms(x.device.index if x.is_cuda else None)
    BV = block_v or default_block_v(B, HV, V, BK, sms)
    pdl = pdl_launch(x.device)
    grid = (B, HV, cdiv(V, BV))
    state_first = _STATE_FIRST[-1] and B * HV * grid[2] <= _STATE_FIRST_PROGRAMS_PER_SM * sms
    launch(_fused_decode_kernel, grid, (
        x, conv_weight, conv_bias if conv_bias is not None else conv_weight, conv_state_pool, g, beta,
        state_pool, slots, cu_seqlens, o, out_states, out_rows if out_rows is not None else slots, out_windows,
        float(scale),
        x.stride(0), conv_weight.stride(0), conv_weight.stride(1), *conv_state_pool.stride(),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        *state_pool.stride(),
        o.stride(0), o.stride(1),
        *out_states.stride(),
        *out_windows.stride(),
    ), dict(
        HK=Hk, HV=HV, K=K, V=V, W=W, BK=BK, BV=BV,
        HAS_BIAS=conv_bias is not None, SILU=activation is not None, IS_KDA=is_kda, L2NORM=bool(use_qk_l2norm),
        OUT_ROWS=out_rows is not None, PDL=pdl, STATE_FIRST=state_first, launch_pdl=pdl,
        **({"num_warps": num_warps} if num_warps else {}),
    ))
    return o, out_states, out_windows


def gated_delta_decode_fused_ref(
    x, conv_weight, conv_bias, conv_state_pool, g, beta, state_pool, slots, cu_seqlens, *,
    num_k_heads, head_k_dim, scale, activation="silu", use_qk_l2norm=True,
):
    """Same contract as gated_delta_decode_fused (values, no in-place rows): causal_conv1d_ref, the q/k/v split and
    gated_delta_recurrent_ref, i.e. gdn_naive's fp32 conv and recurrence request by request."""
    T, Hk, HV, K, V, W, is_kda = _check_fused_args(x, conv_weight, conv_bias, conv_state_pool, g, beta,
                                                    state_pool, slots, cu_seqlens, num_k_heads, head_k_dim,
                                                    activation)
    if cu_seqlens.tolist() != list(range(T + 1)):
        raise ValueError(f"cu_seqlens: expected one token per request [0, 1, ..., {T}], got {cu_seqlens.tolist()}")
    y, windows = causal_conv1d_ref(x, conv_weight, conv_bias, conv_state_pool, slots, cu_seqlens,
                                   activation=activation)  # [T, C] in x.dtype, [B, C, W-1]
    q = y[:, : Hk * K].unflatten(1, (Hk, K))
    k = y[:, Hk * K : 2 * Hk * K].unflatten(1, (Hk, K))
    v = y[:, 2 * Hk * K :].unflatten(1, (HV, V))
    o, states = gated_delta_recurrent_ref(q, k, v, g, beta, state_pool, slots, cu_seqlens, scale=scale,
                                          use_qk_l2norm=use_qk_l2norm)
    return o, states, windows
