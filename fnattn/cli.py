"""The ``fnattn`` command line: ``fnattn demo``, ``fnattn generate``, ``fnattn bench`` (and ``python -m fnattn``)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time


def _progress(total: int):
    from .generation import Progress

    return Progress(total)


def _demo_sampler(args):
    from .generation import Sampler  # torch's draws: speculative sampling's acceptance reads the same generator
    return Sampler(temperature=args.temperature, seed=args.seed, kernel="torch")


def _how(args) -> str:
    return "sampled" if args.temperature else "greedy"


def _runner(step, params, ma, manifest, args, *, max_context: int):
    """A captured-step runner on CUDA unless ``--eager``; None (eager steps) otherwise."""
    if getattr(args, "eager", False) or not str(args.device).startswith("cuda"):
        return None
    from .graph import StepRunner

    runner = StepRunner(step, params, ma, manifest, max_context=max_context)
    if runner.in_pieces:  # a kind registered without capturable=True: its layers run between the graphs
        why = runner.uncapturable("decode")
        print(f"fnattn: decode captured in pieces around {len(why)} eager layer(s) ({why[0]}"
              f"{'; ...' if len(why) > 1 else ''})", file=sys.stderr)
    return runner


def _prefill_runner(step, params, ma, args, *, max_context: int):
    """Prefill captured in pieces per bucket on CUDA unless ``--eager`` (`fnattn.prefill_graph`), its largest
    bucket ``--chunk`` where given, else 2048 tokens (or the whole context, if shorter); None otherwise."""
    if getattr(args, "eager", False) or not str(args.device).startswith("cuda"):
        return None
    from .prefill_graph import PrefillRunner, tokens_up_to

    top = getattr(args, "chunk", None) or min(max_context, 2048)
    return PrefillRunner(step, params, ma, tokens=tokens_up_to(top), max_context=max_context)


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
    progress = _progress(args.tokens)
    runner = _runner(tiny.step, params, ma, tiny.manifest(cfg), args, max_context=len(prompt) + args.tokens)
    state, out = generate(tiny.step, params, ma, state, {0: prompt}, max_new_tokens=args.tokens, runner=runner,
                          sampler=_demo_sampler(args), on_step=lambda i, _: progress(i + 1))
    elapsed = time.perf_counter() - started
    text = bytes(t for t in out[0]).decode("utf-8", errors="replace")
    print(f"generated {len(out[0])} tokens: {text!r}")
    print(f"{len(out[0]) / elapsed:.1f} tokens/s (prefill + decode, {_how(args)}, batch 1)")
    print(f"pages free after release: {state.free_pages}/{state.num_pages}")
    print()
    print(ma.explain())
    return 0


def _state_for(specs, *, tokens: int, page_size: int, device, max_requests: int = 1, recurrent_ring: int = 2,
               prefix_checkpoints: bool = False):
    from . import State

    pages = max_requests * (tokens // page_size + 2)
    return State(specs, num_pages=pages, page_size=page_size, max_requests=max_requests, device=device,
                 recurrent_ring=recurrent_ring, prefix_checkpoints=prefix_checkpoints)


def demo_family(args) -> int:
    """A built-in tiny config of one model family, random weights, token ids as the prompt."""
    import torch

    from . import ModelAttention
    from .driver import generate
    from .models.registry import random_model

    model = random_model(args.model, seed=args.seed, dtype=torch.float32, device=args.device)
    ma = ModelAttention(model.specs, device=args.device)
    # The prompt's UTF-8 bytes, folded into the family's tiny vocabulary (there is no tokenizer).
    prompt = [b % model.config.vocab_size for b in args.prompt.encode("utf-8")] or [0]
    state = _state_for(model.specs, tokens=len(prompt) + args.tokens, page_size=args.page_size, device=args.device)
    kinds = sorted({s.kind for s in model.specs})
    print(f"fnattn demo: {args.model} (tiny config, {len(model.specs)} layers: {', '.join(kinds)}, random weights)")
    print(f"prompt: {args.prompt!r} as token ids {prompt}")
    started = time.perf_counter()
    progress = _progress(args.tokens)
    runner = _runner(model.step, model.params, ma, model.manifest(), args, max_context=len(prompt) + args.tokens)
    state, out = generate(model.step, model.params, ma, state, {0: prompt}, max_new_tokens=args.tokens,
                          sampler=_demo_sampler(args), on_step=lambda i, _: progress(i + 1), runner=runner)
    elapsed = time.perf_counter() - started
    print(f"generated token ids: {out[0]}")
    print(f"{len(out[0]) / elapsed:.1f} tokens/s (prefill + decode, {_how(args)}, batch 1)")
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
        manifest = tiny.manifest(cfg, hidden=True)
        draft = (tiny.draft_step, tiny.init_draft(cfg, params, seed=args.seed + 1), tiny.draft_specs(cfg))
        draft_manifest = tiny.manifest(cfg, hidden=True, hidden_in=True)
        prompt = list(args.prompt.encode("utf-8"))
    else:
        from .models.registry import family_named, random_model

        fam = family_named(args.model)
        if fam.draft is None or fam.step_hidden is None:
            with_draft = [name for name, f in _families().items() if f.draft is not None and f.step_hidden is not None]
            _user_error("fnattn demo", f"--mtp {args.mtp}: --model must be tiny or a family with a draft model "
                                       f"({', '.join(with_draft)}), got {args.model!r}")
        model = random_model(args.model, seed=args.seed, dtype=torch.float32, device=args.device)
        d = fam.draft(model.config, model.params, None, seed=args.seed + 1)
        target, draft = (fam.step_hidden, model.params, model.specs), (d.step, d.params, d.specs)
        manifest, draft_manifest = model.manifest(hidden=True), d.manifest(model.config)
        prompt = [(7 * i + 3) % model.config.vocab_size for i in range(12)]
    total = len(prompt) + args.tokens + (args.mtp + 1) * 2

    def parts(specs):
        return (ModelAttention(specs, device=args.device),
                # room in the ring for every verify position's state: native recovery copies nothing
                _state_for(specs, tokens=total, page_size=args.page_size, device=args.device,
                           recurrent_ring=args.mtp + 2))

    (t_attn, t_state), (d_attn, d_state) = parts(target[2]), parts(draft[2])
    runner = _runner(target[0], target[1], t_attn, manifest, args, max_context=total)  # the verify graph
    # the draft's proposal graphs, where the verify is captured too
    draft_runner = runner and _runner(draft[0], draft[1], d_attn, draft_manifest, args, max_context=total)
    spec = Speculator(target_step=target[0], target_params=target[1], target_attn=t_attn, target_state=t_state,
                      draft_step=draft[0], draft_params=draft[1], draft_attn=d_attn, draft_state=d_state,
                      num_draft=args.mtp, recovery=args.recovery, target_runner=runner, draft_runner=draft_runner,
                      sampler=_demo_sampler(args))
    print(f"fnattn demo --mtp {args.mtp}: {args.model} target + draft head (random weights), "
          f"{args.recovery} recovery")
    started = time.perf_counter()
    progress = _progress(args.tokens)
    out = [spec.start({0: prompt})[0]]
    steps, accepted = 0, 0
    while len(out) < args.tokens:
        emitted = spec.step()[0]
        out += emitted
        steps += 1
        accepted += len(emitted) - 1
        progress(min(len(out), args.tokens))
    elapsed = time.perf_counter() - started
    spec.release(0)
    print(f"generated token ids: {out[: args.tokens]}")
    print(f"speculative steps: {steps}; mean accepted drafts per step: {accepted / max(steps, 1):.2f} of "
          f"{args.mtp}; tokens per step: {(len(out) - 1) / max(steps, 1):.2f}")
    print(f"{len(out) / elapsed:.1f} tokens/s ({_how(args)}, batch 1)")
    # Said every run: 0 accepted looks like a bug, and here it is what random weights give.
    print("note: the target and its draft head have independent random weights, so few or no drafts are "
          "accepted; a checkpoint's trained MTP head is what makes them agree")
    return 0


MAX_NEW_TOKENS = 1 << 20  # the cap where a model states no max_position_embeddings


class _Parser(argparse.ArgumentParser):
    """Usage mistakes end in one line on stderr and exit status 2 (no usage block, no traceback)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def _user_error(prog: str, message: str):
    """Exit 2 with one line: for mistakes found after parsing (files, fields, limits)."""
    sys.stderr.write(f"{prog}: error: {' '.join(str(message).split())}\n")
    raise SystemExit(2)


