"""The GDN prefill conv's launch shapes, timed: `kernels.gdn_conv`'s kernels at a prefill of the Qwen3.5-0.8B
GDN layer (8192 tokens, 6144 q / k / v channels read as a column slice of the input projection, window 4), or
at ``--requests R --tokens T --channels C`` (`fnattn bench gdn-prefill`'s 16 x 4096, 8192 channels).

    python benchmarks/conv_sweep.py [--tokens 8192] [--channels 6144] [--requests 1] [--split] [--out x.json]

The packed tiles: each (BT, BC, num_warps), with and without interior tiles (`kernels.gdn_conv.interior_tiles`: a
tile inside one request reads x alone). The chunk tiles (`kernels.gdn_conv.chunk_tiles`: one chunk of 64 tokens of
one request a program, the requests' first chunks in a second launch): each channel width and warp count, both
program orders at a few. fla-core's conv on the same input, when installed. Each launch is checked against the
shipped path's output first, then timed with ``triton.testing.do_bench``; TB/s counts x read once, y written once.
``--split``: q / k / v written apart (the fla provider's form).
"""

import argparse
import json

import torch
from fnattn.kernels.gdn_conv import _conv_kernel, causal_conv1d

from fnattn.bench import environment
from fnattn.kernels import chunk_indices, gdn_conv


def launch(x, weight, pool, slots, cu, y, out, *, bt: int, bc: int, warps: int, interior: bool = False):
    T, C = x.shape
    B = slots.numel()
    _conv_kernel[(triton_cdiv(T, bt), triton_cdiv(C, bc))](
        x, weight, weight, pool, slots, cu, y, out, T, C, B, B.bit_length(),
        x.stride(0), weight.stride(0), weight.stride(1), *pool.stride(), y.stride(0), 0, 0, 0,
        W=weight.shape[1], BT=bt, BC=bc, HAS_BIAS=False, SILU=True, PER_POS=False, INTERIOR=interior,
        num_warps=warps)


def _flat(y):
    return torch.cat([t.reshape(-1) for t in y]) if isinstance(y, tuple) else y.reshape(-1)


def _one(x, weight, pool, slots, cu, want, moved, bt, bc, warps, interior, do_bench) -> dict:
    T, C = x.shape
    shape = {"tiles": "packed", "bt": bt, "bc": bc, "num_warps": warps, "interior": interior}
    y = torch.empty(T, C, device=x.device, dtype=x.dtype)
    out = torch.empty(slots.numel(), C, weight.shape[1] - 1, device=x.device, dtype=x.dtype)
    run = dict(bt=bt, bc=bc, warps=warps, interior=interior)
    try:
        launch(x, weight, pool, slots, cu, y, out, **run)
        torch.cuda.synchronize()
    except Exception as e:  # a shape the compiler refuses (registers): recorded, not fatal
        return {**shape, "error": str(e)[:200]}
    same = torch.equal(y.reshape(-1), want) if want.numel() == y.numel() and not isinstance(want, tuple) else None
    us = do_bench(lambda: launch(x, weight, pool, slots, cu, y, out, **run)) * 1e3
    print(f"packed BT {bt:4d} BC {bc:4d} warps {warps}{' interior' if interior else '         '}: {us:8.1f} us  "
          f"{moved / us / 1e6:5.2f} TB/s")
    return {**shape, "time_us": us, "tb_s": moved / us / 1e6, "equal_to_shipped": same}


def _chunked(call, want, moved, bc, warps, channels_first, do_bench) -> dict:
    shape = {"tiles": "chunks", "bt": 64, "bc": bc, "num_warps": warps, "channels_first": channels_first}
    saved = dict(gdn_conv.CHUNK_LAUNCH)
    gdn_conv.CHUNK_LAUNCH.update(block_c=bc, num_warps=warps, channels_first=channels_first, min_tokens=0)
    try:
        with gdn_conv.chunk_tiles(True):
            try:
                same = torch.equal(_flat(call()[0]), want)
            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                return {**shape, "error": str(e)[:200]}
            us = do_bench(call) * 1e3
    finally:
        gdn_conv.CHUNK_LAUNCH.update(saved)
    order = "channels first" if channels_first else "tokens first  "
    print(f"chunks BT   64 BC {bc:4d} warps {warps} {order}: {us:8.1f} us  {moved / us / 1e6:5.2f} TB/s  "
          f"{'equal' if same else 'DIFFERENT'}")
    return {**shape, "time_us": us, "tb_s": moved / us / 1e6, "equal_to_shipped": same}


