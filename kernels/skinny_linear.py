"""``y = x @ w.T`` for a few rows of ``x`` (decode-sized GEMMs, M <= 64; any M in the invariant mode), streaming ``w``
once (Triton).

At one to a few dozen rows a linear layer is a matrix-vector product: the time
is the time to read ``w [N, K]`` once. Library GEMMs pick tiles made for large
M there and reach a fraction of the memory bandwidth. This kernel gives each
program a ``[BLOCK_N, K]`` slab of ``w`` (or one of ``SPLIT_K`` pieces of it),
streams it through ``tl.dot`` against all M rows at once (padded to at least 16,
the smallest dot tile; or, with ``SkinnyConfig.dot=False``, through FMAs and a
sum, for a few rows) and accumulates in fp32. With ``SPLIT_K > 1`` the
programs write fp32 partials ``[SPLIT_K, M, N]``; the last of a column tile's
pieces to finish (an arrival counter per tile) sums them in split order and
rounds, in the same launch. Which piece arrives last depends on scheduling; the
order of the sum does not, so the result is the same bits every time, and the
same as ``SkinnyConfig(one_launch=False)``'s second reduce kernel gives.

Folds on load (prologues) and on store (epilogues): ``act="silu_mul"`` (``x [M, 2K]``
is ``gate | up``: ``silu(gate) * up`` in fp32, rounded to ``x.dtype``, as
``silu_and_mul`` then a linear layer compute it); ``norm=(weight, eps, offset)`` (each program sums
the squares of its rows over all of K itself, a second read of ``x`` from L2, then
normalizes with `models.common.rms_norm`'s roundings); ``residual=`` (added to the
fp32 accumulator, rounded once; with split-K after the fixed-order sum). The norm
and residual folds lose on the H200 to FlashInfer's fused add + RMSNorm between two
GEMVs (one decode pair: 18.0 us folded against 14.1 us): the models do not use them. ``rms=(squares, eps)``
scales each row of the product by an rms whose sums of squares another launch left, with no pass over x and x
streamed into the dots as loaded: with `skinny_folds.skinny_linear_add_` before it, an RMSNorm split between two
GEMVs, which the models do use (`models.fused.split_norm`).

In the invariant mode (`fnattn.kernels.invariant`) it takes any number of rows: the launch is the one the table
gives 16 rows whatever M is (`launch_config`), the rows go in 16-row tiles over grid axis 2, and where those tiles
alone fill the device each program sums K's pieces itself (``PIECES``), in the order the split launch adds them.
A row's sums are then the same additions in a call of any size: a decode step, a verify and a prefill agree.

`fnattn.kernels.skinny_folds` takes the op after the product into the same launch (SwiGLU's
activation, GDN's gating, a residual add and the next RMSNorm's row-local half) as an epilogue.

Under `fnattn.kernels.pdl` (on by default), on Hopper, the kernel launches with programmatic dependent launch: each
program loads its first weight tile while the launch before it on the stream finishes, then waits for it
before it reads ``x`` or writes anything. ``w`` must then not be an output of that launch (a model's
weights are not). ``SkinnyConfig(prefetch=True)`` also asks L2 for the rest of the program's weight slab
before the wait. It is off in the table: on, the whole Qwen3.5-0.8B graph step on the H200 took 1.043x as long at
batch 1 and 1.031x at batch 8 (``benchmarks/model_ab.py --toggle prefetch``, bench_switches_ab.json at de9b969).

Configs come from `pick_config`, an explicit table (no autotuning: timing
inside a CUDA-graph warm-up would be wrong and slow); ``config=`` overrides it.
``benchmarks/linear_sweep.py`` times the table against a sweep of tiles; ``fnattn bench linear``
times it against cuBLAS.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass

import torch

from ._counters import tile_counters
from ._switch import declare, declare_tiles, switched
from ._triton import (
    gdc_launch_dependents,
    gdc_wait,
    interpreted,
    next_pow2,
    num_sms,
    pdl_launch,
    require_triton,
    tl,
    triton,
)
from .gdn_gate import gate_columns
from .invariant import invariant_on
from .launch import launch
from .skinny_checks import MAX_M, SkinnyConfig, _check, _check_act_norm  # noqa: F401 - MAX_M: callers read it here
from .skinny_epilogues import _add_residual, _skinny_gemv_splitk_reduce, _store_tile

# Tuned on the H200 at one row (`benchmarks/linear_sweep.py`, benchmarks/results/bench_linear_b1.json): one program
# per SM is enough to stream the weight, and a tile narrower than 32 columns loses more to its short rows than
# it gains in programs (7168 x 1024: 32 columns 6.7 us, 16 columns 8.2 us); a projection too narrow for one
# program per SM (1024 columns) splits K instead (8 pieces: 5.6 us against cuBLAS's 12.9 us at 2048 x 1024).
# Above 16 rows (no sweep there yet) the accumulator ([BLOCK_M, BLOCK_N] fp32) grows: tiles may narrow to 16.
_BLOCK_N = ((16, 64, 32), (32, 32, 16), (64, 32, 16))  # (max M, widest block_n, narrowest block_n)
_PROGRAMS_PER_SM = 1
_MIN_K_PER_SPLIT = 256  # a split shorter than this spends more on its partial than it saves


def pick_config(M: int, N: int, K: int, dtype: torch.dtype, *, sms: int | None = None) -> SkinnyConfig:
    """The table's config for ``[M, K] @ [N, K]^T`` in ``dtype``; ``sms``: SM count (default: the current
    CUDA device's, 132 without one).

    Column tiles first (64 columns at M <= 16, 32 above), halved (down to 32 at
    M <= 32, 16 above) while they make fewer than one program per SM; then K is
    split (each piece at least 256 long) until they do. K tiles are 128 elements in
    half precision (256 bytes a row), 64 in fp32.
    """
    return _overridden(_table(M, N, K, dtype, _device_sms(sms)))


def _device_sms(sms: int | None) -> int:
    return num_sms(torch.cuda.current_device() if torch.cuda.is_available() else None) if sms is None else sms


def _overridden(cfg: SkinnyConfig) -> SkinnyConfig:
    """``cfg`` with the fields `configured` overrides now."""
    return dataclasses.replace(cfg, **_OVERRIDES[-1]) if _OVERRIDES[-1] else cfg


_OVERRIDES = declare_tiles(
    "gemv_config", __name__,
    overrides="the `SkinnyConfig` fields `pick_config` returns over its table's (`configured`): every GEMV's")


@contextlib.contextmanager
def configured(**fields):
    """Within this block `pick_config`'s configs have ``fields`` replaced (``configured(one_launch=False)``):
    a whole model's GEMVs one way, for A/B timings and parity runs."""
    bad = sorted(set(fields) - {f.name for f in dataclasses.fields(SkinnyConfig)})
    if bad:
        raise ValueError(f"configured: expected SkinnyConfig fields, got {', '.join(bad)}")
    dataclasses.replace(_table(16, 64, 128, torch.bfloat16, 132), **fields)  # the values checked once, here
    _OVERRIDES.append({**_OVERRIDES[-1], **fields})
    try:
        yield
    finally:
        _OVERRIDES.pop()


