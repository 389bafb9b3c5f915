"""MLA's latent attention in the invariant mode: each token alone in its programs, its keys in tiles fixed by
position, so a token's result is the same bits in a prefill, a decode and a verify, and beside any requests.

`latent_attention_invariant`: the absorbed query ``q [T, H, R + Dr]`` of every token over its request's cached
latent rows (a paged pool ``[P, S, R + Dr]``) and the step's own new rows up to itself (``new [T, R + Dr]``, not
in the pool while the step runs), one softmax: ``-> (o_lat [T, H, R], lse [T, H])`` in fp32, the LSE in natural
log. A program owns one token and a block of heads and walks the token's positions ``0 .. pos`` in tiles of
``block_n`` keys, ``[i * block_n, (i + 1) * block_n)``: position ``j`` is read from the pool below the request's
cache length and from the step's rows at and above it, so the same key tile holds the same rows whether they
were cached in an earlier step or come with this one. A score is summed over ``R + Dr`` in steps of
``block_d``, in order; the tiles merge in position order within a split of ``split_keys`` positions, each split
from a fresh online softmax, and the splits merge in order. Nothing in a launch depends on how many tokens or
requests the step has, or on the phase: the property the invariant mode (`kernels.invariant`) asks for.

A step of few tokens would leave most of the GPU idle (one token of 128 heads: 8 programs), so there each split
runs as a program of its own and a second launch merges the splits with the same arithmetic
(`attention_tiles.ordered_merge`): where the splits run changes no bit, only the time.

`latent_values`: ``o_lat [T, H, R]`` through ``W_UV`` (``[H, Dv, R]``) per head, ``-> [T, H, Dv]``, in tiles of
16 tokens whatever ``T``; with `latent_absorb.absorb_query` at ``block_t=16`` for ``W_UK`` the whole latent
layer keeps a token's bits whatever shares its step.
"""

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ._triton import next_pow2, num_sms, require_triton, tl, triton
from .attention_tiles import normalized, ordered_merge

#: Tokens one weight product takes: fixed, so a token's row goes through the same products whatever ``T`` is.
TOKEN_TILE = 16
#: Keys (picks) a split of a token's walk holds: each split a fresh online softmax, the splits merged in order.
#: A split's partial sums (``H x R`` fp32: 256 KB at 128 heads of 512) cost about a fifth of its keys' bytes
#: (1024 rows of 576 bf16) when a split runs as a program of its own; fewer keys a split would cost more than
#: the programs gain.
SPLIT_KEYS = 1024
#: The most partial sums one splitting launch may write (bytes); more, and the splits stay in one program.
PARTIAL_BYTES = 64 << 20


