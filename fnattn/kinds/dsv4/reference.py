"""Reference DeepSeek-V4 attention over paged caches, one backend per phase.

For each request (looping on the host) the backend

1. lays out the compressor's raw rows for the positions it needs: the ring of
   the request's compressor state (``comp_state`` / ``index_state``) for the
   positions before this step, then this step's rows;
2. pools every window a new token closes (norm, rope at the window's first
   position) into a compressed entry, and the indexer's entry for CSA;
3. attends each new token over its window of K=V rows (cached, then new,
   causal) and over the compressed entries it may see: every closed window
   for HCA, the indexer's top-k of them for CSA, with per-head sinks;
4. writes the new K=V rows, the new entries in the rows of the tokens that
   close them (zeros elsewhere), and the compressor state after the step
   (prefill, decode) or after every token (verify, native recovery). A
   replay-mode verify writes no state: `fnattn.speculative.replay_writes`
   re-runs the accepted tokens, whose state rows are bit-for-bit the same
   copies of their raw rows.

Every result is a function of positions only, so a chunked prefill, a
prefill and a run of decodes all give the same entries.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ...deltas import Writes, writes
from ...kernels.indexer import ordered_topk
from ...kernels.invariant import invariant_on
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ..full.reference import cached_tokens
from .config import DSV4Inputs, DSV4Output
from .math import (
    attend_sinks,
    attend_sinks_fixed_order,
    indexer_scores,
    pool_windows,
    rms_norm_fp32w,
    rope_cos_sin,
    rope_tail,
)


@dataclass(frozen=True)
class _Branch:
    """One compressor (the attention's, or the CSA indexer's) of one request."""

    entries: Tensor  # [E, D] every entry visible to the request's last new token (cached, then new)
    new_rows: Tensor  # [n, D] this step's token rows of the entries' storage (zeros but at closing tokens)
    states: Tensor  # [n, L, 2, cD] the compressor state after each new token


def _history(ring: Tensor | None, new_kv: Tensor, new_gate: Tensor, c0: int, L: int) -> tuple[Tensor, Tensor]:
    """Raw ``(kv, gate)`` rows of positions ``c0 - L ... c0 + n - 1``: the ring, then this step's rows.

    Positions before 0 (and everything before a fresh request) are kv 0 and
    gate -inf, which the softmax of a window gives weight 0.
    """
    CD = new_kv.shape[-1]
    pos = torch.arange(c0 - L, c0, device=new_kv.device)
    kv = torch.zeros(L, CD, dtype=torch.float32, device=new_kv.device)
    gate = torch.full((L, CD), float("-inf"), dtype=torch.float32, device=new_kv.device)
    if ring is not None:
        old = ring.index_select(0, pos.remainder(L))  # [L, 2, CD] in position order
        live = (pos >= 0)[:, None]
        kv = torch.where(live, old[:, 0], kv)
        gate = torch.where(live, old[:, 1], gate)
    return torch.cat((kv, new_kv.float())), torch.cat((gate, new_gate.float()))


def _ring_after(kv: Tensor, gate: Tensor, c0: int, L: int, upto: int) -> Tensor:
    """The ring after the step's first ``upto`` tokens: ``[L, 2, CD]``, slot ``p % L`` holds position ``p``."""
    end = L + upto  # rows of positions c0 + upto - L ... c0 + upto - 1 in the history
    q0 = c0 + upto - L
    order = (torch.arange(L, device=kv.device) - q0).remainder(L)  # slot s <- history row q0 + ((s - q0) % L)
    rows = torch.stack((kv[end - L:end], gate[end - L:end]), dim=1)  # [L, 2, CD]
    pos = torch.arange(q0, q0 + L, device=kv.device)
    rows = torch.where((pos >= 0)[:, None, None], rows, torch.zeros_like(rows))  # no -inf kept in the state
    return rows.index_select(0, order)


