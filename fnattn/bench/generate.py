"""``fnattn bench generate``: the whole of generation, not only the decode step.

One model (``--family`` at ``--shape``, random weights; bf16 on CUDA), batch 1 unless said:

* ``ttft_ms``: a ``--prompt``-token prefill until its first token is on the host (`fnattn.driver.prefill`);
  ``prefill_long_tok_s``: the same for ``--long-prompt`` tokens (``prefill_8192_tok_s`` when it is 8192);
* plain decode through `fnattn.graph.StepRunner` (captured on CUDA) per batch: ms a step, tokens/s;
  ``eager_decode_ms``: the same step eager (session + apply), batch 1;
* MTP with k drafts (families with a draft): every draft accepted (acceptance forced with `Speculator`'s
  ``force_accept``, decided on the device, so the figure is the machinery's, not the random draft's numerics)
  and every draft wrong (forced to none): ms a step and tokens/s; ``mtp_oracle_speedup`` (batch 1, over plain
  decode's tokens/s) and ``mtp_wrong_step_ratio`` (a wrong step over a plain decode step);
* a serving mix (``--mix`` REQUESTS prompts of LO..HI tokens, NEW tokens each, arriving together,
  `fnattn.driver.generate` with the decode and prefill runners): tokens/s, and ``serving_busy_share``: the
  device's busy time over the mix's wall time (1 where the device never waits for the host); then the same
  prompts with a quarter running at once (continuous batching), admitted in prefill steps of their own
  (``serving_continuous_tok_s``) or inside the running requests' decode steps (``serving_mixed_tok_s``).

Each timed piece also has ``busy_ms``, the device's busy time in one call (`fnattn.bench.profile`; on a CPU
the torch ops' own time), so the host's share shows.
"""

from __future__ import annotations

import statistics
import time

import torch

from .. import Batch, ModelAttention, State
from ..driver import generate, prefill, run_step
from ..speculative import Speculator
from .profile import kernel_profile

