"""Where one GDN layer's prefill goes: fnattn's "fla" provider through a session against fla-core's own conv +
chunk (the `fnattn bench gdn-prefill` case), each timed as the bench times it (eager, ``do_bench``'s median),
then profiled: the device's busy time a call, its kernels by time, and the host's time a call.
From the repository root on a GPU machine:

    python benchmarks/gdn_prefill_profile.py [--requests 16 --length 4096] [--out gdn_prefill_profile.json]

The pieces of the provider are timed apart too: the conv alone (q / k / v written apart), the initial
states' gather, fla-core's chunk forward on the conv's output.
"""

import argparse
import json
import time

import torch

from fnattn import Batch, ModelAttention, switches
from fnattn.bench import environment, timed
from fnattn.bench.cases.delta_rule import recurrent_inputs, recurrent_spec
from fnattn.bench.setup import cached_state
from fnattn.kernels import causal_conv1d, gdn_conv
from fnattn.kinds.delta_rule.triton import _fla_gdn_forward, _qkv_channels, plan


def kernels_of(fn, calls: int = 5) -> dict:
    """Busy time a call and the kernels by time, from torch.profiler over ``calls`` calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host_us = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) / calls * 1e6
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0)
        if dev and getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
            rows.append({"name": e.key[:120], "us_a_call": dev / calls, "count_a_call": e.count / calls})
    rows.sort(key=lambda r: -r["us_a_call"])
    return {"busy_us": sum(r["us_a_call"] for r in rows), "kernels_a_call": sum(r["count_a_call"] for r in rows),
            "host_us_profiled": host_us, "wall_us_profiled": wall_us, "top": rows[:25]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--chunk-tiles", choices=("default", "on", "off"), default="default",
                   help="the conv tiled by the plan's chunks (`kernels.gdn_conv.chunk_tiles`; on: at any size)")
    p.add_argument("--chunk-launch", type=int, nargs=2, metavar=("BLOCK_C", "WARPS"), default=None,
                   help="the chunk tiles' channels a program and warps (default: kernels.gdn_conv.CHUNK_LAUNCH)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.chunk_launch:
        gdn_conv.CHUNK_LAUNCH.update(block_c=a.chunk_launch[0], num_warps=a.chunk_launch[1])
    if a.chunk_tiles == "on":
        gdn_conv.CHUNK_LAUNCH.update(min_tokens=0)
    a.chunk_tiles_on = switches.value("chunk_tiles") if a.chunk_tiles == "default" else a.chunk_tiles == "on"
    with gdn_conv.chunk_tiles(a.chunk_tiles_on):
        run(a)


def run(a) -> None:
    from fla.modules.causal_conv1d import causal_conv1d as fla_conv
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    T = a.requests * a.length
    spec = recurrent_spec("gdn", hk=16, hv=32, dim=128, dtype=torch.bfloat16)
    c = spec.config
    state = cached_state(spec, batch=a.requests, ctx=0, page_size=a.length, extra=a.length)
    batch = Batch.prefill(state, {r: a.length for r in range(a.requests)})
    inputs = recurrent_inputs(spec, T)
    ma = ModelAttention([spec], prefer=("fla",), device="cuda", phases=("prefill",))
    cu, cu_cpu = batch.cu_seqlens.long(), torch.tensor(batch.host_cu_seqlens, dtype=torch.long)
    qk = c.num_k_heads * c.head_k_dim
    views = state.views(0)
    pl = plan((spec,), batch, None)

    def fnattn_fla():
        with ma.session(state, batch) as s:
            s.forward(spec.index, inputs)

    def peer():
        y, _ = fla_conv(inputs.x[None], inputs.conv_weight, inputs.conv_bias, activation="silu", cu_seqlens=cu,
                        cu_seqlens_cpu=cu_cpu)
        q = y[..., :qk].unflatten(-1, (c.num_k_heads, c.head_k_dim))
        k = y[..., qk: 2 * qk].unflatten(-1, (c.num_k_heads, c.head_k_dim))
        v = y[..., 2 * qk:].unflatten(-1, (-1, c.head_v_dim))
        return chunk_gated_delta_rule(q, k, v, inputs.g[None], inputs.beta[None], scale=c.scale,
                                      output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                      cu_seqlens_cpu=cu_cpu)

    tiles = dict(chunks=pl.chunks, chunk_size=pl.chunk_size)  # as the provider passes them

    def our_conv():
        return causal_conv1d(inputs.x, inputs.conv_weight, inputs.conv_bias, views.conv, pl.read_slots,
                             batch.cu_seqlens, activation="silu", split=_qkv_channels(spec), **tiles)

    def our_conv_one_output():
        return causal_conv1d(inputs.x, inputs.conv_weight, inputs.conv_bias, views.conv, pl.read_slots,
                             batch.cu_seqlens, activation="silu", **tiles)

    def peer_conv():
        return fla_conv(inputs.x[None], inputs.conv_weight, inputs.conv_bias, activation="silu", cu_seqlens=cu,
                        cu_seqlens_cpu=cu_cpu)

    def gather():
        return views.ssm.index_select(0, pl.start_rows).float().masked_fill(pl.fresh, 0.0)

    (q, k, v), _ = our_conv()
    q, k = q.unflatten(1, (c.num_k_heads, -1)), k.unflatten(1, (c.num_k_heads, -1))
    v = v.unflatten(1, (-1, c.head_v_dim))
    h0 = gather()
    forward = _fla_gdn_forward()

    def chunk_forward():
        return forward(q[None], k[None], v[None], inputs.g[None], inputs.beta[None], c.scale, h0, pl.cu_seqlens_long,
                       pl.fla_chunks)

    cases = {"fnattn fla (session)": fnattn_fla, "fla-core conv + chunk": peer,
             "fnattn conv (q/k/v apart)": our_conv, "fnattn conv (one output)": our_conv_one_output,
             "fla-core conv": peer_conv, "initial states' gather": gather, "fla-core chunk forward": chunk_forward}
    records = []
    for name, fn in cases.items():
        us = timed(fn, graph=False)
        prof = kernels_of(fn)
        records.append({"case": name, "time_us": us, **prof})
        print(f"{name:28s} {us:9.1f} us  busy {prof['busy_us']:9.1f} us over {prof['kernels_a_call']:.0f} kernels,"
              f" host {prof['host_us_profiled']:8.1f} us")
        for r in prof["top"][:8]:
            print(f"     {r['us_a_call']:9.1f} us  x{r['count_a_call']:.0f}  {r['name'][:90]}")
    if a.out:
        with open(a.out, "w") as f:
            cmd = (f"python benchmarks/gdn_prefill_profile.py --requests {a.requests} --length {a.length}"
                   + f" --chunk-tiles {a.chunk_tiles}"
                   + (" --chunk-launch {} {}".format(*a.chunk_launch) if a.chunk_launch else ""))
            json.dump({"command": cmd + f" --out {a.out}", "environment": environment(), "tokens": T,
                       "chunk_tiles": a.chunk_tiles, "chunk_tiles_on": a.chunk_tiles_on,
                       "chunk_launch": dict(gdn_conv.CHUNK_LAUNCH),
                       "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