def _int_in(lo: int, hi: int | None = None, what: str | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            bounds = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"must be {what or bounds}, got {value}")
        return value
    return parse


def _float_in(lo: float, hi: float, what: str, *, open_lo: bool = False):
    def parse(text: str) -> float:
        import math

        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < lo or value > hi or (open_lo and value == lo):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value
    return parse


_seed = _int_in(0, 2**63 - 1, "an int in [0, 2**63)")  # what torch's generators take


def _non_empty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError(f"must be a non-empty string, got {text!r}")
    return text


def _families() -> dict:
    """name -> `Family` of every model family in the registry (importing it loads the built-in ones, and torch)."""
    from .models.registry import FAMILIES, _load_builtin

    _load_builtin()
    return dict(sorted(FAMILIES.items()))


def _family_list() -> str:
    """The families, each with the config.json model types it reads where they are more than its own name."""
    return ", ".join(name if f.model_types == (name,) else f"{name} (model_type {' / '.join(f.model_types)})"
                     for name, f in _families().items())


class _FamilyHelp:
    """`demo --model`'s help text lists the registry's families only when the help is printed: the registry imports
    torch, which `fnattn --help` and `--version` do without (argparse formats ``%(families)s`` with str())."""

    def __str__(self) -> str:
        return _family_list()


