"""Parity and speed of the GDN / KDA Triton kernels on a GPU (plain torch + kernels/).

    python benchmarks/gpu_check_gated_delta.py --out results.json [--skip-parity] [--skip-timing] [--no-fla]

(a) Parity: gated_delta_recurrent (final and per-position states), gated_delta_chunked
    and causal_conv1d against their pure-torch references, bf16 activations and fp32
    state (plus a bf16 state pool and an fp32-activation case), ragged lengths,
    fresh and cached initial states, Hk < HV. Error is ||a - b|| / ||b|| (and max abs).
(b) Timing (triton.testing.do_bench, median):
    GDN chunked prefill, T=64k as 16 x 4k and 1 x 64k, 16 qk / 32 v heads, d128;
    GDN recurrent decode B=64 / B=256, 32 v heads, d128, with state traffic in TB/s;
    GDN verify B=64 x (1+3) tokens with per-position states;
    KDA chunked prefill T=16k (1 x 16k and 4 x 4k), 32 heads, d128;
    causal_conv1d prefill T=16k and decode B=256, C=8192, W=4;
    and the same GDN/KDA cases through fla-core when importable, with our/fla ratios.
Every case runs in its own try/except; the JSON holds whatever finished.
"""

import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_check_report  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
from fnattn.kernels.gated_delta import (  # noqa: E402
    causal_conv1d,
    causal_conv1d_ref,
    chunk_indices,
    gated_delta_chunked,
    gated_delta_recurrent,
    gated_delta_recurrent_ref,
)

DEV = "cuda"
DT = torch.bfloat16
TOL = 1e-2  # relative L2 error; bf16 inputs and bf16 operands of the chunked dots
TOL_FP32 = 1e-4


# ------------------------------------------------------------------ inputs


def cu_of(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)


def make_inputs(lens, Hk, HV, K, V, *, kda, dtype=DT, g_scale=1.0):
    """q, k l2-normalized; g a log decay <= 0 (logsigmoid, as the models compute it)."""
    T = sum(lens)
    q = torch.nn.functional.normalize(torch.randn(T, Hk, K, device=DEV), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(T, Hk, K, device=DEV), dim=-1).to(dtype)
    v = torch.randn(T, HV, V, device=DEV).to(dtype)
    gshape = (T, HV, K) if kda else (T, HV)
    g = torch.nn.functional.logsigmoid(torch.randn(gshape, device=DEV) + 3.0) * g_scale
    beta = torch.sigmoid(torch.randn(T, HV, device=DEV)).to(dtype)
    return q, k, v, g, beta


def make_pool(n, shape, live, dtype=torch.float32):
    """NaN everywhere except the live slots, so stray reads show."""
    pool = torch.full((n, *shape), float("nan"), device=DEV, dtype=dtype)
    for s in live:
        pool[s] = (torch.randn(*shape, device=DEV) * 0.1).to(dtype)
    return pool


def slots_of(values):
    return torch.tensor(values, dtype=torch.int64, device=DEV)


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item(), (a - b).abs().max().item()


# ------------------------------------------------------------------ parity


def record(results, kernel, case, fn):
    gpu_check_report.record(results, kernel, case, fn, errors=("rel_o", "max_o", "rel_s", "max_s"), fmt=".2e",
                            widths=(22, 64))


def judge(o, o_ref, s, s_ref, tol):
    rel_o, max_o = rel_err(o, o_ref)
    rel_s, max_s = rel_err(s, s_ref)
    finite = bool(torch.isfinite(o).all()) and bool(torch.isfinite(s.float()).all())
    return dict(rel_o=rel_o, max_o=max_o, rel_s=rel_s, max_s=max_s,
                passed=finite and rel_o < tol and rel_s < tol)


