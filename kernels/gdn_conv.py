"""Depthwise causal conv1d over packed requests, with the left context from a saved window.

For channel c of a request whose saved window is s[c, 0..W-2] (oldest first) and
whose new inputs are x_0..x_{n-1}, let z = [s[c, :], x[:, c]]. Then

    y_i[c] = act(bias[c] + sum_w weight[c, w] * z[i + w])       w = 0..W-1

so weight[c, W-1] multiplies the current token. The new window is the last W-1
entries of z (after every token, with per_position_states). The pool is never written.
"""

import torch

from ._switch import declare, switched
from ._triton import num_sms, require_triton, tl, triton
from .gdn_common import cdiv, check_out, check_varlen, pow2
from .gdn_naive import causal_conv1d_seq

_INTERIOR = declare(
    "interior_tiles", True, __name__,
    on="`causal_conv1d`'s tiles inside one request read x alone (no saved-window loads, no per-token masks)",
    off="every tile takes the general path",
    why="the Qwen3.5-0.8B GDN layer's conv of an 8192-token prefill took 134 us against 202 on the H200, the "
        "same bits; off is the general path every tile can take")
_CHUNK_TILES = declare(
    "chunk_tiles", True, __name__,
    on="`causal_conv1d` given a prefill's chunk list tiles by those chunks (calls of at least 16384 tokens)",
    off="packed tiles of the whole batch, each token's request found by a binary search",
    why="16 requests of 4096 tokens x 8192 channels took 837 us against 1507 on the H200, the same bits; "
        "the packed tiles serve smaller calls in one launch")
_SHORT_TILES = declare(
    "short_conv_tiles", True, __name__,
    on="`causal_conv1d` over a call of few tokens (a verify step's) halves its token tile, down to 4, until the "
       "launch has two programs an SM",
    off="tiles of up to 32 tokens whatever the call's size",
    why="a verify step's conv over 6144 channels (Qwen3.5-0.8B, 4 tokens a request, per-position windows) took "
        "8.6 us against 28.6 at batch 8, 34 against 60 at batch 32 and 7.8 against 8.6 at batch 1 on the H100, "
        "the same bits (benchmarks/results/conv_short_tiles.json at f72d6d7; a second run within 0.5 us); off: the "
        "table's tile")
_SHORT_TILE_TOKENS = 4  # the narrowest token tile: a window of W - 1 = 3 taps already re-reads 3 rows of x a tile


def short_conv_tiles(enabled: bool):
    """Within this block `causal_conv1d`'s packed launch over a call of few tokens halves its token tile (from
    ``min(T, 32)`` down to 4) while it has fewer than two programs per SM: a verify step's 32 tokens over 6144
    channels otherwise make 48 programs of 32 x 128. Each output is the sum of its own taps in tap order, so the
    tile does not change a bit. On by default: at batch 8 the conv took 8.6 us against 28.6 (H100)."""
    return switched(_SHORT_TILES, "short_conv_tiles", enabled)


def token_tile(T: int, C: int, BC: int, device_index: int | None) -> int:
    """The packed launch's token tile for ``T`` tokens of ``C`` channels in tiles of ``BC`` on CUDA device
    ``device_index`` (None: none; `short_conv_tiles`)."""
    bt = min(pow2(T), 32)
    if _SHORT_TILES[-1]:
        sms = num_sms(device_index)
        while bt > _SHORT_TILE_TOKENS and cdiv(T, bt) * cdiv(C, BC) < 2 * sms:
            bt //= 2
    return bt


# The chunk tiles' launch: channels a program, warps, whether neighbouring programs take the same tokens' next
# channels (True) or the next tokens' same channels, and the fewest tokens they tile (below it the packed tiles
# serve). The sweep's best at 16 x 4096 tokens x 8192 channels (837 us, 2.57 TB/s; 128 channels and 4 warps 1587
# us): benchmarks/results/conv_sweep_even_16x4096.json. At 8192 tokens the two tilings took the same device time
# (144 us, `conv_sweep_even_0.8b.json`) and the packed tiles launch once, not twice: an 8192-token prefill of
# the 0.8B took 0.968x as long with the packed tiles, paired by round (`bench_chunk_tiles_ab.json` at ada8623).
CHUNK_LAUNCH = {"block_c": 64, "num_warps": 4, "channels_first": True, "min_tokens": 16384}


