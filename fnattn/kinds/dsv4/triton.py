"""DeepSeek-V4 attention on CUDA in the invariant mode (backend ``triton``): every phase, decode and verify
capturable.

A token attends two parts, each in one pass over its own rows in ascending position, wherever those rows
live (`fnattn.kernels.latent_invariant.latent_attention_invariant` with ``indices``: cached rows from the
pool, the step's own from its inputs):

* its window, positions ``t - W + 1 .. t`` of the ``kv`` rows;
* the compressed entries it sees (HCA: every closed window; CSA: the indexer's ordered top-k), as the
  positions of their closing tokens in the ``comp`` rows.

The two merge with the sink in that order (`merge_with_sink`), element by element. FlashMLA splits a token's
rows by where they live (cached or the step's own), so its bits follow how many of the step's tokens precede
it; here nothing does, and a token is the same bits in a prefill, a decode and a verify, beside any requests.
The compressors and the indexer run as FlashMLA's path runs them (`.batched`), their pooling and norm in
fixed orders while the mode is on. K = V: the kernel's value is the whole row (``kv_rank = head_dim``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ...deltas import Writes, writes
from ...kernels.invariant import invariant_on, pointwise
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ..availability import needs_cuda, needs_dtype, package_missing
from .batched import compressor, last_positions, max_entries, token_requests, top_k
from .config import DSV4Inputs, DSV4Output

NAME = "triton"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supports(spec, device) -> list[str]:
    reasons = needs_cuda(device) + package_missing("triton") + needs_dtype(spec, _DTYPES)
    if not invariant_on():
        reasons.append("serves the invariant mode, which is off (FlashMLA is faster outside it)")
    return reasons


def merge_with_sink(os: list, lses: list, sinks) -> torch.Tensor:
    """``sum_i e^lse_i o_i / (sum_i e^lse_i + e^sink)`` over the parts in their order, fp32: each token's heads
    alone (the exponentials through `pointwise`, whose rows are padded on the CPU in the mode)."""
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


def _step(spec: LayerSpec, views: Views, inputs: DSV4Inputs, phase: str) -> tuple[DSV4Output, Writes]:
    from ...kernels.latent_invariant import ascending_picks, latent_attention_invariant

    c, batch = spec.config, inputs.meta.batch
    device, W, m = inputs.q.device, c.sliding_window, c.compress_ratio
    req = token_requests(batch)  # [T] from the device's cu_seqlens: no host read
    pos = batch.positions.long()

    def attend(cache, new, positions):  # positions [T, K]: any order, -1 none
        return latent_attention_invariant(inputs.q, cache, new, batch.block_table, batch.cache_lens,
                                          batch.positions, req, kv_rank=c.head_dim, scale=c.scale,
                                          indices=ascending_picks(positions))

    window = pos[:, None] - torch.arange(W, device=device)[None, :]  # [T, W]: t, t - 1, ..., t - W + 1
    os, lses = [], []
    o, lse = attend(views.kv, inputs.kv, torch.where(window >= 0, window, torch.full_like(window, -1)))
    os.append(o)
    lses.append(lse)
    values, picks = {"kv": inputs.kv}, None
    if m:
        # the compressor states after every token (native verify), after each request's last one (prefill,
        # decode), or none (replay verify: the replay writes them)
        if phase != "verify":
            rings = (torch.arange(batch.num_requests, device=device), last_positions(batch))
        else:
            rings = None if batch.recovery == "replay" else (req, pos)
        comp, comp_states = compressor(spec, views, batch, req, pos, kv_in=inputs.comp_kv, gate_in=inputs.comp_gate,
                                       norm=inputs.comp_norm, inv_freq=inputs.comp_inv_freq, state="comp_state",
                                       rings=rings)
        values.update(comp=comp, **({"comp_state": comp_states} if rings is not None else {}))
        if c.indexer is not None:
            index_k, index_states = compressor(spec, views, batch, req, pos, kv_in=inputs.index_kv,
                                               gate_in=inputs.index_gate, norm=inputs.index_norm,
                                               inv_freq=inputs.comp_inv_freq, state="index_state", rings=rings)
            ent = picks = top_k(views, batch, req, pos, inputs.index_q, inputs.index_w, index_k, c.indexer, m)
            values.update(index_k=index_k, **({"index_state": index_states} if rings is not None else {}))
        else:  # HCA: every entry the token sees
            j = torch.arange(max_entries(batch, m), device=device)[None, :]
            ent = torch.where(j < ((pos + 1) // m)[:, None], j, torch.full_like(j, -1))
        o, lse = attend(views.comp, comp, torch.where(ent >= 0, ent * m + m - 1, torch.full_like(ent, -1)))
        os.append(o)
        lses.append(lse)
    out = DSV4Output(o=merge_with_sink(os, lses, inputs.sinks).to(spec.dtype), topk_indices=picks)
    if phase == "verify" and m:
        out = replace(out, replay=replace(inputs, meta=None))
    return out, writes(**values)


@register("dsv4", "prefill", NAME, supports=supports, invariant=True)
def prefill(spec: LayerSpec, views: Views, inputs: DSV4Inputs) -> tuple[DSV4Output, Writes]:
    return _step(spec, views, inputs, "prefill")


@register("dsv4", "decode", NAME, supports=supports, capturable=True, invariant=True)
def decode(spec: LayerSpec, views: Views, inputs: DSV4Inputs) -> tuple[DSV4Output, Writes]:
    return _step(spec, views, inputs, "decode")


@register("dsv4", "verify", NAME, supports=supports, capturable=True, invariant=True)
def verify(spec: LayerSpec, views: Views, inputs: DSV4Inputs) -> tuple[DSV4Output, Writes]:
    return _step(spec, views, inputs, "verify")