def _branch(spec: LayerSpec, views: Views, batch, b: int, rows: slice, *, kv_in: Tensor, gate_in: Tensor,
            norm: Tensor, inv_freq: Tensor, store: str, state: str, per_token_states: bool) -> _Branch:
    c = spec.config
    m, L, ov = c.compress_ratio, c.ring_len, c.overlap
    c0, n = batch.host_cache_lens[b], batch.host_new_lens[b]
    ring = None
    if c0:
        ring = views[state].index_select(0, batch.recurrent_slots[b:b + 1])[0]  # [L, 2, CD]
    kv, gate = _history(ring, kv_in[rows], gate_in[rows], c0, L)  # [L + n, CD]
    first, last = c0 // m, (c0 + n) // m  # windows closed before the step / by its end
    D = kv_in.shape[-1] // ov
    out_rows = torch.zeros(n, D, dtype=spec.dtype, device=kv_in.device)
    new = out_rows[:0]
    if last > first:
        start = (first - ov + 1) * m - (c0 - L)  # history row of the first position the pooling reads
        pooled = pool_windows(kv[start:].to(spec.dtype), gate[start:], ratio=m, overlap=ov, first=first,
                              count=last - first)  # [k, D]
        pos = torch.arange(first, last, device=kv_in.device) * m
        cos, sin = rope_cos_sin(pos, inv_freq, spec.dtype)
        new = rope_tail(rms_norm_fp32w(pooled, norm, c.norm_eps), cos, sin)  # [k, D]
        closing = torch.arange(first, last, device=kv_in.device) * m + m - 1 - c0  # rows of the closing tokens
        out_rows = out_rows.index_copy(0, closing, new)
    entries = new
    if first:
        cached = cached_tokens(views[store], batch.block_table[b], first * m, batch.page_size)[m - 1::m]
        entries = torch.cat((cached, new))
    counts = range(1, n + 1) if per_token_states else (n,)
    states = torch.stack([_ring_after(kv, gate, c0, L, k) for k in counts])
    return _Branch(entries, out_rows, states)


def _window_keys(views: Views, inputs: DSV4Inputs, batch, b: int, rows: slice, W: int) -> tuple[Tensor, int]:
    """K=V rows of positions ``lo ... c0 + n - 1`` (``lo`` the first any new token's window reaches)."""
    c0 = batch.host_cache_lens[b]
    lo = max(0, c0 - W + 1)
    new = inputs.kv[rows]
    if c0 == 0:
        return new, 0
    cached = cached_tokens(views.kv, batch.block_table[b], c0, batch.page_size)[lo:]
    return torch.cat((cached, new)), lo