def interior_tiles(enabled: bool):
    """Within this block `causal_conv1d`'s tiles that lie inside one request, with every tap reaching back
    only into that request's own tokens, read x alone: no saved-window loads and no per-token masks (the
    general path loads both for each of the W taps). The same products in the same order, so the same bits.
    On by default: at the shipped tile (32 tokens x 128 channels, 4 warps) the Qwen3.5-0.8B GDN layer's conv of
    an 8192-token prefill took 134 us with them against 202 us without on the H200, bit for bit the same
    output (``python benchmarks/conv_sweep.py``, benchmarks/results/conv_sweep.json at 8cb76cd)."""
    return switched(_INTERIOR, "interior_tiles", enabled)


def chunk_tiles(enabled: bool):
    """Within this block `causal_conv1d` given a request's chunk list (``chunks=``, prefill) tiles the tokens
    by those chunks: each program one chunk of one request, its bounds and slot read once, every chunk but a
    request's first reading x alone (`_conv_chunks_kernel`). Without it the tiles are ``BT`` tokens of the
    packed batch, each token's request found by a binary search over ``cu_seqlens``. The same products in the
    same order, so the same bits. The requests' first chunks, which read their saved windows, are a second
    launch (one program per request and channel tile). They tile calls of at least ``CHUNK_LAUNCH["min_tokens"]``
    tokens (16384).
    On by default: q / k / v apart over 16 requests of 4096 tokens x 8192 channels on the H200 they took 837 us
    (2.57 TB/s; fla-core's conv, one output, 803 us) against the packed tiles' 1507 us; at the Qwen3.5-0.8B
    layer's 8192 tokens x 6144 channels 144 us, as the packed tiles (`benchmarks/conv_sweep.py --split`,
    benchmarks/results/conv_sweep_even_*.json at 5b93fab), so below 16384 tokens the packed tiles' one launch
    serves."""
    return switched(_CHUNK_TILES, "chunk_tiles", enabled)


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, bias_ptr, pool_ptr, slots_ptr, cu_ptr, y_ptr, out_ptr,
    T, C, B, n_search,
    sx_t, sw_c, sw_w, sp_n, sp_c, sp_w, sy_t, so_t, so_c, so_w,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, PER_POS: tl.constexpr, INTERIOR: tl.constexpr = False,
    c1=0, c2=0, SPLIT: tl.constexpr = False,
):
    """``BT`` tokens of the packed batch x ``BC`` channels. One launch takes the interior tiles and the others
    alike, though the general path's window loads take ~2.5x the registers (ptxas: 241 against 94 at 32 x 128,
    4 warps): the interior tiles as a launch of their own took 162.7 us against 144.2 for the Qwen3.5-0.8B
    layer's 8192-token conv on the H200, the second launch costing more than the registers saved."""
    rt = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)  # T * C may pass 2^31
    rc = tl.program_id(1) * BC + tl.arange(0, BC)
    mt = rt < T
    mc = rc < C

    # request of each token: the b with cu[b] <= t < cu[b+1], by binary search (no host sync)
    lo = tl.zeros([BT], dtype=tl.int32)
    hi = tl.zeros([BT], dtype=tl.int32) + B
    for _ in range(n_search):
        mid = (lo + hi) // 2
        go = tl.load(cu_ptr + mid) <= rt
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    bos = tl.load(cu_ptr + lo, mask=mt, other=0)
    slot = tl.load(slots_ptr + lo, mask=mt, other=-1).to(tl.int64)

    tl.static_assert(not (INTERIOR and PER_POS), "interior tiles store no per-position windows")
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    # A tile of one request whose taps all reach back into that request's own tokens reads only x: no window
    # loads and no per-token masks (the same products in the same order as the general path below).
    inside = False
    if INTERIOR:
        t0 = tl.program_id(0).to(tl.int64) * BT
        inside = (tl.min(lo, axis=0) == tl.max(lo, axis=0)) & (t0 + BT <= T) & (t0 - (W - 1) >= tl.max(bos, axis=0))
    if inside:
        acc = _conv_interior_taps(x_ptr, w_ptr, rt, rc, mc[None, :], mc, acc, sx_t, sw_c, sw_w, W)
    else:
        acc = _conv_taps(x_ptr, w_ptr, pool_ptr, out_ptr, rt, rc, mt, mc, bos, slot, acc, sx_t, sw_c, sw_w,
                         sp_n, sp_c, sp_w, so_t, so_c, so_w, W, PER_POS)
    _conv_store(acc, bias_ptr, y_ptr, rt, rc, 0, mt, mc, 0, T, C, sy_t, c1, c2, BC,
                HAS_BIAS, SILU, SPLIT)