def _demo_model(text: str) -> str:
    """``tiny`` or a family name, checked against the registry (a model_type or a directory gets a pointer)."""
    if text == "tiny":
        return text
    families = _families()
    if text in families:
        return text
    hint = next((f" (a {text} checkpoint is read by family {name}: give --model {name})"
                 for name, f in families.items() if text in f.model_types), "")
    if not hint and os.path.isdir(text):
        hint = " (a checkpoint directory runs with `fnattn generate --model DIR`)"
    raise argparse.ArgumentTypeError(f"must be tiny or a model family of {list(families)}, got {text!r}{hint}")


def _device(text: str) -> str:
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be a torch device such as cpu or cuda:0, got {text!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r} needs CUDA, which this torch build or machine lacks")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: only {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"must be cpu or cuda[:N], got {text!r}")
    elif device.index:  # the one CPU device is cpu (or cpu:0): tensors made on `cpu` are not on cpu:1
        raise argparse.ArgumentTypeError(f"must be cpu or cuda[:N] (the CPU has one device), got {text!r}")
    elif device.index == 0:
        return "cpu"
    return text


def _prompts(args, prog: str) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        from pathlib import Path

        try:
            prompts += [line for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
        except OSError as e:
            _user_error(prog, f"--prompts-file {args.prompts_file}: {e.strerror or e}")
        except UnicodeDecodeError as e:
            _user_error(prog, f"--prompts-file {args.prompts_file}: must be UTF-8 text, got byte "
                              f"{e.object[e.start]:#04x} at offset {e.start}")
    if not prompts:
        _user_error(prog, "give at least one --prompt (or --prompts-file)")
    return prompts


def _tp_group(args, prog: str):
    """The TP group of ``--tp N`` (None for 1), with the rank's device; exit 2 on a launch mistake."""
    if args.tp == 1:
        return None
    from .tp import launch

    try:
        group, args.device = launch(args.tp, args.device)
    except ValueError as e:
        _user_error(prog, f"--tp {args.tp}: {e}")
    return group


def _load(args, prog: str, group=None):
    """(tokenizer, model, eos ids) of the checkpoint directory, or exit 2 naming the file or field."""
    from pathlib import Path

    import torch

    from .models.loading import CheckpointError, read_config, read_eos_token_ids
    from .models.registry import load_model

    path = Path(args.model)
    try:
        read_config(path)  # a missing or broken config.json is named before the tokenizer is
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            _user_error(prog, f"--model {path}: no tokenizer.json")
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception for unreadable files
            raise CheckpointError(f"{tok_file}: not a tokenizers file ({e})") from None
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
        if group is None:
            model = load_model(path, dtype=dtype, device=args.device)
        else:
            from .models.tp import load_model_tp

            model = load_model_tp(path, group, dtype=dtype, device=args.device)
        eos = read_eos_token_ids(path)
    except (CheckpointError, ValueError) as e:  # ValueError: adapters refusing a config field
        _user_error(prog, str(e))
    return tokenizer, model, eos, read_config(path).get("max_position_embeddings")


TRANSFORMERS_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0}  # GenerationConfig's


