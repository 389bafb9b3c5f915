"""``y = x @ w.T (+ bias)`` whose every row is the same bits however many rows share the call (Triton).

A library GEMM picks its tiles, its split over K and sometimes its algorithm from the row count: a decode
step's one-row product and a verify's four-row product of the same row sum over K in different orders, and
round differently. Here the launch never looks at the row count: every program takes ``BLOCK_M`` rows (the
rows it does not have are masked loads of zeros, which touch no other row's sum) and one ``BLOCK_N`` slab of
``w``, and walks K in ``BLOCK_K`` steps from 0 up, one ``tl.dot`` a step, accumulating in fp32; the bias is
added to the fp32 sum and the result rounded once. Only the grid grows with M. So a row's result depends on
its own values and ``w`` alone: the batch-invariant matmul of the invariant mode (`fnattn.kernels.invariant`),
used for the models' projections on CUDA while the mode is on (`models.norm_rope.row_linear`).

The tile is fixed (`TILE`): no table by row count. K is summed in chunks of `CHUNK_K`, each chunk a fresh
fp32 sum added to the running total in chunk order, so the same sums can be spread over programs: where the
rows and columns alone fill less than half the GPU (a decode step's few rows), every chunk is a program of its
own and a second launch adds the chunks in the same order (split-K whose split points are fixed by K, not by
the row count). The two forms are the same additions: a row's bits do not depend on which one ran.
``fnattn bench invariance`` reports the mode's cost on the whole step.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ._triton import check_rows, interpreted, num_sms, require_triton, tl, triton

# One tile for every call: the property rests on it not changing with M (16 rows: the smallest dot tile).
TILE = {"block_m": 16, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3}
CHUNK_K = 256  # K summed in chunks of this many: each a fresh fp32 sum, added to the total in order


@triton.jit
def _chunk_sum(x_ptr, w_ptr, rows, cols, rm, cm, K, k_lo, s_xm, s_wn, PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr):
    """The fp32 sum over K positions ``k_lo .. k_lo + CHUNK - 1`` (those below K), from zero, in BLOCK_K steps."""
    kk = tl.arange(0, BLOCK_K)
    part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_lo + CHUNK, BLOCK_K):
        km = (k0 + kk) < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * s_xm + (k0 + kk)[None, :], mask=rm[:, None] & km[None, :],
                    other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * s_wn + (k0 + kk)[None, :], mask=cm[:, None] & km[None, :],
                    other=0.0)
        part = tl.dot(x, tl.trans(w), part, input_precision=PRECISION)
    return part


@triton.jit
def _invariant_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, s_xm, s_wn, s_ym,
                             HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             CHUNK: tl.constexpr, SPLIT: tl.constexpr):
    """SPLIT: program (i, j, c) writes chunk c's sum of its tile to ``y_ptr`` (fp32 ``[chunks, M, N]``) for
    `_add_chunks_kernel`; else the tile's chunks summed in order, the bias added, rounded once."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm, cm = rows < M, cols < N
    if SPLIT:
        c = tl.program_id(2)
        part = _chunk_sum(x_ptr, w_ptr, rows, cols, rm, cm, K, c * CHUNK, s_xm, s_wn, PRECISION, BLOCK_M, BLOCK_N,
                          BLOCK_K, CHUNK)
        out = y_ptr + c.to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(out, part, mask=rm[:, None] & cm[None, :])
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k_lo in range(0, K, CHUNK):  # always from 0 up, in the same steps: the order of every row's sum
            acc = acc + _chunk_sum(x_ptr, w_ptr, rows, cols, rm, cm, K, k_lo, s_xm, s_wn, PRECISION, BLOCK_M,
                                   BLOCK_N, BLOCK_K, CHUNK)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None].to(tl.int64) * s_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=rm[:, None] & cm[None, :])


