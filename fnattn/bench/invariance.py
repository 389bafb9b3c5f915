"""``fnattn bench invariance``: does a token's result depend on the phase, the batch or the graph?

For each family (tiny random weights in bf16 unless ``--shape`` names another), with the invariant mode
(`fnattn.kernels.invariant`) off and on:

* ``verify_equals_decode``: a verify step's logits against the decode logits of the same tokens, bit for bit;
* ``speculative_equals_greedy`` and ``oracle_acceptance`` (families with an MTP draft): speculative decoding
  with k = 1 and k = 3 whose drafts are the tokens plain greedy decoding emitted: the ids it emits against
  plain greedy's, and the drafts accepted over those proposed;
* ``batch_invariant``: a request's logits decoded alone against beside others of mixed lengths, in batches of 3
  and of each ``--batch`` size above 1 (``batch_invariant_sizes``);
* ``graph_equals_eager``: greedy ids and logits of captured steps (`fnattn.graph.StepRunner`) against eager
  ones (CUDA only; None on a CPU and where the chosen backends cannot be captured);
* ``invariant_cost``: the decode step's time with the mode on over off, per batch, and its worst batch; each
  step as a server runs it (``decode_form``: ``"graph"``, captured whole, where the chosen backends can be;
  ``"pieces"``, captured around the layers whose decode backend cannot be; else ``"eager"``), so on CUDA the cost
  of a mode whose backends cannot be captured includes the host's launches.

Each record is one (family, mode); a summary record names the figures over every family.
"""

from __future__ import annotations

import statistics
import time

import torch
from jaxtyping import Float

import fnattn as fa
import fnattn.switches

from ..driver import generate, run_step
from ..speculative import Speculator

PROMPTS = {0: [5, 17, 9, 3, 11, 2, 7, 30, 4], 1: [8, 1, 4, 22], 2: [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]}


