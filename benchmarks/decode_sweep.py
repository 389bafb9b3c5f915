"""The paged decode kernel's tile configurations, timed against FlashInfer's decode (plain and tensor cores) over
the same cache, in one process: which (block_n, num_warps, num_stages, splits) reads the cache fastest per batch.

    python benchmarks/decode_sweep.py [--batch 1 8 64] [--ctx 4096] [--out decode_sweep.json]
    python benchmarks/decode_sweep.py --batch 32 128 --ctx 512 --hq 8 --hkv 2 --dim 256 --block-n 32 --stages 2 3

Each configuration's output is first checked against the shipped configuration's (allclose: a different tile
changes the order of the sums), then timed from a CUDA graph with ``triton.testing.do_bench``. TB/s counts the
K and V rows read once. The kernel alone: the backend around it adds its plan and the apply
(`fnattn bench decode` times that).
"""

import argparse
import itertools

import torch

from fnattn.bench import timed, write_json
from fnattn.kernels import paged_attention as pa


def cache(batch, ctx, hq, hkv, dim, page, dev, dt):
    g = torch.Generator(device=dev).manual_seed(0)
    pages_per = -(-(ctx + 1) // page)
    P = batch * pages_per + 1
    r = lambda *s: torch.randn(*s, device=dev, generator=g).to(dt)  # noqa: E731
    k, v = r(P, page, hkv, dim), r(P, page, hkv, dim)
    perm = torch.randperm(P - 1, device=dev, generator=g) + 1  # pages scattered over the pool, as served
    table = perm[:batch * pages_per].view(batch, pages_per).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    return k, v, table, lens, r(batch, hq, dim), r(batch, hkv, dim), r(batch, hkv, dim)


def flashinfer_decode(k, v, table, lens, q, page, hq, hkv, dim, tensor_cores):
    import flashinfer

    B, n = table.shape
    used = -(-lens // page)
    indptr = torch.zeros(B + 1, dtype=torch.int32, device=q.device)
    indptr[1:] = torch.cumsum(used, 0)
    indices = torch.cat([table[b, :int(used[b])] for b in range(B)])
    last = (lens - (used - 1) * page).to(torch.int32)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=q.device),
                                                      "NHD", use_tensor_cores=tensor_cores)
    w.plan(indptr, indices, last, hq, hkv, dim, page, sm_scale=dim ** -0.5, q_data_type=q.dtype,
           kv_data_type=q.dtype)
    return lambda: w.run(q, (k, v))


GRID = {"block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4)}  # each compiles once per SPLIT


def sweep_batch(B: int, a, records: list) -> None:
    """Every configuration at batch ``B``, appended to ``records``, with both FlashInfer decodes beside them."""
    dev = torch.device("cuda")
    k, v, table, lens, q, kn, vn = cache(B, a.ctx, a.hq, a.hkv, a.dim, a.page, dev, torch.bfloat16)
    moved = B * (a.ctx + 1) * a.hkv * a.dim * 2 * k.element_size()
    default_splits = pa.pick_num_splits(B * a.hkv, table.shape[1] * a.page + 1, dev)

    def run(splits=None):
        return pa.paged_decode(q, k, v, table, lens, k_new=kn, v_new=vn, scale=a.dim ** -0.5, num_splits=splits)

    want, _ = run()
    case = f"decode B{B} ctx{a.ctx} {a.hq}q/{a.hkv}kv d{a.dim} p{a.page}"

    def record(name, fn, **extra):
        rec = {"case": case, "backend": name, **extra}
        try:
            us = timed(fn, graph=True)
            rec.update(time_us=us, tb_s=moved / (us * 1e-6) / 1e12)
        except Exception as e:  # noqa: BLE001 - a configuration that fails is a result
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
        records.append(rec)
        print(f"{case:<34}{name:<52}{rec.get('time_us', float('nan')):9.1f} us {rec.get('tb_s', 0):6.2f} TB/s"
              + (f"  {rec['error']}" if "error" in rec else ""), flush=True)

    for tc in (False, True):
        record(f"flashinfer decode{' tc' if tc else ''}",
               flashinfer_decode(k, v, table, lens, q, a.page, a.hq, a.hkv, a.dim, tc))
    record("fnattn paged_decode (shipped)", run, splits=default_splits)
    splits_options = sorted({default_splits, 1, 2, 4} if B * a.hkv < 4 * 132 else {1, 2})
    grid = itertools.product(a.block_n, a.warps, a.stages)
    for (bn, warps, stages), splits in itertools.product(grid, splits_options):
        cfg = {"block_n": bn, "num_warps": warps, "num_stages": stages}
        with pa.configured(**cfg):  # in force while the graph is captured
            try:
                got, _ = run(splits)
                ok = torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
            except Exception as e:  # noqa: BLE001 - shared memory or registers the compiler refuses
                records.append({"case": case, "backend": "fnattn paged_decode", **cfg, "splits": splits,
                                "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            if not ok:
                records.append({"case": case, "backend": "fnattn paged_decode", **cfg, "splits": splits,
                                "error": "output differs from the shipped configuration's"})
                continue
            record(f"fnattn paged_decode bn{bn} w{warps} s{stages} x{splits}", lambda s=splits: run(s),
                   **cfg, splits=splits)
    best = min((r for r in records if r["case"] == case and r.get("time_us") and "block_n" in r),
               key=lambda r: r["time_us"], default=None)
    if best:
        print(f"{case}: best {best['backend']} {best['time_us']:.1f} us", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--block-n", type=int, nargs="+", default=list(GRID["block_n"]), help="keys a tile")
    p.add_argument("--warps", type=int, nargs="+", default=list(GRID["num_warps"]))
    p.add_argument("--stages", type=int, nargs="+", default=list(GRID["num_stages"]))
    p.add_argument("--out", default=None)
    a = p.parse_args()
    records = []
    for B in a.batch:
        sweep_batch(B, a, records)
    if a.out:
        write_json(records, a.out, command="python benchmarks/decode_sweep.py " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(a).items() if v is not None))


if __name__ == "__main__":
    main()