@triton.jit
def _split_state(Q, CACHE, NEW, BLOCK_TABLE, INDICES, t, b, h, h_ok, r, cached_len, pos, R, DQ, S, scale, PICKS,
                 first_tile, last_tile, sq_t, sq_h, sc_p, sc_s, sn_t, sbt_b, si_t,
                 BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_STEPS: tl.constexpr,
                 BLOCK_R: tl.constexpr, SPARSE: tl.constexpr):
    """One split of a token's keys, its tiles ``first_tile .. last_tile``, from a fresh online softmax:
    ``-> (m [BLOCK_H], l [BLOCK_H], acc [BLOCK_H, BLOCK_R])``, the sums not yet divided."""
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for i in range(first_tile, last_tile):
        n = i * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        if SPARSE:
            j = tl.load(INDICES + t * si_t + n, mask=n < PICKS, other=-1).to(tl.int64)  # [BLOCK_N] key positions
            valid = (j >= 0) & (j <= pos)
        else:
            j = n
            valid = j <= pos
        cached = valid & (j < cached_len)
        fresh = valid & (j >= cached_len)
        page = tl.load(BLOCK_TABLE + b * sbt_b + j // S, mask=cached, other=0).to(tl.int64)
        c_row = page * sc_p + (j % S) * sc_s  # the key's row in the pool
        n_row = (t + j - pos) * sn_t  # the key's row among the step's new rows (this request's are consecutive)
        s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        for step in range(D_STEPS):
            d = step * BLOCK_D + tl.arange(0, BLOCK_D)
            d_ok = d < DQ
            q = tl.load(Q + t * sq_t + h[:, None] * sq_h + d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                        other=0.0)  # [BLOCK_H, BLOCK_D]
            k_c = tl.load(CACHE + c_row[:, None] + d[None, :], mask=cached[:, None] & d_ok[None, :], other=0.0)
            k_n = tl.load(NEW + n_row[:, None] + d[None, :], mask=fresh[:, None] & d_ok[None, :], other=0.0)
            k = tl.where(cached[:, None], k_c, k_n)  # [BLOCK_N, BLOCK_D]
            s += tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # no key yet (a sparse token's picks may begin with pads): nothing to rescale, and no exp(-inf + inf)
        seen = m_new > float("-inf")
        alpha = tl.where(seen, tl.exp(m_i - m_new), 1.0)
        p = tl.exp(s - tl.where(seen, m_new, 0.0)[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_c = tl.load(CACHE + c_row[:, None] + r[None, :], mask=cached[:, None] & (r[None, :] < R), other=0.0)
        v_n = tl.load(NEW + n_row[:, None] + r[None, :], mask=fresh[:, None] & (r[None, :] < R), other=0.0)
        v = tl.where(cached[:, None], v_c, v_n)  # [BLOCK_N, BLOCK_R]: a row's latent c_kv is its value
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _store_result(OUT, LSE, t, h, h_ok, r, R, m, den, acc, so_t, so_h, sl_t):
    # a sparse token whose picks are all pads attends nothing: 0 and an lse of -inf
    o, lse = normalized(m, den, acc, m, False, False)
    tl.store(OUT + t * so_t + h[:, None] * so_h + r[None, :], o, mask=h_ok[:, None] & (r[None, :] < R))
    tl.store(LSE + t * sl_t + h, lse, mask=h_ok)


@triton.jit
def _latent_attention_kernel(
    Q, CACHE, NEW, BLOCK_TABLE, CACHE_LENS, POSITIONS, REQUESTS, INDICES, OUT, LSE, M_PART, L_PART, ACC_PART,
    H, R, DQ, S, scale, PICKS, HEAD_BLOCKS,
    sq_t, sq_h, sc_p, sc_s, sn_t, sbt_b, si_t, so_t, so_h, sl_t, smp_t, smp_s, sap_t, sap_s, sap_h,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_STEPS: tl.constexpr,
    BLOCK_R: tl.constexpr, SPARSE: tl.constexpr, SPLIT_TILES: tl.constexpr, PARTIAL: tl.constexpr,
):
    # A token's head blocks are consecutive programs, so they run together and read its keys through L2 once.
    pid = tl.program_id(0)
    t = (pid // HEAD_BLOCKS).to(tl.int64)
    h = (pid % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    b = tl.load(REQUESTS + t).to(tl.int64)
    cached_len = tl.load(CACHE_LENS + b).to(tl.int64)
    pos = tl.load(POSITIONS + t).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    # dense: the tiles that hold positions 0 .. pos; sparse: the tiles of the token's picks, ascending
    tiles = (PICKS + BLOCK_N - 1) // BLOCK_N if SPARSE else (pos + BLOCK_N) // BLOCK_N
    if PARTIAL:  # this program: one split, left unmerged for `_merge_splits_kernel`
        split = tl.program_id(1)
        if split * SPLIT_TILES < tiles:
            m_s, den_s, acc_s = _split_state(
                Q, CACHE, NEW, BLOCK_TABLE, INDICES, t, b, h, h_ok, r, cached_len, pos, R, DQ, S, scale, PICKS,
                split * SPLIT_TILES, tl.minimum(tiles, (split + 1) * SPLIT_TILES),
                sq_t, sq_h, sc_p, sc_s, sn_t, sbt_b, si_t, BLOCK_H, BLOCK_N, BLOCK_D, D_STEPS, BLOCK_R, SPARSE)
            tl.store(M_PART + t * smp_t + split * smp_s + h, m_s, mask=h_ok)
            tl.store(L_PART + t * smp_t + split * smp_s + h, den_s, mask=h_ok)
            tl.store(ACC_PART + t * sap_t + split * sap_s + h[:, None] * sap_h + r[None, :], acc_s,
                     mask=h_ok[:, None] & (r[None, :] < R))
    else:  # every split of the token in this program, merged as they come
        # the running sums wait in OUT between splits (fp32, so exactly): two [BLOCK_H, BLOCK_R] accumulators at
        # once would spill registers
        splits = tl.cdiv(tiles, SPLIT_TILES)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_H], dtype=tl.float32)
        out = OUT + t * so_t + h[:, None] * so_h + r[None, :]
        out_ok = h_ok[:, None] & (r[None, :] < R)
        for split in range(0, splits):
            m_s, den_s, acc_s = _split_state(
                Q, CACHE, NEW, BLOCK_TABLE, INDICES, t, b, h, h_ok, r, cached_len, pos, R, DQ, S, scale, PICKS,
                split * SPLIT_TILES, tl.minimum(tiles, (split + 1) * SPLIT_TILES),
                sq_t, sq_h, sc_p, sc_s, sn_t, sbt_b, si_t, BLOCK_H, BLOCK_N, BLOCK_D, D_STEPS, BLOCK_R, SPARSE)
            tl.debug_barrier()  # the last split's running sums, stored by other threads of this program
            later = tl.full([1, 1], split, tl.int32) > 0  # (a tensor: the interpreter masks with no bool)
            acc = tl.load(out, mask=out_ok & later, other=0.0)
            m, den, acc = ordered_merge(m, den, acc, m_s, den_s, acc_s, False)
            tl.store(out, acc, mask=out_ok)
        tl.debug_barrier()
        acc = tl.load(out, mask=out_ok & (tl.full([1, 1], splits, tl.int32) > 0), other=0.0)
        _store_result(OUT, LSE, t, h, h_ok, r, R, m, den, acc, so_t, so_h, sl_t)


@triton.jit
def _merge_splits_kernel(
    M_PART, L_PART, ACC_PART, POSITIONS, OUT, LSE, H, R, PICKS, HEAD_BLOCKS,
    smp_t, smp_s, sap_t, sap_s, sap_h, so_t, so_h, sl_t,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPARSE: tl.constexpr,
    SPLIT_TILES: tl.constexpr,
):
    # The splitting launch's partials, a token's in split order: the one-program walk's merges, the same bits.
    pid = tl.program_id(0)
    t = (pid // HEAD_BLOCKS).to(tl.int64)
    h = (pid % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    pos = tl.load(POSITIONS + t).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    tiles = (PICKS + BLOCK_N - 1) // BLOCK_N if SPARSE else (pos + BLOCK_N) // BLOCK_N
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for split in range(0, tl.cdiv(tiles, SPLIT_TILES)):
        m_s = tl.load(M_PART + t * smp_t + split * smp_s + h, mask=h_ok, other=float("-inf"))
        den_s = tl.load(L_PART + t * smp_t + split * smp_s + h, mask=h_ok, other=0.0)
        acc_s = tl.load(ACC_PART + t * sap_t + split * sap_s + h[:, None] * sap_h + r[None, :],
                        mask=h_ok[:, None] & (r[None, :] < R), other=0.0)
        m, den, acc = ordered_merge(m, den, acc, m_s, den_s, acc_s, False)
    _store_result(OUT, LSE, t, h, h_ok, r, R, m, den, acc, so_t, so_h, sl_t)


def _check(q, cache, new, block_table, cache_lens, positions, requests, kv_rank, indices):
    def shape(name, t, dims, want):
        if not isinstance(t, torch.Tensor) or t.dim() != len(want) or any(
                w is not None and w != n for w, n in zip(want, t.shape)):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"latent_attention_invariant: {name}: expected shape [{dims}] = "
                             f"{tuple('*' if w is None else w for w in want)}, got {got}")

    shape("q", q, "T, H, Dq", (None, None, None))
    T, H, Dq = q.shape
    shape("cache", cache, "P, S, Dq", (None, None, Dq))
    shape("new", new, "T, Dq", (T, Dq))
    shape("block_table", block_table, "B, pages", (None, None))
    B = block_table.shape[0]
    shape("cache_lens", cache_lens, "B", (B,))
    shape("positions", positions, "T", (T,))
    shape("requests", requests, "T", (T,))
    if indices is not None:
        shape("indices", indices, "T, picks", (T, None))
        if indices.dtype not in (torch.int32, torch.int64) or indices.device != q.device:
            raise ValueError(f"latent_attention_invariant: indices: expected an integer tensor on {q.device}, got "
                             f"{indices.dtype} on {indices.device}")
    for name, t in (("cache", cache), ("new", new)):
        if t.dtype != q.dtype:
            raise ValueError(f"latent_attention_invariant: {name}: expected dtype {q.dtype} (q's), got {t.dtype}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"latent_attention_invariant: q: expected dtype bfloat16, float16 or float32, got {q.dtype}")
    for name, t in (("block_table", block_table), ("cache_lens", cache_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"latent_attention_invariant: {name}: expected dtype torch.int32, got {t.dtype}")
    for name, t in (("positions", positions), ("requests", requests)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"latent_attention_invariant: {name}: expected an integer dtype, got {t.dtype}")
    for name, t in (("q", q), ("cache", cache), ("new", new), ("block_table", block_table)):
        if t.device != q.device:
            raise ValueError(f"latent_attention_invariant: {name}: expected device {q.device} (q's), got {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"latent_attention_invariant: {name}: expected a unit stride on the last dim, got "
                             f"strides {t.stride()}")
    if isinstance(kv_rank, bool) or not isinstance(kv_rank, int) or not 0 < kv_rank <= Dq:
        raise ValueError(f"latent_attention_invariant: kv_rank: expected an int in 1..{Dq} (q's last dim), got "
                         f"{kv_rank!r}")


def latent_attention_invariant(q: Float[Tensor, "T H Dq"], cache: Float[Tensor, "P S Dq"], new: Float[Tensor, "T Dq"],
                               block_table: Int[Tensor, "B pages"], cache_lens: Int[Tensor, " B"],
                               positions: Int[Tensor, " T"], requests: Int[Tensor, " T"], *, kv_rank: int,
                               scale: float, indices: Int[Tensor, "T picks"] | None = None, block_h: int = 16,
                               block_n: int = 32, block_d: int = 64, split_keys: int = SPLIT_KEYS,
                               split: bool | None = None,
                               num_warps: int = 8) -> tuple[Float[Tensor, "T H R"], Float[Tensor, "T H"]]:
    """Module docstring. ``requests [T]``: each token's request (its row of ``block_table`` and
    ``cache_lens``); ``positions [T]``: its position, ``cache_lens[request]`` and up, a request's tokens
    consecutive rows of ``new`` in position order. The tiles are fixed by the dims alone; a caller that wants a
    token's bits to follow nothing else passes the same ones every step.

    ``indices [T, picks]`` (a sparse layer's selection): each token attends only the positions its row names,
    which must be ascending with every -1 (none) after them; its key tiles are then ``block_n`` picks each, in
    that order. A token with no pick gets 0 and an LSE of -inf. None: every position up to the token's own
    (each token sees at least itself).

    ``split_keys`` (a multiple of ``block_n``): a token's keys (picks) reduce in splits of this many, merged in
    order. ``split``: run each split as a program of its own and merge them in a second launch (the same bits as
    one program walking them all); None: only where the grid would fill less than half the GPU and a token's
    splits could be more than one, with its partial sums under ``PARTIAL_BYTES``."""
    require_triton()
    _check(q, cache, new, block_table, cache_lens, positions, requests, kv_rank, indices)
    T, H, Dq = q.shape
    if not scale > 0:
        raise ValueError(f"latent_attention_invariant: scale: expected > 0, got {scale!r}")
    least = 16 if q.is_cuda else 1  # a tile's keys are the K of its probabilities-by-values dot: 16 on tensor cores
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < least or block_n & (block_n - 1):
        raise ValueError(f"latent_attention_invariant: block_n: expected a power of two >= {least} on "
                         f"{q.device.type}, got {block_n!r}")
    if isinstance(split_keys, bool) or not isinstance(split_keys, int) or split_keys < block_n or \
            split_keys % block_n:
        raise ValueError(f"latent_attention_invariant: split_keys: expected a positive multiple of block_n "
                         f"({block_n}), got {split_keys!r}")
    if split is not None and not isinstance(split, bool):
        raise ValueError(f"latent_attention_invariant: split: expected None or a bool, got {split!r}")
    o = torch.empty((T, H, kv_rank), dtype=torch.float32, device=q.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T == 0:
        return o, lse
    sparse = indices is not None
    idx = indices.contiguous() if sparse else positions  # (unread when dense)
    picks = idx.shape[1] if sparse else 0
    head_blocks = triton.cdiv(H, block_h)
    # a dense token's keys end at its position: below its request's cached rows plus the step's, so below this
    max_keys = picks if sparse else block_table.shape[1] * cache.shape[1] + T
    max_splits = triton.cdiv(max(max_keys, 1), split_keys)
    if split is None:
        split = (max_splits > 1 and 2 * T * head_blocks <= num_sms(q.device.index if q.is_cuda else None)
                 and T * max_splits * H * kv_rank * 4 <= PARTIAL_BYTES)
    if split:
        m_part = torch.empty((T, max_splits, H), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty((T, max_splits, H, kv_rank), dtype=torch.float32, device=q.device)
    else:
        m_part = l_part = acc_part = lse  # (unread)
    part_strides = (m_part.stride(0), m_part.stride(1), acc_part.stride(0), acc_part.stride(1),
                    acc_part.stride(2)) if split else (0,) * 5
    tiles = dict(BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_R=max(16, next_pow2(kv_rank)), SPARSE=sparse,
                 SPLIT_TILES=split_keys // block_n)
    _latent_attention_kernel[(T * head_blocks, max_splits if split else 1)](
        q, cache, new, block_table, cache_lens, positions, requests, idx, o, lse, m_part, l_part, acc_part,
        H, kv_rank, Dq, cache.shape[1], float(scale), picks, head_blocks,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), new.stride(0), block_table.stride(0),
        idx.stride(0) if sparse else 0, o.stride(0), o.stride(1), lse.stride(0), *part_strides,
        BLOCK_D=block_d, D_STEPS=triton.cdiv(Dq, block_d), PARTIAL=split, num_warps=num_warps, **tiles)
    if split:
        _merge_splits_kernel[(T * head_blocks,)](
            m_part, l_part, acc_part, positions, o, lse, H, kv_rank, picks, head_blocks, *part_strides,
            o.stride(0), o.stride(1), lse.stride(0), num_warps=num_warps, **tiles)
    return o, lse


def latent_attention_invariant_ref(q, cache, new, block_table, cache_lens, positions, requests, *, kv_rank: int,
                                   scale: float, indices=None) -> tuple[Tensor, Tensor]:
    """`latent_attention_invariant` in fp32 torch, a token at a time: its keys gathered by position."""
    T, H, _ = q.shape
    S = cache.shape[1]
    o = torch.zeros((T, H, kv_rank), dtype=torch.float32, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    for t in range(T):
        b, pos = int(requests[t]), int(positions[t])
        c = int(cache_lens[b])
        seen = range(pos + 1) if indices is None else [int(j) for j in indices[t] if 0 <= int(j) <= pos]
        if not seen:
            continue
        rows = [cache[int(block_table[b, j // S]), j % S] if j < c else new[t + j - pos] for j in seen]
        k = torch.stack(rows).float()  # [keys, Dq]
        s = q[t].float() @ k.T * scale  # [H, keys]
        lse[t] = torch.logsumexp(s, -1)
        o[t] = torch.softmax(s, -1) @ k[:, :kv_rank]
    return o, lse


def ascending_picks(picks: Int[Tensor, "T K"]) -> Int[Tensor, "T K"]:
    """A selection's positions (-1: none, anywhere in a row) ascending, every -1 after them: the order
    `latent_attention_invariant` walks a sparse token's keys in. A row's result follows its own values only."""
    if not isinstance(picks, torch.Tensor) or picks.dim() != 2 or picks.dtype not in (torch.int32, torch.int64):
        got = (f"{picks.dtype} of shape {tuple(picks.shape)}" if isinstance(picks, torch.Tensor)
               else type(picks).__name__)
        raise ValueError(f"ascending_picks: picks: expected a [T, K] int32 or int64 tensor, got {got}")
    big = torch.iinfo(picks.dtype).max
    ordered = torch.where(picks < 0, big, picks).sort(dim=1).values
    return torch.where(ordered == big, -1, ordered)


def request_of_token(cu_seqlens: Int[Tensor, " B1"], tokens: int) -> Int[Tensor, " T"]:
    """Each of ``tokens`` rows' request, from the batch's ``cu_seqlens [B + 1]`` on its device (no host read)."""
    rows = torch.arange(tokens, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), rows, right=True)


def latent_values(o_lat: Float[Tensor, "T H R"], w_uv: Float[Tensor, "H Dv R"], *, block_r: int = 128,
                  block_k: int = 64, num_warps: int = 4) -> Float[Tensor, "T H Dv"]:
    """``o_lat [T, H, R]`` (rounded to ``w_uv``'s dtype first, as the unfused layer does) through ``W_UV`` per
    head: ``-> [T, H, Dv]`` in ``w_uv``'s dtype, fp32 accumulation, ``TOKEN_TILE`` tokens a product whatever
    ``T`` is (`latent_absorb.absorb_query`'s kernel, reading ``W_UV`` transposed in place)."""
    from .latent_absorb import _absorb_query_kernel

    require_triton()
    if not isinstance(o_lat, torch.Tensor) or o_lat.dim() != 3:
        raise ValueError(f"latent_values: o_lat: expected a [T, H, R] tensor, got "
                         f"{tuple(o_lat.shape) if isinstance(o_lat, torch.Tensor) else type(o_lat).__name__}")
    T, H, R = o_lat.shape
    if not isinstance(w_uv, torch.Tensor) or w_uv.dim() != 3 or w_uv.shape[0] != H or w_uv.shape[2] != R:
        raise ValueError(f"latent_values: w_uv: expected shape [H, Dv, R] = ({H}, Dv, {R}), got "
                         f"{tuple(w_uv.shape) if isinstance(w_uv, torch.Tensor) else type(w_uv).__name__}")
    if w_uv.device != o_lat.device:
        raise ValueError(f"latent_values: w_uv: expected device {o_lat.device} (o_lat's), got {w_uv.device}")
    x = o_lat.to(w_uv.dtype).contiguous()
    Dv = w_uv.shape[1]
    out = torch.empty((T, H, Dv), dtype=w_uv.dtype, device=o_lat.device)
    if T == 0:
        return out
    full_k = max(16, next_pow2(R))
    block_k = min(block_k, full_k)
    block_r = min(block_r, max(16, next_pow2(Dv)))
    # W_UV[h] read as [R, Dv] in place: along R (the product's K) stride w_uv.stride(2), along Dv w_uv.stride(1)
    per_program = 4 * TOKEN_TILE  # whole token tiles a program: which program takes a tile changes no bit of it
    _absorb_query_kernel[(triton.cdiv(T, per_program), triton.cdiv(Dv, block_r), H)](
        x, x, w_uv, out, T, H, R, Dv, 0, per_program,
        x.stride(0), x.stride(1), 0, 0, w_uv.stride(0), w_uv.stride(2), w_uv.stride(1), out.stride(0), out.stride(1),
        BLOCK_T=TOKEN_TILE, BLOCK_K=block_k, BLOCK_R=block_r, BLOCK_P=16, K_STEPS=triton.cdiv(R, block_k),
        NUM_STAGES=2, num_warps=num_warps)
    return out


def latent_values_ref(o_lat: Tensor, w_uv: Tensor) -> Tensor:
    """`latent_values` in torch: fp32 products of the rounded latent, rounded once."""
    return torch.einsum("thr,hvr->thv", o_lat.to(w_uv.dtype).float(), w_uv.float()).to(w_uv.dtype)