@triton.jit
def _add_chunks_kernel(part_ptr, b_ptr, y_ptr, M, N, CHUNKS, s_ym, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``y = sum over chunks, in order, from zero (+ bias)``: the unsplit kernel's additions, element by element."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, CHUNKS):
        acc = acc + tl.load(part_ptr + c * M * N + idx, mask=ok, other=0.0)
    col = idx % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + (idx // N) * s_ym + col, acc.to(y_ptr.dtype.element_ty), mask=ok)


def invariant_linear(x: Float[Tensor, "*B K"], w: Float[Tensor, "N K"],
                     bias: Float[Tensor, " N"] | None = None, *, split: bool | None = None) -> Float[Tensor, "*B N"]:
    """``F.linear(x, w, bias)`` over ``x [..., K]`` and ``w [N, K]`` (the same dtype, bf16 / fp16 / fp32), each row
    computed alone in a fixed order (module docstring); fp32 inputs get an fp32 dot, not TF32's. ``split``: K's
    chunks as programs of their own (True), in each tile's program (False), or the former where the tiles alone
    fill less than half the GPU (None); the bits are the same."""
    require_triton()
    owner = "invariant_linear"
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    check_rows(owner, "x", rows, "[M, K]", _invariant_linear_kernel)
    check_rows(owner, "w", w, "[N, K]", _invariant_linear_kernel)
    M, K = rows.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"{owner}: w: expected [N, {K}] (x's last dim), got {tuple(w.shape)}")
    if w.dtype != x.dtype or w.device != x.device:
        raise ValueError(f"{owner}: w: expected x's dtype and device ({x.dtype}, {x.device}), got "
                         f"{w.dtype}, {w.device}")
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"{owner}: bias: expected [{N}] {x.dtype} on {x.device}, got {tuple(bias.shape)} "
                         f"{bias.dtype} on {bias.device}")
    if split is not None and not isinstance(split, bool):
        raise ValueError(f"{owner}: split: expected None or a bool, got {split!r}")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if not (M and N):
        return y.view(*x.shape[:-1], N)
    t = TILE
    tiles = (triton.cdiv(M, t["block_m"]), triton.cdiv(N, t["block_n"]))
    chunks = max(1, triton.cdiv(K, CHUNK_K))
    if split is None:
        split = chunks > 1 and 2 * tiles[0] * tiles[1] <= num_sms(x.device.index if x.is_cuda else None)
    tuning = {} if interpreted(_invariant_linear_kernel) else {"num_warps": t["num_warps"],
                                                              "num_stages": t["num_stages"]}
    common = dict(HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                  BLOCK_M=t["block_m"], BLOCK_N=t["block_n"], BLOCK_K=t["block_k"], CHUNK=CHUNK_K, **tuning)
    b = bias if bias is not None else y
    if not split:
        _invariant_linear_kernel[tiles](rows, w, b, y, M, N, K, rows.stride(0), w.stride(0), y.stride(0),
                                        SPLIT=False, **common)
        return y.view(*x.shape[:-1], N)
    parts = torch.empty(chunks, M, N, dtype=torch.float32, device=x.device)
    _invariant_linear_kernel[(*tiles, chunks)](rows, w, b, parts, M, N, K, rows.stride(0), w.stride(0), N,
                                               SPLIT=True, **common)
    block = 1024
    _add_chunks_kernel[(triton.cdiv(M * N, block),)](parts, b, y, M, N, chunks, y.stride(0),
                                                     HAS_BIAS=bias is not None, BLOCK=block)
    return y.view(*x.shape[:-1], N)


# --------------------------------------------------------------------------- grouped: a MoE step's experts
@triton.jit
def _grouped_kernel(x_ptr, w_ptr, y_ptr, src_ptr, expert_ptr, lo_ptr, hi_ptr, N, K, s_xm, s_we, s_wn, s_ym,
                    GATHER: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, CHUNK: tl.constexpr):
    """Program (t, j): the pairs ``lo[t] .. hi[t] - 1`` (one expert's, at most BLOCK_M) times that expert's
    column slab j, K's chunks summed as `_invariant_linear_kernel` sums them; ``expert[t] < 0``: no tile."""
    t = tl.program_id(0)
    e = tl.load(expert_ptr + t)
    if e >= 0:
        slots = tl.load(lo_ptr + t) + tl.arange(0, BLOCK_M)
        rm = slots < tl.load(hi_ptr + t)
        if GATHER:
            rows = tl.load(src_ptr + slots, mask=rm, other=0)
        else:
            rows = slots
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cm = cols < N
        w_e = w_ptr + e.to(tl.int64) * s_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k_lo in range(0, K, CHUNK):
            acc = acc + _chunk_sum(x_ptr, w_e, rows, cols, rm, cm, K, k_lo, s_xm, s_wn, PRECISION, BLOCK_M,
                                   BLOCK_N, BLOCK_K, CHUNK)
        tl.store(y_ptr + slots[:, None].to(tl.int64) * s_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=rm[:, None] & cm[None, :])