def run(spec: LayerSpec, views: Views, inputs: DSV4Inputs, *, per_token_states: bool, attend=attend_sinks):
    """Every request of the step: ``-> (output, writes by name)``; ``attend``: the attention over the keys and
    mask built here (`attend_sinks`'s contract; the CPU backend passes torch's fused kernel), in the invariant
    mode `attend_sinks_fixed_order` whoever passes what."""
    c = spec.config
    batch = inputs.meta.batch
    cu, m, W = batch.host_cu_seqlens, c.compress_ratio, c.sliding_window
    if invariant_on():
        attend = attend_sinks_fixed_order
    device = inputs.q.device
    outs, picks = [], []
    comp_rows, comp_states, index_rows, index_states = [], [], [], []
    for b in range(batch.num_requests):
        rows = slice(cu[b], cu[b + 1])
        c0, n = batch.host_cache_lens[b], batch.host_new_lens[b]
        q_pos = torch.arange(c0, c0 + n, device=device)  # host positions: the batch's, without a read-back
        keys, lo = _window_keys(views, inputs, batch, b, rows, W)
        k_pos = torch.arange(lo, c0 + n, device=device)
        dist = q_pos[:, None] - k_pos[None, :]
        bias = torch.zeros(n, keys.shape[0], dtype=torch.float32, device=device)
        bias = bias.masked_fill((dist < 0) | (dist >= W), float("-inf"))  # [n, Kw]
        if m:
            comp = _branch(spec, views, batch, b, rows, kv_in=inputs.comp_kv, gate_in=inputs.comp_gate,
                           norm=inputs.comp_norm, inv_freq=inputs.comp_inv_freq, store="comp", state="comp_state",
                           per_token_states=per_token_states)
            comp_rows.append(comp.new_rows)
            comp_states.append(comp.states)
            E = comp.entries.shape[0]
            visible = torch.arange(E, device=device)[None, :] < ((q_pos + 1) // m)[:, None]  # [n, E]
            if c.indexer is not None:
                ix = _branch(spec, views, batch, b, rows, kv_in=inputs.index_kv, gate_in=inputs.index_gate,
                             norm=inputs.index_norm, inv_freq=inputs.comp_inv_freq, store="index_k",
                             state="index_state", per_token_states=per_token_states)
                index_rows.append(ix.new_rows)
                index_states.append(ix.states)
                chosen = _top_k(inputs, rows, ix.entries, visible, c.indexer)  # [n, topk], -1 padded
                picks.append(chosen)
                # The chosen entries only; -1 picks land in a spare column that is dropped.
                hit = torch.where(chosen >= 0, chosen, torch.full_like(chosen, E))
                visible = torch.zeros(n, E + 1, dtype=torch.bool, device=device).scatter(1, hit, True)[:, :E]
            cbias = torch.zeros(n, E, dtype=torch.float32, device=device).masked_fill(~visible, float("-inf"))
            keys, bias = torch.cat((keys, comp.entries)), torch.cat((bias, cbias), dim=1)
        outs.append(attend(inputs.q[rows], keys, bias, inputs.sinks, scale=c.scale))
    out = DSV4Output(o=torch.cat(outs), topk_indices=torch.cat(picks) if picks else None)
    values = {"kv": inputs.kv}
    if m:
        values.update(comp=torch.cat(comp_rows), comp_state=torch.cat(comp_states))
    if c.indexer is not None:
        values.update(index_k=torch.cat(index_rows), index_state=torch.cat(index_states))
    return out, values


def _top_k(inputs: DSV4Inputs, rows: slice, entries: Tensor, visible: Tensor, ix) -> Tensor:
    """The indexer's ``ix.topk`` best visible entries of each token (``[n, topk]`` int64, -1 padded)."""
    n = visible.shape[0]
    chosen = torch.full((n, ix.topk), -1, dtype=torch.long, device=visible.device)
    if not entries.shape[0]:
        return chosen
    scores = indexer_scores(inputs.index_q[rows], inputs.index_w[rows], entries, scale=ix.head_dim ** -0.5)
    scores = scores.masked_fill(~visible, float("-inf"))  # [n, E]
    k = min(ix.topk, entries.shape[0])
    # Ties (ReLU scores are often exactly 0) go to the earlier entry whatever the number of entries, so a
    # token picks the same entries in a decode, a verify or a prefill, and whatever follows it in its prompt.
    top = ordered_topk(scores, k)
    top = torch.where(visible.gather(1, top), top, torch.full_like(top, -1))
    return chosen.index_copy(1, torch.arange(k, device=top.device), top)


def _writes(spec: LayerSpec, values: dict, *, states: bool) -> Writes:
    keep = {n: v for n, v in values.items() if states or spec.config.compress_ratio == 0
            or n not in ("comp_state", "index_state")}
    return writes(**keep)


@register("dsv4", "prefill", "reference", invariant=True)
def prefill(spec: LayerSpec, views: Views, inputs: DSV4Inputs) -> tuple[DSV4Output, Writes]:
    out, values = run(spec, views, inputs, per_token_states=False)
    return out, _writes(spec, values, states=True)


@register("dsv4", "decode", "reference", invariant=True)
def decode(spec: LayerSpec, views: Views, inputs: DSV4Inputs) -> tuple[DSV4Output, Writes]:
    out, values = run(spec, views, inputs, per_token_states=False)
    return out, _writes(spec, values, states=True)


@register("dsv4", "verify", "reference", invariant=True)
def verify(spec: LayerSpec, views: Views, inputs: DSV4Inputs) -> tuple[DSV4Output, Writes]:
    """Verify: the compressor state after every token (native), or none and the inputs to replay them."""
    replay_mode = inputs.meta.batch.recovery == "replay"
    out, values = run(spec, views, inputs, per_token_states=not replay_mode)
    if spec.config.compress_ratio:
        out = replace(out, replay=replace(inputs, meta=None))
    return out, _writes(spec, values, states=not replay_mode)
