"""Decode and prefill cases for full attention."""

from __future__ import annotations

import itertools

import torch

from .. import Batch, CursorAdvance, FullAttentionConfig, FullAttentionInputs, LayerSpec, ModelAttention, State
from ..apply import validate_step, write_step
from ..backends.flashinfer_full import cache_layout
from ..deltas import StepDeltas
from . import timed

_setup_steps = itertools.count(-1, -1)  # negative ids: setup steps never collide with real ones


def cached_state(specs, *, batch: int, ctx: int, page_size: int, extra: int = 1, recurrent_ring: int = 2):
    """``batch`` requests with ``ctx`` random cached tokens each, room for ``extra`` more."""
    specs = [specs] if isinstance(specs, LayerSpec) else list(specs)
    pages = batch * (-(-(ctx + extra) // page_size))
    state = State(specs, num_pages=pages, page_size=page_size, max_requests=batch, device="cuda",
                  recurrent_ring=recurrent_ring)
    for r in range(batch):
        state = state.admit(r)
    state = state.reserve({r: ctx + extra for r in range(batch)})
    # Only the cursor moves; the cache is filled below, directly (benchmark setup).
    state = state.apply(StepDeltas(step_id=next(_setup_steps), state_version=state.version, writes=(),
                                   cursor=CursorAdvance(tuple(range(batch)), (ctx,) * batch)))
    gen = torch.Generator(device="cuda").manual_seed(0)  # independent of any graph capture
    for pool in state.pools.values():
        for t in pool.tensors.values():
            t.normal_(generator=gen)
    return state


def _inputs(spec, T):
    c = spec.config
    r = lambda *s: torch.randn(*s, device="cuda", dtype=spec.dtype)  # noqa: E731
    return FullAttentionInputs(q=r(T, c.num_q_heads, c.head_dim), k=r(T, c.num_kv_heads, c.head_dim),
                               v=r(T, c.num_kv_heads, c.head_dim_v))


def time_fnattn(ma, state, batch, specs, inputs, *, graph: bool) -> float:
    """The pure path: every layer's attention through a session, then the step's one apply.

    The session (and with it each backend's plan) opens outside the timed
    region, as a served decode step plans before replaying its graph.
    """
    specs = [specs] if isinstance(specs, LayerSpec) else list(specs)
    with ma.session(state, batch) as s:

        def run():
            writes = []
            for spec in specs:
                writes += s.forward(spec.index, inputs)[1]
            step = StepDeltas(batch.step_id, batch.state_version, tuple(writes))
            write_step(state._storage.pools, validate_step(state, step))

        return timed(run, graph=graph)


def usual_flashinfer_decode(state, batch, specs, inputs):
    """The usual design, per layer: append the new K/V into the cache, then decode over it."""
    import flashinfer

    spec = specs[0]
    c, S = spec.config, batch.page_size
    views = [state.views(s.index) for s in specs]
    indptr, indices, last = cache_layout(batch, "cuda", extra=1)  # the new token is appended first
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD")
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
    """One decode step over ``layers`` identical layers: pure (attend, then one apply) vs usual."""
    cfg = FullAttentionConfig(num_q_heads=hq, num_kv_heads=hkv, head_dim=dim)
    specs = [LayerSpec(index=i, config=cfg, dtype=dtype) for i in range(layers)]
    state = cached_state(specs, batch=batch, ctx=ctx, page_size=page_size)
    b = Batch.decode(state, range(batch))
    inputs = _inputs(specs[0], batch)
    case = (f"decode B{batch} ctx{ctx} {hq}q/{hkv}kv d{dim} p{page_size} L{layers}"
            + (" graph" if graph else " eager"))
    kv_bytes = layers * batch * ctx * hkv * dim * 2 * dtype.itemsize
    records = []
    runs = {"flashinfer usual (append+decode)":
            lambda: timed(usual_flashinfer_decode(state, b, specs, inputs), graph=graph)}
    for name in ("triton", "flashinfer"):
        ma = ModelAttention(specs, prefer=(name,), device="cuda", phases=("decode",))
        runs[f"fnattn {name} (pure)"] = lambda ma=ma: time_fnattn(ma, state, b, specs, inputs, graph=graph)
    for name, measure in runs.items():
        rec = {"case": case, "backend": name, "peer": "flashinfer usual (append+decode)",
               "shape": {"batch": batch, "ctx": ctx, "hq": hq, "hkv": hkv, "dim": dim, "page_size": page_size,
                         "layers": layers, "dtype": str(dtype)}}
        try:
            us = measure()
            rec.update(time_us=us, tb_s=kv_bytes / (us * 1e-6) / 1e12)
        except Exception as e:  # noqa: BLE001 - one failing backend must not hide the others
            rec["error"] = f"{type(e).__name__}: {e}"
        records.append(rec)
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