@functools.lru_cache(maxsize=1024)  # one entry per projection shape and row count: the table is consulted per call
def _table(M: int, N: int, K: int, dtype: torch.dtype, sms: int) -> SkinnyConfig:
    block_n, narrowest = next((bn, lo) for max_m, bn, lo in _BLOCK_N if M <= max_m)
    while block_n > narrowest and triton_cdiv(N, block_n) < _PROGRAMS_PER_SM * sms:
        block_n //= 2
    block_k = 64 if dtype == torch.float32 else 128
    tiles = triton_cdiv(N, block_n)
    split = 1
    max_split = max(1, K // _MIN_K_PER_SPLIT)
    while tiles * split < _PROGRAMS_PER_SM * sms and split < max_split:
        split *= 2
    split = min(split, max_split)
    # Each stage holds an x tile and a w tile; four stages of 64-row tiles would crowd shared memory.
    stages = 4 if next_pow2(max(M, 16)) <= 32 else 3
    return SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split, num_warps=4, num_stages=stages)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@triton.jit
def _skinny_gemv_kernel(
    X, W, Y, P, C, R, NW, M, N, K, k_per_split, k_per_piece, n_split, n_tiles, sxm, sym, srm, eps, offset,
    GG, GB, GND, GDTB, g_col, g_heads, SQ_IN, s_parts, SQ_OUT, U, UW, u_offset,
    ACT_SILU_MUL: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr, NORM_OFFSET: tl.constexpr,
    USE_DOT: tl.constexpr, FP32_DOT: tl.constexpr, SPLIT: tl.constexpr, ONE_LAUNCH: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr, LINES: tl.constexpr, GATING: tl.constexpr, LIBDEVICE: tl.constexpr,
    SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EARLY: tl.constexpr, WIDEN: tl.constexpr, RMS_SCALE: tl.constexpr, BLOCK_P: tl.constexpr,
    ADD_SQUARES: tl.constexpr, PIECES: tl.constexpr, ROWS_FIRST: tl.constexpr,
):
    """One ``[M, BLOCK_N]`` tile of ``x @ w.T`` over ``[k0, k0 + k_per_split)`` into ``Y [M, N]``.

    ``SPLIT``: the tile's fp32 partial goes to ``P[pid_k]`` (``P``: ``[n_split, M, N]``, contiguous); with
    ``ONE_LAUNCH`` the piece that arrives last at ``C[pid_n]`` (an int32 counter, zero between launches)
    sums the partials and resets the counter, else a second kernel sums them. ``NORM``: rows of ``x``
    RMS-normalized on load (weight ``NW [K]``); ``HAS_RESIDUAL``: ``R [M, N]`` added to the fp32 sum before
    rounding. ``GATING``: the tile that holds GDN's b and a columns (``g_col`` on) also writes beta and g from
    them (`gdn_gate.gate_columns`). ``SWIGLU``: ``W`` is ``[gate; up]`` (``N = 2I`` rows); the tile's products
    alternate gate and up rows of the same pairs, and it writes ``silu(gate) * up`` into ``Y [M, I]``
    (`_store_tile`). ``WIDEN``: ``Y`` is fp32 and each sum is rounded to ``W``'s dtype first (the bits of the
    product in that dtype, widened). ``RMS_SCALE``: each row's sums times ``1 / sqrt(sum(SQ_IN[m]) / K + eps)``
    before the store (``SQ_IN [M, s_parts]``: fp32 sums of squares in pieces), so x streams into the dots as
    loaded. ``ADD_SQUARES`` (with ``HAS_RESIDUAL``): the product is rounded, then the residual added and the sum
    rounded (the unfused ops' bits); the tile's sums of squares of the rounded sum go to ``SQ_OUT[m, pid_n]``
    (``[M, n_tiles]``) and the sum times ``u_offset + UW[n]``, rounded, to ``U [M, N]`` (contiguous).
    The rows go ``BLOCK_M`` at a time over program axis 2 (the invariant mode's grid: one row tile outside it);
    ``ROWS_FIRST``: over axis 0, the column tiles over axis 2, so the row tiles of one weight slab are launched
    side by side and all but the first read it from L2.
    ``PIECES``: K is summed in pieces of ``k_per_piece`` positions, each from zero, added in order: the split
    launch's sums within one program (the same bits; EARLY is 1)."""
    if ROWS_FIRST:
        pid_m, pid_n = tl.program_id(0), tl.program_id(2)
    else:
        pid_m, pid_n = tl.program_id(2), tl.program_id(0)
    pid_k = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    m_ok = m < M
    n_ok = n < N
    x_rows = X + m.to(tl.int64)[:, None] * sxm  # [BM, 1]
    if SWIGLU:  # product n is gate row n // 2 (n even) or the up row of the same pair (n odd)
        w_rows = W + (n // 2 + (n % 2) * (N // 2)).to(tl.int64)[:, None] * K  # [BN, 1]
    else:
        w_rows = W + n.to(tl.int64)[:, None] * K  # [BN, 1]
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    k_first = k_lo + tl.arange(0, EARLY * BLOCK_K)  # [E BK]; every piece has at least one K tile
    w_first = tl.load(w_rows + k_first[None, :], mask=n_ok[:, None] & (k_first < k_hi)[None, :],
                      other=0.0)  # [BN, E BK]
    # The weights are constants of the step: under PDL their first EARLY tiles stream in (and with PREFETCH
    # the rest of the slab is asked of L2) while the launch before this one finishes. x, the residual and the
    # counters are read, and anything written, only after gdc_wait.
    if PDL:
        if PREFETCH:
            for k0 in range(k_lo + EARLY * BLOCK_K, k_hi, BLOCK_K):
                line = k0 + tl.arange(0, LINES) * (BLOCK_K // LINES)  # [LINES]: one address per cache line
                ok = n_ok[:, None] & (line < k_hi)[None, :]
                _prefetch_l2(tl.where(ok, w_rows + line[None, :], W))
        gdc_wait()
        gdc_launch_dependents()
    if RMS_SCALE:  # left by the GEMV that wrote the rows: one load, its latency behind the dots
        p = tl.arange(0, BLOCK_P)  # [BP]
        parts = tl.load(SQ_IN + m[:, None] * s_parts + p[None, :], mask=m_ok[:, None] & (p < s_parts)[None, :],
                        other=0.0)  # [BM, BP]
        row_scale = 1.0 / tl.sqrt_rn(tl.sum(parts, axis=1) / K + eps)  # [BM]; padded rows: 0 sums, finite
    else:
        row_scale = tl.zeros((BLOCK_M,), dtype=tl.float32)  # unused
    if NORM:  # the whole row's statistics, also in a split-K piece that reads only part of it below
        sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)  # [BK]
            xs = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0).to(tl.float32)
            sq += tl.sum(xs * xs, axis=1)
        rstd = 1.0 / tl.sqrt_rn(sq / K + eps)  # [BM]; padded rows: x = 0, rstd finite
    else:
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)  # unused
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_first = _x_tile(x_rows, NW, k_first, m_ok, k_first < k_hi, K, rstd, offset, W.dtype.element_ty, ACT_SILU_MUL,
                      NORM, NORM_OFFSET)
    if PIECES:
        part = _accumulate(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), x_first, w_first, USE_DOT, FP32_DOT)
        for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
            if (k0 - k_lo) % k_per_piece == 0:  # a piece ends: its sum joins the total, the next starts from zero
                acc = acc + part
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            part = _k_tile(part, x_rows, w_rows, NW, k0, k_hi, m_ok, n_ok, K, rstd, offset, W.dtype.element_ty,
                           ACT_SILU_MUL, NORM, NORM_OFFSET, USE_DOT, FP32_DOT, BLOCK_K)
        acc = acc + part
    else:
        acc = _accumulate(acc, x_first, w_first, USE_DOT, FP32_DOT)
        for k0 in range(k_lo + EARLY * BLOCK_K, k_hi, BLOCK_K):
            acc = _k_tile(acc, x_rows, w_rows, NW, k0, k_hi, m_ok, n_ok, K, rstd, offset, W.dtype.element_ty,
                          ACT_SILU_MUL, NORM, NORM_OFFSET, USE_DOT, FP32_DOT, BLOCK_K)
    mask = m_ok[:, None] & n_ok[None, :]
    y_at = Y + m.to(tl.int64)[:, None] * sym + n[None, :]  # [BM, BN]
    if SPLIT:
        tile = m[:, None] * N + n[None, :]  # [BM, BN] within one partial
        tl.store(P + pid_k.to(tl.int64) * M * N + tile, acc, mask=mask)
        if ONE_LAUNCH:
            tl.debug_barrier()  # every thread's partial is stored before the arrival is counted (released)
            counter = C + pid_m * n_tiles + pid_n
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == n_split - 1:  # the last piece: every partial is visible (acquired); from L2, not L1
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(0, n_split):
                    total += tl.load(P + s * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
                if RMS_SCALE:
                    total = total * row_scale[:, None]
                if HAS_RESIDUAL:
                    total = _add_residual(total, R, SQ_OUT, U, UW, u_offset, m, n, m_ok, mask, pid_n, n_tiles, N,
                                          srm, W.dtype.element_ty, ADD_SQUARES)
                if WIDEN:
                    total = total.to(W.dtype.element_ty).to(tl.float32)
                _store_tile(Y, y_at, total, m, m_ok, mask, pid_n, N, sym, SWIGLU, BLOCK_M, BLOCK_N)
                tl.atomic_xchg(counter, 0)  # zero again for the next launch
                if GATING:
                    if (pid_n * BLOCK_N < g_col + 2 * g_heads) & (pid_n * BLOCK_N + BLOCK_N > g_col):
                        gate_columns(total.to(Y.dtype.element_ty), m, n, m_ok, GG, GB, GND, GDTB, g_col, g_heads,
                                     1.0, 20.0, LIBDEVICE)
    else:
        if RMS_SCALE:
            acc = acc * row_scale[:, None]
        if HAS_RESIDUAL:
            acc = _add_residual(acc, R, SQ_OUT, U, UW, u_offset, m, n, m_ok, mask, pid_n, n_tiles, N, srm,
                                W.dtype.element_ty, ADD_SQUARES)
        if WIDEN:
            acc = acc.to(W.dtype.element_ty).to(tl.float32)
        _store_tile(Y, y_at, acc, m, m_ok, mask, pid_n, N, sym, SWIGLU, BLOCK_M, BLOCK_N)
        if GATING:
            if (pid_n * BLOCK_N < g_col + 2 * g_heads) & (pid_n * BLOCK_N + BLOCK_N > g_col):
                gate_columns(acc.to(Y.dtype.element_ty), m, n, m_ok, GG, GB, GND, GDTB, g_col, g_heads, 1.0,
                             20.0, LIBDEVICE)


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the cache line behind each pointer (PTX ``prefetch.global.L2``); nothing is returned."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs.to(tl.int64)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _x_tile(x_rows, NW, k, m_ok, k_ok, K, rstd, offset, dtype: tl.constexpr, ACT_SILU_MUL: tl.constexpr,
            NORM: tl.constexpr, NORM_OFFSET: tl.constexpr):
    """The operand of x at columns ``k``: as stored, ``silu(gate) * up`` or RMS-normalized."""
    xm = m_ok[:, None] & k_ok[None, :]
    if ACT_SILU_MUL:
        g = tl.load(x_rows + k[None, :], mask=xm, other=0.0).to(tl.float32)
        u = tl.load(x_rows + K + k[None, :], mask=xm, other=0.0).to(tl.float32)
        xt = (g / (1.0 + tl.exp(-g)) * u).to(dtype)  # rounded as silu_and_mul's
    else:
        xt = tl.load(x_rows + k[None, :], mask=xm, other=0.0)
    if NORM:  # rms_norm's roundings: with an offset, one (after the scale); without, before and after it
        h = xt.to(tl.float32) * rstd[:, None]
        nw = tl.load(NW + k, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
        if NORM_OFFSET:
            xt = (h * (offset + nw)[None, :]).to(dtype)
        else:
            xt = (h.to(dtype).to(tl.float32) * nw[None, :]).to(dtype)
    return xt


@triton.jit
def _k_tile(acc, x_rows, w_rows, NW, k0, k_hi, m_ok, n_ok, K, rstd, offset, dtype: tl.constexpr,
            ACT_SILU_MUL: tl.constexpr, NORM: tl.constexpr, NORM_OFFSET: tl.constexpr, USE_DOT: tl.constexpr,
            FP32_DOT: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc`` plus the products of the K tile at ``k0`` (x's operand as `_x_tile` makes it, w's as stored)."""
    k = k0 + tl.arange(0, BLOCK_K)  # [BK]
    k_ok = k < k_hi
    xt = _x_tile(x_rows, NW, k, m_ok, k_ok, K, rstd, offset, dtype, ACT_SILU_MUL, NORM, NORM_OFFSET)
    wt = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, BK]
    return _accumulate(acc, xt, wt, USE_DOT, FP32_DOT)


@triton.jit
def _accumulate(acc, xt, wt, USE_DOT: tl.constexpr, FP32_DOT: tl.constexpr):
    if not USE_DOT:  # FMAs and a sum over K: no padding of the rows to 16, every product in registers
        return acc + tl.sum(xt.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :], axis=2)
    elif FP32_DOT:  # fp32 weights: full-precision products, not tf32
        return acc + tl.dot(xt, tl.trans(wt), input_precision="ieee")
    else:
        return acc + tl.dot(xt, tl.trans(wt))


def column_tiles(M: int, N: int, K: int, dtype: torch.dtype, config: SkinnyConfig | None = None) -> int:
    """How many column tiles the launch for ``[M, K] @ [N, K]^T`` has (`launch_config`'s or ``config``'s)."""
    return triton_cdiv(N, (config or launch_config(M, N, K, dtype)).block_n)


INVARIANT_ROWS = 16  # the invariant mode's row tile (the smallest dot tile): every call's product shape
_WIDE_ROWS = declare(
    "wide_invariant_rows", True, __name__,
    on="in the invariant mode a GEMV of more than 16 rows (but the residual add with its squares) takes its rows "
       "in tiles of 64, else 32, where those tiles still give every SM a program",
    off="16-row tiles at every row count",
    why="in 128-row products of the 0.8B shape's projections and lm_head a row's bits were the same with 16-, 32- "
        "and 64-row tiles for the plain product and every fold but the squares, and 64-row tiles took 12.3 / "
        "20.2 / 330 us against 18.1 / 25.0 / 566 with 16 (3584x1024, 6144x1024, 248320x1024; H100, "
        "gemv_row_tiles.json at 17476a0); the mode's Qwen3.5-0.8B step at batch 128 1.13x the mode-off one "
        "against 1.21x with it off, the same at batch 1 to 32 (paired, bench_invariance_ab.json at f72d6d7)")


def wide_invariant_rows(enabled: bool):
    """Within this block (on by default) the invariant mode's GEMV of more than `INVARIANT_ROWS` rows takes
    them in tiles of 64, else 32, where those tiles still give every SM a program: the tile's height changes
    which MMA runs, not the order of a row's sums over K, so a row's bits stay those of its 16-row tile, while
    each weight tile is read once for 64 rows instead of four times. Checked on the H100 for the 0.8B shape's
    projections and lm_head, the plain product and each fold (`benchmarks/gemv_row_tiles.py --folds`): the norm
    on load, the row scale, SiLU-and-mul, the residual, SwiGLU and gating keep their bits; the residual add with
    its squares did not (three shapes of four), so it keeps 16-row tiles. Off: 16-row tiles at every row
    count."""
    return switched(_WIDE_ROWS, "wide_invariant_rows", enabled)


def _invariant_rows(M: int, col_tiles: int, sms: int, wide: bool) -> int:
    """The invariant mode's row tile for an M-row call: `INVARIANT_ROWS`, or with ``wide`` and more rows than
    that, the widest of 64 and 32 whose tiles still give every SM a program."""
    if wide and M > INVARIANT_ROWS:
        for rows in (4 * INVARIANT_ROWS, 2 * INVARIANT_ROWS):
            if triton_cdiv(M, rows) * col_tiles >= sms:
                return rows
    return INVARIANT_ROWS
_MAX_GRID_Z = 65535  # CUDA's bound on grid axes 1 and 2


def launch_config(M: int, N: int, K: int, dtype: torch.dtype, *, sms: int | None = None) -> SkinnyConfig:
    """`pick_config`'s config for the call; in the invariant mode one config for the weight's shape whatever M
    is (the table's at 16 rows, its column tile widened under `invariant_tiles`; K's pieces fixed by the
    shape), products by ``tl.dot`` and a first load of one tile, so a row's sums are the same additions in a
    call of any size."""
    if not invariant_on():
        return pick_config(M, N, K, dtype, sms=sms)
    cfg = _invariant_config(N, K, dtype, _device_sms(sms), _INVARIANT_TILES[-1])
    return dataclasses.replace(_overridden(cfg), dot=True, early=1) if _OVERRIDES[-1] else cfg


@functools.lru_cache(maxsize=1024)  # asked before every launch in the mode: one answer per weight shape
def _invariant_config(N: int, K: int, dtype: torch.dtype, sms: int, widen: bool) -> SkinnyConfig:
    """The mode's config for a weight shape, before `configured`'s overrides: the table's at 16 rows (widened
    by `_invariant_tiles` with ``widen``), by ``tl.dot``, with a first load of one tile."""
    cfg = _table(16, N, K, dtype, sms)
    return dataclasses.replace(_invariant_tiles(cfg, N, sms) if widen else cfg, dot=True, early=1)


_INVARIANT_TILES = declare(
    "invariant_tiles", True, __name__,
    on="in the invariant mode a projection whose 16-row table tile narrowed to 32 columns to fill the device takes "
       "64 (4 stages) where that still gives half the SMs a program, and one of at least 8 x SMs 64-column tiles "
       "(an lm_head) takes 128 (3 stages): its rows fill the device past 16 rows",
    off="the table's 16-row config at every row count",
    why="one call replayed, in the mode at 1 / 8 / 32 / 128 rows (H100, invariant_gemv_sweep.json at 17476a0): "
        "7168x1024 13.2 / 13.4 / 13.9 / 18.2 us against 13.2 / 13.2 / 16.3 / 24.3 with the table's tile, "
        "8224x1024 14.3 / 14.5 / 14.9 / 19.0 against 14.2 / 14.3 / 17.0 / 25.3, 5120x1024 11.8 / 11.9 / 12.6 / 16.2 "
        "against 11.8 / 11.9 / 14.7 / 19.2, the 248320x1024 lm_head 176.6 / 180.5 / 193.8 / 279.8 against "
        "175.6 / 180.9 / 209.9 / 329.2 (mode off: 12.9 / 12.9 / 12.9 / 13.2 us for 7168x1024, cuBLAS past 16 "
        "rows); each kept a row's bits across row counts. The mode's Qwen3.5-0.8B step, paired by round, "
        "1.12x / 1.09x / 0.96x / 1.13x the mode-off one at batch 1 / 8 / 32 / 128 against 1.10x / 1.08x / 1.03x "
        "/ 1.15x with it off (bench_invariance_ab.json at f72d6d7): one config serves every batch")


def invariant_tiles(enabled: bool):
    """Within this block (on by default) the invariant mode's GEMV takes wider column tiles than the table's at
    16 rows where the table narrowed them to give a one-row call a program per SM: a projection of 32-column
    tiles (split along K in no pieces) takes 64 columns and 4 stages where those still give at least half the SMs
    a program (N >= 4224 on 132 SMs), and one with at least 8 programs an SM at
    64 columns (an lm_head) takes 128 and 3 stages (4 would overflow shared memory with 64-row tiles). Past 16
    rows the row tiles fill the device, and each weight tile then feeds more rows; at one row the wider tiles
    cost nothing measurable. The config is still the weight shape's alone, the same at every row count: a row's
    bits do not follow M. Off: the table's 16-row config."""
    return switched(_INVARIANT_TILES, "invariant_tiles", enabled)


_LM_HEAD_PROGRAMS_PER_SM = 8  # column tiles of 64 per SM from which a projection counts as an lm_head


def _invariant_tiles(cfg: SkinnyConfig, N: int, sms: int) -> SkinnyConfig:
    if cfg.split_k > 1:  # a narrow projection split along K: the table's pieces serve every row count
        return cfg
    if triton_cdiv(N, 64) >= _LM_HEAD_PROGRAMS_PER_SM * sms:
        return dataclasses.replace(cfg, block_n=128, num_stages=3)
    if cfg.block_n < 64 and 2 * triton_cdiv(N, 64) >= sms:  # where a one-row call keeps half the SMs busy
        return dataclasses.replace(cfg, block_n=64, num_stages=4)
    return cfg


def skinny_linear(x, w, *, out=None, act=None, residual=None, norm=None, rms=None, config=None):
    """``x [M, K] @ w[N, K]^T -> y [M, N]`` in ``x.dtype`` with fp32 accumulation, M <= 64.

    ``act="silu_mul"``: ``x`` is ``[M, 2K]`` (gate | up) and the product is of
    ``silu(gate) * up`` (rounded to ``x.dtype``). ``residual``: an ``[M, N]``
    tensor in ``x.dtype`` (unit inner stride) added to the fp32 product, the sum
    rounded once. ``norm=(weight [K], eps, offset)``: the product is of
    ``rms_norm(x, weight, eps, offset=offset)`` (`models.common`'s roundings;
    not with ``act``). ``x``'s rows may be strided (unit stride within a row);
    ``w`` is contiguous. ``out``: an ``[M, N]`` tensor to write (unit inner
    stride, sharing no storage with ``x`` or ``residual``), returned; in fp32 it holds the product rounded
    to ``x.dtype``, widened (``skinny_linear(x, w).float()`` without the second launch: logits).
    ``rms=(squares, eps)``: each row of the product times ``1 / sqrt(squares[m].sum() / K + eps)`` before its
    rounding (``squares``: fp32 ``[M, P]``, sums of squares in pieces). With ``x`` rows times an RMSNorm's
    ``offset + weight`` and ``squares`` the rows' own (both as `skinny_folds.skinny_linear_add_` leaves
    them), the product is of the RMSNorm, its rounding moved from the normed rows to the product, and x
    streams into the dots as loaded. Not with ``act`` or ``norm``.
    ``config``: a `SkinnyConfig` instead of `pick_config`'s.
    """
    norm = _check(x, w, out, act, config, residual, norm, rms)
    y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device) if out is None else out
    if not _launch(x, w, y, act, residual, norm, config, rms=rms) and rms is not None:
        y.copy_(rms_scaled_ref(x, w, rms, residual))  # a split launch without its counters: the truth apart
    return y