@triton.jit
def _conv_interior_taps(x_ptr, w_ptr, rt, rc, mask, mc, acc, sx_t, sw_c, sw_w, W: tl.constexpr):
    """``acc`` plus every tap's products for a tile whose inputs all lie in x (``mask``: the x loads')."""
    for w in tl.static_range(W):
        xv = tl.load(x_ptr + (rt - (W - 1) + w)[:, None] * sx_t + rc[None, :], mask=mask, other=0.0)
        wt = tl.load(w_ptr + rc * sw_c + w * sw_w, mask=mc, other=0.0).to(tl.float32)
        acc += xv.to(tl.float32) * wt[None, :]
    return acc


@triton.jit
def _conv_taps(x_ptr, w_ptr, pool_ptr, out_ptr, rt, rc, mt, mc, bos, slot, acc, sx_t, sw_c, sw_w, sp_n, sp_c,
               sp_w, so_t, so_c, so_w, W: tl.constexpr, PER_POS: tl.constexpr):
    """``acc`` plus every tap's products, each input from x or, before the request's first token, from its
    saved window; with PER_POS each token's new window is stored too."""
    for w in tl.static_range(W):
        p = rt - (W - 1) + w  # [BT] input position feeding tap w
        from_x = (mt & (p >= bos))[:, None] & mc[None, :]
        from_s = (mt & (p < bos) & (slot >= 0))[:, None] & mc[None, :]
        xv = tl.load(x_ptr + p[:, None] * sx_t + rc[None, :], mask=from_x, other=0.0)
        j = p - bos + (W - 1)  # index into the saved window when p < bos
        sv = tl.load(pool_ptr + slot[:, None] * sp_n + rc[None, :] * sp_c + j[:, None] * sp_w, mask=from_s, other=0.0)
        val = tl.where(from_x, xv.to(tl.float32), sv.to(tl.float32))  # [BT, BC]
        wt = tl.load(w_ptr + rc * sw_c + w * sw_w, mask=mc, other=0.0).to(tl.float32)
        acc += val * wt[None, :]
        if PER_POS:
            if w > 0:
                p_o = out_ptr + rt[:, None] * so_t + rc[None, :] * so_c + (w - 1) * so_w
                tl.store(p_o, val.to(out_ptr.dtype.element_ty), mask=mt[:, None] & mc[None, :])
    return acc


