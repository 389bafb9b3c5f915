"""Paged GQA attention over a KV cache plus this step's new tokens (Triton).

One kernel serves decode, verify, chunked prefill and prefill. Query token `i`
of request `b` sits at position `p = cache_lens[b] + i`; it attends to the
request's cached tokens (read through `block_table`, non-causal) and to the
step's new tokens `0..i` (causal), all in one online softmax, so the new K/V
are never written to the cache before attention and need no merge launch.

Layouts follow docs/layout.md: caches are `[P, S, Hkv, D]` (one layer of a
pool), query head `h` reads kv head `h // (Hq // Hkv)`, `lse` is the natural-log
log-sum-exp without the sink and `-inf` when nothing was attended.

The query heads sharing a kv head are packed into the rows of one tile (row =
token * G_PAD + head in group), so each K/V tile is loaded once per kv head.
Long contexts with few programs are split over the key range (split-K); a
small second kernel merges the partial results by LSE and applies the sinks
(the last split of each tile merging them in the same launch, through arrival
counters, made the Qwen3.5-0.8B decode step 1.02x slower on the H200).
The invariant mode's launch splits at fixed positions instead (`INVARIANT_SPLIT_KEYS`) and merges a token's
splits in order, in its program or in a second launch, with the same bits either way.

Nothing here writes into its arguments (see `scatter.py` for the writes).
"""


import torch

from ._switch import declare_tiles
from ._tiles import overridden
from ._triton import gdc_launch_dependents, gdc_wait, next_pow2, num_sms, pdl_launch, require_triton, tl, triton
from .attention_naive import attention
from .attention_tiles import (LOG2E, attend_tile, cached_kv, fresh_kv, invariant_keys, invariant_splits, normalized,
                              ordered_merge)
from .launch import launch
from .lse_merge import merge_attention_states, merge_attention_states_ref, merge_splits  # noqa: F401
from .scatter import scatter_kv, scatter_kv_ref, scatter_rows, scatter_rows_ref  # noqa: F401

_MAX_SPLITS = 64
# A split of fewer keys costs a program more than it saves; 64 keys keep batch-1 decode of a few-head
# model (two KV heads at 512 tokens: 4 programs at 256 keys a split, 16 at 64) from running on a handful of SMs.
_MIN_SPLIT_TOKENS = 64
# The invariant launch walks a token's keys in splits of this many positions, each a fresh online softmax,
# merged in order (`attention_tiles.ordered_merge`); with few programs the splits run as programs of their own
# and a second launch merges them, the same bits. A split's partial sums (a group's heads x Dv in fp32: 8 KB at
# 8 heads of 256) are small beside its keys (64 KB at two of 256 dims), so the splits can be as short as the
# usual launch's (`_MIN_SPLIT_TOKENS`): at batch 1 a two-KV-head model at 512 tokens then runs 16 programs, not 4.
INVARIANT_SPLIT_KEYS = 64
INVARIANT_PARTIAL_BYTES = 64 << 20  # the most partial sums a splitting invariant launch may write


# ----------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------


