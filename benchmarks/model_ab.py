"""The whole Qwen3.5-0.8B decode step with switches flipped, all on one model in one process, the steps of
every variant interleaved: which is faster where it counts (a kernel that wins alone can lose in a step,
and the other way round). From the repository root on a GPU machine:

    python benchmarks/model_ab.py --toggle pdl prefetch+own_norm_act --out ab.json [--batch 1 8] [--steps 64]
    python benchmarks/model_ab.py --toggle invariant --batch 128 --profile 3 --out ab.json
    python benchmarks/model_ab.py --toggle fla_direct --prefill 8192 --batch 1 --steps 16 --out ab.json
    python benchmarks/model_ab.py --family deepseek_v32 --shape 2-layer --ctx 2048 --toggle grouped_experts --out x

With ``--prefill P`` each step is an eager prefill of ``--batch`` prompts of P tokens (a fresh State each
time, `fnattn.bench.model.time_prefill`), run under the variant's switches, the variants interleaved alike.

Each batch captures one CUDA graph per variant (the defaults, then each toggle flipped from its default,
captured under its switch) over one state, then replays them round-robin, step after step, the order
rotated each round, so that a drift of the clocks or the memory over the run falls on every variant alike.
The records carry each variant's median step and quartiles, its ratio to the defaults' (< 1: faster), the median
of each round's own ratio (``paired_ratio``: the two steps of a round run back to back, so drift cancels) and the
share of rounds it won (``faster_rounds``); a variant that fails to capture is recorded with its error and the
others still run. A host-bound step (an eager prefill) moves by several percent between runs: read a ratio with
its quartiles and take the run with the most steps.
``--profile N`` then profiles N more steps of each variant (`torch.profiler`: kernels by kind and the top
ones, printed and in its record), so a variant's extra time can be read kernel by kernel.
``--shape tiny --device cpu`` is a smoke run of the same plan (capture-free, each step eager under its
switches; tests/test_model_ab.py runs it).

Toggles: every switch of `fnattn.switches` by its name (``python -m fnattn.switches`` lists them, each with its
default and what runs on either side), and these fields of every GEMV's config (`SkinnyConfig`):

- ``one_launch``: skinny_linear's split-K partials summed in the GEMV's own launch (on, the default) or by
  a second reduce kernel (`SkinnyConfig.one_launch`).
- ``prefetch``: under PDL each GEMV program asks L2 for its whole weight slab before it waits
  (`SkinnyConfig.prefetch`), or loads only its first tile then (off, the default).
- ``early2``, ``early4``: each GEMV's first load 2 or 4 K tiles wide (`SkinnyConfig.early`), in registers
  before it waits under PDL, or one tile (the default).
- ``stages3``: every GEMV pipelines 3 K tiles (`SkinnyConfig.num_stages`), or the table's stages (the
  default: 4 up to 32 rows).
"""

import argparse
import contextlib
import statistics

import fnattn.kernels.skinny_linear as skinny
import torch

import fnattn.switches
from fnattn.bench import write_json
from fnattn.bench.model import _record, build_model, decode_state, time_decode, time_prefill
from fnattn.bench.profile import kernel_profile, print_profile
from fnattn.model_attention import ModelAttention

GEMV_TOGGLES = {  # name: (switch, its default now, what on / off mean): fields of every GEMV's config
    "one_launch": (lambda on: skinny.configured(one_launch=on), lambda: True,
                   {True: "split-K sums in the GEMV's launch", False: "a second reduce kernel"}),
    "early2": (lambda on: skinny.configured(early=2 if on else 1), lambda: False,
               {True: "GEMVs load 2 K tiles before they wait", False: "one tile"}),
    "early4": (lambda on: skinny.configured(early=4 if on else 1), lambda: False,
               {True: "GEMVs load 4 K tiles before they wait", False: "one tile"}),
    "stages3": (lambda on: skinny.configured(num_stages=3) if on else contextlib.nullcontext(), lambda: False,
                {True: "GEMVs pipeline 3 K tiles", False: "the table's stages (4 up to 32 rows)"}),
    "prefetch": (lambda on: skinny.configured(prefetch=on), lambda: False,
                 {True: "GEMVs ask L2 for their weight slab before they wait", False: "first weight tile only"}),
}


def _registered(switch):
    """A registry switch as a toggle: set by name, read by name, described by its record."""
    return (lambda on: fnattn.switches.set(**{switch.name: on}), lambda: fnattn.switches.value(switch.name),
            {True: switch.on, False: switch.off})


