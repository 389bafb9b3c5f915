"""The DSA lightning indexer over a paged key cache: scores and the top-k with the causal limit.

For new token ``t`` of request ``r`` (absolute position ``p``), key position ``j`` scores::

    score[t, j] = sum_h w[t, h] * relu(scale * q[t, h] . k_j)      for j <= p, else -inf

where ``k_j`` is read from the paged cache for ``j < cache_lens[r]`` and from this step's new keys
(``new_k[cu_seqlens[r] + (j - cache_lens[r]) * fresh_stride]``, ``fresh_stride`` 1 unless the step's keys sit
every so many rows, as DeepSeek-V4's entries sit at their closing tokens) above it: the step's keys are not in the
cache yet. FP8 keys
(float8 e4m3, one fp32 scale per key, ``cache_scale`` / ``new_scale``) score ``scale_j * sum_h w[t, h] *
relu(scale * q[t, h] . k8_j)``: the positive scale leaves the relu.
Scores cover ``N = block_table.shape[1] * page_size`` positions, a bound fixed by the batch's shapes, so
the launch never depends on a cache length read on the host (CUDA-graph safe).

``indexer_topk_ref`` keeps the ``topk`` best visible positions per token, best first, ``-1`` padded;
``indexer_topk`` the same set in the order its selection leaves it (a row with fewer visible positions
has its ``-1`` anywhere). Equal scores go to the earlier position (`ordered_topk`): ReLU scores are often
exactly 0, and a tie left to ``torch.topk`` is decided by its algorithm, which follows the row's length, so
a token's selection would change with the tokens after it in its prompt, the chunking or the padding.
The ``*_ref`` functions are the same computation in torch. Dimension names: T new tokens, Hi indexer heads,
Di indexer head dim, P pages, S page size, B requests, M pages per request, N = M * S.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from ._switch import declare_tiles
from ._tiles import overridden
from ._triton import next_pow2, num_sms, require_triton, tl, triton

__all__ = ["configured", "finite_topk", "indexer_scores_paged", "indexer_scores_paged_ref", "indexer_topk",
           "indexer_topk_ref", "ordered_topk", "radix_topk", "sort_positions"]


def _check(q, w, cache_k, new_k, block_table, token_request, cache_lens, cu_seqlens, positions,
           cache_scale=None, new_scale=None, fresh_stride=1):
    if isinstance(fresh_stride, bool) or not isinstance(fresh_stride, int) or fresh_stride < 1:
        raise ValueError(f"fresh_stride: expected an int >= 1, got {fresh_stride!r}")
    T, Hi, Di = q.shape
    if w.shape != (T, Hi):
        raise ValueError(f"w: expected shape {(T, Hi)}, got {tuple(w.shape)}")
    if cache_k.dim() != 3 or cache_k.shape[2] != Di:
        raise ValueError(f"cache_k: expected shape [P, S, {Di}], got {tuple(cache_k.shape)}")
    if new_k.shape != (T, Di):
        raise ValueError(f"new_k: expected shape {(T, Di)}, got {tuple(new_k.shape)}")
    fp8 = cache_k.dtype == torch.float8_e4m3fn
    if cache_k.dtype != new_k.dtype or (q.dtype != new_k.dtype and not fp8):
        raise ValueError(f"q / cache_k / new_k: expected one dtype, got {q.dtype}, {cache_k.dtype}, {new_k.dtype}")
    if fp8:  # FP8 keys: a scale per cached and per new key
        P, S = cache_k.shape[:2]
        for name, t, shape in (("cache_scale", cache_scale, (P, S, 1)), ("new_scale", new_scale, (T, 1))):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != torch.float32:
                got = "None" if t is None else f"{tuple(t.shape)} {t.dtype}"
                raise ValueError(f"{name}: expected a float32 tensor of shape {shape} with FP8 keys, got {got}")
    elif cache_scale is not None or new_scale is not None:
        raise ValueError(f"cache_scale / new_scale: expected None with {cache_k.dtype} keys (they scale FP8 keys)")
    B = block_table.shape[0]
    for name, t, shape in (("token_request", token_request, (T,)), ("cache_lens", cache_lens, (B,)),
                           ("cu_seqlens", cu_seqlens, (B + 1,)), ("positions", positions, (T,))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")


def indexer_scores_paged_ref(q, w, cache_k, new_k, block_table, token_request, cache_lens, cu_seqlens, positions,
                             *, scale: float, cache_scale=None, new_scale=None, fresh_stride: int = 1):
    """``[T, N]`` fp32 scores, ``-inf`` where a position is not visible; torch, same arguments. FP8 keys
    (``cache_k`` and ``new_k`` float8 e4m3, with their ``[P, S, 1]`` / ``[T, 1]`` fp32 scales) score as
    ``scale[j] * sum_h w[h] * relu(q[h] . k8[j])``."""
    _check(q, w, cache_k, new_k, block_table, token_request, cache_lens, cu_seqlens, positions, cache_scale,
           new_scale, fresh_stride)
    S, M = cache_k.shape[1], block_table.shape[1]
    N = M * S
    req = token_request.long()  # [T]
    j = torch.arange(N, device=q.device)  # [N]
    c = cache_lens.long()[req][:, None]  # [T, 1]
    visible = j[None, :] <= positions[:, None]  # [T, N]
    cached = visible & (j[None, :] < c)
    pages = block_table.long()[req][:, j // S]  # [T, N]
    k_cached = cache_k[pages, (j % S)[None, :]]  # [T, N, Di]
    row = (cu_seqlens.long()[req][:, None] + (j[None, :] - c) * fresh_stride).clamp(0, new_k.shape[0] - 1)  # [T, N]
    k = torch.where(cached[..., None], k_cached.float(), new_k[row].float())  # [T, N, Di]
    per_head = F.relu(torch.einsum("thd,tnd->thn", q.float(), k) * scale)  # [T, Hi, N]
    scores = torch.einsum("th,thn->tn", w.float(), per_head)
    if cache_scale is not None:
        scores = scores * torch.where(cached, cache_scale[pages, (j % S)[None, :], 0], new_scale[row, 0])
    return scores.masked_fill(~visible, float("-inf"))


@triton.jit
def _block_scores(k, q, wt, scale, KEYS_MAJOR: tl.constexpr, PRECISION: tl.constexpr):
    """The ``[BLOCK_N]`` scores of one block of keys ``k [BLOCK_N, BLOCK_D]`` (already in q's dtype)."""
    if KEYS_MAJOR:  # positions as the dot's rows: the sum over heads stays within a row's threads
        s = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # [BLOCK_N, BLOCK_H] fp32
        return tl.sum(tl.maximum(s * scale, 0.0) * wt[None, :], axis=1)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N] fp32
    return tl.sum(tl.maximum(s * scale, 0.0) * wt[:, None], axis=0)


