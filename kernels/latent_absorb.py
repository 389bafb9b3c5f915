"""MLA's two weight absorptions of a decode step, each in one launch.

`absorb_query`: the absorbed query ``[q_nope W_UK, q_pe]`` per head, ``[T, H, R + Dr]``. In a decode step
the product is bound by reading ``W_UK`` (``[H, Dn, R]``, 16.8 MB at 128 heads): a batched GEMM over 64
tokens reads it at under half the device's bandwidth, and copying ``q_pe`` beside its result is a second
launch through a strided destination. Here each program owns one head and one tile of ``R``: it reads its
weight tile in pipelined steps of ``Dn`` (or holds it whole, for every token block), and stores straight into
the result's columns; the programs of the first tile copy the head's ``q_pe`` as well.

`merge_own_values`: a decode token's own latent row merged into the attention over its cache by LSE, then
the merged latent output through ``W_UV`` (``[T, H, Dv]``). Each program merges a step of latent columns in
registers and feeds it straight to the product: the merged ``[T, H, R]`` latent is never written and read
back between two launches.
"""

import math

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ._checks import check_like
from ._switch import declare_tiles
from ._tiles import overridden
from ._triton import next_pow2, require_triton, tl, triton
from .lse_merge import no_cached_key, own_row_weights


@triton.jit
def _absorb_query_kernel(
    QN, QP, W, OUT, T, H, Dn, R, Dr, TOKENS_PER_PROGRAM,
    sqn_t, sqn_h, sqp_t, sqp_h, sw_h, sw_d, sw_r, so_t, so_h,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    K_STEPS: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    # the programs that share a head's weight tile are neighbours in launch order: tokens, then columns
    t_first = tl.program_id(0) * TOKENS_PER_PROGRAM
    tile = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    t_stop = tl.minimum(T, t_first + TOKENS_PER_PROGRAM)
    r = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    if K_STEPS == 1:  # the whole weight tile, loaded once and held for every token block
        d = tl.arange(0, BLOCK_K)
        w = tl.load(W + h * sw_h + d[:, None] * sw_d + r[None, :] * sw_r,
                    mask=(d[:, None] < Dn) & (r[None, :] < R), other=0.0)  # [BLOCK_K, BLOCK_R]
    for t0 in range(t_first, t_stop, BLOCK_T):
        t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        t_ok = t < t_stop
        if K_STEPS == 1:
            qn = tl.load(QN + t[:, None] * sqn_t + h * sqn_h + d[None, :], mask=t_ok[:, None] & (d[None, :] < Dn),
                         other=0.0)  # [BLOCK_T, BLOCK_K]
            acc = tl.dot(qn, w)  # fp32 [BLOCK_T, BLOCK_R]
        else:  # Dn in steps, their loads pipelined: fewer registers a program, more programs resident
            acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
            for k in tl.range(0, K_STEPS, num_stages=NUM_STAGES):
                dk = k * BLOCK_K + tl.arange(0, BLOCK_K)
                qn = tl.load(QN + t[:, None] * sqn_t + h * sqn_h + dk[None, :],
                             mask=t_ok[:, None] & (dk[None, :] < Dn), other=0.0)
                wk = tl.load(W + h * sw_h + dk[:, None] * sw_d + r[None, :] * sw_r,
                             mask=(dk[:, None] < Dn) & (r[None, :] < R), other=0.0)
                acc = tl.dot(qn, wk, acc)
        tl.store(OUT + t[:, None] * so_t + h * so_h + r[None, :], acc.to(OUT.dtype.element_ty),
                 mask=t_ok[:, None] & (r[None, :] < R))
        if tile == 0:
            pe_ok = t_ok[:, None] & (p[None, :] < Dr)
            pe = tl.load(QP + t[:, None] * sqp_t + h * sqp_h + p[None, :], mask=pe_ok)
            tl.store(OUT + t[:, None] * so_t + h * so_h + R + p[None, :], pe, mask=pe_ok)


def absorb_query_ref(q_nope: Float[Tensor, "T H Dn"], q_pe: Float[Tensor, "T H Dr"],
                     w_uk: Float[Tensor, "H Dn R"]) -> Float[Tensor, "T H Dq"]:
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
        check_like(f"absorb_query: {name}", t, None, q_nope, "q_nope")


def _power_of_two(where: str, name: str, v, lo: int = 16):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or v & (v - 1):
        raise ValueError(f"{where}: {name}: expected a power of two >= {lo}, got {v!r}")


def absorb_query(q_nope: Float[Tensor, "T H Dn"], q_pe: Float[Tensor, "T H Dr"], w_uk: Float[Tensor, "H Dn R"], *,
                 block_r: int = 128, num_warps: int = 4, block_t: int = 64, token_split: int = 1,
                 block_k: int | None = 64, num_stages: int = 2) -> Float[Tensor, "T H Dq"]:
    """`absorb_query_ref` in one launch (a new ``[T, H, R + Dr]`` tensor; nothing written into the
    arguments). The tiles (powers of two >= 16): ``block_r`` the columns of ``R`` one program owns, ``block_t``
    the tokens one product takes, ``block_k`` the rows of ``Dn`` one product takes (``None``: all of them, the
    weight tile then held for every token block; fewer are read in ``num_stages`` pipelined steps).
    ``token_split`` programs share one weight tile, each a run of the tokens.

    The defaults are the H200 sweep's best at 1-64 tokens and DeepSeek-V3's shape (128 heads, Dn 128, R 512:
    ``benchmarks/results/mla_absorb_sweep_e322246.json``): 12.0 / 12.3 / 13.3 / 15.3 us at 1 / 8 / 32 / 64
    tokens, against 12.4 / 12.6 / 13.8 / 17.6 with the whole weight tile held (22.5 and 22.3 at 128)."""
    require_triton()
    _check(q_nope, q_pe, w_uk)
    T, H, Dn = q_nope.shape
    R, Dr = w_uk.shape[2], q_pe.shape[2]
    full_k = max(16, next_pow2(Dn))
    for name, v in (("block_r", block_r), ("block_t", block_t), ("block_k", full_k if block_k is None else block_k)):
        _power_of_two("absorb_query", name, v)
    for name, v in (("token_split", token_split), ("num_stages", num_stages), ("num_warps", num_warps)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"absorb_query: {name}: expected an int >= 1, got {v!r}")
    out = torch.empty((T, H, R + Dr), dtype=q_nope.dtype, device=q_nope.device)
    if T == 0:
        return out
    block_r = min(block_r, max(16, next_pow2(R)))
    block_t = min(block_t, max(16, next_pow2(T)))
    block_k = full_k if block_k is None else min(block_k, full_k)
    per_program = triton.cdiv(triton.cdiv(T, token_split), block_t) * block_t  # whole token blocks a program
    grid = (triton.cdiv(T, per_program), triton.cdiv(R, block_r), H)
    _absorb_query_kernel[grid](
        q_nope, q_pe, w_uk, out, T, H, Dn, R, Dr, per_program,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), w_uk.stride(0), w_uk.stride(1),
        w_uk.stride(2), out.stride(0), out.stride(1),
        BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_R=block_r, BLOCK_P=max(16, next_pow2(Dr)),
        K_STEPS=triton.cdiv(Dn, block_k), NUM_STAGES=num_stages, num_warps=num_warps)
    return out