@triton.jit
def _paged_attn_kernel(
    Q, K_NEW, V_NEW, K_CACHE, V_CACHE, BLOCK_TABLE, CACHE_LENS, CU_SEQLENS, SINKS,
    OUT, LSE, O_PART, LSE_PART, L_PART,
    sm_scale, softcap, window, num_splits,
    sq_t, sq_h, skn_t, skn_h, svn_t, svn_h,
    skc_p, skc_s, skc_h, svc_p, svc_s, svc_h, sbt_b,
    so_t, so_h, sl_t, sl_h, sop_t, sop_h, sop_s, slp_t, slp_h,
    HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DECODE: tl.constexpr, HAS_NEW: tl.constexpr, HAS_SINK: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr, PDL: tl.constexpr, INVARIANT: tl.constexpr = False, SPLIT_KEYS: tl.constexpr = 64,
):
    if PDL:  # inputs are read only after the launch before this one has finished
        gdc_wait()
        gdc_launch_dependents()
    TOK: tl.constexpr = BLOCK_M // G_PAD  # query tokens per tile
    # Last tiles see the most keys under the causal mask: start them first.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1) // HKV
    kvh = tl.program_id(1) % HKV
    split = tl.program_id(2)

    ctx = tl.load(CACHE_LENS + b)
    if DECODE:
        tok0 = b
        n_q = 1
    else:
        tok0 = tl.load(CU_SEQLENS + b)
        n_q = tl.load(CU_SEQLENS + b + 1) - tok0
    if pid_m * TOK >= n_q:
        return

    rows = tl.arange(0, BLOCK_M)
    tok = pid_m * TOK + rows // G_PAD  # [BM] new-token index within the request
    g = rows % G_PAD
    row_ok = (tok < n_q) & (g < G)
    head = kvh * G + g  # [BM]
    pos = ctx + tok  # [BM] absolute query position
    t_row = (tok0 + tok).to(tl.int64)
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    d_ok = d < D
    dv_ok = dv < DV
    n_off = tl.arange(0, BLOCK_N)

    q = tl.load(
        Q + t_row[:, None] * sq_t + head[:, None] * sq_h + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )  # [BM, D_PAD]

    # Key positions this tile can see: [lo, hi). Cached keys are [0, ctx),
    # new keys [ctx, ctx + n_q).
    first = ctx + pid_m * TOK
    last = tl.minimum(first + TOK, ctx + n_q) - 1
    lo = first * 0
    if WINDOW:
        lo = tl.maximum(first - window + 1, 0)
    if HAS_NEW:
        hi = last + 1
    else:
        hi = ctx
    chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), num_splits), BLOCK_N) * BLOCK_N
    s_lo = lo + split * chunk
    s_hi = tl.minimum(s_lo + chunk, hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)

    if INVARIANT:  # one token a program, its keys in splits of SPLIT_KEYS positions merged in order
        if SPLIT:  # this program: split `split` alone, its sums left for `_merge_ordered_splits_kernel`
            m_i, l_i, acc = invariant_keys(q, pos, ctx, tl.maximum(lo, split * SPLIT_KEYS),
                                           tl.minimum(hi, (split + 1) * SPLIT_KEYS), b, tok0, kvh, d, dv, d_ok,
                                           dv_ok, n_off, K_NEW, V_NEW, K_CACHE, V_CACHE, BLOCK_TABLE, sm_scale,
                                           softcap, window, skn_t, skn_h, svn_t, svn_h, skc_p, skc_s, skc_h,
                                           svc_p, svc_s, svc_h, sbt_b, m_i, l_i, acc, PAGE, BLOCK_N, SOFTCAP,
                                           WINDOW, IEEE)
            part = t_row * slp_t + head * slp_h + split
            tl.store(O_PART + t_row[:, None] * sop_t + head[:, None] * sop_h + split * sop_s + dv[None, :], acc,
                     mask=row_ok[:, None] & dv_ok[None, :])
            tl.store(LSE_PART + part, m_i, mask=row_ok)
            tl.store(L_PART + part, l_i, mask=row_ok)
            return
        m_i, l_i, acc = invariant_splits(q, pos, ctx, lo, hi, b, tok0, kvh, d, dv, d_ok, dv_ok, n_off, K_NEW, V_NEW,
                                         K_CACHE, V_CACHE, BLOCK_TABLE, sm_scale, softcap, window, skn_t, skn_h,
                                         svn_t, svn_h, skc_p, skc_s, skc_h, svc_p, svc_s, svc_h, sbt_b, m_i, l_i, acc,
                                         PAGE, BLOCK_N, SPLIT_KEYS, SOFTCAP, WINDOW, IEEE)
    else:
        c_hi = tl.minimum(s_hi, ctx)
        for start in range(s_lo, c_hi, BLOCK_N):
            j = start + n_off  # [BN]
            j_ok = j < c_hi
            k, v = cached_kv(K_CACHE, V_CACHE, BLOCK_TABLE, b, sbt_b, j, j_ok, kvh, d, dv, d_ok, dv_ok,
                             skc_p, skc_s, skc_h, svc_p, svc_s, svc_h, PAGE)  # [BN, D_PAD], [BN, DV_PAD]
            m_i, l_i, acc = attend_tile(q, k, v, j, j_ok[None, :], pos, m_i, l_i, acc, sm_scale, softcap, window,
                                        SOFTCAP, WINDOW, IEEE)
        if HAS_NEW:
            for start in range(tl.maximum(s_lo, ctx), s_hi, BLOCK_N):
                j = start + n_off  # [BN]
                j_ok = j < s_hi
                k, v = fresh_kv(K_NEW, V_NEW, (tok0 + j - ctx).to(tl.int64), j_ok, kvh, d, dv, d_ok, dv_ok,
                                skn_t, skn_h, svn_t, svn_h)
                m_i, l_i, acc = attend_tile(q, k, v, j, j_ok[None, :] & (j[None, :] <= pos[:, None]), pos, m_i,
                                            l_i, acc, sm_scale, softcap, window, SOFTCAP, WINDOW, IEEE)

    sink = tl.zeros([BLOCK_M], tl.float32)
    if SPLIT and not INVARIANT:  # the sinks wait for the merge
        o, lse = normalized(m_i, l_i, acc, sink, False, True)
        tl.store(
            O_PART + t_row[:, None] * sop_t + head[:, None] * sop_h + split * sop_s + dv[None, :],
            o, mask=row_ok[:, None] & dv_ok[None, :],
        )
        tl.store(LSE_PART + t_row * slp_t + head * slp_h + split, lse, mask=row_ok)
    else:
        if HAS_SINK:
            sink = tl.load(SINKS + head, mask=row_ok, other=0.0) * LOG2E
        o, lse = normalized(m_i, l_i, acc, sink, HAS_SINK, True)
        tl.store(
            OUT + t_row[:, None] * so_t + head[:, None] * so_h + dv[None, :],
            o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :],
        )
        tl.store(LSE + t_row * sl_t + head * sl_h, lse, mask=row_ok)


