"""The ``fnattn`` command line: ``fnattn demo`` (and ``python -m fnattn``)."""

from __future__ import annotations

import argparse
import sys
import time


def _progress(done: int, total: int, started: float, stream=sys.stderr) -> None:
    width = 30
    filled = int(width * done / total)
    rate = done / max(time.perf_counter() - started, 1e-9)
    stream.write(f"\rdecode [{'#' * filled}{'.' * (width - filled)}] {done}/{total}  {rate:6.1f} tok/s")
    if done == total:
        stream.write("\n")
    stream.flush()


def demo(args) -> int:
    import torch

    from . import ModelAttention, State
    from .driver import generate
    from .models import tiny

    torch.manual_seed(args.seed)
    cfg = tiny.TinyConfig()
    params = tiny.init_params(cfg, seed=args.seed, device=args.device)
    specs = tiny.layer_specs(cfg)
    ma = ModelAttention(specs, device=args.device)
    prompt = list(args.prompt.encode("utf-8"))
    pages = (len(prompt) + args.tokens) // args.page_size + 2
    state = State(specs, num_pages=pages, page_size=args.page_size, max_requests=1, device=args.device)
    print(f"fnattn demo: tiny GQA decoder ({cfg.num_layers} layers, {cfg.num_q_heads}q/{cfg.num_kv_heads}kv heads, "
          f"d{cfg.head_dim}, random weights) on {args.device}")
    print(f"prompt: {args.prompt!r} ({len(prompt)} tokens)")
    started = time.perf_counter()
    _progress(0, args.tokens, started)
    state, out = generate(tiny.step, params, ma, state, {0: prompt}, max_new_tokens=args.tokens,
                          on_step=lambda i: _progress(i + 1, args.tokens, started))
    elapsed = time.perf_counter() - started
    text = bytes(t for t in out[0]).decode("utf-8", errors="replace")
    print(f"generated {len(out[0])} tokens: {text!r}")
    print(f"{len(out[0]) / elapsed:.1f} tokens/s (prefill + decode, greedy, batch 1)")
    print(f"pages free after release: {state.free_pages}/{state.num_pages}")
    print()
    print(ma.explain())
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fnattn", description="Attention for LLM inference as pure functions.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="prefill a prompt and greedily decode with a tiny random model")
    p.add_argument("--prompt", default="Attention is a pure function.", help="prompt text (bytes are tokens)")
    p.add_argument("--tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per cache page (default 16)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.set_defaults(fn=demo)
    from .bench.cli import add_arguments
    from .bench.cli import run as bench

    b = sub.add_parser("bench", help="time kernels and backends on a GPU against their peers (JSON, PNG)")
    add_arguments(b)
    b.set_defaults(fn=bench)
    args = parser.parse_args(argv)
    if args.command == "demo" and args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
