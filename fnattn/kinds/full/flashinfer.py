"""FlashInfer backends for full / GQA attention (flashinfer-python 0.6.18).

FlashInfer attends over the paged cache; the step's own tokens are attended
separately and the two parts are merged by log-sum-exp, so nothing is written
during the step. Wrappers live in the workspace and are planned once per group
per step. FlashInfer reports LSE in base 2; outputs here use the natural log.
"""

from __future__ import annotations

import importlib.util
import math

import torch

from ...deltas import Writes, writes
from ...outputs import AttentionOutput
from ...registry import register
from ...spec import LayerSpec
from ...state import Views
from ..availability import needs_cuda, needs_dtype, package_missing
from .config import FullAttentionInputs

LN2 = math.log(2.0)
_WORKSPACE_BYTES = 128 * 1024 * 1024


def supports(spec, device) -> list[str]:
    c = spec.config
    reasons = needs_cuda(device) + package_missing("flashinfer") + needs_dtype(spec)
    if c.head_dim not in (64, 128, 256):
        reasons.append(f"head_dim={c.head_dim} not in (64, 128, 256)")
    if c.head_dim_v != c.head_dim:
        reasons.append("head_dim_v != head_dim")
    if c.sinks:
        reasons.append("sinks are not wired to FlashInfer here")
    if c.sliding_window:
        reasons.append("a sliding window over a cached prefix needs absolute positions")
    return reasons


def cache_layout(batch, device, *, extra: int = 0, host: bool = False):
    """FlashInfer's indptr [B+1], indices [pages], last_page_len [B] over each request's
    cached tokens plus ``extra`` more (1: the usual append-then-decode layout). ``host``: on the host
    (pinned where ``device`` is CUDA), which a FlashInfer plan takes without reading a device tensor back
    (it copies them to its own buffers with non-blocking copies)."""
    S = batch.page_size
    indptr, indices, last = [0], [], []
    for pages, cached in zip(batch.host_pages, batch.host_cache_lens):
        n = cached + extra
        used = -(-n // S)
        indices.extend(pages[:used])
        indptr.append(len(indices))
        last.append(n - (used - 1) * S if used else 0)
    if host:
        pin = torch.device(device).type == "cuda"
        t = lambda x: torch.tensor(x, dtype=torch.int32, pin_memory=pin)  # noqa: E731
    else:
        t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return t(indptr), t(indices), t(last)


def _wrapper(lease, key, cls, *args):
    import flashinfer

    def build():
        buf = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=lease.workspace.device)
        return getattr(flashinfer, cls)(buf, *args)

    return lease.cached(key, build)


def use_tensor_cores(config, num_requests: int) -> bool:
    """Whether FlashInfer's decode should run its tensor-core (prefill-kernel) path for this step.

    Measured on the H200 (FlashInfer 0.6.18, ctx 4k, 32q/8kv d128, page 16, graph): at batch 64 the
    tensor-core path takes 257 us against 383 us without; at batch 1 the plain decode kernel is the
    faster one (18.2 us). Tensor cores pay once a step holds enough query rows per K/V head to fill
    an MMA tile: from batch 8 up with at least 4 query heads per K/V head.
    """
    return num_requests >= 8 and config.group_size >= 4


def plan_decode(specs, batch, lease):
    spec = specs[0]
    c, device = spec.config, lease.workspace.device
    tc = use_tensor_cores(c, batch.num_requests)
    w = _wrapper(lease, ("fi_decode", spec.config, spec.dtype, tc), "BatchDecodeWithPagedKVCacheWrapper", "NHD",
                 False, tc)  # (kv_layout, use_cuda_graph, use_tensor_cores)
    indptr, indices, last = cache_layout(batch, device, host=True)
    w.plan(indptr, indices, last, c.num_q_heads, c.num_kv_heads, c.head_dim, batch.page_size,
           logits_soft_cap=c.softcap or None, sm_scale=c.scale, q_data_type=spec.dtype, kv_data_type=spec.dtype)
    return {"decode": w}


def plan_varlen(specs, batch, lease):
    spec = specs[0]
    c, device = spec.config, lease.workspace.device
    ragged = _wrapper(lease, ("fi_ragged", spec.config, spec.dtype), "BatchPrefillWithRaggedKVCacheWrapper", "NHD")
    # the lengths from the host: a plan given device tensors reads them back (the host waits for the device)
    cu = torch.tensor(batch.host_cu_seqlens, dtype=torch.int32, pin_memory=device.type == "cuda")
    ragged.plan(cu, cu, c.num_q_heads, c.num_kv_heads, c.head_dim, causal=True,
                logits_soft_cap=c.softcap or None, sm_scale=c.scale, q_data_type=spec.dtype, kv_data_type=spec.dtype)
    plan = {"ragged": ragged}
    if batch.has_prefix:
        paged = _wrapper(lease, ("fi_paged", spec.config, spec.dtype), "BatchPrefillWithPagedKVCacheWrapper", "NHD")
        indptr, indices, last = cache_layout(batch, device, host=True)
        paged.plan(cu, indptr, indices, last, c.num_q_heads, c.num_kv_heads, c.head_dim,
                   batch.page_size, causal=False, logits_soft_cap=c.softcap or None, sm_scale=c.scale,
                   q_data_type=spec.dtype, kv_data_type=spec.dtype)
        plan["paged"] = paged
    return plan


def _self_token(spec, q, k, v):
    """Each decode token attends to itself alone: o = v, lse = its own score (base 2)."""
    c = spec.config
    g = c.group_size
    s = torch.einsum("bhd,bhd->bh", q.float(), k.float().repeat_interleave(g, dim=1)) * c.scale
    if c.softcap:
        s = c.softcap * torch.tanh(s / c.softcap)
    return v.repeat_interleave(g, dim=1), s / LN2


def _merge(o1, lse1, o2, lse2):
    import flashinfer

    return flashinfer.merge_state(o1, lse1, o2, lse2)


def _decode(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    plan = inputs.meta.plan
    o_c, lse_c = plan["decode"].run(inputs.q, (views.k, views.v), return_lse=True)
    c = spec.config
    if importlib.util.find_spec("triton") is not None:
        from ...kernels import merge_new_token

        # The step's own token and the merge in one launch instead of four small ones.
        o, lse = merge_new_token(o_c, lse_c, inputs.q, inputs.k, inputs.v, scale=c.scale, softcap=c.softcap,
                                 lse_base2=True)
    else:
        o_n, lse_n = _self_token(spec, inputs.q, inputs.k, inputs.v)
        o, lse = _merge(o_c, lse_c, o_n, lse_n)
        lse = lse * LN2
    return (AttentionOutput(o=o, lse=lse),
            writes(k=inputs.k, v=inputs.v))


def _varlen(spec: LayerSpec, views: Views, inputs: FullAttentionInputs) -> tuple[AttentionOutput, Writes]:
    plan = inputs.meta.plan
    o, lse = plan["ragged"].run(inputs.q, inputs.k, inputs.v, return_lse=True)
    if "paged" in plan:
        o_c, lse_c = plan["paged"].run(inputs.q, (views.k, views.v), return_lse=True)
        o, lse = _merge(o_c, lse_c, o, lse)
    return (AttentionOutput(o=o, lse=lse * LN2),
            writes(k=inputs.k, v=inputs.v))


_decode = register("full", "decode", "flashinfer", supports=supports, plan=plan_decode)(_decode)
register("full", "prefill", "flashinfer", supports=supports, plan=plan_varlen)(_varlen)
_varlen = register("full", "verify", "flashinfer", supports=supports, plan=plan_varlen)(_varlen)