@triton.jit
def _merge_ordered_splits_kernel(
    O_PART, LSE_PART, L_PART, SINKS, OUT, LSE, Hq, num_splits,
    sop_t, sop_h, sop_s, slp_t, slp_h, so_t, so_h, sl_t, sl_h,
    DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_H: tl.constexpr, HAS_SINK: tl.constexpr,
):
    # The invariant launch's splits of one token, every one in order (a split that saw no key changes nothing):
    # the merges the one-program walk makes, then its division.
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = head < Hq
    dv = tl.arange(0, DV_PAD)
    ok = h_ok[:, None] & (dv[None, :] < DV)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV_PAD], tl.float32)
    for s in range(0, num_splits):
        part = t * slp_t + head * slp_h + s
        m_s = tl.load(LSE_PART + part, mask=h_ok, other=float("-inf"))
        l_s = tl.load(L_PART + part, mask=h_ok, other=0.0)
        acc_s = tl.load(O_PART + t * sop_t + head[:, None] * sop_h + s * sop_s + dv[None, :], mask=ok, other=0.0)
        m_i, l_i, acc = ordered_merge(m_i, l_i, acc, m_s, l_s, acc_s, True)
    sink = tl.zeros([BLOCK_H], tl.float32)
    if HAS_SINK:
        sink = tl.load(SINKS + head, mask=h_ok, other=0.0) * LOG2E
    o, lse = normalized(m_i, l_i, acc, sink, HAS_SINK, True)
    tl.store(OUT + t * so_t + head[:, None] * so_h + dv[None, :], o.to(OUT.dtype.element_ty), mask=ok)
    tl.store(LSE + t * sl_t + head * sl_h, lse, mask=h_ok)


