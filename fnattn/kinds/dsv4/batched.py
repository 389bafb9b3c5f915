"""DeepSeek-V4's compressors and CSA indexer for a whole step at once: every phase, no host loop, no host read.

The reference pools windows request by request on the host. Here every token of the step is handled at once,
with shapes fixed by the batch (its tokens ``T``, requests ``B`` and block table), so a step can be captured:

* a token at position ``p`` closes window ``w = (p + 1) // m - 1`` when ``(p + 1) % m == 0``; the entry pools the
  ``L = overlap * m`` raw rows of positions ``p - L + 1 .. p`` (CSA: the previous window's first halves, then
  this one's second halves). A row at or past its request's cache length is one of the step's own rows, one
  below it is in the request's ring (which holds the ``L`` positions before the step), one before position 0
  is kv 0 and gate -inf. Only closing tokens are pooled: at most ``T // m + B``, gathered on the device;
* the ring after a token holds the same ``L`` rows, slot ``q % L`` for position ``q`` (zeros before 0);
* a token sees ``(p + 1) // m`` entries: those closed before the step are read at their closing tokens' rows in
  the pool, the step's own at their closing tokens' rows of the step's entry rows (the rows it writes: zeros
  but at closing tokens), which is why the step's rows are ``m`` apart for the indexer;
* the CSA indexer keeps each token's top-k of the entries it sees.

Same values as the reference to rounding; the states are copies of the same raw rows, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ...kernels.indexer import finite_topk
from ...kernels.invariant import invariant_on, pointwise
from .math import rms_norm_fp32w, rope_cos_sin, rope_tail


def token_requests(batch) -> Tensor:
    """``[T]`` the request (batch row) of each new token, from the device's ``cu_seqlens``."""
    cu = batch.cu_seqlens.long()
    tokens = torch.arange(batch.positions.shape[0], device=cu.device)
    return torch.searchsorted(cu[1:], tokens, right=True)


def last_positions(batch) -> Tensor:
    """``[B]`` each request's last position after the step (``cache_len - 1`` for a request without new tokens)."""
    cu = batch.cu_seqlens.long()
    return batch.cache_lens.long() + (cu[1:] - cu[:-1]) - 1


def raw_rows(views, batch, req: Tensor, pos: Tensor, *, kv_in: Tensor, gate_in: Tensor, state: str, L: int):
    """``-> (kv, gate)`` ``[R, L, CD]`` fp32: the raw rows of positions ``pos - L + 1 .. pos`` of request ``req``
    (``[R]`` each), in position order; kv 0 and gate -inf before position 0."""
    c0 = batch.cache_lens.long()[req][:, None]  # [R, 1]
    cu = batch.cu_seqlens.long()[req][:, None]
    q = pos[:, None] - L + 1 + torch.arange(L, device=pos.device)[None, :]  # [R, L]
    fresh = q >= c0
    step_row = (cu + q - c0).clamp(0, max(kv_in.shape[0] - 1, 0))
    ring = views[state].flatten(0, 1)  # [slots * L, 2, CD]: slot q % L of a request's ring holds position q
    old = ring[batch.recurrent_slots.long()[req][:, None] * L + q.remainder(L)]  # [R, L, 2, CD]
    kv = torch.where(fresh[..., None], kv_in[step_row].float(), old[..., 0, :])
    gate = torch.where(fresh[..., None], gate_in[step_row].float(), old[..., 1, :])
    live = (q >= 0)[..., None]
    return torch.where(live, kv, torch.zeros_like(kv)), torch.where(live, gate, torch.full_like(gate, float("-inf")))


def _pool(kv: Tensor, gate: Tensor, m: int, ov: int) -> Tensor:
    """`pool_windows` of one window a row: ``kv``/``gate`` ``[R, L, CD]`` in position order -> ``[R, D]``."""
    D = kv.shape[-1] // ov
    if ov == 1:
        w_kv, w_gate = kv, gate
    else:
        w_kv = torch.cat((kv[:, :m, :D], kv[:, m:, D:]), dim=1)  # [R, 2m, D]
        w_gate = torch.cat((gate[:, :m, :D], gate[:, m:, D:]), dim=1)
    if invariant_on() and w_kv.is_cuda:
        return pool_fixed_order(w_kv, w_gate)
    # On the CPU torch's softmax and sum over the window axis walk each (window, dim) element in the same order
    # however many windows there are: the invariant mode keeps them.
    weights = w_gate.softmax(dim=1, dtype=torch.float32).to(w_kv.dtype)
    return (w_kv * weights).sum(dim=1)


