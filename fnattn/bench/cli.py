"""Argument parsing for ``fnattn bench`` / ``python -m fnattn.bench``."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys

from . import draw_png, print_table, with_ratios, write_json

CASES = ("decode", "prefill", "gdn-prefill", "gdn-decode", "gdn-decode-sweep", "kda-prefill", "mla-decode",
         "mla-sparse", "indexer", "standard")
MLA_CASES = ("mla-decode", "mla-sparse", "indexer")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("case", choices=CASES, help="what to time; 'standard' runs the reference set of cases")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="decode batch sizes")
    p.add_argument("--ctx", type=int, default=4096, help="cached tokens per request (decode)")
    p.add_argument("--tokens", type=int, nargs="+", default=[16384], help="prefill tokens")
    p.add_argument("--hq", type=int, default=32, help="query heads")
    p.add_argument("--hkv", type=int, default=8, help="key/value heads")
    p.add_argument("--dim", type=int, default=128, help="head dim")
    p.add_argument("--page-size", type=int, default=None, help="tokens per page (default 16; MLA cases 64)")
    p.add_argument("--heads", type=int, default=128, help="MLA query heads (mla-decode, mla-sparse, indexer)")
    p.add_argument("--topk", type=int, default=2048, help="tokens each query attends (mla-sparse, indexer)")
    p.add_argument("--layers", type=int, nargs="+", default=[1],
                   help="decode: layers per step (the pure path applies all their writes at once)")
    p.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA-graph replays")
    p.add_argument("--out", default="bench.json", help="JSON output path")
    p.add_argument("--png", default=None, help="also draw a PNG here")


def run(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("fnattn bench: needs a CUDA device (none found)", file=sys.stderr)
        return 2
    from ..kinds.full.bench import decode_case, prefill_case

    records = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # a time limit still writes what finished
    try:
        graph = not args.eager
        if args.case in MLA_CASES:
            records += mla_cases(args, graph)
        args.page_size = args.page_size or 16
        if args.case in ("decode", "standard"):
            for layers in args.layers:
                for b in args.batch:
                    records += decode_case(batch=b, ctx=args.ctx, hq=args.hq, hkv=args.hkv, dim=args.dim,
                                           page_size=args.page_size, layers=layers, graph=graph)
        if args.case == "standard":  # the Qwen3.5 full-attention shape too
            for b in args.batch:
                records += decode_case(batch=b, ctx=args.ctx, hq=16, hkv=4, dim=256, page_size=args.page_size,
                                       graph=graph)
        if args.case in ("prefill", "standard"):
            for t in args.tokens:
                records += prefill_case(tokens=t, hq=args.hq, hkv=args.hkv, dim=args.dim)
        if args.case in ("gdn-prefill", "gdn-decode", "gdn-decode-sweep", "kda-prefill", "standard"):
            from ..kinds.delta_rule.bench import recurrent_cases

            records += recurrent_cases(args.case)
    finally:
        with_ratios(records)
        print_table(records)
        write_json(records, args.out, command="fnattn bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]))
        if args.png and records:
            draw_png(records, args.png)
    return 0


def mla_cases(args, graph: bool) -> list[dict]:
    from ..kinds.mla.bench import decode_case as mla_decode
    from ..kinds.sparse_mla.bench import indexer_case, sparse_decode_case

    records, page = [], args.page_size or 64
    for b in args.batch:
        if args.case == "mla-decode":
            for layers in args.layers:
                records += mla_decode(batch=b, ctx=args.ctx, heads=args.heads, page_size=page, layers=layers,
                                      graph=graph)
        elif args.case == "mla-sparse":
            records += sparse_decode_case(batch=b, ctx=args.ctx, heads=args.heads, topk=args.topk, page_size=page,
                                          graph=graph)
        else:
            records += indexer_case(batch=b, ctx=args.ctx, heads=args.heads, topk=args.topk, page_size=page,
                                    graph=graph)
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fnattn bench", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))