@triton.jit
def _conv_chunks_kernel(
    x_ptr, w_ptr, bias_ptr, seq_ptr, idx_ptr, cu_ptr, y_ptr,
    T, C, sx_t, sw_c, sw_w, sy_t, c1, c2,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    SPLIT: tl.constexpr, CHANNELS_FIRST: tl.constexpr, EVEN_C: tl.constexpr = False,
):
    """One chunk of one request (``BT`` tokens, `chunk_indices`' pairs) x ``BC`` channels, every chunk but a
    request's first (`_conv_first_chunks_kernel` takes those): each tap reaches back into the request's own
    tokens (``BT >= W - 1``), so x alone is read. Apart from the first chunks, whose saved-window loads would
    raise every program's registers (~1.6x, ptxas) and so lower the occupancy the loads need."""
    if CHANNELS_FIRST:  # neighbouring programs: the same tokens' next channels
        pid_c, pid_t = tl.program_id(0), tl.program_id(1)
    else:
        pid_t, pid_c = tl.program_id(0), tl.program_id(1)
    j = tl.load(idx_ptr + pid_t).to(tl.int64)
    if j > 0:
        req = tl.load(seq_ptr + pid_t)
        bos = tl.load(cu_ptr + req).to(tl.int64)
        eos = tl.load(cu_ptr + req + 1).to(tl.int64)
        rt = bos + j * BT + tl.arange(0, BT)  # [BT] int64 (T * C may pass 2^31)
        rc = pid_c * BC + tl.arange(0, BC)  # [BC]
        mc = _channel_mask(rc, C, BC, EVEN_C)
        m = (rt < eos)[:, None] & mc[None, :]
        acc = _conv_interior_taps(x_ptr, w_ptr, rt, rc, m, mc, tl.zeros([BT, BC], dtype=tl.float32), sx_t, sw_c,
                                  sw_w, W)
        _conv_store(acc, bias_ptr, y_ptr, rt, rc, pid_c, rt < eos, mc, bos, T, C, sy_t, c1, c2,
                    BC, HAS_BIAS, SILU, SPLIT, EVEN_C)


@triton.jit
def _conv_first_chunks_kernel(
    x_ptr, w_ptr, bias_ptr, pool_ptr, slots_ptr, cu_ptr, y_ptr,
    T, C, sx_t, sw_c, sw_w, sp_n, sp_c, sp_w, sy_t, c1, c2,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    SPLIT: tl.constexpr, EVEN_C: tl.constexpr = False,
):
    """The first ``BT`` tokens of request ``program_id(1)`` x ``BC`` channels: taps before its first token read
    its saved window (zero without a slot)."""
    pid_c, req = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu_ptr + req).to(tl.int64)
    eos = tl.load(cu_ptr + req + 1).to(tl.int64)
    slot = tl.load(slots_ptr + req).to(tl.int64)
    rt = bos + tl.arange(0, BT)  # [BT] int64
    rc = pid_c * BC + tl.arange(0, BC)  # [BC]
    mt = rt < eos
    mc = _channel_mask(rc, C, BC, EVEN_C)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for w in tl.static_range(W):
        p = rt - (W - 1) + w  # [BT] input position feeding tap w
        from_x = (mt & (p >= bos))[:, None] & mc[None, :]
        from_s = (mt & (p < bos) & ((p * 0 + slot) >= 0))[:, None] & mc[None, :]
        xv = tl.load(x_ptr + p[:, None] * sx_t + rc[None, :], mask=from_x, other=0.0)
        sv = tl.load(pool_ptr + slot * sp_n + rc[None, :] * sp_c + (p - bos + (W - 1))[:, None] * sp_w,
                     mask=from_s, other=0.0)
        val = tl.where(from_x, xv.to(tl.float32), sv.to(tl.float32))  # [BT, BC]
        wt = tl.load(w_ptr + rc * sw_c + w * sw_w, mask=mc, other=0.0).to(tl.float32)
        acc += val * wt[None, :]
    _conv_store(acc, bias_ptr, y_ptr, rt, rc, pid_c, mt, mc, bos, T, C, sy_t, c1, c2,
                BC, HAS_BIAS, SILU, SPLIT, EVEN_C)


@triton.jit
def _channel_mask(rc, C, BC: tl.constexpr, EVEN_C: tl.constexpr):
    if EVEN_C:
        return tl.full([BC], 1, tl.int1)  # a constant: the masks stay whole rows, the accesses wide
    else:
        return rc < C