PAGE = 16


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device, reps: int) -> float:
    fn()  # warm-up: compiles, captures, allocator
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _busy_ms(fn, device) -> float:
    return kernel_profile(fn, steps=1, device=device).get("busy_us", float("nan")) / 1e3


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _state(model, device, requests: int, tokens: int, ring: int = 2) -> State:
    return State(model.specs, num_pages=requests * (-(-tokens // PAGE) + 2) + 2, page_size=PAGE,
                 max_requests=requests + 1, recurrent_ring=ring, device=device)


def time_to_first_token(model, ma, device, n: int, reps: int, runner=None) -> dict:
    """A fresh request's ``n``-token prefill until its first token is on the host; through ``runner`` (a
    `fnattn.prefill_graph.PrefillRunner`: captured in pieces on CUDA) when given."""
    tokens = _ids(n, model.config.vocab_size, 1)
    holder = {"st": _state(model, device, 1, n)}

    def once():
        st, last = prefill(model.step, model.params, ma, holder["st"].admit(0), {0: tokens}, runner=runner)
        int(last[0].argmax())  # the first token, on the host
        holder["st"] = st.release(0)

    ms = _median_ms(once, device, reps)
    return {"tokens": n, "ms": ms, "tok_s": n / ms * 1e3, "busy_ms": _busy_ms(once, device),
            "graph": runner is not None and runner.capture}


def _prefill_runner(model, ma, tokens: int):
    """A PrefillRunner whose token buckets end at ``tokens`` (CUDA); None elsewhere."""
    if ma.device.type != "cuda":
        return None
    from ..prefill_graph import PrefillRunner, tokens_up_to

    return PrefillRunner(model.step, model.params, ma, tokens=tokens_up_to(tokens), max_context=tokens)


def _runner(model, ma, batch: int, max_context: int, hidden: bool = False):
    """A captured StepRunner of one bucket on CUDA; None (eager steps) elsewhere or where it cannot capture."""
    if ma.device.type != "cuda":
        return None
    from ..graph import StepRunner

    step = model.family.step_hidden if hidden else model.step
    runner = StepRunner(step, model.params, ma, model.manifest(hidden=hidden), buckets=(batch,),
                        max_context=max_context)
    return runner if runner.capture else None


def plain_decode(model, ma, device, batch: int, prompt: int, steps: int, *, graph: bool) -> dict:
    """``steps`` greedy decode steps of ``batch`` requests after ``prompt``-token prompts: the median step and
    every request's tokens (prefill's first included), which oracle drafts replay."""
    prompts = {r: _ids(prompt, model.config.vocab_size, 10 + r) for r in range(batch)}
    st = _state(model, device, batch, prompt + steps + 8)
    for r in prompts:
        st = st.admit(r)
    st, last = prefill(model.step, model.params, ma, st, prompts)
    ids = torch.stack([last[r] for r in prompts]).argmax(-1)
    emitted = {r: [int(t)] for r, t in zip(prompts, ids.tolist())}
    runner = _runner(model, ma, batch, prompt + steps + 8) if graph else None
    holder, times = {"st": st, "ids": ids}, []

    def once():
        st = holder["st"].reserve({r: 1 for r in prompts})
        if runner is None:
            st, logits = run_step(model.step, model.params, ma, st, Batch.decode(st, list(prompts)), holder["ids"])
        else:
            st, logits = runner.decode(st, list(prompts), holder["ids"])
        holder["st"], holder["ids"] = st, logits.argmax(-1)
        for r, t in zip(prompts, holder["ids"].tolist()):  # on the host each step, as a server streams it
            emitted[r].append(t)

    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        once()
        _sync(device)
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times[2:] or times) * 1e3
    return {"batch": batch, "ms": ms, "tok_s": batch / ms * 1e3, "busy_ms": _busy_ms(once, device),
            "graph": runner is not None, "emitted": emitted, "prompts": prompts}


def speculator(model, device, prompts: dict, k: int, steps: int, *, accept_all: bool, graph: bool,
               draft_vocab: int | None = None) -> Speculator:
    """A `Speculator` with ``k`` MTP drafts for ``prompts`` (room for ``steps`` steps), every draft kept
    (``accept_all``) or none, by force (its ``force_accept``, decided on the device); with both runners captured
    on CUDA (``graph``). ``draft_vocab``: the draft's head keeps the first this many token ids' rows
    (`DraftModel.with_vocab`; a BPE vocabulary's low ids are roughly its frequent ones), None: all of them."""
    fam = model.family
    draft = fam.draft(model.config, model.params, None, seed=1)
    if draft_vocab is not None:
        draft = draft.with_vocab(torch.arange(draft_vocab, device=model.params.embed.device))
    batch, prompt = len(prompts), len(next(iter(prompts.values())))
    room = prompt + (k + 1) * (steps + 2) + 8
    attn, d_attn = ModelAttention(model.specs, device=device), ModelAttention(draft.specs, device=device)
    runner = _runner(model, attn, batch, room, hidden=True) if graph else None
    draft_runner = None
    if runner is not None:  # the draft's proposal steps captured too (`StepRunner.propose`)
        from ..graph import StepRunner

        draft_runner = StepRunner(draft.step, draft.params, d_attn, draft.manifest(model.config), buckets=(batch,),
                                  max_context=room + k)
        draft_runner = draft_runner if draft_runner.capture else None
    return Speculator(target_step=fam.step_hidden, target_params=model.params, target_attn=attn,
                      target_state=_state(model, device, batch, room, ring=k + 2), draft_step=draft.step,
                      draft_params=draft.params, draft_attn=d_attn,
                      draft_state=_state(draft, device, batch, room + k), num_draft=k,
                      target_runner=runner, draft_runner=draft_runner,
                      force_accept=k + 1 if accept_all else 1, draft_ids=draft.vocab_ids)


def speculative(model, device, plain: dict, k: int, steps: int, *, accept_all: bool, graph: bool,
                draft_vocab: int | None = None) -> dict:
    """MTP with ``k`` drafts over ``plain``'s prompts, every draft kept (``accept_all``) or none, by force
    (`Speculator`'s ``force_accept``): the machinery's speed at either end, whatever the drafts say. With
    both runners the step is `Speculator._step_on_device`'s: drafts on the device, one host read.
    ``draft_vocab``: the draft's head keeps that many token ids (`speculator`)."""
    prompts = plain["prompts"]
    batch = len(prompts)
    spec = speculator(model, device, prompts, k, steps, accept_all=accept_all, graph=graph, draft_vocab=draft_vocab)
    emitted = {r: [] for r in prompts}
    for r, t in spec.start(prompts).items():
        emitted[r].append(t)
    times, made = [], 0
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        out = spec.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        for r, toks in out.items():
            emitted[r] += toks
            made += len(toks)
    ms = statistics.median(times[2:] or times) * 1e3
    per_step = made / steps / batch
    return {"batch": batch, "k": k, "accept": "all" if accept_all else "none", "draft_vocab": draft_vocab, "ms": ms,
            "tokens_per_step": per_step, "tok_s": batch * per_step / ms * 1e3, "graph": spec.runner is not None,
            "draft_graph": spec.draft_runner is not None,
            "busy_ms": _busy_ms(spec.step, device)}


def serving_mix(model, ma, device, requests: int, lo: int, hi: int, new: int, *, graph: bool,
                running: int | None = None, mixed: bool = False, busy: bool = True) -> dict:
    """``requests`` prompts of ``lo``..``hi`` tokens arriving together, ``new`` tokens each (`generate`, with
    the decode and prefill runners on CUDA): tokens/s of a run after a first one that captures (not timed),
    and ``busy_share``, the device's busy time over the wall time (`fnattn.bench.profile`), so the host's
    share of the mix shows. ``running``: at most this many at once, the others admitted as they finish
    (``mixed``: prefilled inside the running ones' decode steps), each request then generating its own number
    of tokens in ``new`` / 2 .. ``new``. ``busy``: also profile a run for ``busy_s`` (else None)."""
    lengths = torch.randint(lo, hi + 1, (requests,), generator=torch.Generator().manual_seed(3)).tolist()
    prompts = {r: _ids(n, model.config.vocab_size, 100 + r) for r, n in enumerate(lengths)}
    runner = _runner(model, ma, requests, hi + new + 8) if graph else None
    prefill_runner = _prefill_runner(model, ma, 8192) if graph else None
    holder = {"st": _state(model, device, requests, hi + new + 8), "out": None}
    # with fewer running than requests, each its own length (new / 2 .. new): they finish apart, so others are
    # admitted while some decode
    lens = new if running is None else dict(zip(prompts, torch.randint(
        max(1, new // 2), new + 1, (requests,), generator=torch.Generator().manual_seed(4)).tolist()))

    def once():  # every request released at its end: the next run starts from the same empty State
        result = generate(model.step, model.params, ma, holder["st"], prompts, max_new_tokens=lens, runner=runner,
                          prefill_runner=prefill_runner, max_running=running, mixed=mixed)
        holder["st"], holder["out"], holder["stats"] = result[0], result[1], result.stats

    once()  # captures every bucket the mix meets
    _sync(device)
    t0 = time.perf_counter()
    once()
    _sync(device)
    seconds = time.perf_counter() - t0
    made = sum(len(t) for t in holder["out"].values())
    busy_s = _busy_ms(once, device) / 1e3 if busy else None  # a third run, under the profiler
    return {"requests": requests, "prompt_tokens": sum(lengths), "new_tokens": made, "s": seconds,
            "tok_s": made / seconds, "busy_s": busy_s, "busy_share": None if busy_s is None else busy_s / seconds,
            "graph": runner is not None,
            "running": running or requests, "mixed": mixed, "mixed_steps": holder["stats"]["mixed_steps"]}


def run_generate_bench(*, family: str, shape: str, device: str, batches: list[int], prompt: int, long_prompt: int,
                       steps: int, k: int, mix: tuple[int, int, int, int], graph: bool, reps: int,
                       log=print, records: list[dict] | None = None, draft_vocab: int | None = None) -> list[dict]:
    """Every figure of the module docstring as records; the last one is the summary that names them.
    ``records``: a list each record is appended to as soon as it is measured (a run cut short keeps them).
    ``draft_vocab``: the MTP cases again with the draft's head keeping that many token ids (`speculator`)."""
    from .model import build_model

    dev = torch.device(device)
    model, ma, _ = build_model(family, shape, dev)
    base = {"family": family, "shape": shape, "device": dev.type}
    records = [] if records is None else records

    def add(case, rec):
        rec = {"case": case, **base, **{k_: v for k_, v in rec.items() if k_ not in ("emitted", "prompts")}}
        records.append(rec)
        log(f"{case}: " + ", ".join(f"{k_}={v:.4g}" if isinstance(v, float) else f"{k_}={v}"
                                    for k_, v in rec.items() if k_ not in ("case", *base)))
        return rec

    eager_ttft = add("ttft eager", time_to_first_token(model, ma, dev, prompt, reps))
    eager_long = add("prefill long eager", time_to_first_token(model, ma, dev, long_prompt, max(1, reps // 2)))
    ttft, long = eager_ttft, eager_long
    if graph and dev.type == "cuda":  # captured in pieces per bucket (`fnattn.prefill_graph`)
        runner = _prefill_runner(model, ma, max(prompt, long_prompt))
        ttft = add("ttft", time_to_first_token(model, ma, dev, prompt, reps, runner))
        long = add("prefill long", time_to_first_token(model, ma, dev, long_prompt, max(1, reps // 2), runner))
    plain = {}
    for b in batches:
        plain[b] = plain_decode(model, ma, dev, b, prompt, steps + (k + 1) * (steps + 2) + k + 2, graph=graph)
        add("decode", plain[b])
    eager = add("decode eager", plain_decode(model, ma, dev, 1, prompt, min(steps, 16), graph=False))
    spec = {}
    if model.family.draft is not None and model.family.step_hidden is not None:
        for b in batches:
            for accept_all in (True, False):
                spec[(b, accept_all)] = add("mtp", speculative(model, dev, plain[b], k, steps, accept_all=accept_all,
                                                               graph=graph))
                if draft_vocab is not None:
                    spec[(b, accept_all, "vocab")] = add("mtp draft vocab", speculative(
                        model, dev, plain[b], k, steps, accept_all=accept_all, graph=graph, draft_vocab=draft_vocab))
    requests, lo, hi, new = mix
    served = add("serving mix", serving_mix(model, ma, dev, requests, lo, hi, new, graph=graph))
    # continuous batching: a quarter running at once, the rest admitted as they finish, in prefill steps of
    # their own or inside the running requests' decode steps
    running = max(2, requests // 4)
    waves = {mixed: add("serving mix " + ("mixed" if mixed else "continuous"),
                        serving_mix(model, ma, dev, requests, lo, hi, new, graph=graph, running=running, mixed=mixed,
                                    busy=False))
             for mixed in (False, True)}
    b1 = batches[0]
    summary = {"case": "generate summary", **base, "prompt": prompt, "long_prompt": long_prompt, "k": k,
               "ttft_ms": ttft["ms"], "ttft_busy_ms": ttft["busy_ms"], "prefill_long_tok_s": long["tok_s"],
               "ttft_eager_ms": eager_ttft["ms"], "prefill_long_eager_tok_s": eager_long["tok_s"],
               "decode_ms": {b: plain[b]["ms"] for b in batches}, "eager_decode_ms": eager["ms"],
               "eager_decode_busy_ms": eager["busy_ms"], "serving_tok_s": served["tok_s"],
               "serving_busy_share": served["busy_share"], "serving_continuous_tok_s": waves[False]["tok_s"],
               "serving_mixed_tok_s": waves[True]["tok_s"]}
    if long_prompt == 8192:
        summary["prefill_8192_tok_s"] = long["tok_s"]
    if spec:
        summary["mtp_oracle_speedup"] = spec[(b1, True)]["tok_s"] / plain[b1]["tok_s"]
        summary["mtp_oracle_speedup_by_batch"] = {b: spec[(b, True)]["tok_s"] / plain[b]["tok_s"] for b in batches}
        summary["mtp_wrong_step_ratio"] = spec[(b1, False)]["ms"] / plain[b1]["ms"]
        if draft_vocab is not None:  # the same with the draft's smaller head (its proposals are fewer tokens)
            summary["draft_vocab"] = draft_vocab
            summary["mtp_oracle_speedup_draft_vocab"] = spec[(b1, True, "vocab")]["tok_s"] / plain[b1]["tok_s"]
            summary["mtp_wrong_step_ratio_draft_vocab"] = spec[(b1, False, "vocab")]["ms"] / plain[b1]["ms"]
    records.append(summary)
    return records