def _sampling(args, prog: str) -> dict:
    """temperature, top_k, top_p and min_p: each option given wins, then generation_config.json's field.

    As in transformers, the file's temperature is used only where it says ``do_sample: true``
    (else greedy), and then its unset fields take transformers' defaults (top_k 50).
    """
    from .models.loading import CheckpointError, read_sampling_defaults

    try:
        gen = read_sampling_defaults(args.model)
    except CheckpointError as e:
        _user_error(prog, str(e))
    sampling = gen.get("do_sample") is True
    base = TRANSFORMERS_SAMPLING if sampling else {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    if not sampling:
        gen = {k: v for k, v in gen.items() if k != "temperature"}
    return {k: getattr(args, k) if getattr(args, k) is not None else gen.get(k, base[k]) for k in base}


def generate_text(args) -> int:
    """Generation from a local checkpoint directory with its tokenizer: streamed text, or --json."""
    import json

    from . import ModelAttention
    from .driver import generate_completions
    from .generation import Sampler, StopCriteria

    prog = "fnattn generate"
    texts = _prompts(args, prog)
    group = _tp_group(args, prog)
    if group is not None and group.rank:  # every rank runs the same steps; rank 0 speaks for them
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the rest of this process)
    tokenizer, model, eos, max_positions = _load(args, prog, group)
    prompts = {}
    for i, text in enumerate(texts):
        prompts[i] = tokenizer.encode(text).ids
        if not prompts[i]:
            _user_error(prog, f"--prompt {text!r} encodes to no tokens")
    longest = max(len(p) for p in prompts.values())
    if isinstance(max_positions, int) and longest + args.max_new_tokens > max_positions:
        _user_error(prog, f"--max-new-tokens {args.max_new_tokens}: the prompt ({longest} tokens) plus the new "
                          f"tokens exceed the model's max_position_embeddings ({max_positions})")
    stop = StopCriteria(max_new_tokens=args.max_new_tokens, eos_token_ids=eos, stop_strings=tuple(args.stop or ()))
    if args.sampler == "flashinfer" and not (str(args.device).startswith("cuda")
                                             and importlib.util.find_spec("flashinfer") is not None):
        _user_error(prog, f"--sampler flashinfer needs --device cuda and flashinfer installed (device {args.device})")
    seed = args.seed
    if group is not None and seed is None:  # ranks sample alike only from one seed: rank 0's
        import random

        import torch.distributed as dist

        box = [random.getrandbits(63)]
        dist.broadcast_object_list(box, src=0)
        seed = box[0]
    sampler = Sampler(**_sampling(args, prog), seed=seed, kernel=args.sampler)
    ma = ModelAttention(model.specs, device=args.device)
    running = min(args.max_batch or len(prompts), len(prompts))
    share = len(prompts) > 1 and not args.no_prefix_sharing and not args.mixed
    # Recurrent layers resume a shared prefix from states kept at page boundaries.
    state = _state_for(model.specs, tokens=longest + args.max_new_tokens, page_size=args.page_size,
                       device=args.device, max_requests=running, prefix_checkpoints=share)
    streaming = len(prompts) == 1 and not args.json

    def on_text(r: int, chunk: str) -> None:
        if streaming:
            sys.stdout.write(chunk)
            sys.stdout.flush()

    if streaming:
        sys.stdout.write(texts[0])
    started = time.perf_counter()
    runner = _runner(model.step, model.params, ma, model.manifest(), args,
                     max_context=longest + args.max_new_tokens)
    prefill_runner = _prefill_runner(model.step, model.params, ma, args, max_context=longest + args.max_new_tokens)
    result = generate_completions(model.step, model.params, ma, state, prompts, stop=stop, sampler=sampler,
                                  tokenizer=tokenizer, on_text=on_text, max_running=running,
                                  share_prefixes=share, runner=runner, prefill_runner=prefill_runner,
                                  mixed=args.mixed, chunk=args.chunk)
    _, done = result
    elapsed = time.perf_counter() - started
    total = sum(len(c.ids) for c in done.values())
    if args.json:
        rows = [{"prompt": texts[r], "prompt_ids": c.prompt, "ids": c.ids, "text": c.text,
                 "finish_reason": c.finish_reason,
                 "timings": {"first_token_s": c.first_token_s, "finished_s": c.finished_s,
                             "tokens_per_s": len(c.ids) / max(c.finished_s or 0.0, 1e-9)}}
                for r, c in done.items()]
        print(json.dumps({"model": str(args.model), "elapsed_s": elapsed, "completions": rows, "stats": result.stats},
                         ensure_ascii=False))
    elif not streaming:
        for r, c in done.items():
            print(f"[{r}] {texts[r]}{c.text}")
    hits = f", prefix hit rate {result.stats['prefix_hit_rate']:.0%}" if len(prompts) > 1 else ""
    if group is None or group.rank == 0:
        tp = f", tp={group.size}" if group is not None else ""
        print(f"\n[{total} tokens, {total / elapsed:.1f} tokens/s{hits}{tp}]", file=sys.stderr)
    if group is not None:  # every rank leaves together (a peer's closed connection would abort the others)
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fnattn")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", type=_device, help="torch device: cpu (default) or cuda[:N]")
    p.add_argument("--page-size", type=_int_in(1, 1 << 16), default=16, help="tokens per cache page (default 16)")
    p.add_argument("--eager", action="store_true",
                   help="run every step eagerly; on CUDA decode and MTP verify steps are captured in graphs, and "
                        "generate's prefill in pieces per bucket, by default")
    p.add_argument("--invariant", action="store_true",
                   help="compute each token in an order that depends only on its own context (fnattn.switches "
                        "'invariant'): the same ids whatever the batch, and MTP's ids equal plain greedy's; on "
                        "CUDA the kernels that do not honour it step aside for Triton paths that do")