@triton.jit
def _conv_store(acc, bias_ptr, y_ptr, rt, rc, pid_c, mt, mc, bos, T, C, sy_t, c1, c2, BC: tl.constexpr,
                HAS_BIAS: tl.constexpr, SILU: tl.constexpr, SPLIT: tl.constexpr, EVEN_C: tl.constexpr = False):
    """Bias, activation and the store of a tile (its rows ``mt`` by its channels ``mc``). EVEN_C (chunk tiles
    whose ``BC`` divides C and, with SPLIT, c1 and c2; ``pid_c`` and ``bos`` are read only then): the tile lies
    in one of y's three blocks, whose base, row length and first column are then scalars."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rc, mask=mc, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    if SPLIT and EVEN_C:
        c0 = pid_c * BC
        r = rt[:, None]
        n = bos * 0 + T  # int64 (T may be a constexpr 1)
        if c0 < c1:
            off = r * c1 + rc[None, :]
        elif c0 < c2:
            off = n * c1 + r * (c2 - c1) + (rc - c1)[None, :]
        else:
            off = n * c2 + r * (C - c2) + (rc - c2)[None, :]
    elif SPLIT:  # y is three row-major blocks: channels [0, c1) as [T, c1], then [c1, c2) and [c2, C)
        r, c, n = rt[:, None], rc[None, :].to(tl.int64), (rt * 0 + T)[:, None]
        off = tl.where(c < c1, r * c1 + c,
                       tl.where(c < c2, n * c1 + r * (c2 - c1) + (c - c1), n * c2 + r * (C - c2) + (c - c2)))
    else:
        off = rt[:, None] * sy_t + rc[None, :]
    tl.store(y_ptr + off, acc.to(y_ptr.dtype.element_ty), mask=mt[:, None] & mc[None, :])


@triton.jit
def _conv_final_window_kernel(
    x_ptr, pool_ptr, slots_ptr, cu_ptr, out_ptr,
    C, sx_t, sp_n, sp_c, sp_w, so_n, so_c, so_w,
    W: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr,
):
    b = tl.program_id(0)
    rc = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = rc < C
    bos = tl.load(cu_ptr + b).to(tl.int64)
    eos = tl.load(cu_ptr + b + 1).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    j = tl.arange(0, BW)
    mj = j < W - 1
    p = eos - (W - 1) + j  # [BW] position of window entry j
    from_x = mc[:, None] & (mj & (p >= bos))[None, :]
    live = (j * 0 + slot) >= 0  # tensor-shaped: TRITON_INTERPRET mishandles bool tensor & bool scalar
    from_s = mc[:, None] & (mj & (p < bos) & live)[None, :]
    xv = tl.load(x_ptr + p[None, :] * sx_t + rc[:, None], mask=from_x, other=0.0)
    p_s = pool_ptr + slot * sp_n + rc[:, None] * sp_c + (p - bos + W - 1)[None, :] * sp_w
    sv = tl.load(p_s, mask=from_s, other=0.0)
    val = tl.where(from_x, xv.to(tl.float32), sv.to(tl.float32))  # [BC, BW]
    p_o = out_ptr + b.to(tl.int64) * so_n + rc[:, None] * so_c + j[None, :] * so_w
    tl.store(p_o, val.to(out_ptr.dtype.element_ty), mask=mc[:, None] & mj[None, :])


def _check_conv_args(x, weight, bias, conv_state_pool, slots, cu_seqlens, activation):
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, C], got shape {tuple(x.shape)}")
    T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 2:
        raise ValueError(f"weight: expected [C={C}, W] with W >= 2, got shape {tuple(weight.shape)}")
    W = weight.shape[1]
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"bias: expected [C={C}] or None, got shape {tuple(bias.shape)}")
    if conv_state_pool.dim() != 3 or tuple(conv_state_pool.shape[1:]) != (C, W - 1):
        raise ValueError(
            f"conv_state_pool: expected [N, C, W-1] = [N, {C}, {W - 1}], got shape {tuple(conv_state_pool.shape)}"
        )
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation: expected 'silu', 'swish' or None, got {activation!r}")
    for name, t in (("weight", weight), ("bias", bias), ("conv_state_pool", conv_state_pool)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: expected device {x.device}, got {t.device}")
    B = check_varlen(slots, cu_seqlens, T, x.device)
    return T, C, W, B


def _check_chunks(chunks, chunk_size, W, T, device):
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < max(16, W - 1) \
            or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size: expected a power of two >= {max(16, W - 1)} (16 and the window's W - 1), "
                         f"got {chunk_size!r}")
    if not isinstance(chunks, tuple) or len(chunks) != 2 or not all(isinstance(t, torch.Tensor) for t in chunks):
        raise ValueError(f"chunks: expected a (request, chunk of request) pair of tensors, got "
                         f"{type(chunks).__name__}")
    seq, idx = chunks
    for name, t in (("chunks[0] (requests)", seq), ("chunks[1] (chunk of request)", idx)):
        if t.dim() != 1 or t.dtype != torch.int32 or t.device != device:
            raise ValueError(f"{name}: expected a 1-D int32 tensor on {device}, got {tuple(t.shape)} {t.dtype} "
                             f"on {t.device}")
    if seq.numel() != idx.numel() or seq.numel() < -(-T // chunk_size):
        raise ValueError(f"chunks: expected two lists of one length, at least {-(-T // chunk_size)} "
                         f"({T} tokens in chunks of {chunk_size}), got {seq.numel()} and {idx.numel()}")


def _check_chunk_launch(launch: dict) -> None:
    """`CHUNK_LAUNCH` as the sweeps may have set it: each field a valid launch value (the error names it)."""
    def whole(v):  # an int, not a bool (True == 1)
        return isinstance(v, int) and not isinstance(v, bool)

    for key, ok, expected in (
            ("block_c", lambda v: whole(v) and v >= 16 and v & (v - 1) == 0, "a power of two >= 16"),
            ("num_warps", lambda v: whole(v) and v in (1, 2, 4, 8, 16, 32), "one of 1, 2, 4, 8, 16, 32"),
            ("channels_first", lambda v: isinstance(v, bool), "True or False"),
            ("min_tokens", lambda v: whole(v) and v >= 0, "an int >= 0")):
        value = launch.get(key)
        if not ok(value):
            raise ValueError(f"CHUNK_LAUNCH[{key!r}]: expected {expected}, got {value!r}")


def causal_conv1d(
    x, weight, bias, conv_state_pool, slots, cu_seqlens, *,
    activation="silu", per_position_states=False, out_states=None, split=None, chunks=None, chunk_size=64,
):
    """Depthwise causal conv over packed requests; left context from conv_state_pool[slots].

    x [T, C]; weight [C, W]; bias [C] or None; conv_state_pool [N, C, W-1] (last W-1
    inputs, oldest first); slots [B] (< 0: zero context); cu_seqlens [B+1] int32.
    Returns (y [T, C] in x.dtype, windows): windows is [B, C, W-1] (after each request)
    or, with per_position_states, [T, C, W-1] (after every token); written to
    `out_states` when given, else to a new tensor of conv_state_pool.dtype.
    With ``split=(c1, c2)`` (0 < c1 < c2 < C) y comes as three contiguous tensors, channels [0, c1),
    [c1, c2) and [c2, C): ``((y0 [T, c1], y1 [T, c2 - c1], y2 [T, C - c2]), windows)``, the same values as
    y's column slices (GDN's q, k and v, which fla-core's chunk takes contiguous, with no copy).
    ``chunks``: the requests' chunks of ``chunk_size`` tokens, `chunk_indices`' ``(request, chunk of request)``
    pair of int32 tensors for these ``cu_seqlens`` (a prefill's plan has them); under `chunk_tiles`, from
    ``CHUNK_LAUNCH["min_tokens"]`` tokens, the tokens are tiled by them (not with ``per_position_states``), the
    same output.
    """
    require_triton()
    T, C, W, B = _check_conv_args(x, weight, bias, conv_state_pool, slots, cu_seqlens, activation)
    if split is not None:
        if (not isinstance(split, tuple) or len(split) != 2 or not all(isinstance(c, int) for c in split)
                or not 0 < split[0] < split[1] < C):
            raise ValueError(f"split: expected (c1, c2) with 0 < c1 < c2 < {C} (the channels), got {split!r}")
    if chunks is not None:
        _check_chunks(chunks, chunk_size, W, T, x.device)
    rows = T if per_position_states else B
    if out_states is None:
        out_states = torch.empty(rows, C, W - 1, dtype=conv_state_pool.dtype, device=x.device)
    else:
        check_out("out_states", out_states, (rows, C, W - 1), x.device)
    y = torch.empty(T * C if split else (T, C), dtype=x.dtype, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    BC = min(pow2(C), 128)
    by_chunks = chunks is not None and _CHUNK_TILES[-1] and not per_position_states
    if by_chunks:
        _check_chunk_launch(CHUNK_LAUNCH)
    if by_chunks and T >= max(1, CHUNK_LAUNCH["min_tokens"]):
        seq, idx = chunks
        bc = min(pow2(C), CHUNK_LAUNCH["block_c"])
        c1, c2 = split if split else (0, 0)
        even = C % bc == 0 and c1 % bc == 0 and c2 % bc == 0
        common = dict(W=W, BT=chunk_size, BC=bc, HAS_BIAS=bias is not None, SILU=activation is not None,
                      SPLIT=split is not None, EVEN_C=even, num_warps=CHUNK_LAUNCH["num_warps"])
        bias_ptr = bias if bias is not None else weight  # read only with HAS_BIAS
        n = seq.numel()
        grid = (cdiv(C, bc), n) if CHUNK_LAUNCH["channels_first"] else (n, cdiv(C, bc))
        _conv_chunks_kernel[grid](
            x, weight, bias_ptr, seq, idx, cu_seqlens, y, T, C, x.stride(0), weight.stride(0), weight.stride(1), C,
            c1, c2, CHANNELS_FIRST=CHUNK_LAUNCH["channels_first"], **common)
        _conv_first_chunks_kernel[(cdiv(C, bc), B)](
            x, weight, bias_ptr, conv_state_pool, slots, cu_seqlens, y, T, C, x.stride(0), weight.stride(0),
            weight.stride(1), *conv_state_pool.stride(), C, c1, c2, **common)
    elif T > 0:
        BT = token_tile(T, C, BC, x.device.index if x.is_cuda else None)
        _conv_kernel[(cdiv(T, BT), cdiv(C, BC))](
            x, weight, bias if bias is not None else weight, conv_state_pool, slots, cu_seqlens, y, out_states,
            T, C, B, B.bit_length(),
            x.stride(0), weight.stride(0), weight.stride(1), *conv_state_pool.stride(), C,
            *(out_states.stride() if per_position_states else (0, 0, 0)),
            W=W, BT=BT, BC=BC, HAS_BIAS=bias is not None, SILU=activation is not None,
            PER_POS=bool(per_position_states), INTERIOR=_INTERIOR[-1] and not per_position_states,
            c1=split[0] if split else 0, c2=split[1] if split else 0, SPLIT=split is not None,
        )
    if not per_position_states and B > 0:
        _conv_final_window_kernel[(B, cdiv(C, BC))](
            x, conv_state_pool, slots, cu_seqlens, out_states,
            C, x.stride(0), *conv_state_pool.stride(), *out_states.stride(),
            W=W, BC=BC, BW=pow2(W - 1, lo=2),
        )
    if split:
        c1, c2 = split
        y = (y[: T * c1].view(T, c1), y[T * c1 : T * c2].view(T, c2 - c1), y[T * c2 :].view(T, C - c2))
    return y, out_states


def causal_conv1d_ref(
    x, weight, bias, conv_state_pool, slots, cu_seqlens, *,
    activation="silu", per_position_states=False,
):
    """Same contract as causal_conv1d: gdn_naive.causal_conv1d_seq (fp32) request by request."""
    T, C, W, B = _check_conv_args(x, weight, bias, conv_state_pool, slots, cu_seqlens, activation)
    ys, windows = [], []
    cu = cu_seqlens.tolist()
    for b, slot in enumerate(slots.tolist()):
        if slot >= 0:
            win = conv_state_pool[slot].float()  # [C, W-1]
        else:
            win = torch.zeros(C, W - 1, dtype=torch.float32, device=x.device)
        y, after = causal_conv1d_seq(x[cu[b]:cu[b + 1]], weight, bias, win, activation)  # [n, C], [n, C, W-1]
        ys.append(y)
        if per_position_states:
            windows.append(after)
        else:
            windows.append(after[-1:] if after.shape[0] else win[None])
    y = torch.cat(ys) if ys else x.new_zeros((T, C), dtype=torch.float32)
    empty = x.new_zeros((0, C, W - 1), dtype=torch.float32)
    return y.to(x.dtype), torch.cat(windows or [empty]).to(conv_state_pool.dtype)
