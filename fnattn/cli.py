"""The ``fnattn`` command line: ``fnattn demo`` (and ``python -m fnattn``)."""

from __future__ import annotations

import argparse
import sys
import time


def _progress(done: int, total: int, started: float, stream=None) -> None:
    stream = stream or sys.stderr  # looked up per call: tests and notebooks swap sys.stderr
    width = 30
    filled = int(width * done / total)
    rate = done / max(time.perf_counter() - started, 1e-9)
    stream.write(f"\rdecode [{'#' * filled}{'.' * (width - filled)}] {done}/{total}  {rate:6.1f} tok/s")
    if done == total:
        stream.write("\n")
    stream.flush()


def demo(args) -> int:
    if args.mtp:
        return demo_mtp(args)
    if args.model != "tiny":
        return demo_family(args)
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
                          on_step=lambda i, _: _progress(i + 1, args.tokens, started))
    elapsed = time.perf_counter() - started
    text = bytes(t for t in out[0]).decode("utf-8", errors="replace")
    print(f"generated {len(out[0])} tokens: {text!r}")
    print(f"{len(out[0]) / elapsed:.1f} tokens/s (prefill + decode, greedy, batch 1)")
    print(f"pages free after release: {state.free_pages}/{state.num_pages}")
    print()
    print(ma.explain())
    return 0