TOGGLES = {**GEMV_TOGGLES, **{name: _registered(s) for name, s in fnattn.switches.switches().items()}}


def variants(toggles):
    """``[(label, {toggle: value})]``: the defaults, then each toggle flipped; ``a+b`` flips both together."""
    out = [("defaults", {})]
    for spec in toggles:
        values, labels = {}, []
        for name in spec.split("+"):
            if name not in TOGGLES:
                raise SystemExit(f"model_ab.py: --toggle: expected names from {sorted(TOGGLES)} joined by '+', "
                                 f"got {spec!r}")
            values[name] = flipped = not TOGGLES[name][1]()
            labels.append(f"{name}={'on' if flipped else 'off'}")
        detail = TOGGLES[name][2][flipped] if len(values) == 1 else "together"
        out.append((f"{' + '.join(labels)}: {detail}", values))
    return out


def spread(times: list[float], base: list[float]) -> dict:
    """A variant's steps (seconds, one a round) against the defaults' of the same rounds: the ratio of the medians,
    the median of the rounds' own ratios (paired: drift over the run cancels within a round), the share of rounds
    in which the variant was faster, and its quartiles in us."""
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    paired = [t / b for t, b in zip(times, base)]
    return {"ratio_to_defaults": statistics.median(times) / statistics.median(base),
            "paired_ratio": statistics.median(paired), "faster_rounds": sum(r < 1 for r in paired) / len(paired),
            "quartiles_us": [q[0] * 1e6, q[2] * 1e6]}


def switched(values: dict):
    stack = contextlib.ExitStack()
    for name, on in values.items():
        stack.enter_context(TOGGLES[name][0](on))
    return stack


def run_prefill_ab(plan, model, ma, dev, *, shape: str, batches, prompt: int, steps: int,
                   family: str = "qwen3_5") -> list[dict]:
    """``--prefill``: eager prefill steps of every variant, interleaved (each under its switches)."""
    out = []
    page = ma.page_size or 16
    for b in batches:
        case = f"{family} {shape} prefill B{b} P{prompt}"
        times, live, mas = {}, [], []
        for k, (label, values) in enumerate(plan):
            mas.append(ma)
            try:
                with switched(values):  # compiles and warms up this variant's kernels
                    mas[k] = ModelAttention(model.specs, device=dev)  # its own backends, chosen under its switches
                    time_prefill(model, mas[k], dev, b, prompt, page_size=page, reps=0)
                live.append(k)
                times[k] = []
            except Exception as e:  # noqa: BLE001 - a variant that fails is a result; the others still run
                if k == 0:
                    raise
                out.append({"case": case, "backend": "fnattn eager", "phase": "prefill", "variant": label,
                            "switches": dict(values), "error": f"{type(e).__name__}: {e}"[:500]})
        for i in range(steps):
            for j in range(len(live)):
                k = live[(i + j) % len(live)]
                with switched(plan[k][1]):
                    times[k] += time_prefill(model, mas[k], dev, b, prompt, page_size=page, reps=1, warm=False)
        for k in live:
            label, values = plan[k]
            out.append(_record(case, "fnattn eager", "prefill", statistics.median(times[k]), b * prompt,
                               variant=label, switches=dict(values), **spread(times[k], times[0])))
    return out


