"""Argument parsing for ``fnattn bench`` / ``python -m fnattn.bench``."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys

from . import draw_png, print_table, with_ratios, write_json

CASES = ("decode", "prefill", "gdn-prefill", "gdn-decode", "kda-prefill", "mla-decode", "mla-sparse", "indexer",
         "standard", "model", "overhead", "linear", "invariance", "generate")
MLA_CASES = ("mla-decode", "mla-sparse", "indexer")
# what `fnattn bench --help` says above the options (and `python -m fnattn.bench --help`)
ABOUT = ("Time fnattn's standard cases next to their peers (FlashInfer, FlashMLA, fla-core, torch SDPA, "
         "transformers, the memory roofline) and write the records as JSON (and a PNG). Tile sweeps and A/B "
         "comparisons of fast-path switches are scripts in the repository's benchmarks/ folder.")
DEFAULT_BATCH = [1, 8, 64]
DEFAULT_PROMPT = [512]
LINEAR_BATCH = [1, 8, 32]  # rows of a decode-sized projection (fnattn bench linear)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("case", choices=CASES,
                   help="what to time; 'standard' runs the reference set of cases; 'indexer': the DSA indexer "
                        "(bf16 / FP8 keys, both selections) against the field's pipeline, the sparse layer of the "
                        "same shape, and DeepSeek-V4's CSA indexer (top-k 512 and 1024)")
    p.add_argument("--batch", type=int, nargs="+", default=DEFAULT_BATCH,
                   help="decode batch sizes (default 1 8 64; linear: rows, default 1 8 32)")
    p.add_argument("--ctx", type=int, default=4096, help="cached tokens per request (decode)")
    p.add_argument("--tokens", type=int, nargs="+", default=[16384], help="prefill tokens")
    p.add_argument("--hq", type=int, default=32, help="query heads")
    p.add_argument("--hkv", type=int, default=8, help="key/value heads")
    p.add_argument("--dim", type=int, default=128, help="head dim")
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per page (default 16; MLA cases 64; model, overhead: the size the chosen backends "
                        "need, else 16)")
    p.add_argument("--heads", type=int, default=128, help="MLA query heads (mla-decode, mla-sparse, indexer)")
    p.add_argument("--topk", type=int, default=2048, help="tokens each query attends (mla-sparse, indexer)")
    p.add_argument("--layers", type=int, nargs="+", default=[1],
                   help="decode: layers per step (the pure path applies all their writes at once)")
    p.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA-graph replays")
    p.add_argument("--out", default="bench.json", help="JSON output path")
    p.add_argument("--png", default=None, help="also draw a PNG here")
    lin = p.add_argument_group("linear", "fnattn bench linear: decode-sized projections, cuBLAS vs skinny_linear "
                                         "(fnattn/bench/linear.py)")
    # The case times the config table only; the sweep it was tuned from is benchmarks/linear_sweep.py. The flag
    # stays so that the commands older records name still run.
    lin.add_argument("--no-sweep", action="store_true", help="accepted and ignored: the case never sweeps "
                                                              "(benchmarks/linear_sweep.py does)")
    m = p.add_argument_group("model", "fnattn bench model: a whole model (fnattn/bench/model.py)")
    m.add_argument("--family", default="qwen3_5",
                   help="model family (default qwen3_5; invariance also takes 'all': every family)")
    m.add_argument("--shape", default=None,
                   help="tiny (CPU-sized), tiny-24 (its widths, 24 layers) or a real shape of the family: qwen3_5 "
                        "0.8b, deepseek_v32 2-layer, kimi_linear 4-layer (released layer shapes, fewer layers) "
                        "(default tiny; overhead: tiny on CPU, 0.8b on CUDA)")
    m.add_argument("--prompt", type=int, nargs="+", default=DEFAULT_PROMPT,
                   help="prompt / cached tokens per request (default 512; invariance: one value, the timed decode "
                        "step's context, default 16)")
    m.add_argument("--steps", type=int, default=None,
                   help="decode steps timed per case (default 32; 64 for the CPU tiny end-to-end case)")
    m.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    m.add_argument("--prefill-tokens", type=int, default=16384, help="time prefill when batch x prompt <= this")
    m.add_argument("--hf-tokens", type=int, default=65536, help="run transformers when batch x prompt <= this")
    m.add_argument("--no-transformers", action="store_true", help="skip the transformers peer")
    m.add_argument("--prefer", nargs="+", default=None, metavar="BACKEND",
                   help="backend names in order of preference for every layer (default: fnattn's own ranking), "
                        "e.g. --prefer triton_fused triton fla reference")
    m.add_argument("--uncapturable", default=None, metavar="KIND",
                   help="model: KIND's decode backend registered again as a notebook's, without capturable=True: "
                        "the graph case then replays pieces around KIND's layers (docs/graphs.md, 'Decode in "
                        "pieces'), e.g. --uncapturable full")
    m.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, under torchrun --nproc-per-node N "
                                                     "(default 1; rank 0 writes the results)")
    m.add_argument("--new-tokens", type=int, default=None,
                   help="invariance: tokens each request decodes in the greedy and speculative comparisons "
                        "(default 32 on a CPU, 256 on CUDA)")
    m.add_argument("--cost-only", action="store_true",
                   help="invariance: time the decode step with the mode off and on (invariant_cost) and skip the "
                        "properties")
    g = p.add_argument_group("generate", "fnattn bench generate: time to first token, decode, MTP and a serving "
                                          "mix (fnattn/bench/generate.py; also --family, --shape, --batch, "
                                          "--prompt, --steps, --device, --eager)")
    g.add_argument("--long-prompt", type=int, default=None, help="the long prefill's tokens (default 8192 on "
                                                                   "CUDA, 256 on a CPU)")
    g.add_argument("--draft", type=int, default=3, help="MTP drafts per step (default 3)")
    g.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="also time the MTP cases with the draft's head keeping the first N token ids' rows "
                        "(DraftModel.with_vocab; default: not)")
    g.add_argument("--mix", type=int, nargs=4, default=None, metavar=("REQUESTS", "LO", "HI", "NEW"),
                   help="serving mix: REQUESTS prompts of LO..HI tokens, NEW tokens each (default 64 128 4096 256 "
                        "on CUDA, 4 16 64 8 on a CPU)")
    m.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="also profile STEPS decode steps of each case, eager and replayed, and one prefill "
                        "step: time per step by "
                        "kernel (CUDA) or leaf torch op (CPU), name and kind, and each layer's time against its "
                        "own bytes (the eager steps), in the JSON (fnattn/bench/profile.py; default 0: off)")


def run_model(args) -> int:
    from .model import draw_model_png, print_model_table, run_model_bench

    args.shape = args.shape or "tiny"
    for name in ("prompt", "batch"):
        if any(v < 1 for v in getattr(args, name)):
            print(f"fnattn bench: --{name} values must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if args.profile < 0:
        print(f"fnattn bench: --profile must be >= 0, got {args.profile}", file=sys.stderr)
        return 2
    if args.steps is not None and args.steps < 1:
        print(f"fnattn bench: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    import torch

    if args.device not in (None, "cpu") and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        print(f"fnattn bench: --device must be cpu or an available cuda device, got {args.device!r}", file=sys.stderr)
        return 2
    group = None
    if args.tp != 1:
        from ..tp import launch

        try:
            if args.tp < 1:
                raise ValueError("must be >= 1")
            group, args.device = launch(args.tp, args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        except ValueError as e:
            print(f"fnattn bench: --tp {args.tp}: {e}", file=sys.stderr)
            return 2
    records = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # a time limit still writes what finished
    steps = args.steps or (64 if args.shape == "tiny" else 32)
    lead = group is None or group.rank == 0  # every rank times the same steps; rank 0 reports them
    try:
        run_model_bench(family=args.family, shape=args.shape, batches=args.batch, prompts=args.prompt, steps=steps,
                        device=args.device, page_size=args.page_size, prefill_tokens=args.prefill_tokens,
                        hf_tokens=args.hf_tokens, transformers=not args.no_transformers, graph=not args.eager,
                        records=records, log=lambda line: lead and print(line, file=sys.stderr), tp=group,
                        prefer=args.prefer, profile=args.profile, uncapturable=args.uncapturable)
    except ValueError as e:
        if not records:  # a user mistake (family, shape): one line
            print(f"fnattn bench: {e}", file=sys.stderr)
            return 2
        raise
    finally:
        if records and lead:
            with_ratios(records)
            print_model_table(records)
            write_json(records, args.out, command=_model_command(args, steps))
            if args.png:
                why = draw_model_png(records, args.png)
                if why:
                    print(f"fnattn bench: {why}", file=sys.stderr)
    if group is not None:  # every rank leaves together (a peer's closed connection would abort the others)
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0


def _model_command(args, steps: int) -> str:
    """The command line that reproduces this run, from the parsed options (so also when called as a function)."""
    parts = ["fnattn bench model", f"--family {args.family}", f"--shape {args.shape}",
             "--batch " + " ".join(map(str, args.batch)), "--prompt " + " ".join(map(str, args.prompt)),
             f"--steps {steps}", f"--prefill-tokens {args.prefill_tokens}", f"--hf-tokens {args.hf_tokens}"]
    parts += [f"--device {args.device}"] if args.device else []
    parts += [f"--page-size {args.page_size}"] if args.page_size else []
    parts += ["--eager"] if args.eager else []
    parts += ["--no-transformers"] if args.no_transformers else []
    parts += ["--prefer " + " ".join(args.prefer)] if args.prefer else []
    parts += [f"--tp {args.tp}"] if args.tp != 1 else []
    parts += [f"--profile {args.profile}"] if args.profile else []
    parts += [f"--out {shlex.quote(args.out)}"] + ([f"--png {shlex.quote(args.png)}"] if args.png else [])
    return " ".join(parts)


def argv_command(case: str) -> str:
    """This process's command line as ``fnattn bench CASE ...``, however it was started (``fnattn bench``,
    ``python -m fnattn bench`` or ``python -m fnattn.bench``)."""
    rest = sys.argv[sys.argv.index(case) + 1:] if case in sys.argv else []
    return " ".join(["fnattn bench", case, *(shlex.quote(a) for a in rest)])


def run(args) -> int:
    import torch

    if args.case == "model":
        return run_model(args)
    if args.case == "overhead":  # the framework over the same kernels called directly (fnattn/bench/overhead.py)
        from .overhead import run_overhead

        return run_overhead(args)
    if args.case == "generate":  # the whole of generation (fnattn/bench/generate.py)
        return run_generate(args)
    if args.case == "invariance":  # a token's result against its phase, batch and graph (fnattn/bench/invariance.py)
        return run_invariance(args)
    if args.case == "linear":  # cuBLAS vs skinny_linear on Qwen3.5-0.8B's projections (fnattn/bench/linear.py)
        from .linear import run_linear

        return run_linear(args, LINEAR_BATCH if args.batch is DEFAULT_BATCH else args.batch,
                          command=argv_command(args.case))
    if not torch.cuda.is_available():
        print("fnattn bench: needs a CUDA device (none found)", file=sys.stderr)
        return 2
    from .cases.full import decode_case, prefill_case

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
        if args.case in ("gdn-prefill", "gdn-decode", "kda-prefill", "standard"):
            from .cases.delta_rule import recurrent_cases

            records += recurrent_cases(args.case)
    finally:
        with_ratios(records)
        print_table(records)
        write_json(records, args.out, command=argv_command(args.case))
        if args.png and records:
            draw_png(records, args.png)
    return 0


def _device_or_none(requested: str | None) -> str | None:
    """``--device`` for the cases that default to CUDA where there is one; None (said on stderr) when it
    names a device this machine lacks."""
    import torch

    device = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if device != "cpu" and not (device.startswith("cuda") and torch.cuda.is_available()):
        print(f"fnattn bench: --device must be cpu or an available cuda device, got {device!r}", file=sys.stderr)
        return None
    return device


def run_generate(args) -> int:
    from .generate import run_generate_bench

    device = _device_or_none(args.device)
    if device is None:
        return 2
    cuda = device.startswith("cuda")
    batches = [1, 8] if args.batch is DEFAULT_BATCH else args.batch
    long_prompt = args.long_prompt or (8192 if cuda else 256)
    mix = args.mix or ([64, 128, 4096, 256] if cuda else [4, 16, 64, 8])
    steps = args.steps or (32 if cuda else 6)
    for name, values in (("--batch", batches), ("--prompt", args.prompt), ("--long-prompt", [long_prompt]),
                         ("--draft", [args.draft]), ("--mix", mix), ("--steps", [steps]),
                         ("--draft-vocab", [1 if args.draft_vocab is None else args.draft_vocab])):
        if min(values) < 1:
            print(f"fnattn bench: {name} values must be >= 1, got {values}", file=sys.stderr)
            return 2
    if mix[1] > mix[2]:
        print(f"fnattn bench: --mix LO must be <= HI, got {mix[1]} > {mix[2]}", file=sys.stderr)
        return 2
    shape = args.shape or ("0.8b" if cuda else "tiny")
    if args.draft_vocab is not None:
        vocab = _vocab_size(args.family, shape)
        if vocab is not None and args.draft_vocab > vocab:
            print(f"fnattn bench: --draft-vocab must be at most the vocabulary ({vocab}), got {args.draft_vocab}",
                  file=sys.stderr)
            return 2
    # the command that reproduces this run, from the parsed options (so also when called as a function)
    command = (f"fnattn bench generate --family {args.family} --shape {shape} --device {device} --batch "
               f"{' '.join(map(str, batches))} --prompt {args.prompt[0]} --long-prompt {long_prompt} --steps {steps} "
               f"--draft {args.draft}{f' --draft-vocab {args.draft_vocab}' if args.draft_vocab else ''} "
               f"--mix {' '.join(map(str, mix))}{' --eager' if args.eager else ''} "
               f"--out {shlex.quote(args.out)}")
    records = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # a time limit still writes what finished
    try:
        run_generate_bench(family=args.family, shape=shape, device=device, batches=batches, prompt=args.prompt[0],
                           long_prompt=long_prompt, steps=steps, k=args.draft, mix=tuple(mix), graph=not args.eager,
                           reps=5, log=lambda line: print(line, file=sys.stderr), records=records,
                           draft_vocab=args.draft_vocab)
        print(json.dumps(records[-1]))
    except ValueError as e:
        if not records:  # a user mistake (family, shape): one line
            print(f"fnattn bench: {e}", file=sys.stderr)
            return 2
        raise
    finally:
        if records:
            write_json(records, args.out, command=command)
    return 0


def _vocab_size(family: str, shape: str) -> int | None:
    """The vocabulary of ``family`` at ``shape``, or None where the names are wrong (the bench says so later)."""
    from ..models.registry import family_named
    from .model import config_for

    try:
        return family_named(family).adapt(config_for(family, shape)).vocab_size
    except (ValueError, KeyError, AttributeError):
        return None


def run_invariance(args) -> int:
    from ..models.registry import family_names
    from .invariance import family_records, summary

    device = _device_or_none(args.device)
    if device is None:
        return 2
    names = family_names() if args.family == "all" else [args.family]
    if args.family != "all" and args.family not in family_names():
        print(f"fnattn bench: --family must be 'all' or one of {', '.join(family_names())}, got {args.family!r}",
              file=sys.stderr)
        return 2
    batches = [1, 8, 32, 128] if args.batch is DEFAULT_BATCH else args.batch
    tokens = args.new_tokens or (256 if device.startswith("cuda") else 32)
    shape = args.shape or "tiny"
    prompts = [16] if args.prompt is DEFAULT_PROMPT else args.prompt
    if len(prompts) != 1:
        print(f"fnattn bench: --prompt: invariance times one context, got {len(prompts)} values {prompts}",
              file=sys.stderr)
        return 2
    for name, values in (("--batch", batches), ("--new-tokens", [tokens]), ("--steps", [args.steps or 1]),
                         ("--prompt", prompts)):
        if min(values) < 1:
            print(f"fnattn bench: {name} values must be >= 1, got {values}", file=sys.stderr)
            return 2
    records = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # a time limit still writes what finished
    try:
        for name in names:
            records += family_records(name, shape=shape, device=device, tokens=tokens, batches=batches,
                                      steps=args.steps or 8, prompt=prompts[0], cost_only=args.cost_only,
                                      log=lambda line: print(line, file=sys.stderr))
        records.append(summary(records))
        print(json.dumps(records[-1]))
    except ValueError as e:
        if not records:  # a user mistake (family, shape): one line
            print(f"fnattn bench: {e}", file=sys.stderr)
            return 2
        raise
    finally:
        if records:
            write_json(records, args.out, command=argv_command(args.case))
    return 0


def mla_cases(args, graph: bool) -> list[dict]:
    from .cases.mla import decode_case as mla_decode
    from .cases.dsv4 import csa_indexer_case
    from .cases.sparse_mla import indexer_case, sparse_decode_case

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
            for topk in (512, 1024):  # DeepSeek-V4's CSA indexer over the same context
                records += csa_indexer_case(batch=b, ctx=args.ctx, topk=topk, page_size=page, graph=graph)
    return records


def main(argv=None) -> int:
    from ..threads import apply_thread_policy

    p = argparse.ArgumentParser(prog="fnattn bench", description=ABOUT)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        apply_thread_policy()
    except ValueError as e:
        print(f"fnattn bench: {e}", file=sys.stderr)
        return 2
    return run(args)