def triton_cdiv(a, b):
    return -(-a // b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens a request")
    p.add_argument("--channels", type=int, default=6144)
    p.add_argument("--requests", type=int, default=1)
    p.add_argument("--split", action="store_true", help="q / k / v written apart (at C/4, C/2 as the 0.8B's)")
    p.add_argument("--no-packed", action="store_true", help="leave out the packed tiles' sweep")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from triton.testing import do_bench

    dev, dt = torch.device("cuda"), torch.bfloat16
    R, C, W = a.requests, a.channels, 4
    T = R * a.tokens
    wide = torch.randn(T, C + 2048 + 32, device=dev, dtype=dt)  # q, k, v columns, then z / b / a
    x = wide[:, :C]
    weight = torch.randn(C, W, device=dev, dtype=dt)
    pool = torch.randn(R + 3, C, W - 1, device=dev, dtype=dt)
    slots = torch.arange(1, R + 1, device=dev)
    cu = torch.arange(0, T + 1, a.tokens, device=dev, dtype=torch.int32)
    chunks = chunk_indices(cu, 64)
    split = (C // 4, C // 2) if a.split else None

    def shipped():
        return causal_conv1d(x, weight, None, pool, slots, cu, split=split, chunks=chunks)

    with gdn_conv.chunk_tiles(False):
        want = _flat(shipped()[0])
    moved = 2 * T * C * x.element_size()
    records = []
    if not a.no_packed and not a.split:
        for interior in (False, True):
            for bt in (16, 32, 64):
                for bc in (64, 128, 256):
                    for warps in (4, 8):
                        records.append(_one(x, weight, pool, slots, cu, want, moved, bt, bc, warps, interior,
                                            do_bench))
    for bc in (32, 64, 128, 256):
        for warps in (4, 8, 16, 32):
            for first in (True, False) if bc in (64, 128) and warps in (8, 16) else (True,):
                records.append(_chunked(shipped, want, moved, bc, warps, first, do_bench))
    with gdn_conv.chunk_tiles(False):
        packed_us = do_bench(shipped) * 1e3
    saved = dict(gdn_conv.CHUNK_LAUNCH)
    gdn_conv.CHUNK_LAUNCH.update(min_tokens=0)  # the chunk tiles at any size
    with gdn_conv.chunk_tiles(True):
        chunk_us = do_bench(shipped) * 1e3
    gdn_conv.CHUNK_LAUNCH.update(saved)
    print(f"causal_conv1d (conv + final window): packed tiles {packed_us:.1f} us, chunk tiles {chunk_us:.1f} us "
          f"({gdn_conv.CHUNK_LAUNCH})")
    fla = None
    try:
        from fla.modules.causal_conv1d import causal_conv1d as fla_conv

        cu_long, cu_cpu = cu.long(), cu.long().cpu()
        xc = x.contiguous()  # fla-core's conv takes [1, T, C]
        fla_us = do_bench(lambda: fla_conv(xc[None], weight, None, activation="silu", cu_seqlens=cu_long,
                                           cu_seqlens_cpu=cu_cpu)) * 1e3
        from fla.modules.causal_conv1d.ops import causal_conv1d_fwd_kernel

        # its autotuner's pick for this shape: tuned in this run, or read from fla-core's config files
        best = getattr(causal_conv1d_fwd_kernel, "best_config", None) \
            or next(iter(getattr(causal_conv1d_fwd_kernel, "cache", {}).values()), None)
        fla = {"time_us": fla_us, "tb_s": moved / fla_us / 1e6, "best_config": str(best)}
        print(f"fla-core causal_conv1d: {fla_us:.1f} us {moved / fla_us / 1e6:.2f} TB/s ({best})")
    except Exception as e:  # noqa: BLE001 - the peer is optional
        fla = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    if a.out:
        cmd = (f"python benchmarks/conv_sweep.py --tokens {a.tokens} --channels {C} --requests {R}"
               f"{' --split' if a.split else ''}{' --no-packed' if a.no_packed else ''} --out {a.out}")
        with open(a.out, "w") as f:
            json.dump({"command": cmd, "environment": environment(), "shipped_us": packed_us,
                       "chunk_tiles_us": chunk_us, "chunk_launch": dict(gdn_conv.CHUNK_LAUNCH), "fla_core": fla,
                       "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