# ----------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _check_shape(name, t, dims, expected):
    """`dims` names the axes ("B, Hq, D"); None in `expected` matches anything."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor [{dims}], got {type(t).__name__}")
    ok = t.dim() == len(expected) and all(e is None or e == n for e, n in zip(expected, t.shape))
    if not ok:
        want = tuple("*" if e is None else e for e in expected)
        raise ValueError(f"{name}: expected shape [{dims}] = {want}, got {tuple(t.shape)}")


def _check_dtype(name, t, dtypes):
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {[str(x) for x in dtypes]}, got {t.dtype}")


def _check_common(q, k_cache, v_cache, block_table, cache_lens, sinks, scale, softcap, window, B):
    Hq = q.shape[1]
    _check_shape("k_cache", k_cache, "P, S, Hkv, D", (None, None, None, q.shape[2]))
    P, S, Hkv, D = k_cache.shape
    _check_shape("v_cache", v_cache, "P, S, Hkv, Dv", (P, S, Hkv, None))
    _check_shape("block_table", block_table, "B, max_pages", (B, None))
    _check_shape("cache_lens", cache_lens, "B", (B,))
    _check_dtype("q", q, _FLOATS)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: expected dtype {q.dtype} (q's), got {t.dtype}")
    _check_dtype("block_table", block_table, (torch.int32,))
    _check_dtype("cache_lens", cache_lens, (torch.int32,))
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q: expected Hq a multiple of Hkv={Hkv}, got Hq={Hq}")
    Dv = v_cache.shape[3]
    for name, n in (("D", D), ("Dv", Dv)):
        if not 1 <= n <= 256:
            raise ValueError(f"{name}: expected a head dim in 1..256, got {n}")
    if sinks is not None:
        _check_shape("sinks", sinks, "Hq", (Hq,))
        if not sinks.is_floating_point():
            raise ValueError(f"sinks: expected a float dtype, got {sinks.dtype}")
    if softcap < 0:
        raise ValueError(f"softcap: expected >= 0 (0 disables), got {softcap}")
    if window < 0:
        raise ValueError(f"sliding_window: expected >= 0 (0 disables), got {window}")
    if not scale > 0:
        raise ValueError(f"scale: expected > 0, got {scale}")
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                   cache_lens=cache_lens)
    if sinks is not None:
        tensors["sinks"] = sinks
    for name, t in tensors.items():
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (q's), got {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a unit stride on the last dim, got strides {t.stride()}")
    return P, S, Hkv, D, Dv


def _check_new(name, t, expected, dims, q):
    _check_shape(name, t, dims, expected)
    if t.dtype != q.dtype:
        raise ValueError(f"{name}: expected dtype {q.dtype} (q's), got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name}: expected device {q.device} (q's), got {t.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: expected a unit stride on the last dim, got strides {t.stride()}")


def pick_num_splits(programs, max_keys, device=None):
    """Split the keys only while the grid is under ~2 waves, >= 64 keys a split."""
    sms = num_sms(device.index if device is not None and device.type == "cuda" else None)
    if programs >= sms:
        return 1
    want = triton.cdiv(2 * sms, max(programs, 1))
    return max(1, min(want, max_keys // _MIN_SPLIT_TOKENS, _MAX_SPLITS))


_TILE_FIELDS = ("block_m", "block_n", "num_warps", "num_stages")
_OVERRIDES = declare_tiles(
    "paged_attention_tiles", __name__,
    overrides="`paged_decode` / `paged_prefill`'s launch (block_m, block_n, num_warps, num_stages) over "
              "`_config`'s choice (`configured`)")


def configured(**fields):
    """Within this block every launch takes ``fields`` (some of block_m, block_n, num_warps, num_stages:
    powers of two, stages 1..8) in place of `_config`'s choice: for config sweeps and A/B timings."""
    return overridden(_OVERRIDES, fields, {f: (1, 8, False) if f == "num_stages" else (1, 256, True)
                                           for f in _TILE_FIELDS})


def _config(d_pad, dv_pad, g_pad, q_len, dtype, wide=False):
    chosen = dict(zip(_TILE_FIELDS, _default_config(d_pad, dv_pad, g_pad, q_len, dtype, wide)), **_OVERRIDES[-1])
    chosen["block_m"] = max(chosen["block_m"], g_pad)  # a tile holds at least one token's whole group
    return tuple(chosen[f] for f in _TILE_FIELDS)


def _default_config(d_pad, dv_pad, g_pad, q_len, dtype, wide=False):
    """``wide``: the grid has a program for every SM before any split. Decode-sized tiles then take two
    stages, not three: less shared memory a program, more programs resident per SM, more loads in flight
    (B64, 4k context, 32q / 8kv, d128 on the H200: 264.7 against 343.2 us; `benchmarks/decode_sweep.py`).
    Smaller grids keep three: each program walks a split of the keys alone. Head dims above 128 keep three
    too: at d256 two stages read slower (Qwen3.5's 8q / 2kv at batch 128: 57.2 against 54.5 us;
    benchmarks/results/decode_sweep_d256_bc4ab8a.json)."""
    d_max = max(d_pad, dv_pad)
    rows = g_pad * q_len
    if rows <= 64:
        block_m = max(16, next_pow2(rows))
    else:
        block_m = 128 if d_max <= 128 and dtype != torch.float32 else 64
    block_m = max(block_m, g_pad)  # a tile holds at least one token's whole group
    block_n = 64 if d_max <= 128 and dtype != torch.float32 else 32
    num_warps = 8 if block_m >= 128 else 4
    num_stages = 2 if dtype == torch.float32 or (wide and rows <= 64 and d_max <= 128) else 3
    return block_m, block_n, num_warps, num_stages


