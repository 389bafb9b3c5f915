"""Decode and prefill cases for full attention."""

from __future__ import annotations

import torch

from ... import Batch, FullAttentionConfig, FullAttentionInputs, LayerSpec, ModelAttention
from ...apply import validate_step, write_step
from ...deltas import StepDeltas
from ...kinds.full.flashinfer import cache_layout
from .. import timed, timed_session
from ..setup import cached_state


def _inputs(spec, T):
    c = spec.config
    r = lambda *s: torch.randn(*s, device="cuda", dtype=spec.dtype)  # noqa: E731
    return FullAttentionInputs(q=r(T, c.num_q_heads, c.head_dim), k=r(T, c.num_kv_heads, c.head_dim),
                               v=r(T, c.num_kv_heads, c.head_dim_v))


def time_fnattn(ma, state, batch, specs, inputs, *, graph: bool) -> float:
    """The pure path: every layer's attention through a session, then the step's one apply.

    With a graph the session (and with it each backend's plan) opens outside
    the captured region, as a served decode step plans before replaying its
    graph (`timed_session`). The apply's checks and scatter are timed; the
    cursors are not moved, so every replay is the same step.
    """
    specs = [specs] if isinstance(specs, LayerSpec) else list(specs)

    def step(s):
        writes = [s.forward(spec.index, inputs)[1] for spec in specs]
        write_step(state.storage.pools, validate_step(state, StepDeltas.collect(batch, writes)))

    return timed_session(ma, state, batch, step, graph=graph)


def usual_flashinfer_decode(state, batch, specs, inputs, *, tensor_cores: bool = False):
    """The usual design, per layer: append the new K/V into the cache, then decode over it (with FlashInfer's
    tensor-core decode path when ``tensor_cores``)."""
    import flashinfer

    spec = specs[0]
    c, S = spec.config, batch.page_size
    views = [state.views(s.index) for s in specs]
    indptr, indices, last = cache_layout(batch, "cuda", extra=1)  # the new token is appended first
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_tensor_cores=tensor_cores)
    wrapper.plan(indptr, indices, last, c.num_q_heads, c.num_kv_heads, c.head_dim, S, sm_scale=c.scale,
                 q_data_type=spec.dtype, kv_data_type=spec.dtype)
    batch_idx = torch.arange(batch.num_requests, dtype=torch.int32, device="cuda")
    positions = batch.cache_lens.clone()

    def run():
        for view in views:
            flashinfer.append_paged_kv_cache(inputs.k, inputs.v, batch_idx, positions, (view.k, view.v), indices,
                                             indptr, last)
            wrapper.run(inputs.q, (view.k, view.v))

    return run


def decode_case(*, batch: int, ctx: int, hq: int, hkv: int, dim: int, page_size: int = 16, layers: int = 1,
                dtype=torch.bfloat16, graph: bool = True) -> list[dict]:
    """One decode step over ``layers`` identical layers: pure (attend, then one apply) vs usual.

    The peer is FlashInfer's usual append-then-decode at its best: both of its decode configurations
    (plain and tensor cores) are timed and listed, and every ratio is to the faster one in this case.
    """
    cfg = FullAttentionConfig(num_q_heads=hq, num_kv_heads=hkv, head_dim=dim)
    specs = [LayerSpec(index=i, config=cfg, dtype=dtype) for i in range(layers)]
    state = cached_state(specs, batch=batch, ctx=ctx, page_size=page_size)
    b = Batch.decode(state, range(batch))
    inputs = _inputs(specs[0], batch)
    case = (f"decode B{batch} ctx{ctx} {hq}q/{hkv}kv d{dim} p{page_size} L{layers}"
            + (" graph" if graph else " eager"))
    kv_bytes = layers * batch * ctx * hkv * dim * 2 * dtype.itemsize
    records = []
    peers = {f"flashinfer usual{' tc' if tc else ''} (append+decode)":
             lambda tc=tc: timed(usual_flashinfer_decode(state, b, specs, inputs, tensor_cores=tc), graph=graph)
             for tc in (False, True)}
    runs = dict(peers)
    for name in ("triton", "flashinfer"):
        ma = ModelAttention(specs, prefer=(name,), device="cuda", phases=("decode",))
        runs[f"fnattn {name} (pure)"] = lambda ma=ma: time_fnattn(ma, state, b, specs, inputs, graph=graph)
    for name, measure in runs.items():
        rec = {"case": case, "backend": name,
               "shape": {"batch": batch, "ctx": ctx, "hq": hq, "hkv": hkv, "dim": dim, "page_size": page_size,
                         "layers": layers, "dtype": str(dtype)}}
        try:
            us = measure()
            rec.update(time_us=us, tb_s=kv_bytes / (us * 1e-6) / 1e12)
        except Exception as e:  # noqa: BLE001 - one failing backend must not hide the others
            rec["error"] = f"{type(e).__name__}: {e}"
        records.append(rec)
    timed_peers = [r for r in records if r["backend"] in peers and r.get("time_us")]
    best = min(timed_peers, key=lambda r: r["time_us"])["backend"] if timed_peers else None
    for r in records:
        r["peer"] = best  # the best configuration FlashInfer offers here (None: neither ran)
        if r["backend"] in peers:
            r["peer_configurations"] = list(peers)
    return records


def prefill_case(*, tokens: int, hq: int, hkv: int, dim: int, dtype=torch.bfloat16, page_size: int = 64) -> list[dict]:
    """Causal prefill of one fresh request of ``tokens`` tokens: own Triton kernel vs torch SDPA."""
    import torch.nn.functional as F

    spec = LayerSpec(index=0, config=FullAttentionConfig(num_q_heads=hq, num_kv_heads=hkv, head_dim=dim), dtype=dtype)
    state = cached_state(spec, batch=1, ctx=0, page_size=page_size, extra=tokens)
    b = Batch.prefill(state, {0: tokens})
    inputs = _inputs(spec, tokens)
    flops = 4 * hq * dim * tokens * tokens / 2  # QK^T and PV, causal half
    case = f"prefill causal T{tokens} {hq}q/{hkv}kv d{dim}"
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (inputs.q, inputs.k, inputs.v))  # [1, H, T, D]
    runs = {
        "torch sdpa": lambda: timed(lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True,
                                                                          enable_gqa=True), graph=False),
    }
    for name in ("triton", "flashinfer"):
        ma = ModelAttention([spec], prefer=(name,), device="cuda", phases=("prefill",))
        runs[f"fnattn {name}"] = lambda ma=ma: time_fnattn(ma, state, b, spec, inputs, graph=False)
    records = []
    for name, measure in runs.items():
        rec = {"case": case, "backend": name, "peer": "torch sdpa",
               "shape": {"tokens": tokens, "hq": hq, "hkv": hkv, "dim": dim, "dtype": str(dtype)}}
        try:
            us = measure()
            rec.update(time_us=us, tflop_s=flops / (us * 1e-6) / 1e12)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"
        records.append(rec)
    return records
