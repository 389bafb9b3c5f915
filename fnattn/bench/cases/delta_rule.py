"""GDN / KDA cases: the fnattn backends through a session next to fla-core on the same inputs.

fnattn's time covers the whole backend (causal conv, q/k/v split, l2 norm,
recurrence); fla-core's covers its kernel on q/k/v taken from the same conv
output. The "fnattn fla" rows run fla-core's kernel inside the fnattn backend,
so the gap between them and the fla-core rows is the conv and the plumbing. Tile sweeps and the fast-path
switches' other sides are timed outside the package (``benchmarks/gdn_decode_sweep.py``,
``benchmarks/switch_ab.py gdn-prefill``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import Batch, GDNConfig, KDAConfig, LayerSpec, ModelAttention
from ...apply import validate_step, write_step
from ...deltas import StepDeltas
from ...kinds.delta_rule.config import RecurrentInputs
from .. import timed, timed_session
from ..setup import cached_state

DEVICE = "cuda"


def recurrent_cases(case: str) -> list[dict]:
    """Records of the bench CLI cases "gdn-prefill", "gdn-decode", "kda-prefill" ("standard": all three).

    "gdn-decode" times the ``triton`` and the opt-in ``triton_fused`` backends next to fla-core, and
    the decode kernels alone (two launches against `kernels.gated_delta_decode_fused`), also at
    Qwen3.5-0.8B's 16qk/16v and at batch 1."""
    records = []
    if case in ("gdn-prefill", "standard"):
        for requests, length in ((16, 4096), (1, 65536)):
            records += prefill_case("gdn", requests=requests, length=length, hk=16, hv=32, dim=128)
    if case in ("gdn-decode", "standard"):
        for batch in (64, 256):
            records += decode_case(batch=batch, hk=16, hv=32, dim=128)
        for hk, hv in ((16, 32), (16, 16)):
            for batch in (1, 64, 256):
                records += decode_kernels_case(batch=batch, hk=hk, hv=hv, dim=128)
    if case in ("kda-prefill", "standard"):
        for requests, length in ((1, 16384), (4, 4096)):
            records += prefill_case("kda", requests=requests, length=length, hk=32, hv=32, dim=128)
    return records


def recurrent_spec(kind: str, *, hk: int, hv: int, dim: int, dtype) -> LayerSpec:
    if kind == "gdn":
        cfg = GDNConfig(num_k_heads=hk, num_v_heads=hv, head_k_dim=dim, head_v_dim=dim)
    else:
        cfg = KDAConfig(num_heads=hv, head_k_dim=dim, head_v_dim=dim)
    return LayerSpec(index=0, config=cfg, dtype=dtype)


def recurrent_inputs(spec: LayerSpec, T: int) -> RecurrentInputs:
    """Conv input and gates shaped like a model's projections (log decays near 0, beta in (0, 1))."""
    c = spec.config
    H = c.num_state_heads
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)  # noqa: E731
    return RecurrentInputs(x=r(T, c.conv_dim).to(spec.dtype),
                           conv_weight=(0.5 * r(c.conv_dim, c.conv_kernel)).to(spec.dtype),
                           g=F.logsigmoid(r(*c.gate_shape(T)) + 3.0), beta=torch.sigmoid(r(T, H)).to(spec.dtype))


def _peer_qkv(spec, state, batch, inputs):
    """q, k [T, Hk, K] and v [T, H, V] (contiguous) from the same conv the backend runs."""
    from ...kernels import causal_conv1d

    c = spec.config
    hk = c.num_qk_heads
    slots = batch.recurrent_slots.masked_fill(batch.cache_lens == 0, -1)
    mixed, _ = causal_conv1d(inputs.x, inputs.conv_weight, None, state.views(0).conv, slots, batch.cu_seqlens)
    qk = hk * c.head_k_dim
    q, k, v = mixed.split([qk, qk, mixed.shape[1] - 2 * qk], dim=1)
    return (q.unflatten(1, (hk, -1)).contiguous(), k.unflatten(1, (hk, -1)).contiguous(),
            v.unflatten(1, (-1, c.head_v_dim)).contiguous())


