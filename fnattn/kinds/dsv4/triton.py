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
from ...kernels.invariant import invariant_on
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ..availability import needs_cuda, needs_dtype, package_missing
from .batched import compressed_entries, merge_with_sink, token_requests
from .config import DSV4Inputs, DSV4Output

NAME = "triton"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supports(spec, device) -> list[str]:
    reasons = needs_cuda(device) + package_missing("triton") + needs_dtype(spec, _DTYPES)
    if not invariant_on():
        reasons.append("serves the invariant mode, which is off (FlashMLA is faster outside it)")
    return reasons


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
    parts = [attend(views.kv, inputs.kv, torch.where(window >= 0, window, torch.full_like(window, -1)))]
    values, picks = {"kv": inputs.kv}, None
    if m:
        comp, ent, picks, compressed = compressed_entries(spec, views, inputs, phase, req, pos)
        values.update(compressed)
        parts.append(attend(views.comp, comp, torch.where(ent >= 0, ent * m + m - 1, torch.full_like(ent, -1))))
    os, lses = zip(*parts)  # (o [T, H, D], lse [T, H]) of each part
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
