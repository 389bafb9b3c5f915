"""The GDN decode kernels' tiles, timed from CUDA graphs: which V tile and warp count each kernel should take.

    python benchmarks/gdn_decode_sweep.py [--batch 1 8 64] [--out gdn_decode_sweep.json]

Two sweeps, each over V tiles 16, 32, 64 and 1, 2, 4, 8 warps:

- `fnattn.kernels.gated_delta_recurrent` alone (the states into spare pool rows) at batch 64 and 256, 16qk/32v;
  the peer is the default tile (BV 32, 4 warps);
- `fnattn.kernels.gated_delta_decode_fused` alone at each ``--batch`` (Qwen3.5-0.8B's 16qk/16v); the peer is the
  tile the kernel picks by default.

Ratios > 1 beat the default. TB/s counts the fp32 state read and written (the fused kernel: plus its conv window
and inputs). `fnattn bench gdn-decode` times the kernels in the shipped configuration next to fla-core.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys

import torch
import torch.nn.functional as F

from fnattn.bench import print_table, timed, with_ratios, write_json
from fnattn.bench.cases.delta_rule import decode_kernel_inputs, measure_runs

DEVICE = "cuda"
BLOCK_V = (16, 32, 64)
WARPS = (1, 2, 4, 8)


def decode_tile_sweep(*, batch: int, hk: int, hv: int, dim: int, dtype=torch.bfloat16) -> list[dict]:
    """The recurrent decode kernel alone (states into spare pool rows) over V tiles and warps."""
    from fnattn.kernels import gated_delta_recurrent

    case = f"gdn decode kernel sweep B{batch} {hk}qk/{hv}v d{dim} graph"
    shape = {"batch": batch, "hk": hk, "hv": hv, "dim": dim, "dtype": str(dtype), "state_dtype": "torch.float32"}
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)  # noqa: E731
    q, k = r(batch, hk, dim).to(dtype), r(batch, hk, dim).to(dtype)
    v, g, beta = r(batch, hv, dim).to(dtype), F.logsigmoid(r(batch, hv) + 3.0), torch.sigmoid(r(batch, hv)).to(dtype)
    pool = r(2 * batch, hv, dim, dim)  # rows 0..B-1 read, B..2B-1 written
    slots = torch.arange(batch, device=DEVICE)
    rows = slots + batch
    cu = torch.arange(batch + 1, device=DEVICE, dtype=torch.int32)
    state_bytes = 2 * batch * hv * dim * dim * 4
    runs = {}
    for block_v in BLOCK_V:
        for warps in WARPS:
            runs[f"BV{block_v} w{warps}"] = (lambda bv=block_v, w=warps: timed(lambda: gated_delta_recurrent(
                q, k, v, g, beta, pool, slots, cu, scale=dim ** -0.5, out_states=pool, out_rows=rows,
                use_qk_l2norm=True, block_v=bv, num_warps=w), graph=True))
    # the peer is the default tile (BV 32, 4 warps): ratios > 1 beat it
    return measure_runs(case, "BV32 w4", shape, runs, lambda us: {"tb_s": state_bytes / (us * 1e-6) / 1e12})


def decode_fused_sweep(*, batch: int, hk: int, hv: int, dim: int, dtype=torch.bfloat16, width: int = 4) -> list[dict]:
    """`kernels.gated_delta_decode_fused` alone over V tiles and warps, replayed from a CUDA graph; the peer
    is the tile the kernel picks by default (ratios > 1 beat it)."""
    from fnattn.kernels import gated_delta_decode_fused

    case = f"gdn fused decode sweep B{batch} {hk}qk/{hv}v d{dim} graph"
    shape = {"batch": batch, "hk": hk, "hv": hv, "dim": dim, "conv_kernel": width, "dtype": str(dtype),
             "state_dtype": "torch.float32"}
    x, weight, conv_pool, g, beta, pool, slots, rows, cu = decode_kernel_inputs(batch, hk, hv, dim, dtype, width)

    def run(**tile):
        return timed(lambda: gated_delta_decode_fused(x, weight, None, conv_pool, g, beta, pool, slots, cu,
                                                      num_k_heads=hk, head_k_dim=dim, scale=dim ** -0.5,
                                                      out_states=pool, out_rows=rows, **tile), graph=True)

    peer = "default tile"
    runs = {peer: run}
    for block_v in BLOCK_V:
        for warps in WARPS:
            runs[f"BV{block_v} w{warps}"] = lambda bv=block_v, w=warps: run(block_v=bv, num_warps=w)
    moved = 2 * batch * hv * dim * dim * 4 + batch * x.shape[1] * (1 + 2 * (width - 1)) * 2 + batch * hv * dim * 2
    return measure_runs(case, peer, shape, runs, lambda us: {"tb_s": moved / (us * 1e-6) / 1e12})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64],
                   help="batch sizes of the fused kernel's sweep (default 1 8 64)")
    p.add_argument("--out", default="gdn_decode_sweep.json", help="JSON output path")
    words = sys.argv[1:] if argv is None else list(argv)
    a = p.parse_args(words)
    if any(b < 1 for b in a.batch):
        print(f"gdn_decode_sweep: --batch values must be >= 1, got {a.batch}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gdn_decode_sweep: needs a CUDA device (none found)", file=sys.stderr)
        return 2
    records: list[dict] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # a time limit still writes what finished
    try:
        for batch in (64, 256):
            records += decode_tile_sweep(batch=batch, hk=16, hv=32, dim=128)
        for batch in a.batch:
            records += decode_fused_sweep(batch=batch, hk=16, hv=16, dim=128)
    finally:
        with_ratios(records)
        print_table(records)
        if records:
            write_json(records, a.out, command=shlex.join(["python", "benchmarks/gdn_decode_sweep.py", *words]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