def _launch(x, w, y, act, residual, norm, config, gating=None, swiglu=False, rms=None, add_squares=None) -> bool:
    """Write ``y`` (checked arguments); ``gating=(g, beta, neg_decay, dt_bias, col, H)``: also g and beta,
    when the launch can (``-> whether it did``). ``swiglu``: ``y [M, N / 2]`` is ``silu(gate) * up`` of the
    products, when the launch can; when it cannot (no counters for a split launch, an empty K), nothing is
    written.
    ``rms=(squares [M, P], eps)``: each row's product times ``1 / sqrt(squares[m].sum() / K + eps)``, when the
    launch can (a split launch needs its counters); when it cannot, nothing is written. ``add_squares=(squares
    [M, column_tiles(...)], scaled [M, N], weight [N], offset)`` (with ``residual``): the residual added as
    the unfused ops round it, each column tile's fp32 sums of squares of the result and the result times
    ``offset + weight``, rounded, written there, when the launch can; when it cannot, nothing is written."""
    M, N, K = x.shape[0], w.shape[0], w.shape[1]
    if M == 0 or N == 0:
        return False
    if K == 0:  # an empty product; the norm of an empty row scales nothing
        if not swiglu and add_squares is None and rms is None:
            y.zero_() if residual is None else y.copy_(residual)
        return False
    require_triton()
    sms = num_sms(x.device.index if x.is_cuda else None)
    mode = invariant_on()
    cfg = config or launch_config(M, N, K, x.dtype, sms=sms)
    pdl = pdl_launch(x.device)  # the first weight tile loads while the launch before finishes
    plan = _plan(M, N, K, x.dtype, y.dtype, cfg, act, norm is not None and norm[2] != 0.0, norm is not None,
                 gating is not None, swiglu, 0 if rms is None else rms[0].shape[1], add_squares is not None, pdl,
                 interpreted(_skinny_gemv_kernel), sms if mode else 0, mode and _WIDE_ROWS[-1])
    grid, k_per_split, k_per_piece = plan.grid, plan.k_per_split, plan.k_per_piece
    split = grid[1]
    # Absent operands: x stands in for the pointers, which the constexpr flags keep the kernel from reading.
    r = x if residual is None else residual
    srm = 0 if residual is None else residual.stride(0)
    nw, eps, offset = (x, 0.0, 0.0) if norm is None else norm
    if rms is not None:
        eps = rms[1]
    # Counters: one per (row tile, column tile), for the split-K arrivals.
    counters = tile_counters(x.device, plan.col_tiles * plan.row_tiles) if split > 1 and cfg.one_launch else None
    common = plan.constexprs
    if split > 1 and counters is None:  # the reduce kernel has no gating, SwiGLU, row scale or squares epilogue
        if swiglu or add_squares is not None or rms is not None:
            return False
        gating, common = None, {**common, "GATING": False}
    gg, gb, gnd, gdtb, g_col, g_heads = (y, y, y, y, 0, 0) if gating is None else gating
    sq_in, parts = (y, 1) if rms is None else (rms[0], rms[0].shape[1])
    sq_out, u, uw, u_offset = (y, y, y, 0.0) if add_squares is None else add_squares
    c = y if counters is None else counters
    if split == 1:
        launch(_skinny_gemv_kernel, grid, (x, w, y, y, c, r, nw, M, N, K, k_per_split, k_per_piece, 1, plan.col_tiles,
                                           x.stride(0), y.stride(0), srm, eps, offset, gg, gb, gnd, gdtb, g_col,
                                           g_heads, sq_in, parts, sq_out, u, uw, u_offset),
               dict(HAS_RESIDUAL=residual is not None, SPLIT=False, ONE_LAUNCH=False, **common))
        return gating is not None or swiglu or add_squares is not None or rms is not None
    part = torch.empty((split, M, N), dtype=torch.float32, device=x.device)  # [SPLIT_K, M, N]
    one_launch = counters is not None
    launch(_skinny_gemv_kernel, grid, (x, w, y, part, c, r, nw, M, N, K, k_per_split, k_per_piece, split,
                                       plan.col_tiles, x.stride(0), y.stride(0), srm, eps, offset, gg, gb, gnd, gdtb,
                                       g_col, g_heads, sq_in, parts, sq_out, u, uw, u_offset),
           dict(HAS_RESIDUAL=residual is not None, SPLIT=True, ONE_LAUNCH=one_launch, **common))
    if not one_launch:
        block = min(256, next_pow2(N))  # several programs per row: the sum is a few loads each, latency-bound
        launch(_skinny_gemv_splitk_reduce, (M, triton_cdiv(N, block)), (part, y, r, M, N, y.stride(0), srm),
               dict(SPLIT_K=split, HAS_RESIDUAL=residual is not None, BLOCK=block, WIDEN=y.dtype != x.dtype,
                    num_warps=4))
    return gating is not None or swiglu or add_squares is not None or rms is not None


