"""The GDN prefill conv's launch shapes, timed: `kernels.gdn_conv._conv_kernel` at a prefill of the Qwen3.5-0.8B
GDN layer (8192 tokens, 6144 q / k / v channels read as a column slice of the input projection, window 4).

    python benchmarks/conv_sweep.py [--tokens 8192] [--out conv_sweep.json]

Each (BT, BC, num_warps) launch, with and without interior tiles (`kernels.gdn_conv.interior_tiles`: a tile
inside one request reads x alone), is checked against the shipped configuration's output first, then timed with
``triton.testing.do_bench``; TB/s counts x read once, y written once.
"""

import argparse
import json

import torch
from fnattn.kernels.gdn_conv import _conv_kernel, causal_conv1d

from fnattn.bench import environment


def launch(x, weight, pool, slots, cu, y, out, *, bt: int, bc: int, warps: int, interior: bool = False):
    T, C = x.shape
    B = slots.numel()
    _conv_kernel[(triton_cdiv(T, bt), triton_cdiv(C, bc))](
        x, weight, weight, pool, slots, cu, y, out, T, C, B, B.bit_length(),
        x.stride(0), weight.stride(0), weight.stride(1), *pool.stride(), y.stride(0), 0, 0, 0,
        W=weight.shape[1], BT=bt, BC=bc, HAS_BIAS=False, SILU=True, PER_POS=False, INTERIOR=interior,
        num_warps=warps)


def _one(x, weight, pool, slots, cu, want, moved, bt, bc, warps, interior, do_bench) -> dict:
    T, C = x.shape
    shape = {"bt": bt, "bc": bc, "num_warps": warps, "interior": interior}
    y = torch.empty(T, C, device=x.device, dtype=x.dtype)
    out = torch.empty(1, C, weight.shape[1] - 1, device=x.device, dtype=x.dtype)
    run = dict(bt=bt, bc=bc, warps=warps, interior=interior)
    try:
        launch(x, weight, pool, slots, cu, y, out, **run)
        torch.cuda.synchronize()
    except Exception as e:  # a shape the compiler refuses (registers): recorded, not fatal
        return {**shape, "error": str(e)[:200]}
    same = torch.equal(y, want)
    us = do_bench(lambda: launch(x, weight, pool, slots, cu, y, out, **run)) * 1e3
    print(f"BT {bt:4d} BC {bc:4d} warps {warps}{' interior' if interior else '         '}: {us:8.1f} us  "
          f"{moved / us / 1e6:5.2f} TB/s  {'equal' if same else 'DIFFERENT'}")
    return {**shape, "time_us": us, "tb_s": moved / us / 1e6, "equal_to_shipped": same}


def triton_cdiv(a, b):
    return -(-a // b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--channels", type=int, default=6144)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from triton.testing import do_bench

    dev, dt = torch.device("cuda"), torch.bfloat16
    T, C, W = a.tokens, a.channels, 4
    wide = torch.randn(T, C + 2048 + 32, device=dev, dtype=dt)  # q, k, v columns, then z / b / a
    x = wide[:, :C]
    weight = torch.randn(C, W, device=dev, dtype=dt)
    pool = torch.randn(4, C, W - 1, device=dev, dtype=dt)
    slots = torch.tensor([1], device=dev)
    cu = torch.tensor([0, T], device=dev, dtype=torch.int32)
    want, _ = causal_conv1d(x, weight, None, pool, slots, cu)
    moved = 2 * T * C * x.element_size()
    records = []
    for interior in (False, True):
        for bt in (16, 32, 64, 128):
            for bc in (64, 128, 256):
                for warps in (4, 8):
                    records.append(_one(x, weight, pool, slots, cu, want, moved, bt, bc, warps, interior, do_bench))
    shipped = do_bench(lambda: causal_conv1d(x, weight, None, pool, slots, cu)) * 1e3
    print(f"shipped causal_conv1d (conv + final window): {shipped:.1f} us")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": f"python benchmarks/conv_sweep.py --tokens {T} --channels {C} --out {a.out}",
                       "environment": environment(), "shipped_us": shipped, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