def _state(attn: fa.ModelAttention, device, ring=2, tokens=64, prompts=PROMPTS):
    """Room for ``prompts`` and ``tokens`` more each, in pages of the size ``attn``'s backends serve (FlashMLA's 64
    at a released MLA shape), else of 4, so the tiny models' requests span several pages."""
    page = attn.page_size or 4
    pages = len(prompts) * (-(-(max(map(len, prompts.values())) + tokens + 8) // page)) + 4
    return fa.State(attn.specs, num_pages=pages, page_size=page, max_requests=len(prompts) + 1, recurrent_ring=ring,
                    device=device)


def batch_of(size: int, vocab: int) -> dict[int, list[int]]:
    """Request 0's prompt and ``size - 1`` others of mixed lengths (3 to 15 tokens): the batches a request is
    compared beside (also `benchmarks/invariance_probe.py` and the GPU tests)."""
    others = {r: [(11 * r + 3 * i) % (vocab - 1) + 1 for i in range(3 + (5 * r) % 13)] for r in range(1, size)}
    return {0: PROMPTS[0], **others}


def prefill_prompts(model, attn, st: fa.State,
                    prompts: dict[int, list[int]]) -> tuple[fa.State, Float[torch.Tensor, "B V"]]:
    """Admit and prefill ``prompts`` in one step: ``-> (state, each request's last logits [B, V])``."""
    for r in prompts:
        st = st.admit(r)
    counts = {r: len(p) for r, p in prompts.items()}
    st = st.reserve(counts)
    tokens = torch.tensor([t for p in prompts.values() for t in p], device=st.device)
    with attn.session(st, fa.Batch.prefill(st, counts)) as s:
        logits, d = model.step(model.params, s, tokens)
    ends = torch.tensor(list(counts.values())).cumsum(0) - 1
    return st.apply(d), logits[ends.to(logits.device)]


def request_0_logits(model, attn, st: fa.State, prompts: dict[int, list[int]],
                     steps: int) -> Float[torch.Tensor, "S V"]:
    """Request 0's logits over its prefill's last token and ``steps`` greedy decode steps of every request in
    ``prompts`` (admitted and prefilled into ``st`` in one step): ``[1 + steps, V]``, what a request's batch
    must not change."""
    st, last = prefill_prompts(model, attn, st, prompts)
    rows, ids = [last[0]], last.argmax(-1)
    for _ in range(steps):
        st, logits = _decode_step(model, attn, st.reserve({r: 1 for r in prompts}), list(prompts), ids)
        rows.append(logits[0])
        ids = logits.argmax(-1)
    return torch.stack(rows)


def model_at(name: str, shape: str, device, layers: int | None = None):
    """``name``'s random bf16 model at ``shape``'s widths (`fnattn.bench.model.config_for`); ``layers``: only its
    first that many (the widths, not the depth, choose a launch's tiles)."""
    from ..models.registry import random_model
    from .model import config_for

    cfg = config_for(name, shape)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
        if cfg.get("layer_types"):
            cfg["layer_types"] = cfg["layer_types"][:layers]
    return random_model(name, seed=0, dtype=torch.bfloat16, device=device, config=cfg)


def verify_equals_decode(model, device, k: int = 3) -> bool:
    tokens = [3, 14, 15, 9][: k + 1]
    attn = fa.ModelAttention(model.specs, device=device)
    st, _ = prefill_prompts(model, attn, _state(attn, device), {0: PROMPTS[0]})
    decoded = []
    for t in tokens:
        st = st.reserve({0: 1})
        with attn.session(st, fa.Batch.decode(st, [0])) as s:
            logits, d = model.step(model.params, s, torch.tensor([t], device=device))
        st = st.apply(d)
        decoded.append(logits[0])
    st, _ = prefill_prompts(model, attn, _state(attn, device, ring=k + 2), {0: PROMPTS[0]})
    st = st.reserve({0: k + 1})
    with attn.session(st, fa.Batch.verify(st, [0], num_draft=k)) as s:
        verified, _ = model.step(model.params, s, torch.tensor(tokens, device=device))
    return bool(torch.equal(verified, torch.stack(decoded)))


def speculative(fam, model, draft, device, k: int, tokens: int) -> tuple[bool, int, int]:
    """``-> (emitted == plain greedy, drafts accepted, drafts proposed)`` with oracle drafts."""
    prompts = {r: PROMPTS[r] for r in (0, 1)}
    attn, d_attn = fa.ModelAttention(model.specs, device=device), fa.ModelAttention(draft.specs, device=device)
    _, plain = generate(fam.step, model.params, attn, _state(attn, device, tokens=tokens + k + 2), prompts,
                        max_new_tokens=tokens + k + 1)
    emitted = {r: [] for r in prompts}

    def oracle(step, drafts):
        return {r: plain[r][len(emitted[r]):len(emitted[r]) + k] for r in drafts}

    spec = Speculator(target_step=fam.step_hidden, target_params=model.params,
                      target_attn=attn, target_state=_state(attn, device, ring=k + 2, tokens=tokens + k + 2),
                      draft_step=draft.step, draft_params=draft.params,
                      draft_attn=d_attn, draft_state=_state(d_attn, device, tokens=tokens + 2 * k + 2), num_draft=k,
                      propose_hook=oracle)
    for r, t in spec.start(prompts).items():
        emitted[r].append(t)
    accepted = proposed = 0
    live = set(prompts)
    while live:
        for r, got in spec.step().items():
            emitted[r] += got
            accepted, proposed = accepted + len(got) - 1, proposed + k
            if len(emitted[r]) >= tokens:  # leaves, so its oracle never runs past the plain ids
                spec.release(r)
                live.discard(r)
    same = all(emitted[r][:tokens] == plain[r][:tokens] for r in prompts)
    return same, accepted, proposed


def _decode(model, attn, device, prompts, steps: int, runner=None):
    """Prefill ``prompts``, then ``steps`` greedy decode steps of them all, eager or through ``runner``:
    ``-> (the prefill's last logits [B, V], every step's logits [steps, B, V])``."""
    st, last = prefill_prompts(model, attn, _state(attn, device, tokens=steps, prompts=prompts), prompts)
    out, ids = [], last.argmax(-1)
    for _ in range(steps):
        st, logits = _decode_step(model, attn, st.reserve({r: 1 for r in prompts}), list(prompts), ids, runner)
        out.append(logits.clone())
        ids = logits.argmax(-1)
    return last, torch.stack(out)


def _decode_step(model, attn, st, ids_of: list[int], tokens, runner=None):
    """One decode step of requests ``ids_of`` (room reserved), eager or through ``runner``: ``-> (state,
    logits)``."""
    if runner is None:
        return run_step(model.step, model.params, attn, st, fa.Batch.decode(st, ids_of), tokens)
    return runner.decode(st, ids_of, tokens)


def batch_invariant(model, device, steps: int, sizes=(3,)) -> bool:
    """Request 0's logits (its prefill's last token's, then each decode step's) alone and beside ``size - 1``
    others of mixed lengths, for every size."""

    def request_0(prompts):
        attn = fa.ModelAttention(model.specs, device=device)
        return request_0_logits(model, attn, _state(attn, device, tokens=steps, prompts=prompts), prompts, steps)

    alone = request_0({0: PROMPTS[0]})
    return all(torch.equal(alone, request_0(batch_of(n, model.config.vocab_size))) for n in sizes)


def graph_equals_eager(model, device, steps: int) -> bool | None:
    """None on a CPU, and where the chosen backends cannot be captured (the runner's steps would be eager too)."""
    runner = _runner(model, fa.ModelAttention(model.specs, device=device), device, 2)
    if runner is None:
        return None
    prompts = {r: PROMPTS[r] for r in (0, 1)}
    _, eager = _decode(model, runner.attn, device, prompts, steps)
    _, graph = _decode(model, runner.attn, device, prompts, steps, runner)
    return bool(torch.equal(eager, graph))


def _runner(model, attn, device, lanes: int):
    """A `StepRunner` of one bucket that captures its steps, or None (a CPU; backends that cannot be captured)."""
    if torch.device(device).type != "cuda":
        return None
    from ..graph import StepRunner

    runner = StepRunner(model.step, model.params, attn, model.manifest(), buckets=(lanes,))
    return runner if runner.capture else None


def decode_step_us(model, device, batch: int, steps: int, prompt: int = 16) -> tuple[float, str]:
    """Median microseconds of a decode step of ``batch`` requests (prompts of ``prompt`` tokens) as a server runs
    it: captured whole (``"graph"``) where the chosen backends can be, in pieces around the layers whose
    decode backend cannot be (``"pieces"``), else eager (``"eager"``): ``-> (us, form)``."""
    attn = fa.ModelAttention(model.specs, device=device)
    runner = _runner(model, attn, device, batch)
    prompts = {r: [(7 * r + i) % model.config.vocab_size for i in range(prompt)] for r in range(batch)}
    page = attn.page_size or 16
    st = fa.State(model.specs, num_pages=batch * (-(-(prompt + steps + 4) // page)) + 4, page_size=page,
                  max_requests=batch + 1, device=device)
    st, last = prefill_prompts(model, attn, st, prompts)
    ids, times = last.argmax(-1), []
    for _ in range(steps + 1):  # the first captures (or warms up): left out of the median
        st = st.reserve({r: 1 for r in prompts})
        _sync(device)
        t0 = time.perf_counter()
        st, logits = _decode_step(model, attn, st, list(prompts), ids, runner)
        _sync(device)
        times.append(time.perf_counter() - t0)
        ids = logits.argmax(-1)
    form = "eager" if runner is None else "pieces" if runner.in_pieces else "graph"
    return statistics.median(times[1:]) * 1e6, form


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def family_records(name: str, *, shape: str, device: str, tokens: int, batches: list[int], steps: int,
                   prompt: int = 16, cost_only: bool = False, log=print) -> list[dict]:
    """Each mode's record (off, then on: ``invariant_cost`` on the latter); ``cost_only``: the decode step's times
    alone, the properties left out of the records."""
    from ..models.registry import family_named

    fam = family_named(name)
    model = model_at(name, shape, device)
    draft = fam.draft(model.config, model.params, None, seed=1) if fam.draft and fam.step_hidden else None
    records, cost = [], {}
    for on in (False, True):
        with fnattn.switches.set(invariant=on):
            rec = {"case": f"invariance {name}", "family": name, "shape": shape, "invariant": on, "prompt": prompt}
            if not cost_only:
                rec.update(_properties(fam, model, draft, device, tokens, batches))
            timed = {b: decode_step_us(model, device, b, steps, prompt) for b in batches}
            rec["decode_us"] = {b: us for b, (us, _) in timed.items()}
            rec["decode_form"] = {b: form for b, (_, form) in timed.items()}
            cost[on] = rec["decode_us"]
            log(f"{name} invariant={on}: " + ", ".join(f"{k}={v}" for k, v in rec.items() if k not in ("case",)))
            records.append(rec)
    ratios = {b: cost[True][b] / cost[False][b] for b in batches}
    records[-1]["invariant_cost_by_batch"] = ratios
    records[-1]["invariant_cost"] = max(ratios.values())
    return records


def _properties(fam, model, draft, device, tokens: int, batches: list[int]) -> dict:
    rec = {"verify_equals_decode": verify_equals_decode(model, device)}
    if draft is not None:
        same, acc, prop = zip(*(speculative(fam, model, draft, device, k, tokens) for k in (1, 3)))
        rec["speculative_equals_greedy"] = all(same)
        rec["oracle_acceptance"] = sum(acc) / sum(prop)
    rec["batch_invariant_sizes"] = sizes = sorted({3, *(b for b in batches if b > 1)})
    rec["batch_invariant"] = batch_invariant(model, device, steps=min(tokens, 16), sizes=sizes)
    rec["graph_equals_eager"] = graph_equals_eager(model, device, steps=min(tokens, 16))
    return rec


def summary(records: list[dict]) -> dict:
    """The figures over every family, with the mode on."""
    on = [r for r in records if r.get("invariant")]

    def every(key):
        values = [r[key] for r in on if r.get(key) is not None]
        return all(values) if values else None

    acceptance = [r["oracle_acceptance"] for r in on if "oracle_acceptance" in r]
    return {"case": "invariance summary", "invariant": True, "families": [r["family"] for r in on],
            "speculative_equals_greedy": every("speculative_equals_greedy"),
            "oracle_acceptance": min(acceptance) if acceptance else None,
            "verify_equals_decode": every("verify_equals_decode"), "batch_invariant": every("batch_invariant"),
            "graph_equals_eager": every("graph_equals_eager"),
            "invariant_cost": max(r["invariant_cost"] for r in on)}
