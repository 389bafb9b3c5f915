"""``fnattn bench model``: a whole model's prefill and decode, eager and captured, beside transformers
on the same weights and the memory roofline, all measured in one run.

Weights are random (`models.registry.random_checkpoint` of the family's config dict at ``--shape``),
bf16 on CUDA and fp32 on CPU. For each prompt length P and batch B:

- prefill: one step of B prompts of P tokens through the driver (the session, every layer, the apply),
  when B * P fits ``--prefill-tokens``, with logits for each prompt's last token only; tok/s = B * P / time;
- decode: ``--steps`` steps over B requests holding P cached tokens (random K/V and recurrent rows, as
  `bench.setup.cached_state` fills them), eager (`driver.run_step`: session, step, apply) and, where
  `fnattn.graph.StepRunner` captures, replayed from CUDA graphs; the median step and B / step tok/s;
- transformers' causal LM with the same tensors loaded by name (sdpa attention; fla's kernels when
  installed), prefill and decode, when B * P fits ``--hf-tokens``;
- the roofline: the weights read per step, and per step the weights plus every K/V row read and
  written and every recurrent row read and written, each over the device copy bandwidth measured now. A MoE
  step's routed experts count as many as its tokens picked in one untimed eager step before the timed ones
  (``experts_touched``: the distinct experts of each MoE layer).

Every decode record carries ``x_roofline`` (its step over its own roofline), ``achieved_tb_s`` (the step's
bytes, as the roofline counts them, over its time) and ``ratio_to_peer`` (transformers' step over this one,
> 1: faster); with ``--profile`` the profiled cases' records also carry ``launches_per_step``, and each eager
case has a ``fnattn eager layers`` record: every layer's kernel time a step (its work inside a profiler range,
`models.common.layer_ranges`) against its own bytes over the copy bandwidth (`roofline.layer_times`). The last record,
``model summary``, names the captured step at the first prompt length per batch (``decode_b1_ms``,
``decode_b8_ms``, ``decode_b32_ms`` where those batches ran) and its ``launches_per_step`` (batch 1, profiled).
``--shape tiny`` runs on CPU in seconds; its ``cpu e2e`` record is the tiny model's P-token prefill plus
``--steps`` decode steps, end to end.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time

import torch

from .roofline import (
    copy_bandwidth,
    expert_layers,
    experts_per_token,
    layer_times,
    print_layers,
    step_bytes,
    weight_bytes,
)

QWEN3_5_0_8B = {  # the Qwen3.5-0.8B text decoder's shape
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 1024, "num_hidden_layers": 24,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"], "intermediate_size": 3584,
    "hidden_act": "silu", "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": True,
}
QWEN3_5_0_8B["layer_types"] = QWEN3_5_0_8B["layer_types"] * 6

# Released models' layer shapes with fewer layers: every width, head count, expert count and vocabulary as
# released, so each layer's kernels and bytes are the real ones, at a size one H200 holds in random bf16.
DEEPSEEK_V32_2L = {  # DeepSeek-V3.2: 2 of its 61 layers, one dense (as its first three are), one MoE
    "model_type": "deepseek_v32", "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 2,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 163840,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "hidden_act": "silu",
    "attention_bias": False, "tie_word_embeddings": False,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048,
}
KIMI_LINEAR_4L = {  # Kimi-Linear-48B-A3B: 4 of its 27 layers, KDA x 3 then MLA (its 3:1 schedule)
    "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"], "first_k_dense_replace": 1,
    "linear_attn_config": {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
    "num_attention_heads": 32, "num_key_value_heads": 32, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 9216,
    "moe_intermediate_size": 1024, "num_experts": 256, "num_experts_per_token": 8, "num_expert_group": 1,
    "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 2.446, "num_shared_experts": 1,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
}
SHAPES = {"qwen3_5": {"0.8b": QWEN3_5_0_8B}, "deepseek_v32": {"2-layer": DEEPSEEK_V32_2L},
          "kimi_linear": {"4-layer": KIMI_LINEAR_4L}}
HF_CLASSES = {"qwen3_5": ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM")}


def config_for(family: str, shape: str) -> dict:
    """The config dict of ``family`` at ``shape`` ("tiny": the family's tiny config; "tiny-24": its widths
    with the layer schedule repeated to 24 layers, Qwen3.5-0.8B's count, a CPU stand-in for the host work of
    a real depth: the session, the apply and the launches scale with layers, not widths)."""
    from ..models.registry import family_named

    fam = family_named(family)
    if shape == "tiny":
        return fam.tiny_config()
    if shape == "tiny-24":
        cfg = fam.tiny_config()
        schedule = cfg.get("layer_types") or [None] * cfg["num_hidden_layers"]
        cfg["num_hidden_layers"] = 24
        if cfg.get("layer_types"):
            cfg["layer_types"] = [schedule[i % len(schedule)] for i in range(24)]
        return cfg
    known = sorted(SHAPES.get(family, {})) + ["tiny", "tiny-24"]
    if shape not in SHAPES.get(family, {}):
        raise ValueError(f"--shape: must be one of {known} for family {family!r}, got {shape!r}")
    return dict(SHAPES[family][shape])


# ------------------------------------------------------------------------------------------ bytes


def routed_experts_touched(model, ma, state, batch: int) -> tuple[list[int] | None, object]:
    """``-> (distinct experts each MoE layer's tokens picked in one eager decode step, the state after)``, or
    None for a model without routed experts (or whose expert layers `weight_bytes` does not see one by one)."""
    from fnattn.models.common import counting_routed_experts

    with counting_routed_experts() as counts:
        _, state = time_decode(model, ma, state, batch, 1, warmup=0)
    return (list(counts) if counts and len(counts) == len(expert_layers(model.params)) else None), state


# ------------------------------------------------------------------------------------------ timing


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _tokens(n: int, vocab: int, device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).to(device)


def time_prefill(model, ma, device, batch: int, prompt: int, *, page_size: int, reps: int,
                 warm: bool = True) -> list[float]:
    """Seconds of ``reps`` prefill steps of ``batch`` prompts of ``prompt`` tokens (a fresh State each time),
    after a first run, which compiles and autotunes and is not counted (``warm=False``: no first run)."""
    from ..batch import Batch
    from ..driver import run_step
    from ..state import State

    pages = batch * -(-prompt // page_size)
    times = []
    for i in range(reps + 1 if warm else reps):
        st = State(model.specs, num_pages=pages, page_size=page_size, max_requests=batch, device=device)
        for r in range(batch):
            st = st.admit(r)
        st = st.reserve({r: prompt for r in range(batch)})
        # logits for each prompt's last token only, as a server samples (and as transformers' logits_to_keep=1)
        b = Batch.prefill(st, {r: prompt for r in range(batch)}, logits_for="last")
        tokens = _tokens(b.num_tokens, model.config.vocab_size, device, i)
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            run_step(model.step, model.params, ma, st, b, tokens)
        _sync(device)
        times.append(time.perf_counter() - t0)
        del st, b
    return times[1:] if warm else times


def decode_state(model, device, batch: int, ctx: int, *, page_size: int, room: int):
    """``batch`` requests holding ``ctx`` random cached tokens, with pages reserved for ``room`` more."""
    from .setup import cached_state

    return cached_state(model.specs, batch=batch, ctx=ctx, page_size=page_size, extra=room, device=device)


def time_decode(model, ma, state, batch: int, steps: int, *, runner=None, warmup: int = 3):
    """``-> (seconds of each of ``steps`` decode steps after ``warmup``, the state after)``; eager, or
    through ``runner``. An error from a step leaves the given handle stale (room was reserved first): as from
    `fnattn.driver.prefill`, the exception's ``state`` is the live State, nothing of the failed step applied."""
    from ..batch import Batch
    from ..driver import run_step

    device, ids = state.device, list(range(batch))
    tokens = _tokens(batch, model.config.vocab_size, device, 7)
    times = []
    with torch.no_grad():
        for i in range(warmup + steps):
            state = state.reserve({r: 1 for r in ids})
            _sync(device)
            t0 = time.perf_counter()
            try:
                if runner is None:
                    state, logits = run_step(model.step, model.params, ma, state, Batch.decode(state, ids), tokens)
                else:
                    state, logits = runner.decode(state, ids, tokens)
            except Exception as e:
                e.state = state
                raise
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return times, state


def cpu_end_to_end(model, ma, *, prompt: int, steps: int, page_size: int) -> dict:
    """The tiny model's ``prompt``-token prefill then ``steps`` greedy decode steps, one request, on CPU;
    the best of three runs (a warm-up run first)."""
    from ..batch import Batch
    from ..driver import prefill, run_step
    from ..state import State

    ids = [(7 * i) % (model.config.vocab_size - 1) + 1 for i in range(prompt)]
    best = None
    for _ in range(4):
        st = State(model.specs, num_pages=-(-(prompt + steps) // page_size) + 1, page_size=page_size,
                   max_requests=1).admit(0)
        t0 = time.perf_counter()
        with torch.no_grad():
            st, last = prefill(model.step, model.params, ma, st, {0: ids})
            t1 = time.perf_counter()
            tok = last[0].argmax().view(1)
            for _ in range(steps):
                st = st.reserve({0: 1})
                st, logits = run_step(model.step, model.params, ma, st, Batch.decode(st, [0]), tok)
                tok = logits[0].argmax().view(1)
        t2 = time.perf_counter()
        run = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0}
        best = run if best is None or run["total_s"] < best["total_s"] else best
    return best


# ------------------------------------------------------------------------------------------ transformers


def _check_memory(fam, cfg, dtype, device, what: str) -> None:
    """Refuse, naming the sizes, a model whose weights alone exceed the device's free memory (the host's
    physical memory on a CPU), before allocating any of it."""
    import os

    need = sum(math.prod(shape) for shape in fam.weight_shapes(cfg).values()) * dtype.itemsize
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[0]
        where = f"{torch.cuda.get_device_name(device)} (free)"
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        where = "this host"
    if need > have:
        raise ValueError(f"{what}: needs {need / 1e9:.1f} GB of {str(dtype).removeprefix('torch.')} weights on "
                         f"{device.type}, {where} has {have / 1e9:.1f} GB")


def transformers_model(family: str, config: dict, weights: dict, device, dtype):
    """transformers' causal LM of ``config`` holding ``weights`` (loaded by name) or None, with the reason."""
    if family not in HF_CLASSES:
        return None, f"no transformers class is wired for family {family!r}"
    try:
        import importlib

        module, config_cls, model_cls = HF_CLASSES[family]
        mod = importlib.import_module(f"transformers.models.{module}")
    except ImportError as e:
        return None, f"transformers does not have it: {e}"
    kw = {k: v for k, v in config.items() if k != "model_type"}
    hf_cfg = getattr(mod, config_cls)(**kw, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    hf_cfg._attn_implementation = "sdpa"
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = getattr(mod, model_cls)(hf_cfg).eval()
    finally:
        torch.set_default_dtype(before)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not (config.get("tie_word_embeddings") and m == "lm_head.weight")]
    if missing or unexpected:
        return None, f"weights do not load by name (missing {missing[:3]}, unexpected {unexpected[:3]})"
    if config.get("tie_word_embeddings"):
        hf.tie_weights()
    return hf, None


def hf_prefill_and_decode(hf, device, vocab: int, batch: int, prompt: int, steps: int, warmup: int = 2):
    """transformers: seconds of the B x P prefill (only the last logits kept) and of each decode step."""
    ids = _tokens(batch * prompt, vocab, device, 3).view(batch, prompt)
    with torch.no_grad():
        for _ in range(2):  # the first prefill compiles / autotunes fla's kernels
            _sync(device)
            t0 = time.perf_counter()
            out = hf(ids, use_cache=True, logits_to_keep=1)
            _sync(device)
            prefill_s = time.perf_counter() - t0
        # transformers renamed `past_key_values` to `cache` (5.2x); take whichever this version speaks
        key = "cache" if hasattr(out, "cache") else "past_key_values"
        cache, tok, times = getattr(out, key), out.logits[:, -1].argmax(-1, keepdim=True), []
        for i in range(warmup + steps):
            _sync(device)
            t0 = time.perf_counter()
            out = hf(tok, **{key: cache}, use_cache=True, logits_to_keep=1)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            cache = getattr(out, key)
    return prefill_s, times


# ------------------------------------------------------------------------------------------ the run


def _record(case, backend, phase, seconds, tokens, **extra) -> dict:
    rec = {"case": case, "backend": backend, "phase": phase, "time_us": seconds * 1e6,
           "tok_s": tokens / seconds if seconds else None}
    rec.update(extra)
    return rec


def _graph_runner(model, ma, batch: int, max_context: int):
    """A StepRunner for one bucket, or the reason there is none."""
    if ma.device.type != "cuda":
        return None, "CUDA graphs need a CUDA device"
    try:
        from ..graph import StepRunner
    except ImportError as e:
        return None, f"fnattn.graph.StepRunner is not available ({e})"
    runner = StepRunner(model.step, model.params, ma, model.manifest(), buckets=(batch,), max_context=max_context)
    if not runner.capture:
        why = "; ".join(runner.uncapturable("decode")) or "not a CUDA model"
        return None, f"no CUDA-graph capture here ({why})"
    return runner, None


def notebook_kind(model, ma, kind: str, prefer=None):
    """``ma`` over ``kind``'s decode backend registered again as a notebook registers a new kind's: a user's
    backend (ranked first), not declared capturable, so `StepRunner` captures decode in pieces around its
    layers. The copy runs the same function, plan and page size."""
    from ..model_attention import ModelAttention
    from ..registry import register

    layers = [spec.index for spec in model.specs if spec.kind == kind]
    if not layers:
        raise ValueError(f"--uncapturable: expected a kind of this model's layers "
                         f"({sorted({spec.kind for spec in model.specs})}), got {kind!r}")
    chosen = ma.backend(layers[0], "decode")

    def notebook_copy(spec, views, inputs):
        return chosen.source(spec, views, inputs)

    notebook_copy.__module__ = "__main__"  # where a notebook cell defines it: a user's backend
    register(kind, "decode", "notebook_copy", plan=chosen.plan, supports=chosen.supports, page_size=chosen.page_size,
             replace=True)(notebook_copy)
    return ModelAttention(model.specs, device=ma.device, prefer=None if prefer is None else ["notebook_copy", *prefer])


def build_model(family: str, shape: str, device, *, tp=None, prefer=None, keep_weights: bool = False):
    """``-> (model, ModelAttention, weights or None)``: ``--family`` at ``--shape`` with random weights, bf16
    on CUDA and fp32 on CPU (refused before anything is allocated when it cannot fit); ``tp``: this rank's
    share (`fnattn.models.tp`). ``keep_weights``: also return the checkpoint (the transformers peer loads it)."""
    from ..model_attention import ModelAttention
    from ..models.registry import Model, _with_dtype, family_named, random_checkpoint

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    fam = family_named(family)
    cfg = _with_dtype(fam.adapt(config_for(family, shape)), dtype)
    _check_memory(fam, cfg, dtype, dev, f"--family {family} --shape {shape}")
    weights = random_checkpoint(fam, cfg, dtype=dtype, device=dev)
    if tp is not None and tp.size > 1:
        from ..models.tp import shard_model

        model = shard_model(fam, cfg, weights, tp)
    else:
        model = Model(fam, cfg, fam.load(cfg, weights))
    return model, ModelAttention(model.specs, device=dev, prefer=prefer), (weights if keep_weights else None)


def run_model_bench(*, family: str, shape: str, batches, prompts, steps: int, device: str | None = None,
                    page_size: int | None = None, prefill_tokens: int = 16384, hf_tokens: int = 65536,
                    transformers: bool = True, graph: bool = True, records: list | None = None,
                    log=print, tp=None, prefer=None, profile: int = 0, uncapturable: str | None = None) -> list[dict]:
    """Every measurement of one model (module docstring); appends to ``records`` as it goes.

    ``prefer``: backend names in order of preference (`ModelAttention`'s ``prefer``; None: its default).

    ``page_size``: None takes the one the chosen backends need (`ModelAttention.page_size`: FlashMLA's 64), else 16.

    ``profile``: also profile that many decode steps of each case, eager and replayed, and one prefill step
    (`fnattn.bench.profile`: kernels on CUDA, leaf torch ops on a CPU), as records of backend "... profile".

    ``tp``: a `fnattn.tp.TPGroup` of several ranks: this rank's share of the model (`fnattn.models.tp`),
    timed like a whole one; the transformers peer (a whole model) is skipped.

    ``uncapturable``: a kind of the model whose chosen decode backend is registered again as a notebook's,
    without ``capturable=True`` (`notebook_kind`): the eager and graph cases run that copy, the graph case in
    pieces around the kind's layers."""
    records = [] if records is None else records
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = config_for(family, shape)
    sharded = tp is not None and tp.size > 1
    transformers = transformers and not sharded
    # the checkpoint outlives the load only for the transformers peer, which loads the same tensors by name
    model, ma, weights = build_model(family, shape, dev, tp=tp, prefer=prefer, keep_weights=transformers)
    if uncapturable is not None:
        ma = notebook_kind(model, ma, uncapturable, prefer)
    page_size = page_size or ma.page_size or 16
    cfg, dtype = model.config, model.config.dtype
    wbytes = weight_bytes(model.params)
    bw = copy_bandwidth(dev)
    name = f"{family} {shape}" + (f" tp{tp.size}" if sharded else "")
    log(f"{name}: {wbytes / 1e9:.3f} GB of weights, copy bandwidth {bw / 1e12:.2f} TB/s on {dev}")
    records.append({"case": name, "backend": "roofline weights", "phase": "decode", "weight_bytes": wbytes,
                    "copy_bandwidth_tb_s": bw / 1e12, "time_us": wbytes / bw * 1e6, "page_size": page_size,
                    "note": "every weight read once per decode step, over the copy bandwidth measured now (a MoE "
                            "step's own roofline counts the routed experts its tokens picked)"})
    skipped = f"--tp {tp.size} (the peer is the whole model)" if sharded else "--no-transformers"
    hf, hf_why = (None, skipped) if not transformers else (None, None)
    if transformers:
        hf, hf_why = transformers_model(family, config, weights, dev, dtype)
        if hf is None:
            log(f"transformers: skipped ({hf_why})")
    if hf is None:
        records.append({"case": name, "backend": "transformers", "phase": "decode", "skipped": hf_why})
    del weights
    if dev.type == "cpu" and shape == "tiny":
        for prompt in prompts:
            run = cpu_end_to_end(model, ma, prompt=prompt, steps=steps, page_size=page_size)
            records.append({"case": f"{name} cpu e2e P{prompt}+{steps}", "backend": "fnattn eager", "phase": "e2e",
                            "time_us": run["total_s"] * 1e6, "threads": torch.get_num_threads(), **run,
                            "target_s": 0.25})
            log(f"cpu e2e: {prompt}-token prefill + {steps} decode steps in {run['total_s']:.3f} s "
                f"(prefill {run['prefill_s']:.3f} s, decode {run['decode_s']:.3f} s, "
                f"{torch.get_num_threads()} threads)")
    for prompt in prompts:
        for b in batches:
            case = f"{name} B{b} ctx{prompt}"
            if b * prompt <= prefill_tokens:
                t = statistics.median(time_prefill(model, ma, dev, b, prompt, page_size=page_size, reps=3))
                records.append(_record(f"{name} prefill B{b} P{prompt}", "fnattn eager", "prefill", t, b * prompt,
                                       peer="transformers"))
                if profile:  # one prefill step (its State's creation included: a few fills)
                    from .profile import kernel_profile, print_profile

                    result = kernel_profile(lambda b=b, prompt=prompt: time_prefill(
                        model, ma, dev, b, prompt, page_size=page_size, reps=0), steps=1, device=dev)
                    records.append({"case": f"{name} prefill B{b} P{prompt}", "backend": "fnattn eager profile",
                                    "phase": "prefill", "profile": result})
                    print_profile(f"{name} prefill B{b} P{prompt} fnattn eager", result, log=log)
            # eager then graph steps, each after warm-up (and profiled) steps, and one counting the routed experts
            room = 2 * (steps + 8 + profile) + 1
            st = decode_state(model, dev, b, prompt, page_size=page_size, room=room)
            moved = step_bytes(st, b, prompt)
            k = experts_per_token(model.config)
            touched, st = routed_experts_touched(model, ma, st, b) if k is not None else (None, st)
            read = weight_bytes(model.params, tokens=b, experts_per_token=k, touched=touched)
            per_step = read + sum(moved.values())
            records.append({"case": case, "backend": "roofline step", "phase": "decode", "time_us": per_step / bw * 1e6,
                            "bytes": {"weights": read, **moved}, "tok_s": b / (per_step / bw),
                            **({"experts_touched": touched} if touched is not None else {})})
            times, st = time_decode(model, ma, st, b, steps)
            records.append(_record(case, "fnattn eager", "decode", statistics.median(times), b))
            if profile:
                st = _profile_decode(records, case, "fnattn eager", model, ma, st, b, profile, log,
                                     layers=(prompt, touched, bw))
            if graph:
                runner, why = _graph_runner(model, ma, b, prompt + room)  # the block table's reserved width
                if runner is None:
                    records.append({"case": case, "backend": "fnattn graph", "phase": "decode", "skipped": why})
                    log(f"{case}: graph skipped ({why})")
                else:
                    times, st = time_decode(model, ma, st, b, steps, runner=runner)
                    # host time of the lane checks before each replay (target: <= 30 us a step)
                    pieces = {"eager_layers": len(runner.uncapturable("decode"))} if runner.in_pieces else {}
                    records.append(_record(case, "fnattn graph", "decode", statistics.median(times), b,
                                           validation_us=runner.last_validation_s * 1e6, **pieces))
                    if profile:
                        st = _profile_decode(records, case, "fnattn graph", model, ma, st, b, profile, log,
                                             runner=runner)
            del st
            if hf is not None and b * prompt <= hf_tokens:
                pre, times = hf_prefill_and_decode(hf, dev, cfg.vocab_size, b, prompt, steps)
                records.append(_record(f"{name} prefill B{b} P{prompt}", "transformers", "prefill", pre, b * prompt))
                records.append(_record(case, "transformers eager", "decode", statistics.median(times), b))
            elif hf is not None:
                log(f"{case}: transformers skipped (B x P = {b * prompt} > --hf-tokens {hf_tokens})")
            _finish_case(records, case)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    records.append(model_summary(records, name, prompts[0]))
    return records


def model_summary(records: list[dict], name: str, prompt: int) -> dict:
    """The figures a script reads: the captured decode step (eager where none was captured) at ``prompt`` per
    batch, ``decode_b{B}_ms``, and batch 1's ``launches_per_step`` when it was profiled."""
    out = {"case": f"{name} model summary", "backend": "summary", "phase": "decode", "prompt": prompt}
    steps = {}
    for backend in ("fnattn eager", "fnattn graph"):  # the graph's figure replaces the eager one
        for r in records:
            case = r["case"]
            if r["backend"] == backend and r.get("time_us") and case.startswith(f"{name} B") \
                    and case.endswith(f" ctx{prompt}"):
                b = int(case[len(name) + 2:].split()[0])
                steps[b] = (r["time_us"] / 1e3, backend, r.get("launches_per_step"), r.get("achieved_tb_s"))
    for b, (ms, backend, launches, tb_s) in sorted(steps.items()):
        out[f"decode_b{b}_ms"] = ms
        out[f"decode_b{b}_backend"] = backend
        if tb_s is not None:
            out[f"decode_b{b}_achieved_tb_s"] = tb_s
        if b == 1 and launches is not None:
            out["launches_per_step"] = launches
    return out


def _profile_decode(records, case, backend, model, ma, state, batch, steps, log, runner=None, layers=None):
    """Profile ``steps`` decode steps (`fnattn.bench.profile`); ``-> the state after``.

    ``layers`` (eager steps only): ``(ctx, touched, bandwidth)``; each layer's work then runs in a profiler range
    and a ``... layers`` record sets each layer's kernel time against its bytes (`layer_times`)."""
    from ..models.common import layer_ranges
    from .profile import kernel_profile, print_profile

    holder = [state]

    def one():
        holder[0] = time_decode(model, ma, holder[0], batch, 1, runner=runner, warmup=0)[1]

    prefix = "fnattn layer "
    with layer_ranges() if layers is not None else contextlib.nullcontext():
        result = kernel_profile(one, steps=steps, device=state.device, ranges=prefix if layers is not None else None)
    records.append({"case": case, "backend": f"{backend} profile", "phase": "decode", "profile": result})
    if layers is not None and "ranges" in result:
        ctx, touched, bw = layers
        times = [result["ranges"].get(f"{prefix}{i}", 0.0) for i in range(len(model.config.specs))]
        rec = layer_times(model, holder[0], batch, ctx, touched, bw, times, busy_us=result["busy_us"])
        records.append({"case": case, "backend": f"{backend} layers", "phase": "decode", **rec})
        print_layers(f"{case} {backend}", rec, log=log)
    timed = next((r for r in reversed(records) if r["case"] == case and r["backend"] == backend), None)
    if timed is not None and "kernels" in result:
        timed["launches_per_step"] = result["kernels"]
    print_profile(f"{case} {backend}", result, log=log)
    return holder[0]


def _finish_case(records: list[dict], case: str) -> None:
    """Ratios for one decode case: to transformers (peer) and to this case's step roofline."""
    rows = [r for r in records if r["case"] == case and r.get("time_us")]
    roof = next((r for r in rows if r["backend"] == "roofline step"), None)
    peer = next((r for r in rows if r["backend"] == "transformers eager"), None)
    for r in rows:
        if r["backend"].startswith("fnattn") or r["backend"].startswith("transformers"):
            if roof:
                r["x_roofline"] = r["time_us"] / roof["time_us"]
                r["achieved_tb_s"] = sum(roof["bytes"].values()) / (r["time_us"] * 1e-6) / 1e12
            if peer:
                r["peer"] = peer["backend"]


def draw_model_png(records: list[dict], path) -> str | None:
    """Decode step time against batch per backend and context, log scale; ``-> None`` or why no PNG was drawn."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no PNG"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r.get("phase") == "decode" and r.get("time_us") and " B" in r["case"]]
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in rows:
        head, _, ctx = r["case"].rpartition(" ctx")
        series.setdefault((r["backend"], ctx), []).append((int(head.rpartition(" B")[2]), r["time_us"] / 1e3))
    fig, ax = plt.subplots(figsize=(8, 5))
    for (backend, ctx), pts in sorted(series.items()):
        pts.sort()
        style = "--" if backend.startswith("roofline") else "-"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=f"{backend}, ctx {ctx}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (requests)")
    ax.set_ylabel("decode step, ms (median)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def print_model_table(records: list[dict]) -> None:
    print(f"{'case':<40}{'backend':<22}{'ms':>10}{'tok/s':>12}{'x roof':>8}{'vs HF':>8}")
    for r in records:
        if r.get("skipped"):
            print(f"{r['case']:<40}{r['backend']:<22}  skipped: {r['skipped'][:70]}")
            continue
        if not r.get("time_us"):
            continue
        tok = f"{r['tok_s']:.0f}" if r.get("tok_s") else ""
        roof = f"{r['x_roofline']:.2f}" if r.get("x_roofline") else ""
        ratio = f"{r['ratio_to_peer']:.2f}x" if r.get("ratio_to_peer") else ""
        print(f"{r['case']:<40}{r['backend']:<22}{r['time_us'] / 1e3:>10.3f}{tok:>12}{roof:>8}{ratio:>8}")
