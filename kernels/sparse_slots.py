"""Top-k positions to what a sparse attention kernel reads, in one launch (Triton).

A sparse MLA layer's indexer names, for each new token, ``topk`` absolute key positions of its request
(``-1``: none). Positions below the request's cache length are cached rows, at physical slot
``block_table[r, j // S] * S + j % S`` of the paged pool; the others are this step's own rows, not in
the pool yet: row ``cu_seqlens[r] + j - cache_lens[r]`` of the step's inputs. `topk_slots` writes both,
as int32 lists padded with -1 to a multiple of ``pad_to`` (FlashMLA's sparse kernel walks them in blocks),
and, for a step of ``new`` rows per request, which of those its token picked: a ``[T, new]`` mask.

Fifteen-odd torch ops (gathers, casts, wheres, a pad, a scatter) done as one pass over the lists.
`topk_slots_ref` is the torch form, the same bits.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from ._triton import gdc_launch_dependents, gdc_wait, next_pow2, pdl_launch, require_triton, tl, triton

_INTS = (torch.int32, torch.int64)


@triton.jit
def _topk_slots_kernel(IDX, REQ, CACHE_LENS, CU, BLOCK_TABLE, SLOTS, ROWS, PICKED, K, K_PAD, s_idx, s_bt,
                       S: tl.constexpr, NEW: tl.constexpr, NEW_PAD: tl.constexpr, WANT_ROWS: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program t: token t's list."""
    t = tl.program_id(0).to(tl.int64)
    if PDL:  # every input only after the launch before this one has finished
        gdc_wait()
        gdc_launch_dependents()
    r = tl.load(REQ + t).to(tl.int64)
    c = tl.load(CACHE_LENS + r).to(tl.int64)
    base = tl.load(CU + r).to(tl.int64)
    new = tl.arange(0, NEW_PAD)
    seen = tl.zeros([NEW_PAD], dtype=tl.int32)
    for k0 in range(0, K_PAD, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        j = tl.load(IDX + t * s_idx + k, mask=k < K, other=-1).to(tl.int64)  # [BLOCK]; the padding is -1
        cached = (j >= 0) & (j < c)
        fresh = j >= c
        page = tl.load(BLOCK_TABLE + r * s_bt + j // S, mask=cached, other=0).to(tl.int64)
        tl.store(SLOTS + t * K_PAD + k, tl.where(cached, page * S + j % S, -1).to(tl.int32), mask=k < K_PAD)
        if WANT_ROWS:
            tl.store(ROWS + t * K_PAD + k, tl.where(fresh, base + j - c, -1).to(tl.int32), mask=k < K_PAD)
        if NEW > 0:
            hit = fresh[None, :] & ((j - c)[None, :] == new[:, None])  # [NEW_PAD, BLOCK]
            seen = tl.maximum(seen, tl.max(hit.to(tl.int32), axis=1))
    if NEW > 0:
        tl.store(PICKED + t * NEW + new, seen.to(tl.int8), mask=new < NEW)


def _check(indices, request_of_token, cache_lens, cu_seqlens, block_table, page_size, pad_to, new):
    if not isinstance(indices, torch.Tensor) or indices.dim() != 2 or indices.dtype not in _INTS:
        got = (tuple(indices.shape), indices.dtype) if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise ValueError(f"topk_slots: indices: expected a [T, topk] int32 / int64 tensor, got {got}")
    T = indices.shape[0]
    B = block_table.shape[0] if isinstance(block_table, torch.Tensor) and block_table.dim() == 2 else None
    if B is None or block_table.dtype not in _INTS:
        raise ValueError("topk_slots: block_table: expected a [B, pages] int32 / int64 tensor, got "
                         f"{getattr(block_table, 'shape', type(block_table).__name__)}")
    for name, t, shape in (("request_of_token", request_of_token, (T,)), ("cache_lens", cache_lens, (B,)),
                           ("cu_seqlens", cu_seqlens, (B + 1,))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype not in _INTS:
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"topk_slots: {name}: expected a {shape} int32 / int64 tensor, got {got}")
        if t.device != indices.device:
            raise ValueError(f"topk_slots: {name}: expected device {indices.device} (indices'), got {t.device}")
    if block_table.device != indices.device:
        raise ValueError(f"topk_slots: block_table: expected device {indices.device} (indices'), got "
                         f"{block_table.device}")
    for name, v, lo in (("page_size", page_size, 1), ("pad_to", pad_to, 1), ("new", new, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"topk_slots: {name}: expected an int >= {lo}, got {v!r}")


def topk_slots(indices: Int[Tensor, "T topk"], request_of_token: Int[Tensor, " T"], cache_lens: Int[Tensor, " B"],
               cu_seqlens: Int[Tensor, " B1"], block_table: Int[Tensor, "B pages"], *, page_size: int, pad_to: int = 1,
               rows: bool = False, new: int = 0
               ) -> tuple[Int[Tensor, "T K"], Int[Tensor, "T K"] | None, Bool[Tensor, "T new"] | None]:
    """``indices [T, topk]`` (absolute positions, -1: none) -> ``(slots, rows, picked)``.

    ``slots [T, K]`` int32: the cached positions' physical slots in the paged pool, -1 elsewhere and in the
    padding (``K``: topk rounded up to ``pad_to``). ``rows``: the same for the step's own positions, rows
    of the step's inputs (None unless asked). ``picked [T, new]`` bool: whether the token's list holds its
    request's new position ``cache_lens[r] + i`` (None when ``new`` is 0).
    """
    _check(indices, request_of_token, cache_lens, cu_seqlens, block_table, page_size, pad_to, new)
    T, topk = indices.shape
    k_pad = -(-topk // pad_to) * pad_to
    dev = indices.device
    slots = torch.empty((T, k_pad), dtype=torch.int32, device=dev)
    row_out = torch.empty((T, k_pad), dtype=torch.int32, device=dev) if rows else None
    picked = torch.empty((T, new), dtype=torch.int8, device=dev) if new else None
    if T:
        require_triton()
        pdl = pdl_launch(dev)
        _topk_slots_kernel[(T,)](indices, request_of_token, cache_lens, cu_seqlens, block_table, slots,
                                 slots if row_out is None else row_out, slots if picked is None else picked,
                                 topk, k_pad, indices.stride(0), block_table.stride(0), S=page_size, NEW=new,
                                 NEW_PAD=next_pow2(max(new, 1)), WANT_ROWS=rows, BLOCK=min(1024, next_pow2(k_pad)),
                                 PDL=pdl, launch_pdl=pdl, num_warps=4)
    return slots, row_out, None if picked is None else picked.bool()


def topk_slots_ref(indices: Int[Tensor, "T topk"], request_of_token: Int[Tensor, " T"], cache_lens: Int[Tensor, " B"],
                   cu_seqlens: Int[Tensor, " B1"], block_table: Int[Tensor, "B pages"], *, page_size: int,
                   pad_to: int = 1, rows: bool = False, new: int = 0
                   ) -> tuple[Int[Tensor, "T K"], Int[Tensor, "T K"] | None, Bool[Tensor, "T new"] | None]:
    """`topk_slots` in torch (the gathers and wheres it replaces)."""
    _check(indices, request_of_token, cache_lens, cu_seqlens, block_table, page_size, pad_to, new)
    T, topk = indices.shape
    pad = -topk % pad_to
    idx = torch.nn.functional.pad(indices.long(), (0, pad), value=-1)  # [T, K]
    req = request_of_token.long()
    c = cache_lens.long()[req][:, None]  # [T, 1]
    valid = idx >= 0
    cached, fresh = valid & (idx < c), valid & (idx >= c)
    S = page_size
    page = block_table.long()[req[:, None], torch.where(cached, idx, 0) // S]  # [T, K]
    slots = torch.where(cached, page * S + idx % S, -1).to(torch.int32)
    row_out = torch.where(fresh, cu_seqlens.long()[req][:, None] + idx - c, -1).to(torch.int32) if rows else None
    picked = None
    if new:
        rel = idx - c
        picked = ((rel[:, None, :] == torch.arange(new, device=idx.device)[None, :, None]) & fresh[:, None, :]).any(-1)
    return slots, row_out, picked
