"""Parity and speed of the Triton attention kernels on a GPU (plain torch + kernels/).

    python benchmarks/gpu_check_attention.py --out results.json [--skip-parity] [--skip-timing] [--sweep]

(a) Parity: every kernel against its pure-torch reference in bf16 over
    GQA 1/4/8, D 64/128/256, page 1/16/64, ragged lengths, prefix 0 and > 0,
    verify with k = 1..4 drafts. Prints max errors and PASS/FAIL.
(b) Timing (triton.testing.do_bench, median): paged_decode at B 1/8/64, ctx 4k,
    32q/8kv, d128, and causal paged_prefill at 16k, 32q/8kv, d128, no prefix.
    --sweep also times a few tile configurations to help pick defaults.
Every case runs in its own try/except; the JSON holds whatever finished.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_check_report  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from fnattn.kernels import lse_merge, paged_attention, scatter  # noqa: E402

DEV = "cuda"
DT = torch.bfloat16
TOL = 2e-2  # bf16 inputs, fp32 reference; P is rounded to bf16 before P @ V


def make_cache(cache_lens, Hkv, D, Dv, S, spare_pages=4):
    """NaN-filled pool with each request's tokens on shuffled pages (as in the tests)."""
    dtype = DT
    pages = [(n + S - 1) // S for n in cache_lens]
    P = sum(pages) + spare_pages
    k_cache = torch.full((P, S, Hkv, D), float("nan"), device=DEV, dtype=dtype)
    v_cache = torch.full((P, S, Hkv, Dv), float("nan"), device=DEV, dtype=dtype)
    order = torch.randperm(P, device=DEV)
    block_table = torch.zeros(len(cache_lens), max(pages + [1]) + 1, dtype=torch.int32, device=DEV)
    used = 0
    for b, n in enumerate(cache_lens):
        ids = order[used:used + pages[b]]
        used += pages[b]
        block_table[b, :pages[b]] = ids.int()
        t = torch.arange(n, device=DEV)
        k_cache[ids[t // S], t % S] = torch.randn(n, Hkv, D, device=DEV, dtype=dtype)
        v_cache[ids[t // S], t % S] = torch.randn(n, Hkv, Dv, device=DEV, dtype=dtype)
    lens = torch.tensor(cache_lens, dtype=torch.int32, device=DEV)
    return k_cache, v_cache, block_table, lens


def compare(out, ref):
    o, lse = out
    ro, rlse = ref
    o, ro = o.float(), ro.float()
    err_o = (o - ro).abs()
    finite = torch.isfinite(rlse)
    err_l = (lse - rlse).abs()[finite]
    ok = bool(torch.isfinite(o).all()) and bool((err_o <= TOL + TOL * ro.abs()).all())
    ok = ok and bool((err_l <= TOL).all()) and torch.equal(torch.isinf(lse), ~finite)
    return dict(max_err_o=err_o.max().item() if err_o.numel() else 0.0,
                max_err_lse=err_l.max().item() if err_l.numel() else 0.0, passed=ok)


def record(results, kernel, case, fn):
    gpu_check_report.record(results, kernel, case, fn, errors=("max_err_o", "max_err_lse"), fmt=".3e", widths=(24, 60))


def decode_case(Hq, Hkv, D, S, cache_lens, num_splits, **kw):
    def run():
        k_cache, v_cache, block_table, lens = make_cache(cache_lens, Hkv, D, D, S)
        B = len(cache_lens)
        q = torch.randn(B, Hq, D, device=DEV, dtype=DT)
        k_new = torch.randn(B, Hkv, D, device=DEV, dtype=DT)
        v_new = torch.randn(B, Hkv, D, device=DEV, dtype=DT)
        args = (q, k_cache, v_cache, block_table, lens)
        kw2 = dict(k_new=k_new, v_new=v_new, scale=D ** -0.5, **kw)
        out = paged_attention.paged_decode(*args, num_splits=num_splits, **kw2)
        return compare(out, paged_attention.paged_decode_ref(*args, **kw2))
    return run


def prefill_case(Hq, Hkv, D, S, cache_lens, new_lens, **kw):
    def run():
        k_cache, v_cache, block_table, lens = make_cache(cache_lens, Hkv, D, D, S)
        T = sum(new_lens)
        cu = torch.tensor([0] + new_lens, device=DEV).cumsum(0).int()
        q = torch.randn(T, Hq, D, device=DEV, dtype=DT)
        k_new = torch.randn(T, Hkv, D, device=DEV, dtype=DT)
        v_new = torch.randn(T, Hkv, D, device=DEV, dtype=DT)
        args = (q, k_new, v_new, cu, k_cache, v_cache, block_table, lens)
        out = paged_attention.paged_prefill(*args, scale=D ** -0.5, **kw)
        return compare(out, paged_attention.paged_prefill_ref(*args, scale=D ** -0.5, **kw))
    return run


def merge_case(T, H, Dv):
    def run():
        o1, o2 = (torch.randn(T, H, Dv, device=DEV, dtype=DT) for _ in range(2))
        lse1, lse2 = (torch.randn(T, H, device=DEV) * 4 for _ in range(2))
        lse1[0] = float("-inf")
        lse1[1], lse2[1] = float("-inf"), float("-inf")
        out = lse_merge.merge_attention_states(o1, lse1, o2, lse2)
        return compare(out, lse_merge.merge_attention_states_ref(o1, lse1, o2, lse2))
    return run


def scatter_case(L, P, S, H, D):
    def run():
        cache = torch.randn(L, P, S, H, D, device=DEV, dtype=DT)
        n = min(P * S, 300)
        slots = torch.randperm(P * S, device=DEV)[:n]
        slots[::7] = -1
        new = torch.randn(L, n, H, D, device=DEV, dtype=DT)
        expect = scatter.scatter_kv_ref(cache.clone(), slots, new)
        scatter.scatter_kv(cache, slots, new)
        rows = torch.randn(2, 9, 4, 64, 64, device=DEV)
        index = torch.tensor([3, -1, 8, 0], device=DEV)
        src = torch.randn(2, 4, 4, 64, 64, device=DEV)
        expect_rows = scatter.scatter_rows_ref(rows.clone(), index, src)
        scatter.scatter_rows(rows, index, src)
        ok = torch.equal(cache, expect) and torch.equal(rows, expect_rows)
        return dict(max_err_o=(cache.float() - expect.float()).abs().max().item(), passed=ok)
    return run


def parity(results):
    heads = {1: (8, 8), 4: (16, 4), 8: (32, 4)}
    for ratio, (Hq, Hkv) in heads.items():
        for D in (64, 128, 256):
            for S in (1, 16, 64):
                tag = f"gqa{ratio} Hq{Hq}/Hkv{Hkv} d{D} page{S}"
                lens = [0, 1, 77, 1000, 2500]
                for ns in (None, 1, 7):
                    record(results, "paged_decode", f"{tag} ns={ns}", decode_case(Hq, Hkv, D, S, lens, ns))
                record(results, "paged_decode", f"{tag} window+softcap+sinks",
                       decode_case(Hq, Hkv, D, S, lens, None, sliding_window=300, softcap=30.0,
                                   sinks=torch.randn(Hq, device=DEV)))
                record(results, "paged_prefill", f"{tag} prefix0",
                       prefill_case(Hq, Hkv, D, S, [0, 0, 0], [1, 200, 513]))
                record(results, "paged_prefill", f"{tag} prefix>0",
                       prefill_case(Hq, Hkv, D, S, [5, 700, 64], [300, 33, 1]))
                record(results, "paged_prefill", f"{tag} prefix>0 window+sinks",
                       prefill_case(Hq, Hkv, D, S, [5, 700, 64], [300, 33, 1], sliding_window=128,
                                    sinks=torch.randn(Hq, device=DEV)))
                for k in (1, 2, 3, 4):
                    record(results, "paged_prefill", f"{tag} verify k={k}",
                           prefill_case(Hq, Hkv, D, S, [0, 17, 900, 3000], [1 + k] * 4))
    for Dv in (64, 128, 256, 512):
        record(results, "merge_attention_states", f"T300 H8 Dv{Dv}", merge_case(300, 8, Dv))
    for S in (1, 16, 64):
        record(results, "scatter_kv+scatter_rows", f"L4 page{S} H8 d128", scatter_case(4, 64, S, 8, 128))


def bench(fn):
    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    try:
        graph_ms = triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
    except Exception:
        graph_ms = None
    return ms * 1e3, graph_ms * 1e3 if graph_ms is not None else None


def time_decode(timings, B, ctx=4096, Hq=32, Hkv=8, D=128, S=16, num_splits=None):
    name = f"paged_decode B{B} ctx{ctx} {Hq}q/{Hkv}kv d{D} page{S} ns={num_splits}"
    try:
        k_cache, v_cache, block_table, lens = make_cache([ctx] * B, Hkv, D, D, S, spare_pages=0)
        q = torch.randn(B, Hq, D, device=DEV, dtype=DT)
        k_new = torch.randn(B, Hkv, D, device=DEV, dtype=DT)
        v_new = torch.randn(B, Hkv, D, device=DEV, dtype=DT)
        fn = lambda: paged_attention.paged_decode(  # noqa: E731
            q, k_cache, v_cache, block_table, lens, k_new=k_new, v_new=v_new,
            scale=D ** -0.5, num_splits=num_splits)
        us, graph_us = bench(fn)
        nbytes = B * ctx * Hkv * 2 * D * 2 + 2 * B * Hq * D * 2
        row = dict(case=name, us=us, graph_us=graph_us, tb_s=nbytes / us / 1e6)
        print(f"{name:64s} {us:9.1f} us  graph {graph_us or float('nan'):9.1f} us  "
              f"{row['tb_s']:.2f} TB/s", flush=True)
    except Exception as e:
        row = dict(case=name, error=f"{type(e).__name__}: {e}")
        print(f"FAIL {name}: {row['error']}", flush=True)
    timings.append(row)


def time_prefill(timings, T=16384, Hq=32, Hkv=8, D=128, S=16):
    name = f"paged_prefill causal T{T} {Hq}q/{Hkv}kv d{D} cache_len 0"
    try:
        k_cache, v_cache, block_table, lens = make_cache([0], Hkv, D, D, S, spare_pages=1)
        cu = torch.tensor([0, T], dtype=torch.int32, device=DEV)
        q = torch.randn(T, Hq, D, device=DEV, dtype=DT)
        k_new = torch.randn(T, Hkv, D, device=DEV, dtype=DT)
        v_new = torch.randn(T, Hkv, D, device=DEV, dtype=DT)
        fn = lambda: paged_attention.paged_prefill(  # noqa: E731
            q, k_new, v_new, cu, k_cache, v_cache, block_table, lens,
            scale=D ** -0.5, max_new_len=T)
        us, _ = bench(fn)
        flops = 2 * T * T * Hq * D  # causal: half of 4 * T^2 * Hq * D
        row = dict(case=name, us=us, tflop_s=flops / us / 1e6)
        print(f"{name:64s} {us:9.1f} us  {row['tflop_s']:.1f} TFLOP/s", flush=True)
    except Exception as e:
        row = dict(case=name, error=f"{type(e).__name__}: {e}")
        print(f"FAIL {name}: {row['error']}", flush=True)
    timings.append(row)


def timing(timings, sweep):
    for B in (1, 8, 64):
        time_decode(timings, B)
    time_decode(timings, 1, num_splits=1)
    time_decode(timings, 64, S=64)
    time_decode(timings, 64, Hq=16, Hkv=4, D=256)
    time_prefill(timings)
    if not sweep:
        return
    default = paged_attention._config
    for block_m, block_n, warps, stages in [(None, 32, 4, 2), (None, 64, 4, 2), (None, 128, 4, 3),
                                           (None, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 3),
                                           (64, 64, 4, 3)]:
        def cfg(d_pad, dv_pad, g_pad, q_len, dtype, bm=block_m, bn=block_n, w=warps, st=stages):
            m = default(d_pad, dv_pad, g_pad, q_len, dtype)[0] if bm is None or q_len == 1 else bm
            return m, bn, w, st
        paged_attention._config = cfg
        tag = f"sweep block_m={block_m} block_n={block_n} warps={warps} stages={stages}"
        print(tag, flush=True)
        n = len(timings)
        for B in (1, 64):
            time_decode(timings, B)
        if block_m is not None:
            time_prefill(timings)
        for row in timings[n:]:
            row["config"] = tag
    paged_attention._config = default


def main():
    gpu_check_report.main(__doc__, parity, lambda rows, args: timing(rows, args.sweep),
                          flags=(("--sweep", "also time a few tile configurations"),))


if __name__ == "__main__":
    main()