def session_time(name, spec, state, batch, inputs, *, graph: bool, apply: bool = False) -> float:
    """One layer through backend ``name``; with a graph its session (and plan) opens outside the
    captured region (`timed_session`). ``apply``: the step's apply checks and writes are timed too."""
    ma = ModelAttention([spec], prefer=(name,), device=DEVICE, phases=(batch.phase,))

    def step(s):
        _, writes = s.forward(spec.index, inputs)
        if apply:
            write_step(state.storage.pools, validate_step(state, StepDeltas.collect(batch, [writes])))

    return timed_session(ma, state, batch, step, graph=graph)


def measure_runs(case: str, peer: str, shape: dict, runs: dict, rate) -> list[dict]:
    """Time every run; ``rate(us) -> {"tb_s" or "mtok_s": value}``. One failure never hides the others."""
    records = []
    for name, measure in runs.items():
        rec = {"case": case, "backend": name, "peer": peer, "shape": shape}
        try:
            us = measure()
            rec.update(time_us=us, **rate(us))
        except Exception as e:  # noqa: BLE001 - one failing backend must not hide the others
            rec["error"] = f"{type(e).__name__}: {e}"
        records.append(rec)
        torch.cuda.empty_cache()
    return records


def failed_records(case: str, peer: str, shape: dict, names, e: Exception) -> list[dict]:
    err = f"setup {type(e).__name__}: {e}"
    return [{"case": case, "backend": n, "peer": peer, "shape": shape, "error": err} for n in names]