def run_ab(toggles, *, batches, steps: int, shape: str = "0.8b", device: str = "cuda",
           prefill: int | None = None, family: str = "qwen3_5", ctx: int = 512, profile: int = 0) -> list[dict]:
    """The records of every variant at every batch (module docstring). On CUDA the steps are graph replays,
    each graph captured under its variant's switches; elsewhere (a smoke run) the capture-free runner runs
    each step eagerly, under the same switches. ``prefill``: prefill steps of that many tokens instead.
    ``profile``: after the timed rounds, that many more steps of each variant under `torch.profiler`, each
    record's ``profile`` (`fnattn.bench.profile.kernel_profile`: its kernels by kind and the top ones): where
    one variant's time goes that another's does not."""
    from fnattn.bench.overhead import _runner

    plan = variants(toggles)
    dev = torch.device(device)
    model, ma, _ = build_model(family, shape, dev)
    if prefill is not None:
        return run_prefill_ab(plan, model, ma, dev, shape=shape, batches=batches, prompt=prefill, steps=steps,
                              family=family)
    out = []
    for b in batches:
        case = f"{family} {shape} B{b} ctx{ctx}"
        room = 2 * len(plan) * (steps + 4 + (profile + 1 if profile else 0))
        st = decode_state(model, dev, b, ctx, page_size=ma.page_size or 16, room=room)
        runners, mas, live = [], [], []
        for k, (label, values) in enumerate(plan):
            mas.append(ma)
            try:
                with switched(values):  # the switches act while the step is traced: at capture
                    # its own choice of backends, made under its switches (the invariant mode takes only those
                    # that honour it, and a session refuses the others while it is on)
                    mas[k] = ModelAttention(model.specs, device=dev)
                    runner, _ = _runner(model, mas[k], b, ctx + room, graph=True)
                    _, st = time_decode(model, mas[k], st, b, 1, runner=runner)  # captures (on CUDA), then a replay
            except Exception as e:  # noqa: BLE001 - a variant that fails is a result; the others still run
                if k == 0:
                    raise
                st = getattr(e, "state", st)  # a step that failed hands back the live state (time_decode)
                out.append({"case": case, "backend": "fnattn graph", "phase": "decode", "variant": label,
                            "switches": dict(values), "error": f"{type(e).__name__}: {e}"[:500]})
                runner = None
            runners.append(runner)
            if runner is not None:
                live.append(k)
        times = {k: [] for k in live}
        for i in range(steps):
            for j in range(len(live)):
                k = live[(i + j) % len(live)]
                with switched(plan[k][1]):  # what a capture-free runner traces each step
                    step, st = time_decode(model, mas[k], st, b, 1, runner=runners[k], warmup=0)
                times[k] += step
        profiles = {}
        for k in live if profile else ():
            profiles[k], st = _profiled(model, mas[k], st, b, runners[k], plan[k][1], profile, dev)
            print_profile(f"{case} {plan[k][0]}", profiles[k], rows=12)
        for k in live:
            label, values = plan[k]
            out.append(_record(case, "fnattn graph" if dev.type == "cuda" else "fnattn runner (no capture)", "decode",
                               statistics.median(times[k]), b, variant=label, switches=dict(values),
                               **spread(times[k], times[0]), **({"profile": profiles[k]} if k in profiles else {})))
        del st, runners
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _profiled(model, ma, st, batch: int, runner, values: dict, steps: int, dev):
    """``steps`` decode steps of one variant under the profiler (after one unprofiled): ``-> (its
    kernel_profile, the state after)``."""
    held = [st]

    def step():
        with switched(values):
            held[0] = time_decode(model, ma, held[0], batch, 1, runner=runner, warmup=0)[1]

    return kernel_profile(step, steps=steps, device=dev), held[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--toggle", nargs="+", required=True, metavar="NAME[+NAME]",
                   help=f"switches to flip, one variant each ({', '.join(sorted(TOGGLES))}; a+b: both at once)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=64, help="timed steps of each variant")
    p.add_argument("--family", default="qwen3_5", help="the model family (default qwen3_5)")
    p.add_argument("--shape", default="0.8b", help="the family's shape (tiny: a CPU smoke run)")
    p.add_argument("--ctx", type=int, default=512, help="cached tokens per request (decode)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prefill", type=int, default=None, metavar="P", help="time prefills of P-token prompts")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="decode: profile this many more steps of each variant (kernels by kind, the top ones; "
                        "printed and in each record)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.profile < 0:
        raise SystemExit(f"model_ab.py: --profile: expected a step count >= 0, got {args.profile}")
    if args.prefill is not None and args.prefill < 1:
        raise SystemExit(f"model_ab.py: --prefill: expected a token count >= 1, got {args.prefill}")
    records = run_ab(args.toggle, batches=args.batch, steps=args.steps, shape=args.shape, device=args.device,
                     prefill=args.prefill, family=args.family, ctx=args.ctx, profile=args.profile)
    for r in records:
        if "error" in r:
            print(f"{r['case']:<26}{r['variant']:<70}  failed: {r['error']}")
        else:
            lo, hi = r["quartiles_us"]
            print(f"{r['case']:<26}{r['variant']:<70}{r['time_us']:9.1f} us ({lo:.1f}-{hi:.1f})  "
                  f"{r['ratio_to_defaults']:.3f}x  paired {r['paired_ratio']:.3f}x, faster in "
                  f"{r['faster_rounds']:.0%} of rounds")
    write_json(records, args.out, command="python benchmarks/model_ab.py " + " ".join(
        ["--toggle", *args.toggle, "--batch", *map(str, args.batch), "--steps", str(args.steps), "--family",
         args.family, "--shape", args.shape, "--ctx", str(args.ctx), "--device", args.device,
         *(["--prefill", str(args.prefill)] if args.prefill else []),
         *(["--profile", str(args.profile)] if args.profile else []),
         "--out", args.out]))


if __name__ == "__main__":
    main()