@dataclass(frozen=True)
class _Plan:
    """What a GEMV launch derives from its shapes, config and folds alone: the same for every call alike."""

    grid: tuple[int, int, int]  # (column tiles, K pieces as programs, row tiles); ROWS_FIRST: rows, pieces, columns
    col_tiles: int
    row_tiles: int
    k_per_split: int  # K positions a program sums
    k_per_piece: int  # K positions each of its fresh sums covers (PIECES)
    constexprs: dict  # the kernel's compile-time arguments but HAS_RESIDUAL, SPLIT and ONE_LAUNCH


@functools.lru_cache(maxsize=4096)  # an eager decode step launches ~100 GEMVs of a few dozen kinds
def _plan(M: int, N: int, K: int, x_dtype, y_dtype, cfg: SkinnyConfig, act, norm_offset: bool, norm: bool,
          gating: bool, swiglu: bool, rms_parts: int, add_squares: bool, pdl: bool, interpret: bool,
          invariant_sms: int, wide: bool = False) -> _Plan:
    """``invariant_sms``: the invariant mode's launch (the device's SM count; 0 outside the mode): rows in tiles
    of `INVARIANT_ROWS` (wider with ``wide`` where no fold reduces along a row: `_invariant_rows`; over grid axis
    0, the column tiles over axis 2: ``ROWS_FIRST``), and where the tiles alone fill the device, each program
    sums K's pieces itself (``PIECES``) rather than as programs of their own: the same additions."""
    if invariant_sms:
        # the residual add's squares: a row's bits moved with the tile's height on the H100 (gemv_row_tiles.json)
        BLOCK_M = _invariant_rows(M, triton_cdiv(N, cfg.block_n), invariant_sms, wide and not add_squares)
    else:
        BLOCK_M = max(16, next_pow2(M)) if cfg.dot else next_pow2(M)  # a dot tile has at least 16 rows
    row_tiles = triton_cdiv(M, BLOCK_M)
    k_tiles = triton_cdiv(K, cfg.block_k)
    per_split = triton_cdiv(k_tiles, cfg.split_k)  # K tiles each piece streams; no piece left empty
    split = triton_cdiv(k_tiles, per_split)
    k_per_piece = per_split * cfg.block_k
    col_tiles = triton_cdiv(N, cfg.block_n)
    # (a config's first load of several tiles could cross a piece: such a call keeps the pieces as programs)
    pieces = split > 1 and invariant_sms and row_tiles * col_tiles >= invariant_sms and cfg.early == 1
    if pieces:
        split, per_split = 1, k_tiles
    rows_first = row_tiles > 1 and col_tiles <= _MAX_GRID_Z
    constexprs = dict(ACT_SILU_MUL=act == "silu_mul", NORM=norm, NORM_OFFSET=norm_offset, USE_DOT=cfg.dot,
                      FP32_DOT=x_dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n,
                      BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                      PDL=pdl, launch_pdl=pdl, PREFETCH=pdl and cfg.prefetch,
                      LINES=max(1, cfg.block_k * x_dtype.itemsize // 128), GATING=gating,
                      LIBDEVICE=not interpret, SWIGLU=swiglu, EARLY=cfg.early, WIDEN=y_dtype != x_dtype,
                      RMS_SCALE=rms_parts > 0, BLOCK_P=next_pow2(max(rms_parts, 1)), ADD_SQUARES=add_squares,
                      PIECES=bool(pieces), ROWS_FIRST=rows_first)
    grid = (row_tiles, split, col_tiles) if rows_first else (col_tiles, split, row_tiles)
    return _Plan(grid, col_tiles, row_tiles, per_split * cfg.block_k, k_per_piece, constexprs)


def rms_norm_ref(x, weight, eps: float, offset: float = 0.0):
    """`models.common.rms_norm` (this package imports nothing from fnattn; a test holds the two equal): fp32
    statistics, ``x * rstd`` rounded once after ``* (offset + weight)`` with an offset, before ``* weight``
    (and after) without one."""
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (offset + weight.float())).to(x.dtype)
    return h.to(x.dtype) * weight


def rms_scaled_ref(x, w, rms, residual=None):
    """The truth of `skinny_linear`'s ``rms=``: fp32 products times each row's scale, rounded once."""
    squares, eps = rms
    y = (x.float() @ w.float().T) * torch.rsqrt(squares.sum(-1, keepdim=True) / max(w.shape[1], 1) + eps)
    return (y if residual is None else y + residual.float()).to(x.dtype)


def skinny_linear_ref(x, w, *, act=None, residual=None, norm=None):
    """The truth of `skinny_linear`: fp32 products and sums (the residual added to the fp32 product), rounded
    once to ``x.dtype``; ``act`` and ``norm`` round their operand to ``x.dtype`` first, as the unfused ops do."""
    norm = _check_act_norm(act, norm)
    if act == "silu_mul":
        g, u = x.float().chunk(2, dim=-1)
        x = (torch.nn.functional.silu(g) * u).to(x.dtype)
    if norm is not None:
        x = rms_norm_ref(x, *norm)
    y = x.float() @ w.float().T
    if residual is not None:
        y = residual.float() + y
    return y.to(x.dtype)