def recurrent_case(lens, slots, Hk, HV, K, V, *, kda, per_pos, pool_dtype=torch.float32):
    def run():
        q, k, v, g, beta = make_inputs(lens, Hk, HV, K, V, kda=kda)
        pool = make_pool(max(slots) + 2, (HV, K, V), [s for s in slots if s >= 0], pool_dtype)
        args = (q, k, v, g, beta, pool, slots_of(slots), cu_of(lens))
        o, s = gated_delta_recurrent(*args, scale=K ** -0.5, per_position_states=per_pos)
        o_ref, s_ref = gated_delta_recurrent_ref(*args, scale=K ** -0.5, per_position_states=per_pos)
        return judge(o, o_ref, s, s_ref, TOL)
    return run


def chunked_case(lens, slots, Hk, HV, K, V, *, kda, dtype=DT, chunk_size=64, g_scale=1.0,
                 pool_dtype=torch.float32):
    def run():
        q, k, v, g, beta = make_inputs(lens, Hk, HV, K, V, kda=kda, dtype=dtype, g_scale=g_scale)
        pool = make_pool(max(slots) + 2, (HV, K, V), [s for s in slots if s >= 0], pool_dtype)
        args = (q, k, v, g, beta, pool, slots_of(slots), cu_of(lens))
        o, s = gated_delta_chunked(*args, scale=K ** -0.5, chunk_size=chunk_size)
        o_ref, s_ref = gated_delta_recurrent_ref(*args, scale=K ** -0.5)
        return judge(o, o_ref, s, s_ref, TOL if dtype != torch.float32 else TOL_FP32)
    return run


def conv_case(lens, slots, C, W, *, per_pos):
    def run():
        T = sum(lens)
        x = torch.randn(T, C, device=DEV).to(DT)
        w = (torch.randn(C, W, device=DEV) * 0.3).to(DT)
        bias = torch.randn(C, device=DEV).to(DT)
        pool = make_pool(max(slots) + 2, (C, W - 1), [s for s in slots if s >= 0], DT)
        args = (x, w, bias, pool, slots_of(slots), cu_of(lens))
        y, s = causal_conv1d(*args, activation="silu", per_position_states=per_pos)
        y_ref, s_ref = causal_conv1d_ref(*args, activation="silu", per_position_states=per_pos)
        row = judge(y, y_ref, s, s_ref, TOL)
        row["passed"] = row["passed"] and torch.equal(s, s_ref)  # windows are copies
        return row
    return run


def parity(results):
    ragged = [1, 7, 33, 2]
    ragged_slots = [3, -1, 0, 5]
    heads = [(16, 32, 128, 128), (4, 4, 64, 64), (2, 8, 128, 64)]
    for kda in (False, True):
        name = "kda" if kda else "gdn"
        for Hk, HV, K, V in heads:
            tag = f"{name} Hk{Hk}/HV{HV} K{K} V{V}"
            record(results, "recurrent", f"{tag} decode B64",
                   recurrent_case([1] * 64, list(range(64)), Hk, HV, K, V, kda=kda, per_pos=False))
            record(results, "recurrent", f"{tag} ragged {ragged}",
                   recurrent_case(ragged, ragged_slots, Hk, HV, K, V, kda=kda, per_pos=False))
            record(results, "recurrent", f"{tag} verify 8x(1+3) per-position",
                   recurrent_case([4] * 8, [7, 6, 5, -1, 3, 2, 1, 0], Hk, HV, K, V, kda=kda, per_pos=True))
            record(results, "recurrent", f"{tag} ragged bf16 state pool",
                   recurrent_case(ragged, ragged_slots, Hk, HV, K, V, kda=kda, per_pos=False,
                                  pool_dtype=torch.bfloat16))
            lens = [1, 63, 64, 65, 200, 700]
            slots = [2, -1, 0, 6, -1, 4]
            record(results, "chunked", f"{tag} ragged {lens}",
                   chunked_case(lens, slots, Hk, HV, K, V, kda=kda))
            record(results, "chunked", f"{tag} ragged chunk32",
                   chunked_case(lens, slots, Hk, HV, K, V, kda=kda, chunk_size=32))
        record(results, "chunked", f"{name} Hk4/HV8 K128 V128 fp32 activations",
               chunked_case([5, 130, 77], [1, -1, 0], 4, 8, 128, 128, kda=kda, dtype=torch.float32))
        record(results, "chunked", f"{name} Hk4/HV8 K128 V128 bf16 state pool",
               chunked_case([5, 130, 77], [1, -1, 0], 4, 8, 128, 128, kda=kda, pool_dtype=torch.bfloat16))
        record(results, "chunked", f"{name} Hk4/HV8 K128 V128 strong decay (g x 20)",
               chunked_case([5, 130, 77], [1, -1, 0], 4, 8, 128, 128, kda=kda, g_scale=20.0))
    for C in (1024, 8192):
        for per_pos in (False, True):
            record(results, "causal_conv1d", f"C{C} W4 ragged per_pos={per_pos}",
                   conv_case([1, 2, 0, 9, 300], [4, -1, 0, 2, 2], C, 4, per_pos=per_pos))