def expert_tiles(picked: Int[Tensor, " P"], num_experts: int,
                 ) -> tuple[Int[Tensor, " n"], Int[Tensor, " n"], Int[Tensor, " n"]]:
    """The row tiles of pairs sorted by expert (``picked [P]``, ascending): each tile at most ``TILE["block_m"]``
    pairs of one expert, ``-> (expert [n], lo [n], hi [n])``, int32, pairs ``lo .. hi - 1``. ``n`` is a bound fixed by
    P and the expert count (so a captured step's grid does not follow the routing); tiles past the real ones have
    expert -1. Device ops only: no host read."""
    if not isinstance(picked, Tensor) or picked.dim() != 1 or picked.dtype.is_floating_point \
            or picked.dtype == torch.bool:
        got = (tuple(picked.shape), picked.dtype) if isinstance(picked, Tensor) else type(picked).__name__
        raise ValueError(f"expert_tiles: picked: expected an int [P] tensor (expert ids, ascending), got {got}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"expert_tiles: num_experts: expected an int >= 1, got {num_experts!r}")
    P, m = picked.numel(), TILE["block_m"]
    n = max(1, min(P, P // m + min(num_experts, P)))
    every = torch.arange(num_experts, device=picked.device, dtype=picked.dtype)
    starts = torch.searchsorted(picked, every)  # [E]: each expert's first pair
    ends = torch.searchsorted(picked, every, right=True)  # [E]: one past its last
    tiles = (ends - starts + m - 1) // m  # [E]
    tile_ends = tiles.cumsum(0)  # [E]
    t = torch.arange(n, device=picked.device, dtype=tile_ends.dtype)
    expert = torch.searchsorted(tile_ends, t, right=True)  # [n]: E past the last real tile
    real = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    lo = starts[e] + (t - (tile_ends[e] - tiles[e])) * m
    hi = torch.minimum(lo + m, ends[e])
    return (torch.where(real, e, -1).to(torch.int32), lo.to(torch.int32), hi.to(torch.int32))


def invariant_grouped_linear(x: Float[Tensor, "R K"], w: Float[Tensor, "E N K"],
                             tiles: tuple[Tensor, Tensor, Tensor], src: Int[Tensor, " P"] | None = None,
                             ) -> Float[Tensor, "P N"]:
    """Row p of the result is ``x[src[p]] @ w[e].T`` for the expert e whose tile (`expert_tiles`) holds pair p,
    every row the bits `invariant_linear` gives it alone (the same tile, chunks and order): a MoE step's
    experts in one launch without a host read, whatever the routing. ``src`` (int, [P]): each pair's row of
    ``x``; None: pair p takes row p (then P = R). Rows no tile holds are left unwritten."""
    require_triton()
    owner = "invariant_grouped_linear"
    check_rows(owner, "x", x, "[R, K]", _grouped_kernel)
    check_rows(owner, "w", w, "[E, N, K]", _grouped_kernel)
    E, N, K = w.shape
    if x.shape[1] != K or w.dtype != x.dtype or w.device != x.device:
        raise ValueError(f"{owner}: w: expected [E, N, {x.shape[1]}] {x.dtype} on {x.device} (x's), got "
                         f"{tuple(w.shape)} {w.dtype} on {w.device}")
    if w.stride(1) != K:
        raise ValueError(f"{owner}: w: expected each expert's rows contiguous (stride {K}), got strides "
                         f"{w.stride()}")
    expert, lo, hi = tiles
    if not all(isinstance(v, Tensor) and v.dtype == torch.int32 and v.dim() == 1 and v.device == x.device
               and v.shape == expert.shape for v in tiles):
        raise ValueError(f"{owner}: tiles: expected three int32 [n] tensors on {x.device} (expert_tiles), got "
                         f"{[(tuple(v.shape), v.dtype) if isinstance(v, Tensor) else type(v).__name__ for v in tiles]}")
    if src is not None and (src.dim() != 1 or src.dtype.is_floating_point or src.device != x.device):
        raise ValueError(f"{owner}: src: expected an int [P] tensor on {x.device}, got "
                         f"{tuple(src.shape)} {src.dtype} on {src.device}")
    P = x.shape[0] if src is None else src.shape[0]
    y = torch.empty(P, N, dtype=x.dtype, device=x.device)
    if not (P and N and expert.numel()):
        return y
    t = TILE
    tuning = {} if interpreted(_grouped_kernel) else {"num_warps": t["num_warps"], "num_stages": t["num_stages"]}
    grid = (expert.numel(), triton.cdiv(N, t["block_n"]))
    _grouped_kernel[grid](x, w, y, x if src is None else src, expert, lo, hi, N, K, x.stride(0), w.stride(0),
                          w.stride(1), y.stride(0), GATHER=src is not None,
                          PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=t["block_m"],
                          BLOCK_N=t["block_n"], BLOCK_K=t["block_k"], CHUNK=CHUNK_K, **tuning)
    return y