@triton.jit
def _merge_own_values_kernel(
    O_C, L_C, Q, NEW, W, OUT, LSE_OUT, CACHE_LENS, ALLOWED,
    T, H, R, DQ, DV, sm_scale, lse_scale,
    soc_t, soc_h, slc_t, slc_h, sq_t, sq_h, sn_t, sw_h, sw_v, so_t, so_h,
    BLOCK_T: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_LENS: tl.constexpr, HAS_ALLOWED: tl.constexpr,
):
    # a program per tile of Dv: the tiles of one token block are neighbours, so they read its rows from L2
    v_tile = tl.program_id(0)
    t = (tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    t_ok = t < T
    # the own row's score: q . new over the whole absorbed width
    s = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for d0 in range(0, DQ, BLOCK_Q):
        d = d0 + tl.arange(0, BLOCK_Q)
        ok = t_ok[:, None] & (d[None, :] < DQ)
        qv = tl.load(Q + t[:, None] * sq_t + h * sq_h + d[None, :], mask=ok, other=0.0).to(tl.float32)
        nv = tl.load(NEW + t[:, None] * sn_t + d[None, :], mask=ok, other=0.0).to(tl.float32)
        s += tl.sum(qv * nv, 1)
    s = s * sm_scale
    if HAS_ALLOWED:  # a token that did not pick its own row keeps the cached part alone
        s = tl.where(tl.load(ALLOWED + t, mask=t_ok, other=0) != 0, s, float("-inf"))
    lc = tl.load(L_C + t * slc_t + h * slc_h, mask=t_ok, other=float("-inf")) * lse_scale
    empty = no_cached_key(lc)  # as is a request whose cache is empty
    if HAS_LENS:
        empty = empty | (tl.load(CACHE_LENS + t, mask=t_ok, other=0) == 0)
    m, wc, wn = own_row_weights(lc, s, empty)
    total = wc + wn
    inv = 1.0 / tl.where(total > 0, total, 1.0)
    wc = wc * inv
    wn = wn * inv
    keep = wc > 0  # an empty cached part may hold anything, NaN included: it must not reach the product
    v = v_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        ok = t_ok[:, None] & (r[None, :] < R)
        oc = tl.load(O_C + t[:, None] * soc_t + h * soc_h + r[None, :], mask=ok & keep[:, None], other=0.0)
        nv = tl.load(NEW + t[:, None] * sn_t + r[None, :], mask=ok, other=0.0)
        w = tl.load(W + h * sw_h + v[None, :] * sw_v + r[:, None], mask=(r[:, None] < R) & (v[None, :] < DV),
                    other=0.0)  # [BLOCK_R, BLOCK_V]: W_UV[h] transposed
        # the merged latent in fp32, rounded to the weight's dtype once, as the merge kernel's output would be
        merged = oc.to(tl.float32) * wc[:, None] + nv.to(tl.float32) * wn[:, None]
        acc = tl.dot(merged.to(w.dtype), w, acc)
    tl.store(OUT + t[:, None] * so_t + h * so_h + v[None, :], acc.to(OUT.dtype.element_ty),
             mask=t_ok[:, None] & (v[None, :] < DV))
    if v_tile == 0:
        tl.store(LSE_OUT + t * H + h, tl.where(total > 0, m + tl.log(total), float("-inf")), mask=t_ok)


_MERGE_OVERRIDES = declare_tiles(
    "merge_values_tiles", __name__,
    overrides="`merge_own_values`'s launch (block_t, block_r, block_v, num_warps) where its caller passes none "
              "(`configured_merge`)")


def configured_merge(**fields):
    """Within this block `merge_own_values` takes ``fields`` (some of block_t, block_r, block_v, num_warps:
    powers of two) where its caller passes none: for sweeps inside whole layers
    (``benchmarks/mla_merge_layers.py``)."""
    return overridden(_MERGE_OVERRIDES, fields, {"block_t": (16, 256, True), "block_r": (16, 512, True),
                                                  "block_v": (16, 512, True), "num_warps": (1, 16, True)})


def merge_own_values_ref(o_c: Float[Tensor, "T H R"], lse_c: Float[Tensor, "T H"], q: Float[Tensor, "T H Dq"],
                         new: Float[Tensor, "T Dq"], w_uv: Float[Tensor, "H Dv R"], *, scale: float,
                         lse_base2: bool = False, cache_lens: Int[Tensor, " T"] | None = None,
                         allowed: Bool[Tensor, " T"] | None = None
                         ) -> tuple[Float[Tensor, "T H Dv"], Float[Tensor, "T H"]]:
    """The own row merged by LSE (`fnattn.kernels.merge_new_token_ref`), then through ``W_UV``: ``o_c [T, H, R]``
    and ``lse_c [T, H]`` the attention over each token's cache (base 2 when ``lse_base2``; +inf / NaN mark no
    key), ``q [T, H, R + Dr]`` the absorbed query, ``new [T, R + Dr]`` each token's own row, ``w_uv [H, Dv, R]``.
    Returns ``o [T, H, Dv]`` in ``w_uv``'s dtype and the natural-log ``lse [T, H]`` fp32."""
    from .lse_merge import merge_new_token_ref

    R = o_c.shape[-1]
    o_lat, lse = merge_new_token_ref(o_c, lse_c, q, new[:, None], new[:, None, :R], scale=scale, lse_base2=lse_base2,
                                     cache_lens=cache_lens, allowed=allowed)
    o = torch.einsum("thr,hvr->thv", o_lat.float(), w_uv.float()).to(w_uv.dtype)
    return o, lse


def merge_own_values(o_c: Float[Tensor, "T H R"], lse_c: Float[Tensor, "T H"], q: Float[Tensor, "T H Dq"],
                     new: Float[Tensor, "T Dq"], w_uv: Float[Tensor, "H Dv R"], *, scale: float,
                     lse_base2: bool = False, cache_lens: Int[Tensor, " T"] | None = None,
                     allowed: Bool[Tensor, " T"] | None = None, block_t: int | None = None,
                     block_r: int | None = None, block_v: int | None = None,
                     num_warps: int | None = None) -> tuple[Float[Tensor, "T H Dv"], Float[Tensor, "T H"]]:
    """`merge_own_values_ref` in one launch: one decode token per request (``cache_lens`` and ``allowed``
    [T], one entry a token). The tiles (powers of two >= 16): ``block_t`` the tokens one program takes,
    ``block_v`` its columns of ``Dv`` (all of them by default; fewer give more programs, each reading its
    rows of ``W_UV`` once), ``block_r`` the latent columns one product step takes.

    ``None`` takes the H200 sweep's best at DeepSeek-V3's shape (``mla_absorb_sweep_e322246.json``): 16 tokens
    a program up to 64 tokens (each program reads ``W_UV[h]`` again, from L2), 64 beyond; 128 latent columns a
    step up to 32 tokens, 64 beyond. There it took 13.8 / 14.4 / 16.6 / 21.4 / 28.3 us at 1 / 8 / 32 / 64 /
    128 tokens against 14.8 / 15.4 / 18.5 / 23.0 / 30.8 for the merge kernel and the batched product."""
    require_triton()
    if not all(isinstance(t, torch.Tensor) for t in (o_c, lse_c, q, new, w_uv)):
        raise ValueError("merge_own_values: o_c, lse_c, q, new and w_uv must be tensors")
    for name, t, dims in (("o_c", o_c, "[T, H, R]"), ("new", new, "[T, R + Dr]"), ("w_uv", w_uv, "[H, Dv, R]")):
        if t.dim() != dims.count(",") + 1:
            raise ValueError(f"merge_own_values: {name}: expected {dims}, got {tuple(t.shape)}")
    (T, H, R), DQ, Dv = o_c.shape, new.shape[1], w_uv.shape[1]
    for name, t, shape in (("lse_c", lse_c, (T, H)), ("q", q, (T, H, DQ)), ("new", new, (T, DQ)),
                           ("w_uv", w_uv, (H, Dv, R))):
        if tuple(t.shape) != shape:
            raise ValueError(f"merge_own_values: {name}: expected shape {shape}, got {tuple(t.shape)}")
        if t.device != o_c.device:
            raise ValueError(f"merge_own_values: {name}: expected device {o_c.device} (o_c's), got {t.device}")
    if DQ < R:
        raise ValueError(f"merge_own_values: new: expected rows of at least R = {R}, got {DQ}")
    for name, t in (("o_c", o_c), ("q", q), ("new", new), ("w_uv", w_uv)):
        if t.stride(-1) != 1:
            raise ValueError(f"merge_own_values: {name}: expected a unit stride on the last dim, got {t.stride()}")
    if lse_c.dtype != torch.float32:
        raise ValueError(f"merge_own_values: lse_c: expected dtype torch.float32, got {lse_c.dtype}")
    for name, t, dtypes in (("cache_lens", cache_lens, (torch.int32, torch.int64)),
                            ("allowed", allowed, (torch.bool, torch.int8))):
        if t is not None and (tuple(t.shape) != (T,) or t.device != o_c.device or t.dtype not in dtypes):
            raise ValueError(f"merge_own_values: {name}: expected [{T}] {dtypes[0]} on {o_c.device}, got shape "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    # an argument, else a `configured_merge` field, else the sweep's tile for this many tokens
    tile = {"block_t": 16 if T <= 64 else 64, "block_r": 128 if T <= 32 else 64, "block_v": None, "num_warps": 8,
            **_MERGE_OVERRIDES[-1]}
    block_t = tile["block_t"] if block_t is None else block_t
    block_r = tile["block_r"] if block_r is None else block_r
    block_v = tile["block_v"] if block_v is None else block_v
    num_warps = tile["num_warps"] if num_warps is None else num_warps
    full_v = max(16, next_pow2(Dv))
    for name, v in (("block_t", block_t), ("block_r", block_r), ("block_v", full_v if block_v is None else block_v)):
        _power_of_two("merge_own_values", name, v)
    _power_of_two("merge_own_values", "num_warps", num_warps, lo=1)
    o = torch.empty((T, H, Dv), dtype=w_uv.dtype, device=o_c.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=o_c.device)
    if T == 0:
        return o, lse
    block_t = min(block_t, max(16, next_pow2(T)))
    block_v = full_v if block_v is None else min(block_v, full_v)
    _merge_own_values_kernel[(triton.cdiv(Dv, block_v), triton.cdiv(T, block_t), H)](
        o_c, lse_c, q, new, w_uv, o, lse, lse if cache_lens is None else cache_lens,
        lse if allowed is None else allowed.contiguous().view(torch.int8),
        T, H, R, DQ, Dv, float(scale), math.log(2.0) if lse_base2 else 1.0,
        o_c.stride(0), o_c.stride(1), lse_c.stride(0), lse_c.stride(1), q.stride(0), q.stride(1), new.stride(0),
        w_uv.stride(0), w_uv.stride(1), o.stride(0), o.stride(1),
        BLOCK_T=block_t, BLOCK_Q=64, BLOCK_R=min(block_r, max(16, next_pow2(R))), BLOCK_V=block_v,
        HAS_LENS=cache_lens is not None, HAS_ALLOWED=allowed is not None, num_warps=num_warps)
    return o, lse