def prefill_case(kind: str, *, requests: int, length: int, hk: int, hv: int, dim: int,
                 dtype=torch.bfloat16) -> list[dict]:
    """Chunked prefill of ``requests`` fresh requests of ``length`` tokens (eager: prefill is not replayed)."""
    T = requests * length
    peer = "fla-core " + ("chunk_gated_delta_rule" if kind == "gdn" else "chunk_kda")
    heads = f"{hk}qk/{hv}v" if kind == "gdn" else f"{hv}h"
    case = f"{kind} prefill {requests}x{length} (T={T}) {heads} d{dim}"
    shape = {"requests": requests, "length": length, "tokens": T, "hk": hk, "hv": hv, "dim": dim, "dtype": str(dtype)}
    names = ("fnattn triton", "fnattn fla", peer, "fla-core conv + " + peer[len("fla-core "):])
    try:
        spec = recurrent_spec(kind, hk=hk, hv=hv, dim=dim, dtype=dtype)
        state = cached_state(spec, batch=requests, ctx=0, page_size=length, extra=length)
        batch = Batch.prefill(state, {r: length for r in range(requests)})
        inputs = recurrent_inputs(spec, T)
    except Exception as e:  # noqa: BLE001 - a case that cannot be set up still leaves its records
        return failed_records(case, peer, shape, names, e)

    def fla_peer():
        if kind == "gdn":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as op
        else:
            from fla.ops.kda import chunk_kda as op
        q, k, v = _peer_qkv(spec, state, batch, inputs)
        args = (q[None], k[None], v[None], inputs.g[None], inputs.beta[None])
        cu, cu_cpu = batch.cu_seqlens.long(), torch.tensor(batch.host_cu_seqlens, dtype=torch.long)
        return timed(lambda: op(*args, scale=spec.config.scale, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                cu_seqlens=cu, cu_seqlens_cpu=cu_cpu), graph=False)

    def fla_layer_peer():
        """fla-core's own causal conv in front of the chunk kernel: the same work as a backend call."""
        from fla.modules.causal_conv1d import causal_conv1d

        if kind == "gdn":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as op
        else:
            from fla.ops.kda import chunk_kda as op
        c = spec.config
        hq = c.num_k_heads if kind == "gdn" else c.num_heads
        qk = hq * c.head_k_dim
        cu, cu_cpu = batch.cu_seqlens.long(), torch.tensor(batch.host_cu_seqlens, dtype=torch.long)

        def run():
            y, _ = causal_conv1d(inputs.x[None], inputs.conv_weight, inputs.conv_bias, activation="silu",
                                 cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
            q = y[..., :qk].unflatten(-1, (hq, c.head_k_dim))
            k = y[..., qk : 2 * qk].unflatten(-1, (hq, c.head_k_dim))
            v = y[..., 2 * qk :].unflatten(-1, (-1, c.head_v_dim))
            return op(q, k, v, inputs.g[None], inputs.beta[None], scale=c.scale, output_final_state=True,
                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)

        return timed(run, graph=False)

    runs = {
        "fnattn triton": lambda: session_time("triton", spec, state, batch, inputs, graph=False),
        "fnattn fla": lambda: session_time("fla", spec, state, batch, inputs, graph=False),
        peer: fla_peer,
        names[3]: fla_layer_peer,
    }
    return measure_runs(case, peer, shape, runs, lambda us: {"mtok_s": T / us})


def decode_case(*, batch: int, hk: int, hv: int, dim: int, dtype=torch.bfloat16) -> list[dict]:
    """GDN decode, one token per request, replayed from a CUDA graph; bound by fp32 state traffic."""
    peer = "fla-core fused_recurrent_gated_delta_rule"
    case = f"gdn decode B{batch} {hk}qk/{hv}v d{dim} graph"
    shape = {"batch": batch, "hk": hk, "hv": hv, "dim": dim, "dtype": str(dtype), "state_dtype": "torch.float32"}
    names = ("fnattn triton", "fnattn triton + apply", "fnattn triton + apply, no ring", "fnattn triton_fused",
             "fnattn triton_fused + apply", "fnattn triton_fused + apply, no ring", peer)
    try:
        spec = recurrent_spec("gdn", hk=hk, hv=hv, dim=dim, dtype=dtype)
        state = cached_state(spec, batch=batch, ctx=16, page_size=16)
        b = Batch.decode(state, range(batch))  # spare ring rows: states written in place, the apply moves cursors
        inputs = recurrent_inputs(spec, batch)
        flat = cached_state(spec, batch=batch, ctx=16, page_size=16, recurrent_ring=1)
        b_flat = Batch.decode(flat, range(batch))  # one row per slot: the apply copies every new state
    except Exception as e:  # noqa: BLE001
        return failed_records(case, peer, shape, names, e)
    # read + write of each request's [HV, K, V] fp32 state; q/k/v/o and the conv window are small
    state_bytes = 2 * batch * hv * dim * dim * 4

    def fla_peer():
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        q, k, v = _peer_qkv(spec, state, b, inputs)  # [B, Hk, K], [B, Hk, K], [B, HV, V]
        h0 = state.views(0).ssm.index_select(0, b.recurrent_slots)  # the requests' current rows, as a dense batch
        args = (q[:, None], k[:, None], v[:, None])
        return timed(lambda: fused_recurrent_gated_delta_rule(
            *args, g=inputs.g[:, None], beta=inputs.beta[:, None], scale=spec.config.scale, initial_state=h0,
            output_final_state=True, use_qk_l2norm_in_kernel=True), graph=True)

    runs = {
        "fnattn triton": lambda: session_time("triton", spec, state, b, inputs, graph=True),
        "fnattn triton + apply": lambda: session_time("triton", spec, state, b, inputs, graph=True, apply=True),
        "fnattn triton + apply, no ring": lambda: session_time("triton", spec, flat, b_flat, inputs, graph=True,
                                                               apply=True),
        # the opt-in one-launch decode (conv window update fused into the recurrent kernel)
        "fnattn triton_fused": lambda: session_time("triton_fused", spec, state, b, inputs, graph=True),
        "fnattn triton_fused + apply": lambda: session_time("triton_fused", spec, state, b, inputs, graph=True,
                                                            apply=True),
        "fnattn triton_fused + apply, no ring": lambda: session_time("triton_fused", spec, flat, b_flat, inputs,
                                                                     graph=True, apply=True),
        peer: fla_peer,
    }
    return measure_runs(case, peer, shape, runs, lambda us: {"tb_s": state_bytes / (us * 1e-6) / 1e12})


def decode_kernel_inputs(batch: int, hk: int, hv: int, dim: int, dtype, width: int):
    """``(x, conv weight, conv windows, g, beta, state pool, slots, out rows, cu_seqlens)`` of one decode
    step: the pool's rows 0..B-1 are read, B..2B-1 written."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)  # noqa: E731
    C = 2 * hk * dim + hv * dim
    x, weight = r(batch, C).to(dtype), (0.5 * r(C, width)).to(dtype)
    g, beta = F.logsigmoid(r(batch, hv) + 3.0), torch.sigmoid(r(batch, hv)).to(dtype)
    conv_pool = r(batch, C, width - 1).to(dtype)
    pool = r(2 * batch, hv, dim, dim)
    slots = torch.arange(batch, device=DEVICE)
    cu = torch.arange(batch + 1, device=DEVICE, dtype=torch.int32)
    return x, weight, conv_pool, g, beta, pool, slots, slots + batch, cu


def decode_kernels_case(*, batch: int, hk: int, hv: int, dim: int, dtype=torch.bfloat16, width: int = 4) -> list[dict]:
    """The decode kernels alone, states into spare pool rows, replayed from a CUDA graph: the conv and the
    recurrence as two launches (and each alone) against `kernels.gated_delta_decode_fused`."""
    from ...kernels import causal_conv1d, gated_delta_decode_fused, gated_delta_recurrent

    peer = "conv + recurrent (two launches)"
    case = f"gdn decode kernels B{batch} {hk}qk/{hv}v d{dim} graph"
    shape = {"batch": batch, "hk": hk, "hv": hv, "dim": dim, "conv_kernel": width, "dtype": str(dtype),
             "state_dtype": "torch.float32"}
    x, weight, conv_pool, g, beta, pool, slots, rows, cu = decode_kernel_inputs(batch, hk, hv, dim, dtype, width)
    qk, C, scale = hk * dim, x.shape[1], dim ** -0.5

    def conv():
        return causal_conv1d(x, weight, None, conv_pool, slots, cu, activation="silu")

    def recurrent(mixed):
        q = mixed[:, :qk].unflatten(1, (hk, dim))
        k = mixed[:, qk : 2 * qk].unflatten(1, (hk, dim))
        v = mixed[:, 2 * qk :].unflatten(1, (hv, dim))
        return gated_delta_recurrent(q, k, v, g, beta, pool, slots, cu, scale=scale, out_states=pool, out_rows=rows,
                                     use_qk_l2norm=True)

    mixed = conv()[0]
    runs = {
        "causal_conv1d": lambda: timed(conv, graph=True),
        "gated_delta_recurrent": lambda: timed(lambda: recurrent(mixed), graph=True),
        peer: lambda: timed(lambda: recurrent(conv()[0]), graph=True),
        "gated_delta_decode_fused": lambda: timed(lambda: gated_delta_decode_fused(
            x, weight, None, conv_pool, g, beta, pool, slots, cu, num_k_heads=hk, head_k_dim=dim, scale=scale,
            out_states=pool, out_rows=rows), graph=True),
    }
    # the state is read and written; x, the windows (read and written) and o are the rest
    moved = 2 * batch * hv * dim * dim * 4 + batch * C * (1 + 2 * (width - 1)) * 2 + batch * hv * dim * 2
    records = measure_runs(case, peer, shape, runs, lambda us: {"tb_s": moved / (us * 1e-6) / 1e12})
    for rec in records:  # the step's bytes over one of its two kernels' time is no bandwidth of either
        if rec["backend"] in ("causal_conv1d", "gated_delta_recurrent"):
            rec.pop("tb_s", None)
    return records