@triton.jit
def _scores_kernel(q_ptr, w_ptr, kc_ptr, kn_ptr, bt_ptr, req_ptr, cl_ptr, cu_ptr, pos_ptr, out_ptr,
                   N, S, HI, DI, scale,
                   s_qt, s_qh, s_wt, s_kp, s_ks, s_knt, s_bt, s_ot,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                   cs_ptr=None, ns_ptr=None, s_cp=0, s_cs=0, s_nst=0, FP8: tl.constexpr = False, FRESH_STRIDE=1,
                   KEYS_MAJOR: tl.constexpr = True, PRECISION: tl.constexpr = "tf32"):
    # program (t, i) scores positions [i * SPLIT, (i + 1) * SPLIT) of token t in three loops: the cached keys it
    # sees (from their pages), the step's own keys it sees (from new_k), and -inf for the positions past it,
    # so a program reads no key the token cannot see and the loops carry no per-position source choice
    t = tl.program_id(0)
    r = tl.load(req_ptr + t)
    c = tl.load(cl_ptr + r).to(tl.int32)
    p = tl.load(pos_ptr + t).to(tl.int32)
    start = tl.load(cu_ptr + r).to(tl.int32)
    lo = tl.program_id(1) * SPLIT
    hi = tl.minimum(lo + SPLIT, N)
    seen = tl.minimum(hi, p + 1)  # end of the visible positions in this program's range
    cached_end = tl.minimum(seen, c)
    d = tl.arange(0, BLOCK_D)
    dm = d < DI
    h = tl.arange(0, BLOCK_H)
    hm = h < HI
    # the token's queries and head weights once, for every block of positions this program scores
    q = tl.load(q_ptr + t * s_qt + h[:, None] * s_qh + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    wt = tl.load(w_ptr + t * s_wt + h, mask=hm, other=0.0).to(tl.float32)
    n = tl.arange(0, BLOCK_N)
    out = out_ptr + t.to(tl.int64) * s_ot
    for j0 in tl.range(lo, cached_end, BLOCK_N):
        j = j0 + n
        m = j < cached_end
        page = tl.load(bt_ptr + r * s_bt + j // S, mask=m, other=0).to(tl.int64)
        k = tl.load(kc_ptr + page[:, None] * s_kp + (j % S)[:, None] * s_ks + d[None, :],
                    mask=m[:, None] & dm[None, :], other=0.0)
        score = _block_scores(k.to(q.dtype), q, wt, scale, KEYS_MAJOR, PRECISION)
        if FP8:  # each key's scale is positive: it leaves the relu and the sum over heads
            score = score * tl.load(cs_ptr + page * s_cp + (j % S) * s_cs, mask=m, other=0.0)
        tl.store(out + j, score, mask=m)
    for j0 in tl.range(tl.maximum(lo, c), seen, BLOCK_N):
        j = j0 + n
        m = j < seen
        row = tl.where(m, start + (j - c) * FRESH_STRIDE, 0).to(tl.int64)
        k = tl.load(kn_ptr + row[:, None] * s_knt + d[None, :], mask=m[:, None] & dm[None, :], other=0.0)
        score = _block_scores(k.to(q.dtype), q, wt, scale, KEYS_MAJOR, PRECISION)
        if FP8:
            score = score * tl.load(ns_ptr + row * s_nst, mask=m, other=0.0)
        tl.store(out + j, score, mask=m)
    for j0 in tl.range(tl.maximum(lo, seen), hi, BLOCK_N):
        j = j0 + n
        tl.store(out + j, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=j < hi)


# indexer_sweep.json (3d3456e, B64 ctx 32k, bf16 keys, the head-major dot, one dot a program): 128 positions a
# program 243.5 us, 64 271.7; FP8 keys (indexer_sweep_fp8.json, c87f563): 128 positions 255.5 us, 64 483.8.
_DEFAULT_TILE = {"block_n": 128, "split": 0, "num_warps": 4, "num_stages": 3, "keys_major": 1}
PROGRAMS_PER_SM = 4  # `split` 0: a program scores as many positions as make about this many programs an SM
_OVERRIDES = declare_tiles(
    "indexer_tiles", __name__,
    overrides="`indexer_scores_paged`'s launch (block_n, split, num_warps, num_stages, keys_major) over "
              "`_DEFAULT_TILE` (`configured`)")


@contextlib.contextmanager
def configured(**fields):
    """Within this block `indexer_scores_paged` launches with ``fields`` (some of block_n: positions a dot;
    split: positions a program, the token's queries loaded once for all of them, 0 for as many as give
    `PROGRAMS_PER_SM` programs an SM; num_warps, num_stages; keys_major: 1 for the dot with positions as its rows,
    0 with heads as its rows) in place of the defaults (128, 0, 4, 3, 1): for sweeps and A/B timings
    (``benchmarks/indexer_sweep.py``). block_n, split (unless 0) and num_warps powers of two, block_n at most 256,
    split at least block_n."""
    # 512 positions a dot (8 warps) gave other scores than the shipped tile on the H200 (indexer_sweep_48fd542.json)
    with overridden(_OVERRIDES, fields, {"block_n": (16, 256, True), "split": (0, 1 << 20, False),
                                         "num_warps": (1, 64, True), "num_stages": (1, 8, False),
                                         "keys_major": (0, 1, False)}):
        tile = {**_DEFAULT_TILE, **_OVERRIDES[-1]}
        split = tile["split"]
        if split and (split & (split - 1) or split < tile["block_n"]):
            raise ValueError(f"configured: split: expected 0 or a power of two >= block_n={tile['block_n']}, "
                             f"got {split}")
        yield


def _split(tile, T: int, N: int, device) -> int:
    """Positions a program scores: the tile's, or for 0 the power of two (at least block_n) nearest to giving
    `PROGRAMS_PER_SM` programs an SM for ``T`` tokens of ``N`` positions."""
    if tile["split"]:
        return tile["split"]
    programs = PROGRAMS_PER_SM * num_sms(device.index if device.type == "cuda" else None)
    return max(tile["block_n"], next_pow2(max(1, T * N // programs)))


def indexer_scores_paged(q, w, cache_k, new_k, block_table, token_request, cache_lens, cu_seqlens, positions,
                         *, scale: float, cache_scale=None, new_scale=None, fresh_stride: int = 1):
    """``indexer_scores_paged_ref`` in one Triton launch of ``T x ceil(N / split)`` programs (`configured`); FP8
    keys are read as they are stored, in half the bytes, and widened to q's dtype. A program reads only the keys
    its token sees: a short request in a batch of long ones costs its own length, not the batch's bound."""
    require_triton()
    _check(q, w, cache_k, new_k, block_table, token_request, cache_lens, cu_seqlens, positions, cache_scale,
           new_scale, fresh_stride)
    T, Hi, Di = q.shape
    S, M = cache_k.shape[1], block_table.shape[1]
    N = M * S
    if cache_k.stride(2) != 1 or new_k.stride(1) != 1 or q.stride(2) != 1 or block_table.stride(1) != 1:
        raise ValueError("indexer_scores_paged: the head dim of q / cache_k / new_k and block_table rows must be "
                         "contiguous")
    tile = {**_DEFAULT_TILE, **_OVERRIDES[-1]}
    split = _split(tile, T, N, q.device)
    out = torch.empty(T, N, dtype=torch.float32, device=q.device)
    if T == 0:
        return out
    grid = (T, triton.cdiv(N, split))
    _scores_kernel[grid](q, w, cache_k, new_k, block_table, token_request, cache_lens, cu_seqlens, positions, out,
                         N, S, Hi, Di, float(scale),
                         q.stride(0), q.stride(1), w.stride(0), cache_k.stride(0), cache_k.stride(1),
                         new_k.stride(0), block_table.stride(0), out.stride(0),
                         BLOCK_H=max(16, next_pow2(Hi)), BLOCK_D=max(16, next_pow2(Di)), BLOCK_N=tile["block_n"],
                         SPLIT=split, num_warps=tile["num_warps"], num_stages=tile["num_stages"],
                         KEYS_MAJOR=bool(tile["keys_major"]), FRESH_STRIDE=fresh_stride,
                         # fp32 queries get an fp32 dot, not TF32's 10-bit mantissas (half precision ignores it)
                         PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                         **(dict(cs_ptr=cache_scale, ns_ptr=new_scale, s_cp=cache_scale.stride(0),
                                 s_cs=cache_scale.stride(1), s_nst=new_scale.stride(0), FP8=True)
                            if cache_scale is not None else {}))
    return out


def ordered_topk(scores: Float[Tensor, "T N"], k: int, *, best_first: bool = True) -> Int[Tensor, "T k"]:
    """The positions of the ``k`` largest scores of each row (int64), equal scores to the earlier position:
    best first, or without ``best_first`` in the order the selection leaves them (the same set).

    The order is total, so the set depends on the scores alone: not on the row's length, its padding or the
    selection algorithm (``torch.topk`` breaks ties by its algorithm, which changes with the row's length).
    Each fp32 score becomes an int32 in the same order (-0.0 as 0.0; -inf lowest) and goes above the reversed
    position in one int64 key, all keys distinct. Scores must not be NaN; no host sync (capturable).
    On the H200 at [64, 32768] scores and k = 2048 the indexer took 417 us with these keys, against 547 us when
    torch.topk over the fp32 scores settled only the cut-off's ties afterwards (cumsums and a scatter over the
    row) and 331 us with torch.topk's own tie order."""
    N = scores.shape[-1]
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 ties with 0.0, as the floats compare
    monotone = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: reverse their magnitude bits
    later = torch.arange(N - 1, -1, -1, device=scores.device)  # an earlier position ranks higher
    keys = monotone.to(torch.int64) * (1 << 32) + later
    return torch.topk(keys, k, dim=-1, sorted=best_first).indices


def finite_topk(scores: Float[Tensor, "T N"], topk: int, *, best_first: bool = True) -> Int[Tensor, "T topk"]:
    """The ``topk`` best finite scores of each row as int64 positions (`ordered_topk`: ties to the earlier
    position), ``-1`` padded: best first, or without ``best_first`` in the order the selection leaves them
    (the same set, without the final sort by score)."""
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk: expected a positive int, got {topk!r}")
    idx = ordered_topk(scores, min(topk, scores.shape[1]), best_first=best_first)
    idx = torch.where(torch.isfinite(scores.gather(1, idx)), idx, torch.full_like(idx, -1))
    return F.pad(idx, (0, topk - idx.shape[1]), value=-1) if idx.shape[1] < topk else idx


def indexer_topk_ref(q, w, cache_k, new_k, block_table, token_request, cache_lens, cu_seqlens, positions,
                     *, scale: float, topk: int, cache_scale=None, new_scale=None):
    """``[T, topk]`` int64 positions (best first, -1 padded) from the torch scores."""
    scores = indexer_scores_paged_ref(q, w, cache_k, new_k, block_table, token_request, cache_lens, cu_seqlens,
                                      positions, scale=scale, cache_scale=cache_scale, new_scale=new_scale)
    return finite_topk(scores, topk)


RADIX_TOPK = 2048  # the one top-k sgl_kernel's radix select serves (DeepSeek-V3.2's and GLM-5's)


@functools.cache
def sgl_kernel_loaded() -> bool:
    """Whether sgl_kernel imports: once, not on every step that may take the radix select. The import itself is
    needed, not only the package's presence: it registers ``torch.ops.sgl_kernel``."""
    try:
        import sgl_kernel  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def sgl_kernel_op(name: str) -> bool:
    """Whether ``torch.ops.sgl_kernel.<name>`` is registered: builds trimmed to some architectures' ops (or an
    older release) lack some, DeepSeek-V4's ``deepseek_v4_topk_transform_512`` among them."""
    if not sgl_kernel_loaded():
        return False
    import torch

    return hasattr(torch.ops.sgl_kernel, name)


def radix_reasons(scores, topk: int) -> list[str]:
    """Why `radix_topk` cannot select ``topk`` of ``scores`` here (empty: it can)."""
    reasons = []
    if topk != RADIX_TOPK:
        reasons.append(f"sgl_kernel's radix select keeps {RADIX_TOPK} positions, not {topk}")
    if not scores.is_cuda:
        reasons.append("sgl_kernel's radix select runs on CUDA only")
    if not sgl_kernel_loaded():
        reasons.append("sgl_kernel is not installed")
    return reasons


def radix_topk(scores: Float[Tensor, "T N"], positions: Int[Tensor, " T"], topk: int) -> Int[Tensor, "T topk"]:
    """`finite_topk`'s set of positions through sgl_kernel's radix select (``fast_topk``, DeepSeek-V3.2's DSA top-k
    in sglang-kernel): ``[T, topk]`` int64, each row's positions latest first, ``-1`` after them.

    Row ``t`` selects among its first ``min(positions[t] + 1, N)`` scores: the visible ones, all finite. The
    kernel's own order comes from its atomics; sorting the row makes the result (and the sparse attention's
    sums over it) the same every run. Two limits of the kernel: of scores equal at the 2048th best, which are
    kept is the order its threads arrive in, and a row whose threshold bin (8 bits of the score as fp16) holds
    more than 16384 positions selects among the first 16384 its threads meet (another set than `ordered_topk`'s,
    and not the same every run). The buffer starts at ``-1``, so a position the kernel does not write is no key,
    never a stray index."""
    bad = radix_reasons(scores, topk)
    if bad:
        raise ValueError(f"radix_topk: {'; '.join(bad)}")
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"scores: expected [T, N] float32 rows of unit stride, got {tuple(scores.shape)} "
                         f"{scores.dtype}, strides {scores.stride()}")
    T = scores.shape[0]
    if positions.shape != (T,) or positions.is_floating_point() or positions.device != scores.device:
        raise ValueError(f"positions: expected an integer tensor of shape {(T,)} on {scores.device}, got "
                         f"{tuple(positions.shape)} {positions.dtype} on {positions.device}")
    return _radix_select(scores, positions, topk)


@triton.jit
def _sort_rows_kernel(x_ptr, out_ptr, K, s_x, s_out, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + t * s_x + k, mask=k < K, other=-1)
    tl.store(out_ptr + t * s_out + k, tl.sort(x, descending=True).to(tl.int64), mask=k < K)


def sort_positions(picked: Int[Tensor, "T K"]) -> Int[Tensor, "T K"]:
    """Each row of int32 positions (-1: none) in descending order, as int64: one program a row (a bitonic sort
    in registers, up to 4096 a row), where ``torch.sort`` takes a segmented radix sort of several launches."""
    require_triton()
    if picked.dim() != 2 or picked.dtype != torch.int32 or picked.stride(1) != 1:
        raise ValueError(f"picked: expected [T, K] int32 rows of unit stride, got {tuple(picked.shape)} "
                         f"{picked.dtype}, strides {picked.stride()}")
    T, K = picked.shape
    if K > 4096:
        raise ValueError(f"picked: expected at most 4096 positions a row, got {K}")
    out = torch.empty(T, K, dtype=torch.int64, device=picked.device)
    if T and K:
        _sort_rows_kernel[(T,)](picked, out, K, picked.stride(0), out.stride(0), BLOCK=next_pow2(K),
                                num_warps=8 if K > 1024 else 4)
    return out


def _radix_select(scores, positions, topk: int):
    """`radix_topk` over checked arguments."""
    T, N = scores.shape
    lengths = (positions + 1).clamp(max=N).to(torch.int32)  # [T] visible positions per row
    picked = torch.full((T, topk), -1, dtype=torch.int32, device=scores.device)
    torch.ops.sgl_kernel.fast_topk(scores, picked, lengths, None)
    return sort_positions(picked)


def indexer_topk(q, w, cache_k, new_k, block_table, token_request, cache_lens, cu_seqlens, positions,
                 *, scale: float, topk: int, cache_scale=None, new_scale=None, radix: bool = False):
    """``indexer_topk_ref``'s set with the Triton scores; the selection is `ordered_topk`'s, unsorted (no host
    sync), or with ``radix`` where `radix_reasons` finds none, `radix_topk`'s (ordered by position)."""
    if not isinstance(radix, bool):
        raise ValueError(f"radix: expected True or False, got {radix!r}")
    scores = indexer_scores_paged(q, w, cache_k, new_k, block_table, token_request, cache_lens, cu_seqlens, positions,
                                  scale=scale, cache_scale=cache_scale, new_scale=new_scale)
    if radix and not radix_reasons(scores, topk):  # the scores are the launch's own, positions checked with them
        return _radix_select(scores, positions, topk)
    return finite_topk(scores, topk, best_first=False)