def _state_for(specs, *, tokens: int, page_size: int, device, max_requests: int = 1, recurrent_ring: int = 2):
    from . import State

    pages = max_requests * (tokens // page_size + 2)
    return State(specs, num_pages=pages, page_size=page_size, max_requests=max_requests, device=device,
                 recurrent_ring=recurrent_ring)


def demo_family(args) -> int:
    """A built-in tiny config of one model family, random weights, token ids as the prompt."""
    import torch

    from . import ModelAttention
    from .driver import generate
    from .models.registry import random_model

    model = random_model(args.model, seed=args.seed, dtype=torch.float32, device=args.device)
    ma = ModelAttention(model.specs, device=args.device)
    prompt = [(7 * i + 3) % model.config.vocab_size for i in range(12)]
    state = _state_for(model.specs, tokens=len(prompt) + args.tokens, page_size=args.page_size, device=args.device)
    kinds = sorted({s.kind for s in model.specs})
    print(f"fnattn demo: {args.model} (tiny config, {len(model.specs)} layers: {', '.join(kinds)}, random weights)")
    print(f"prompt token ids: {prompt}")
    started = time.perf_counter()
    _progress(0, args.tokens, started)
    state, out = generate(model.step, model.params, ma, state, {0: prompt}, max_new_tokens=args.tokens,
                          on_step=lambda i, _: _progress(i + 1, args.tokens, started))
    elapsed = time.perf_counter() - started
    print(f"generated token ids: {out[0]}")
    print(f"{len(out[0]) / elapsed:.1f} tokens/s (prefill + decode, greedy, batch 1)")
    print()
    print(ma.explain())
    return 0


def demo_mtp(args) -> int:
    """Speculative decoding with a multi-token-prediction draft; prints acceptance and tokens per step."""
    import torch

    from . import ModelAttention
    from .speculative import Speculator

    if args.model == "tiny":
        from .models import tiny

        cfg = tiny.TinyConfig()
        params = tiny.init_params(cfg, seed=args.seed, device=args.device)
        target = (tiny.step_hidden, params, tiny.layer_specs(cfg))
        draft = (tiny.draft_step, tiny.init_draft(cfg, params, seed=args.seed + 1), tiny.draft_specs(cfg))
        prompt = list(args.prompt.encode("utf-8"))
    else:
        from .models.registry import family_named, random_model

        fam = family_named(args.model)
        if fam.draft is None or fam.step_hidden is None:
            print(f"fnattn demo: family {args.model!r} has no draft model for --mtp", file=sys.stderr)
            return 2
        model = random_model(args.model, seed=args.seed, dtype=torch.float32, device=args.device)
        d = fam.draft(model.config, model.params, None, seed=args.seed + 1)
        target, draft = (fam.step_hidden, model.params, model.specs), (d.step, d.params, d.specs)
        prompt = [(7 * i + 3) % model.config.vocab_size for i in range(12)]
    total = len(prompt) + args.tokens + (args.mtp + 1) * 2

    def parts(specs):
        return (ModelAttention(specs, device=args.device),
                # room in the ring for every verify position's state: native recovery copies nothing
                _state_for(specs, tokens=total, page_size=args.page_size, device=args.device,
                           recurrent_ring=args.mtp + 2))

    (t_attn, t_state), (d_attn, d_state) = parts(target[2]), parts(draft[2])
    spec = Speculator(target_step=target[0], target_params=target[1], target_attn=t_attn, target_state=t_state,
                      draft_step=draft[0], draft_params=draft[1], draft_attn=d_attn, draft_state=d_state,
                      num_draft=args.mtp, recovery=args.recovery)
    print(f"fnattn demo --mtp {args.mtp}: {args.model} target + draft head (random weights), "
          f"{args.recovery} recovery")
    started = time.perf_counter()
    out = [spec.start({0: prompt})[0]]
    steps, accepted = 0, 0
    while len(out) < args.tokens:
        emitted = spec.step()[0]
        out += emitted
        steps += 1
        accepted += len(emitted) - 1
        _progress(min(len(out), args.tokens), args.tokens, started)
    elapsed = time.perf_counter() - started
    spec.release(0)
    print(f"generated token ids: {out[: args.tokens]}")
    print(f"speculative steps: {steps}; mean accepted drafts per step: {accepted / max(steps, 1):.2f} of "
          f"{args.mtp}; tokens per step: {(len(out) - 1) / max(steps, 1):.2f}")
    print(f"{len(out) / elapsed:.1f} tokens/s (greedy, batch 1)")
    return 0


def generate_text(args) -> int:
    """Greedy generation from a local checkpoint directory with its tokenizer, streaming text."""
    from pathlib import Path

    import torch

    from . import ModelAttention
    from .driver import generate
    from .models.registry import load_model

    path = Path(args.model)
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        print(f"fnattn generate: {path} has no tokenizer.json", file=sys.stderr)
        return 2
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tok_file))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model = load_model(path, dtype=dtype, device=args.device)
    ma = ModelAttention(model.specs, device=args.device)
    prompt = tokenizer.encode(args.prompt).ids
    if not prompt:
        print("fnattn generate: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    state = _state_for(model.specs, tokens=len(prompt) + args.tokens, page_size=args.page_size, device=args.device)
    generated: list[int] = []
    shown = ""

    def stream(i, tokens):
        nonlocal shown
        generated.append(tokens[0])
        text = tokenizer.decode(generated)
        sys.stdout.write(text[len(shown):])
        sys.stdout.flush()
        shown = text

    sys.stdout.write(args.prompt)
    started = time.perf_counter()
    generate(model.step, model.params, ma, state, {0: prompt}, max_new_tokens=args.tokens, on_step=stream)
    elapsed = time.perf_counter() - started
    print(f"\n[{len(generated)} tokens, {len(generated) / elapsed:.1f} tokens/s]", file=sys.stderr)
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
    p.add_argument("--model", default="tiny",
                   help="tiny (default), or a built-in tiny config of a model family: qwen3_5, qwen3_next, "
                        "deepseek_v3, deepseek_v32, glm5, kimi_linear")
    p.add_argument("--mtp", type=int, default=0, metavar="K",
                   help="speculative decoding with a K-token draft head; prints acceptance and tokens per step")
    p.add_argument("--recovery", choices=["native", "replay"], default="native",
                   help="how recurrent layers recover after verification (with --mtp)")
    p.set_defaults(fn=demo)
    g = sub.add_parser("generate", help="greedy generation from a local checkpoint directory")
    g.add_argument("--model", required=True, help="directory with config.json, safetensors and tokenizer.json")
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--tokens", type=int, default=32, help="tokens to generate (default 32)")
    g.add_argument("--device", default="cpu", help="torch device (default cpu)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--page-size", type=int, default=16, help="tokens per cache page (default 16)")
    g.set_defaults(fn=generate_text)
    from .bench.cli import add_arguments
    from .bench.cli import run as bench

    b = sub.add_parser("bench", help="time kernels and backends on a GPU against their peers (JSON, PNG)")
    add_arguments(b)
    b.set_defaults(fn=bench)
    args = parser.parse_args(argv)
    if args.command in ("demo", "generate") and args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")
    if args.command == "demo" and args.mtp < 0:
        parser.error(f"--mtp must be >= 0, got {args.mtp}")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