def _launch(q, k_new, v_new, k_cache, v_cache, block_table, cache_lens, cu_seqlens,
            sinks, scale, softcap, window, num_splits, q_len, B, decode, invariant=False):
    T, Hq, D = q.shape
    _, S, Hkv, _ = k_cache.shape
    Dv = v_cache.shape[3]
    G = Hq // Hkv
    g_pad, d_pad, dv_pad = next_pow2(G), max(16, next_pow2(D)), max(16, next_pow2(Dv))
    sms = num_sms(q.device.index if q.device.type == "cuda" else None)
    if invariant:  # one token's group a tile (padded to the smallest dot), the tile from the dims alone
        g_pad = max(16, g_pad)
        block_m, block_n, num_warps, num_stages = _default_config(d_pad, dv_pad, g_pad, 1, q.dtype)
        if INVARIANT_SPLIT_KEYS % block_n:
            raise ValueError(f"INVARIANT_SPLIT_KEYS: expected a multiple of the key tile ({block_n}), got "
                             f"{INVARIANT_SPLIT_KEYS}")
    else:
        block_m, block_n, num_warps, num_stages = _config(d_pad, dv_pad, g_pad, q_len, q.dtype)
    m_tiles = triton.cdiv(q_len, block_m // g_pad)
    programs = m_tiles * B * Hkv
    max_keys = block_table.shape[1] * S + q_len  # a token's position is below its cached rows and the step's
    if invariant:  # the splits follow positions; the argument only says whether they run as programs
        max_splits = triton.cdiv(max_keys, INVARIANT_SPLIT_KEYS)
        if num_splits is None:
            apart = (max_splits > 1 and 2 * programs <= sms
                     and T * Hq * max_splits * Dv * 4 <= INVARIANT_PARTIAL_BYTES)
        else:
            apart = num_splits > 1
        num_splits = max_splits if apart else 1
    else:
        if programs >= sms:
            block_m, block_n, num_warps, num_stages = _config(d_pad, dv_pad, g_pad, q_len, q.dtype, wide=True)
        if num_splits is None:
            num_splits = pick_num_splits(programs, max_keys, q.device)
        if not 1 <= num_splits <= 256:
            raise ValueError(f"num_splits: expected 1..256, got {num_splits}")

    o = torch.empty(T, Hq, Dv, dtype=q.dtype, device=q.device)  # [T, Hq, Dv]
    lse = torch.empty(T, Hq, dtype=torch.float32, device=q.device)  # [T, Hq]
    split = num_splits > 1
    if split:
        o_part = torch.empty(T, Hq, num_splits, Dv, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(T, Hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        o_part, lse_part = o, lse  # unused
    l_part = torch.empty_like(lse_part) if split and invariant else lse_part  # (unread outside that launch)
    has_new = k_new is not None
    if not has_new:
        k_new, v_new = k_cache[0], v_cache[0]  # unused; any [*, Hkv, D] view
    sinks_f = sinks.float().contiguous() if sinks is not None else lse
    cu = cu_seqlens if cu_seqlens is not None else cache_lens

    grid = (m_tiles, B * Hkv, num_splits)
    pdl = pdl_launch(q.device)
    launch(_paged_attn_kernel, grid, (
        q, k_new, v_new, k_cache, v_cache, block_table, cache_lens, cu, sinks_f,
        o, lse, o_part, lse_part, l_part,
        float(scale), float(softcap), int(window), num_splits,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        o.stride(0), o.stride(1), lse.stride(0), lse.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2) if split else 0,
        lse_part.stride(0), lse_part.stride(1),
    ), dict(
        HKV=Hkv, G=G, G_PAD=g_pad, D=D, D_PAD=d_pad, DV=Dv, DV_PAD=dv_pad,
        PAGE=S, BLOCK_M=block_m, BLOCK_N=block_n,
        DECODE=decode, HAS_NEW=has_new, HAS_SINK=sinks is not None,
        SOFTCAP=softcap > 0, WINDOW=window > 0, SPLIT=split,
        IEEE=q.dtype == torch.float32, INVARIANT=invariant, SPLIT_KEYS=INVARIANT_SPLIT_KEYS,
        num_warps=num_warps, num_stages=num_stages, PDL=pdl, launch_pdl=pdl,
    ))
    if split and invariant:
        block_h = 16
        launch(_merge_ordered_splits_kernel, (T, triton.cdiv(Hq, block_h)), (
            o_part, lse_part, l_part, sinks_f, o, lse, Hq, num_splits,
            o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
            o.stride(0), o.stride(1), lse.stride(0), lse.stride(1),
        ), dict(DV=Dv, DV_PAD=dv_pad, BLOCK_H=block_h, HAS_SINK=sinks is not None, num_warps=4))
    elif split:
        merge_splits(o_part, lse_part, o, lse, sinks=sinks_f if sinks is not None else None)
    return o, lse


def paged_decode(q, k_cache, v_cache, block_table, cache_lens, *, k_new=None, v_new=None,
                 scale, softcap=0.0, sliding_window=0, sinks=None, num_splits=None, invariant=False):
    """One query token per request over its cached tokens and (optionally) its new token.

    q [B, Hq, D]; k_cache [P, S, Hkv, D]; v_cache [P, S, Hkv, Dv];
    block_table [B, max_pages] int32; cache_lens [B] int32 (cached tokens);
    k_new [B, Hkv, D], v_new [B, Hkv, Dv]: the step's own token, not in the
    cache, at position cache_lens[b] (the query's position either way).
    Without k_new the result is the cached part alone, ready to merge.
    cache_lens[b] must fit in the block table row (max_pages * S); that is
    not checked here, as checking needs a device sync.
    num_splits: split-K factor; None picks one from B*Hkv and the block table
    capacity (no device sync, so it is safe under CUDA graph capture).
    invariant: the invariant mode's launch (`fnattn.kernels.invariant`): each token alone in its programs, its
    keys in tiles and splits fixed by position; the same launch `paged_prefill(..., invariant=True)` makes, so
    a token's output is the same bits in a decode, a verify and a prefill step (needs k_new). There
    num_splits only says whether the splits run as programs (> 1) or in one (1); None: as programs where the
    grid is small. Either gives the same bits.
    Returns o [B, Hq, Dv] (q's dtype) and lse [B, Hq] fp32 (without the sink).
    """
    require_triton()
    _check_shape("q", q, "B, Hq, D", (None, None, None))
    B = q.shape[0]
    _, _, Hkv, D, Dv = _check_common(q, k_cache, v_cache, block_table, cache_lens, sinks,
                                     scale, softcap, sliding_window, B)
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new / v_new: expected both or neither")
    if k_new is not None:
        _check_new("k_new", k_new, (B, Hkv, D), "B, Hkv, D", q)
        _check_new("v_new", v_new, (B, Hkv, Dv), "B, Hkv, Dv", q)
    if B == 0:
        return (q.new_empty(0, q.shape[1], Dv), torch.empty(0, q.shape[1], device=q.device))
    if invariant:
        if k_new is None:
            raise ValueError("k_new / v_new: the invariant launch needs the step's own token")
        cu = torch.arange(B + 1, dtype=torch.int32, device=q.device)  # one new token each, as a varlen step
        return _launch(q, k_new, v_new, k_cache, v_cache, block_table, cache_lens, cu, sinks,
                       scale, softcap, sliding_window, num_splits, 1, B, decode=False, invariant=True)
    return _launch(q, k_new, v_new, k_cache, v_cache, block_table, cache_lens, None, sinks,
                   scale, softcap, sliding_window, num_splits, 1, B, decode=True)


def paged_prefill(q, k_new, v_new, cu_seqlens, k_cache, v_cache, block_table, cache_lens, *,
                  scale, softcap=0.0, sliding_window=0, sinks=None, max_new_len=None,
                  num_splits=None, invariant=False):
    """New tokens of each request over its cached prefix (non-causal) and each other (causal).

    q [T, Hq, D]; k_new [T, Hkv, D]; v_new [T, Hkv, Dv]; cu_seqlens [B+1] int32;
    caches, block_table, cache_lens as in `paged_decode`. Serves prefill,
    chunked prefill and speculative verify (1 + k new tokens per request).
    max_new_len: the longest request's new-token count (an upper bound is
    fine); None reads it from cu_seqlens (a device sync: pass it under CUDA
    graph capture).
    num_splits: split-K factor (useful for verify at small batch); None picks.
    invariant: the invariant mode's launch (`paged_decode`'s argument of that name, num_splits as there).
    Returns o [T, Hq, Dv] (q's dtype) and lse [T, Hq] fp32 (without the sink).
    """
    require_triton()
    _check_shape("q", q, "T, Hq, D", (None, None, None))
    _check_shape("cu_seqlens", cu_seqlens, "B+1", (None,))
    _check_dtype("cu_seqlens", cu_seqlens, (torch.int32,))
    if cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens: expected shape [B+1] with B >= 0, got (0,)")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens: expected device {q.device} (q's), got {cu_seqlens.device}")
    B, T = cu_seqlens.shape[0] - 1, q.shape[0]
    _, _, Hkv, D, Dv = _check_common(q, k_cache, v_cache, block_table, cache_lens, sinks,
                                     scale, softcap, sliding_window, B)
    _check_new("k_new", k_new, (T, Hkv, D), "T, Hkv, D", q)
    _check_new("v_new", v_new, (T, Hkv, Dv), "T, Hkv, Dv", q)
    if max_new_len is None:
        max_new_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if B > 0 else 0
    if B == 0 or max_new_len <= 0:
        return (torch.zeros(T, q.shape[1], Dv, dtype=q.dtype, device=q.device),
                torch.full((T, q.shape[1]), float("-inf"), device=q.device))
    return _launch(q, k_new, v_new, k_cache, v_cache, block_table, cache_lens, cu_seqlens,
                   sinks, scale, softcap, sliding_window, num_splits, max_new_len, B,
                   decode=False, invariant=invariant)


# ----------------------------------------------------------------------------
# Pure-torch references
# ----------------------------------------------------------------------------


def attend_ref(q, k, v, q_pos, k_pos, *, scale, softcap=0.0, sliding_window=0, sinks=None):
    """Dense masked attention in fp32 over explicit positions (`attention_naive.attention`).

    q [n, Hq, D], k [m, Hkv, D], v [m, Hkv, Dv], q_pos [n], k_pos [m].
    Returns o [n, Hq, Dv] fp32 and lse [n, Hq] fp32 (without the sink).
    """
    return attention(q, k, v, q_pos, k_pos, scale=scale, softcap=softcap, sliding_window=sliding_window,
                     sinks=sinks)


def _gather_cache(cache, pages, n):
    """The first n tokens of one request: cache [P, S, H, X], pages [max_pages] -> [n, H, X]."""
    t = torch.arange(n, device=cache.device)
    S = cache.shape[1]
    return cache[pages.long()[t // S], t % S]


def paged_decode_ref(q, k_cache, v_cache, block_table, cache_lens, *, k_new=None, v_new=None,
                     scale, softcap=0.0, sliding_window=0, sinks=None, num_splits=None):
    """Reference for `paged_decode` (num_splits is accepted and ignored)."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        n = int(cache_lens[b])
        k = _gather_cache(k_cache, block_table[b], n)
        v = _gather_cache(v_cache, block_table[b], n)
        if k_new is not None:
            k = torch.cat([k, k_new[b:b + 1]])
            v = torch.cat([v, v_new[b:b + 1]])
        o, lse = attend_ref(
            q[b:b + 1], k, v,
            torch.tensor([n], device=q.device), torch.arange(k.shape[0], device=q.device),
            scale=scale, softcap=softcap, sliding_window=sliding_window, sinks=sinks,
        )
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses)


def paged_prefill_ref(q, k_new, v_new, cu_seqlens, k_cache, v_cache, block_table, cache_lens, *,
                      scale, softcap=0.0, sliding_window=0, sinks=None, max_new_len=None,
                      num_splits=None):
    """Reference for `paged_prefill` (max_new_len and num_splits are ignored)."""
    o = torch.zeros(q.shape[0], q.shape[1], v_new.shape[2], device=q.device)
    lse = torch.full((q.shape[0], q.shape[1]), float("-inf"), device=q.device)
    for b in range(cu_seqlens.shape[0] - 1):
        lo, hi = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        n = int(cache_lens[b])
        k = torch.cat([_gather_cache(k_cache, block_table[b], n), k_new[lo:hi]])
        v = torch.cat([_gather_cache(v_cache, block_table[b], n), v_new[lo:hi]])
        o[lo:hi], lse[lo:hi] = attend_ref(
            q[lo:hi], k, v,
            torch.arange(n, n + hi - lo, device=q.device), torch.arange(n + hi - lo, device=q.device),
            scale=scale, softcap=softcap, sliding_window=sliding_window, sinks=sinks,
        )
    return o.to(q.dtype), lse