# ------------------------------------------------------------------ timing


def bench_us(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def time_case(timings, name, make, fla_make=None, nbytes=None, tokens=None):
    """make() -> (fn, out); fla_make() -> (fn, out) with out comparable to ours (o [T, HV, V])."""
    row = dict(case=name)
    try:
        fn, ours = make()
        fn()
        row["us"] = bench_us(fn)
        if nbytes:
            row["tb_s"] = nbytes / row["us"] / 1e6
        if tokens:
            row["mtok_s"] = tokens / row["us"]
        if fla_make is not None:
            try:
                fla_fn, theirs = fla_make()
                fla_fn()
                row["fla_us"] = bench_us(fla_fn)
                row["ours_over_fla"] = row["us"] / row["fla_us"]
                if ours is not None and theirs is not None:
                    row["rel_diff_vs_fla"] = rel_err(ours(), theirs())[0]
            except Exception as e:
                row["fla_error"] = f"{type(e).__name__}: {e}"
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        row["trace"] = traceback.format_exc(limit=3)
    timings.append(row)
    extra = " ".join(f"{k}={row[k]:.3g}" for k in ("tb_s", "mtok_s", "fla_us", "ours_over_fla", "rel_diff_vs_fla")
                     if k in row)
    us = row.get("us", float("nan"))
    print(f"{name:60s} {us:10.1f} us  {extra} {row.get('error', '')} {row.get('fla_error', '')}", flush=True)
    torch.cuda.empty_cache()


def fla_ops(use_fla):
    if not use_fla:
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        from fla.ops.kda import chunk_kda
    except Exception as e:
        print(f"fla-core not usable: {type(e).__name__}: {e}", flush=True)
        return None
    return dict(chunk_gdn=chunk_gated_delta_rule, recurrent_gdn=fused_recurrent_gated_delta_rule, chunk_kda=chunk_kda)


def prefill_timing(timings, fla, *, kda, B, L, Hk, HV, K=128, V=128):
    T = B * L
    name = f"{'kda' if kda else 'gdn'} chunked prefill {B}x{L} (T={T}) {Hk}qk/{HV}v d{K}"
    lens = [L] * B
    cu = cu_of(lens)
    slots = slots_of(list(range(B)))
    state = {}

    def make():
        q, k, v, g, beta = make_inputs(lens, Hk, HV, K, V, kda=kda)
        pool = (torch.randn(B, HV, K, V, device=DEV) * 0.1)
        state.update(q=q, k=k, v=v, g=g, beta=beta, pool=pool)
        chunks = chunk_indices(cu, 64)
        out = {}

        def fn():
            out["o"] = gated_delta_chunked(q, k, v, g, beta, pool, slots, cu, scale=K ** -0.5, chunks=chunks)[0]
        return fn, lambda: out["o"]

    fla_make = None
    if fla is not None:
        def fla_make():
            s = state
            cu64 = cu.long()
            out = {}
            op = fla["chunk_kda"] if kda else fla["chunk_gdn"]
            args = (s["q"][None], s["k"][None], s["v"][None], s["g"][None], s["beta"][None])

            def fn():
                out["o"] = op(*args, scale=K ** -0.5, initial_state=s["pool"], output_final_state=True,
                              cu_seqlens=cu64)[0][0]
            return fn, lambda: out["o"]

    time_case(timings, name, make, fla_make, tokens=T)


def decode_timing(timings, fla, *, B, Hk=16, HV=32, K=128, V=128, per_pos_tokens=0):
    n = 1 + per_pos_tokens
    verify = per_pos_tokens > 0
    shape = f"verify B{B}x{n}" if verify else f"decode B{B}"
    name = f"gdn recurrent {shape} {Hk}qk/{HV}v d{K}"
    lens = [n] * B
    cu = cu_of(lens)
    slots = slots_of(list(range(B)))
    state = {}

    def make():
        q, k, v, g, beta = make_inputs(lens, Hk, HV, K, V, kda=False)
        pool = torch.randn(B, HV, K, V, device=DEV) * 0.1
        outs = torch.empty((B * n if verify else B), HV, K, V, device=DEV)
        state.update(q=q, k=k, v=v, g=g, beta=beta, pool=pool)
        res = {}

        def fn():
            res["o"] = gated_delta_recurrent(q, k, v, g, beta, pool, slots, cu, scale=K ** -0.5,
                                             per_position_states=verify, out_states=outs)[0]
        return fn, lambda: res["o"]

    # read the state once, write one state per token written; q/k/v/o are small
    nbytes = B * HV * K * V * 4 * (1 + (n if verify else 1))
    fla_make = None
    if fla is not None and not verify:
        def fla_make():
            s = state
            res = {}

            def fn():
                # [B, 1, H, D] batch layout: one token per sequence
                res["o"] = fla["recurrent_gdn"](
                    s["q"][:, None], s["k"][:, None], s["v"][:, None], g=s["g"][:, None], beta=s["beta"][:, None],
                    scale=K ** -0.5, initial_state=s["pool"], output_final_state=True)[0][:, 0]
            return fn, lambda: res["o"]

    time_case(timings, name, make, fla_make, nbytes=nbytes)


def conv_timing(timings, *, lens, C=8192, W=4):
    name = f"causal_conv1d {len(lens)} requests T={sum(lens)} C{C} W{W}"

    def make():
        T = sum(lens)
        x = torch.randn(T, C, device=DEV).to(DT)
        w = torch.randn(C, W, device=DEV).to(DT)
        pool = torch.randn(len(lens), C, W - 1, device=DEV).to(DT)
        cu, slots = cu_of(lens), slots_of(list(range(len(lens))))
        return (lambda: causal_conv1d(x, w, None, pool, slots, cu)), None

    time_case(timings, name, make, nbytes=sum(lens) * C * 2 * 2)


def timing(timings, use_fla):
    fla = fla_ops(use_fla)
    prefill_timing(timings, fla, kda=False, B=16, L=4096, Hk=16, HV=32)
    prefill_timing(timings, fla, kda=False, B=1, L=65536, Hk=16, HV=32)
    for B in (64, 256):
        decode_timing(timings, fla, B=B)
    decode_timing(timings, fla, B=64, per_pos_tokens=3)
    prefill_timing(timings, fla, kda=True, B=1, L=16384, Hk=32, HV=32)
    prefill_timing(timings, fla, kda=True, B=4, L=4096, Hk=32, HV=32)
    conv_timing(timings, lens=[16384])
    conv_timing(timings, lens=[1] * 256)


def main():
    gpu_check_report.main(__doc__, parity, lambda rows, args: timing(rows, not args.no_fla),
                          flags=(("--no-fla", "do not time fla-core for comparison"),))


if __name__ == "__main__":
    main()