def pool_fixed_order(w_kv: Float[Tensor, "R n D"], w_gate: Float[Tensor, "R n D"]) -> Float[Tensor, "R D"]:
    """`_pool`'s softmax over each window and weighted sum with their sums over the window axis through the
    fixed-tile GEMM (`fnattn.kernels.invariant_linear`, a product with a ones column): a window's entry is the same
    bits however many windows the step pools, where torch's CUDA reductions lay out by that number. The max is
    exact in any order. ``w_kv``, ``w_gate`` ``[R, n, D]`` -> ``[R, D]`` in ``w_kv.dtype``."""
    from ...kernels.invariant_linear import invariant_linear

    R, n, D = w_kv.shape
    ones = torch.ones(1, n, dtype=torch.float32, device=w_kv.device)

    def window_sums(x):  # [R, n, D] -> [R, D], each summed over n from the first row on
        return invariant_linear(x.float().transpose(1, 2).contiguous().view(R * D, n), ones).view(R, D)

    gate = w_gate.float()
    e = torch.exp(gate - gate.amax(dim=1, keepdim=True))  # [R, n, D]
    weights = (e / window_sums(e)[:, None, :]).to(w_kv.dtype)
    return window_sums(w_kv * weights).to(w_kv.dtype)


def _closing_tokens(pos: Tensor, m: int, B: int) -> tuple[Tensor, Tensor]:
    """``-> (tokens [K], valid [K])``: the step's tokens that close a window, first to last, in ``K = min(T,
    T // m + B)`` places (a request of ``n`` tokens closes at most ``n // m + 1``); the places past them hold
    token 0, not valid."""
    T = pos.shape[0]
    K = min(T, T // m + B)
    closes = (pos + 1).remainder(m) == 0
    place = torch.where(closes, torch.cumsum(closes.long(), 0) - 1, K)  # the ones that close none: a spare place
    tokens = torch.zeros(K + 1, dtype=torch.long, device=pos.device)
    tokens = tokens.scatter(0, place, torch.arange(T, device=pos.device))[:K]
    return tokens, torch.arange(K, device=pos.device) < closes.sum()


def compressor(spec, views, batch, req: Tensor, pos: Tensor, *, kv_in: Tensor, gate_in: Tensor, norm: Tensor,
               inv_freq: Tensor, state: str, rings: tuple[Tensor, Tensor] | None):
    """One compressor (the attention's or the CSA indexer's) over the step: ``-> (entry rows [T, D]: the entry a
    token closes, zeros where it closes none; the rings after positions ``rings = (requests [R], positions
    [R])`` as ``[R, L, 2, CD]``, or None)``."""
    c = spec.config
    m, L, ov = c.compress_ratio, c.ring_len, c.overlap
    T, D = pos.shape[0], kv_in.shape[-1] // ov
    rows = dict(kv_in=kv_in, gate_in=gate_in, state=state, L=L)
    tokens, valid = _closing_tokens(pos, m, batch.num_requests)
    kv, gate = raw_rows(views, batch, req[tokens], pos[tokens], **rows)
    pooled = _pool(kv.to(spec.dtype), gate, m, ov)  # [K, D]
    window = (pos[tokens] + 1) // m - 1
    cos, sin = rope_cos_sin(window.clamp(min=0) * m, inv_freq, spec.dtype)
    entries = rope_tail(rms_norm_fp32w(pooled, norm, c.norm_eps), cos, sin)  # [K, D]
    out = torch.zeros(T + 1, D, dtype=entries.dtype, device=pos.device)  # row T: the places past the closers
    out = out.index_copy(0, torch.where(valid, tokens, T), entries)[:T]
    if rings is None:
        return out, None
    r_req, r_pos = rings
    kv, gate = raw_rows(views, batch, r_req, r_pos, **rows)  # [R, L, CD] in position order
    held = torch.stack((kv, gate), dim=2)  # [R, L, 2, CD]
    # slot s holds position p - ((p - s) mod L), at place L - 1 - ((p - s) mod L) of the position order
    s = torch.arange(L, device=pos.device)[None, :]
    place = L - 1 - (r_pos[:, None] - s).remainder(L)  # [R, L]
    held = held.gather(1, place[:, :, None, None].expand(-1, -1, 2, held.shape[-1]))
    before_zero = (r_pos[:, None] - (r_pos[:, None] - s).remainder(L)) < 0
    return out, torch.where(before_zero[:, :, None, None], torch.zeros_like(held), held)


def max_entries(batch, m: int) -> int:
    """Entries any request of the batch's block table could hold: a bound from shapes only."""
    return batch.block_table.shape[1] * batch.page_size // m


def paged_reasons(views, batch, index_q: Tensor, m: int) -> list[str]:
    """Why `top_k` scores with its torch form here (empty: with the paged Triton indexer)."""
    from ..availability import package_missing

    reasons = package_missing("triton")
    if not index_q.is_cuda:
        reasons.append("the paged indexer kernel runs on CUDA")
    if batch.page_size % m:
        reasons.append(f"a page of {batch.page_size} tokens holds no whole number of entries of {m}")
    if views.index_k.dim() != 3:
        reasons.append(f"index_k: expected pages [P, S, Di], got {tuple(views.index_k.shape)}")
    return reasons


def _first_rows(batch, m: int) -> Tensor:
    """``[B + 1]`` the step's entry row of each request's first new entry (``cu + first * m + m - 1 - c0``),
    the last one a spare: the form of ``cu_seqlens`` `indexer_scores_paged` takes, its rows ``m`` apart."""
    c0, cu = batch.cache_lens.long(), batch.cu_seqlens.long()
    first = cu[:-1] + (c0 // m) * m + m - 1 - c0
    return torch.cat((first, cu[-1:]))


def paged_scores(views, batch, req: Tensor, pos: Tensor, index_q: Tensor, index_w: Tensor, entry_rows: Tensor,
                 ix, m: int) -> Tensor:
    """``[T, E]`` scores (``-inf``: not visible) by `fnattn.kernels.indexer_scores_paged`: an entry's key is the
    row of its closing token, every ``m``-th row of a page from row ``m - 1``, so the pages seen ``m`` rows at a
    time are pages of ``S / m`` entries under the same block table; the step's own entries are every ``m``-th
    of its entry rows (``fresh_stride``)."""
    from ...kernels.indexer import indexer_scores_paged

    return indexer_scores_paged(index_q, index_w, views.index_k[:, m - 1::m], entry_rows.to(views.index_k.dtype),
                                batch.block_table, req, batch.cache_lens.long() // m, _first_rows(batch, m),
                                (pos + 1) // m - 1, scale=ix.head_dim ** -0.5, fresh_stride=m)


def gathered_scores(views, batch, req: Tensor, pos: Tensor, index_q: Tensor, index_w: Tensor, entry_rows: Tensor,
                    ix, m: int) -> Tensor:
    """`paged_scores` in torch, over every entry's key gathered for every token (``[T, E, Di]``: for the CPU)."""
    E, S = max_entries(batch, m), batch.page_size
    j = torch.arange(E, device=pos.device)[None, :]  # [1, E]
    c = (batch.cache_lens.long() // m)[req][:, None]  # [T, 1] entries in the cache
    cached, visible = j < c, j < ((pos + 1) // m)[:, None]  # [T, E]
    closer = j * m + m - 1  # [1, E] the closing token's position
    page = batch.block_table.long()[req[:, None], (closer // S).expand(len(req), -1)]
    pool = views.index_k.reshape(-1, views.index_k.shape[-1])
    keys = pool[torch.where(cached, page * S + closer % S, 0)]  # [T, E, Di]
    fresh_row = (_first_rows(batch, m)[req][:, None] + (j - c) * m).clamp(0, entry_rows.shape[0] - 1)
    keys = torch.where(cached[..., None], keys, entry_rows[fresh_row].to(keys.dtype))
    keys = torch.where(visible[..., None], keys, torch.zeros_like(keys))  # never a null page's rows
    s = torch.relu(torch.einsum("thd,ted->the", index_q.float(), keys.float())) * ix.head_dim ** -0.5
    return (s * index_w.float()[:, :, None]).sum(dim=1).masked_fill(~visible, float("-inf"))  # [T, E]


V4_TOPK = "deepseek_v4_topk_transform_512"  # sgl_kernel's DeepSeek-V4 selection, where the build has it


def _radix_entries(scores: Tensor, visible: Tensor, tables: Tensor, entries_a_page: int, topk: int):
    """sgl_kernel's DeepSeek-V4 selection (``deepseek_v4_topk_transform_512``, top-k up to 1024) over ``scores``:
    each row's entry ids sorted latest first, -1 after them (None where it cannot serve)."""
    from ...kernels.indexer import sgl_kernel_op, sort_positions

    if topk > 1024 or entries_a_page & (entries_a_page - 1) or not sgl_kernel_op(V4_TOPK):
        return None
    T = scores.shape[0]
    lengths = visible.to(torch.int32)
    slots = torch.full((T, topk), -1, dtype=torch.int32, device=scores.device)
    raw = torch.full((T, topk), -1, dtype=torch.int32, device=scores.device)
    getattr(torch.ops.sgl_kernel, V4_TOPK)(scores, lengths, tables, slots, entries_a_page, raw)
    raw = torch.where((raw >= 0) & (raw < lengths[:, None]), raw, torch.full_like(raw, -1))
    return sort_positions(raw)


def ordered(scores: Tensor, topk: int) -> Tensor:
    """The ``topk`` best finite scores of each row, best first, -1 padded; ties to the earlier entry, however
    wide the batch's block table (`fnattn.kernels.indexer`'s own selection)."""
    return finite_topk(scores, topk)


def top_k(views, batch, req: Tensor, pos: Tensor, index_q: Tensor, index_w: Tensor, entry_rows: Tensor, ix,
          m: int) -> Tensor:
    """``[T, topk]`` entry ids each token attends (-1 padded), over the cached index keys and the step's own.

    On CUDA the scores come from the paged Triton indexer (`paged_scores`: no ``[T, E, Di]`` gather of the keys)
    and, outside the invariant mode, the selection from sgl_kernel's DeepSeek-V4 top-k, its picks sorted by entry;
    elsewhere the torch form (`gathered_scores`) and the selection that breaks ties to the earlier entry."""
    args = (views, batch, req, pos, index_q, index_w, entry_rows, ix, m)
    if paged_reasons(views, batch, index_q, m):
        return ordered(gathered_scores(*args), ix.topk)
    scores = paged_scores(*args)
    if not invariant_on():
        tables = batch.block_table.to(torch.int32)[req].contiguous()  # the kernel reads a page table a row
        picked = _radix_entries(scores, (pos + 1) // m, tables, batch.page_size // m, ix.topk)
        if picked is not None:
            return picked
    return ordered(scores, ix.topk)


def compressed_entries(spec, views, inputs, phase: str, req: Int[Tensor, " T"], pos: Int[Tensor, " T"]
                       ) -> tuple[Float[Tensor, "T D"], Int[Tensor, "T E"], Int[Tensor, "T E"] | None,
                                  dict[str, Tensor]]:
    """The step's compressors (and CSA's indexer) for ``req`` / ``pos`` ``[T]``, every token at once:
    ``-> (entry rows [T, D] (zeros but at closing tokens), the entries each token attends [T, E] (-1: none;
    HCA: every closed window it sees, CSA: the indexer's top-k), the indexer's picks or None, the writes by
    name)``."""
    c, batch, m = spec.config, inputs.meta.batch, spec.config.compress_ratio
    # the compressor states after every token (native verify), after each request's last one (prefill,
    # decode), or none (replay verify: the replay writes them)
    if phase != "verify":
        rings = (torch.arange(batch.num_requests, device=pos.device), last_positions(batch))
    else:
        rings = None if batch.recovery == "replay" else (req, pos)
    comp, comp_states = compressor(spec, views, batch, req, pos, kv_in=inputs.comp_kv, gate_in=inputs.comp_gate,
                                   norm=inputs.comp_norm, inv_freq=inputs.comp_inv_freq, state="comp_state",
                                   rings=rings)
    values = {"comp": comp, **({"comp_state": comp_states} if rings is not None else {})}
    picks = None
    if c.indexer is not None:
        index_k, index_states = compressor(spec, views, batch, req, pos, kv_in=inputs.index_kv,
                                           gate_in=inputs.index_gate, norm=inputs.index_norm,
                                           inv_freq=inputs.comp_inv_freq, state="index_state", rings=rings)
        ent = picks = top_k(views, batch, req, pos, inputs.index_q, inputs.index_w, index_k, c.indexer, m)
        values.update(index_k=index_k, **({"index_state": index_states} if rings is not None else {}))
    else:  # HCA: every entry the token sees
        j = torch.arange(max_entries(batch, m), device=pos.device)[None, :]
        ent = torch.where(j < ((pos + 1) // m)[:, None], j, torch.full_like(j, -1))
    return comp, ent, picks, values


def merge_with_sink(os: Sequence[Float[Tensor, "T H D"]], lses: Sequence[Float[Tensor, "T H"]],
                    sinks: Float[Tensor, " H"] | None) -> Float[Tensor, "T H D"]:
    """``sum_i e^lse_i o_i / (sum_i e^lse_i + e^sink)`` over the parts in their order, fp32: each token's heads
    alone (the exponentials through `pointwise`, whose rows are padded on the CPU in the invariant mode)."""
    lse = torch.stack(lses)  # [P, T, H]
    top = lse.max(dim=0).values
    if sinks is not None:
        top = torch.maximum(top, sinks.float()[None, :])
    w = pointwise(torch.exp, lse - top[None])  # [P, T, H]
    den = w[0]
    for wi in w[1:]:
        den = den + wi
    if sinks is not None:
        den = den + pointwise(torch.exp, sinks.float()[None, :] - top)
    num = w[0][..., None] * os[0]
    for wi, oi in zip(w[1:], os[1:]):
        num = num + wi[..., None] * oi
    return num / den[..., None]