def main(argv=None) -> int:
    parser = _Parser(prog="fnattn", description="Attention for LLM inference as pure functions.")
    parser.add_argument("--version", action="version", version=f"fnattn {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="command")  # without one: the help, then exit 2
    p = sub.add_parser("demo", help="prefill a prompt and decode (greedy, or sampled) with a tiny random model")
    p.add_argument("--prompt", default="Attention is a pure function.", type=_non_empty,
                   help="prompt text (bytes are tokens)")
    p.add_argument("--tokens", "--max-new-tokens", dest="tokens", type=_int_in(1, MAX_NEW_TOKENS), default=32,
                   help=f"tokens to generate (default 32, at most {MAX_NEW_TOKENS})")
    _common(p)
    p.add_argument("--seed", type=_seed, default=0, help="weight seed (default 0)")
    model = p.add_argument("--model", default="tiny", type=_demo_model,
                           help="tiny (default), or a built-in tiny config of a model family: %(families)s")
    model.families = _FamilyHelp()
    p.add_argument("--mtp", type=_int_in(0), default=0, metavar="K",
                   help="speculative decoding with a K-token draft head; prints acceptance and tokens per step")
    p.add_argument("--recovery", choices=["native", "replay"], default="native",
                   help="how recurrent layers recover after verification (with --mtp)")
    p.add_argument("--temperature", type=_float_in(0, 1e4, "a number >= 0"), default=0.0,
                   help="0: greedy (default); > 0: sample, seeded by --seed (with --mtp: speculative sampling)")
    p.set_defaults(fn=demo)
    g = sub.add_parser("generate", help="generation from a local checkpoint directory")
    g.add_argument("--model", required=True, help="directory with config.json, safetensors and tokenizer.json")
    g.add_argument("--prompt", action="append", help="prompt text; repeat it for several prompts in one batch")
    g.add_argument("--prompts-file", help="a text file with one prompt per line (added after any --prompt)")
    g.add_argument("--max-new-tokens", "--tokens", dest="max_new_tokens", type=_int_in(1, MAX_NEW_TOKENS),
                   default=32, help="tokens to generate per prompt at most (default 32; bounded by the model's "
                                    f"max_position_embeddings, or {MAX_NEW_TOKENS} where it states none)")
    # The sampling options default to generation_config.json's fields (see _sampling), else greedy.
    g.add_argument("--temperature", type=_float_in(0, 1e4, "a number >= 0"), default=None,
                   help="0: greedy; > 0: sample (default: generation_config.json's where do_sample is true, "
                        "else 0)")
    g.add_argument("--top-k", type=_int_in(0), default=None,
                   help="keep the k most likely tokens (0: off; default: generation_config.json's)")
    g.add_argument("--top-p", type=_float_in(0, 1, "in (0, 1]", open_lo=True), default=None,
                   help="nucleus sampling mass (1: off; default: generation_config.json's)")
    g.add_argument("--min-p", type=_float_in(0, 1, "in [0, 1]"), default=None,
                   help="drop tokens below min-p times the top probability (0: off; default: "
                        "generation_config.json's)")
    g.add_argument("--seed", type=_seed, default=None,
                   help="sampling seed: the same seed gives the same tokens")
    g.add_argument("--sampler", choices=["auto", "torch", "flashinfer"], default="auto",
                   help="sampling kernels: auto (default: FlashInfer's fused kernels for a CUDA model when "
                        "installed, else torch), torch (the same tokens as transformers for a seed), flashinfer")
    g.add_argument("--stop", action="append", type=_non_empty,
                   help="stop when the text contains this string (repeatable); the stop string is not printed")
    g.add_argument("--max-batch", type=_int_in(1), default=None,
                   help="requests running at once (default: every prompt); the others wait and are admitted "
                        "as running ones finish")
    g.add_argument("--mixed", action="store_true",
                   help="prompts admitted while others decode (--max-batch) are prefilled inside the running "
                        "requests' decode steps, each layer's decode and prefill backends side by side, instead "
                        "of in steps of their own that keep those waiting; turns prefix sharing off")
    g.add_argument("--chunk", type=_int_in(1), default=None,
                   help="prompt tokens a request feeds per step at most (chunked prefill; default: all at once)")
    g.add_argument("--json", action="store_true", help="print ids, text, finish reason and timings per prompt as JSON")
    g.add_argument("--no-prefix-sharing", action="store_true",
                   help="with several prompts, do not share the pages of their common prefix (shared by default; "
                        "the hit rate is reported)")
    _common(g)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--tp", type=_int_in(1, 1 << 10), default=1,
                   help="tensor-parallel ranks (default 1); N > 1 under torchrun --nproc-per-node N, each rank "
                        "holding 1/N of the heads and MLP (NCCL with --device cuda, else gloo)")
    g.set_defaults(fn=generate_text)
    from .bench.cli import ABOUT, add_arguments
    from .bench.cli import run as bench

    b = sub.add_parser("bench", help="time kernels and backends on a GPU against their peers (JSON, PNG)",
                       description=ABOUT)
    add_arguments(b)
    b.set_defaults(fn=bench)
    words = sys.argv[1:] if argv is None else list(argv)
    args, extra = parser.parse_known_args(words)
    if extra:  # said by the parser they were given to: a subcommand's, like every other mistake in its options
        # The top level takes no option values, so words before the command are the top level's own.
        given_to = parser
        if args.command is not None and words.index(args.command) == 0:
            given_to = sub.choices[args.command]
        given_to.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help(sys.stderr)
        _user_error("fnattn", f"a command is required: one of {', '.join(sub.choices)}")
    from .threads import apply_thread_policy

    try:
        apply_thread_policy()
    except ValueError as e:
        _user_error("fnattn", e)
    invariant = getattr(args, "invariant", False)
    from . import switches

    try:
        with switches.set(invariant=invariant):
            return args.fn(args)
    except BrokenPipeError:  # the reader went away (`fnattn demo | head`): stop quietly, as shell tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        return 1


if __name__ == "__main__":
    sys.exit(main())
