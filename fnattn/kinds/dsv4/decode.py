"""DeepSeek-V4 decode without host loops: the compressor step and the indexer's top-k for one token per request.

The reference pools windows request by request on the host; a decode step
adds one token per request, so every request can be advanced at once with
shapes fixed by the batch (``B``, the block table's width), which a captured
graph needs:

* the ring after the step is the ring with slot ``p % L`` replaced by the new
  token's raw row (slots holding positions before 0 zeroed);
* a request whose token closes a window (``(p + 1) % m == 0``) pools the
  ring's ``L`` rows in position order (CSA: first halves of the previous
  window, then second halves of this one), for every request, kept only
  where the window closes;
* cached entries are read from the rows of their closing tokens, for every
  entry a request of the batch's width could hold, masked by what is visible;
* the indexer keeps each token's top-k (ties to the earlier entry, as the
  reference), -1 padded.

Same values as the reference to rounding; the states are copies of the same
raw rows, bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...kernels.indexer import ordered_topk
from .math import rms_norm_fp32w, rope_cos_sin, rope_tail


def ring_positions(c0: Tensor, L: int) -> Tensor:
    """``[B, L]`` the position slot ``s`` of each ring holds before a step at cursor ``c0`` (< 0: none yet)."""
    s = torch.arange(L, device=c0.device)[None, :]
    return c0[:, None] - 1 - (c0[:, None] - 1 - s).remainder(L)


def compressor_step(spec, views, batch, *, kv_in: Tensor, gate_in: Tensor, norm: Tensor, inv_freq: Tensor,
                    state: str):
    """``-> (new entry [B, D] (zeros where no window closes), closes [B] bool, ring after [B, L, 2, CD])``."""
    c = spec.config
    m, L, ov = c.compress_ratio, c.ring_len, c.overlap
    c0 = batch.cache_lens.long()  # [B]
    ring = views[state].index_select(0, batch.recurrent_slots)  # [B, L, 2, CD]
    held = ring_positions(c0, L)  # [B, L]
    new = torch.stack((kv_in.float(), gate_in.float()), dim=1)  # [B, 2, CD]
    slot = c0.remainder(L)
    mine = torch.arange(L, device=c0.device)[None, :] == slot[:, None]  # [B, L] the new token's slot
    after = torch.where(mine[:, :, None, None], new[:, None], ring)
    live = (held >= 0) | mine
    after = torch.where(live[:, :, None, None], after, torch.zeros_like(after))
    # The ring in position order: c0 - L + 1 ... c0 (positions before 0: kv 0, gate -inf).
    pos = c0[:, None] - L + 1 + torch.arange(L, device=c0.device)[None, :]  # [B, L]
    rows = after.gather(1, pos.remainder(L)[:, :, None, None].expand(-1, -1, 2, after.shape[-1]))
    kv = torch.where((pos >= 0)[:, :, None], rows[:, :, 0], torch.zeros_like(rows[:, :, 0]))
    gate = torch.where((pos >= 0)[:, :, None], rows[:, :, 1], torch.full_like(rows[:, :, 1], float("-inf")))
    pooled = _pool_batched(kv.to(spec.dtype), gate, m, ov)  # [B, D]
    w = (c0 + 1) // m - 1  # the window the token closes, if it closes one
    cos, sin = rope_cos_sin(w.clamp(min=0) * m, inv_freq, spec.dtype)
    entry = rope_tail(rms_norm_fp32w(pooled, norm, c.norm_eps), cos, sin)  # [B, D]
    closes = (c0 + 1).remainder(m) == 0
    entry = torch.where(closes[:, None], entry, torch.zeros_like(entry))
    return entry, closes, after


def _pool_batched(kv: Tensor, gate: Tensor, m: int, ov: int) -> Tensor:
    """`pool_windows` of one window per request: ``kv``/``gate`` ``[B, L, CD]`` in position order."""
    D = kv.shape[-1] // ov
    if ov == 1:
        w_kv, w_gate = kv, gate
    else:
        w_kv = torch.cat((kv[:, :m, :D], kv[:, m:, D:]), dim=1)  # [B, 2m, D]
        w_gate = torch.cat((gate[:, :m, :D], gate[:, m:, D:]), dim=1)
    weights = w_gate.softmax(dim=1, dtype=torch.float32).to(w_kv.dtype)
    return (w_kv * weights).sum(dim=1)


def max_entries(batch, m: int) -> int:
    """Entries any request of the batch's block table could hold: a bound from shapes only."""
    return batch.block_table.shape[1] * batch.page_size // m


def entry_slots(batch, m: int) -> Tensor:
    """``[B, E]`` the pool slot of the closing token of entry ``j`` of each request (garbage past its pages)."""
    E, S = max_entries(batch, m), batch.page_size
    p = torch.arange(E, device=batch.block_table.device)[None, :] * m + m - 1  # [1, E]
    return batch.block_table.long().gather(1, (p // S).expand(batch.num_requests, -1)) * S + p % S


def decode_top_k(views, batch, index_q: Tensor, index_w: Tensor, new_key: Tensor, closes: Tensor, ix, m: int
                 ) -> Tensor:
    """``[B, topk]`` entry ids each token attends (-1 padded), over the cached index keys and the new one."""
    c0 = batch.cache_lens.long()
    E = max_entries(batch, m)
    j = torch.arange(E, device=c0.device)[None, :]
    cached = j < (c0 // m)[:, None]  # [B, E]
    keys = views.index_k.reshape(-1, views.index_k.shape[-1])[entry_slots(batch, m)]  # [B, E, Di]
    here = (j == (c0 // m)[:, None]) & closes[:, None]  # the entry this token closes
    keys = torch.where(here[:, :, None], new_key[:, None], keys)
    visible = cached | here
    keys = torch.where(visible[:, :, None], keys, torch.zeros_like(keys))  # never read a null page's rows
    s = torch.einsum("bhd,bed->bhe", index_q.float(), keys.float())
    s = torch.relu(s) * ix.head_dim ** -0.5
    scores = (s * index_w.float()[:, :, None]).sum(dim=1).masked_fill(~visible, float("-inf"))  # [B, E]
    k = min(ix.topk, E)
    top = ordered_topk(scores, k)  # ties to the earlier entry, however wide the batch's block table
    top = torch.where(visible.gather(1, top), top, torch.full_like(top, -1))
    if k < ix.topk:
        top = torch.nn.functional.pad(top, (0, ix.topk - k), value=-1)
    return top
