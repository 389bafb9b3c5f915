"""Whether `short_conv_tiles` should be on: the GDN conv of a verify step, its token tile as the table gives it and
halved to fill the device, timed (one call replayed from a CUDA graph) and compared bit for bit.

    python benchmarks/conv_short_tiles.py --batch 1 8 32 --tokens 4 --out conv_short_tiles.json

Each case is ``--batch`` requests of ``--tokens`` tokens (k + 1 for k drafts) over the Qwen3.5-0.8B GDN layer's
6144 conv channels, with per-position windows (what a verify keeps for its rollback) and without. NaN times
without CUDA (a smoke run under TRITON_INTERPRET=1 checks the plan and the bits).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from fnattn.kernels.gdn_conv import causal_conv1d

from fnattn.bench import timed, write_json
from fnattn.kernels import gdn_conv


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--tokens", type=int, default=4, help="tokens a request (k + 1)")
    p.add_argument("--channels", type=int, default=6144)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.tokens < 1 or args.channels < 1 or any(b < 1 for b in args.batch):
        p.error(f"--batch, --tokens, --channels: expected values >= 1, got {args.batch}, {args.tokens}, "
                f"{args.channels}")
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)
    C, W = args.channels, 4
    records = []
    for B in args.batch:
        g = torch.Generator().manual_seed(B)
        x = torch.randn(B * args.tokens, C, generator=g).to(dev, dtype)
        w = (torch.randn(C, W, generator=g) * 0.5).to(dev, dtype)
        pool = torch.randn(B + 1, C, W - 1, generator=g).to(dev, dtype)
        slots = torch.arange(B, dtype=torch.int32, device=dev)
        cu = torch.arange(0, B * args.tokens + 1, args.tokens, dtype=torch.int32, device=dev)
        for per_pos in (True, False):
            row = {"case": f"conv B{B} T{args.tokens} C{C}{' per-position' if per_pos else ''}", "batch": B,
                   "tokens": args.tokens, "per_position_states": per_pos}
            outs = {}
            for on in (False, True):
                with gdn_conv.short_conv_tiles(on):
                    row["token_tile_on" if on else "token_tile_off"] = gdn_conv.token_tile(
                        B * args.tokens, C, min(128, C), torch.cuda.current_device() if cuda else None)
                    call = lambda x=x, w=w, pool=pool, slots=slots, cu=cu, per_pos=per_pos: causal_conv1d(  # noqa: E731
                        x, w, None, pool, slots, cu, per_position_states=per_pos)
                    outs[on] = call()
                    row["us_on" if on else "us_off"] = timed(call) if cuda else float("nan")
            row["same_bits"] = all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
            row["on_over_off"] = row["us_on"] / row["us_off"]
            records.append(row)
            print(json.dumps(row))
    if args.out:
        write_json(records, args.out, command="python benchmarks/conv_short_tiles.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
