"""Where a request's decode results first depend on its batch, layer by layer, in the invariant mode.

    python benchmarks/invariance_probe.py --family qwen3_5 --shape 0.8b --layers 4 --others 7 --steps 8
    python benchmarks/invariance_probe.py --shape 0.8b --layers 4 --prefer triton reference   # an order of yours
    python benchmarks/invariance_probe.py --shape 0.8b --layers 4 --switch pdl=off              # a switch's other side

Runs request 0 alone and beside ``--others`` requests of other prompt lengths (greedy, pages of 4 tokens, so
the requests cross pages at different steps), with the mode on. At every decode step it keeps request 0's row
of each attention layer's inputs and outputs (`AttentionSession.forward` wrapped) and of the logits, then prints
the first (step, layer, field) whose bits differ between the two runs:

* a layer's inputs equal and its outputs different: that layer's backend (named) depends on the batch;
* a layer's outputs equal and the next layer's inputs different: the model's own code between them
  (projections, norms, the MLP) does.

``--others 0`` runs request 0 alone twice: a difference then is a step that does not repeat its own bits (a
race), not a dependence on the batch.

Prints one JSON line (``first_difference``: null where every row is the same bits).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

import fnattn
import fnattn as fa
from fnattn.bench.invariance import PROMPTS, batch_of, model_at, prefill_prompts
from fnattn.session import AttentionSession


def rows_of(value, row: int, prefix: str) -> dict[str, torch.Tensor]:
    """Row ``row`` of every tensor field of a backend's inputs or outputs (nested dataclasses flattened)."""
    out = {}
    if isinstance(value, torch.Tensor):
        if value.dim() and value.shape[0] > row:
            out[prefix] = value[row].detach().clone()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            if f.name not in ("meta", "batch"):
                out.update(rows_of(getattr(value, f.name), row, f"{prefix}.{f.name}"))
    elif isinstance(value, tuple):
        for i, v in enumerate(value):
            out.update(rows_of(v, row, f"{prefix}[{i}]"))
    return out


def greedy_trace(model, attn, prompts: dict[int, list[int]], steps: int, device) -> list[tuple]:
    """``[(step, layer, field, row)]`` of request 0 over ``steps`` greedy decode steps, in the order they ran."""
    trace: list[tuple] = []
    forward = AttentionSession.forward
    step = -1  # the decode step running: `recording` reads it

    def recording(session, layer, inputs):
        out = forward(session, layer, inputs)
        if session.batch.phase == "decode":
            row = list(session.batch.request_ids).index(0)
            for name, t in rows_of(inputs, row, "inputs").items():
                trace.append((step, layer, name, t))
            for name, t in rows_of(out[0], row, "outputs").items():
                trace.append((step, layer, name, t))
        return out

    st = fa.State(model.specs, num_pages=len(prompts) * (steps // 4 + 8) + 4, page_size=4,
                  max_requests=len(prompts) + 1, device=device, fill=float("nan"))
    st, last = prefill_prompts(model, attn, st, prompts)
    ids = last.argmax(-1)
    AttentionSession.forward = recording
    try:
        for step in range(steps):
            st = st.reserve({r: 1 for r in prompts})
            batch = fa.Batch.decode(st, list(prompts))
            with attn.session(st, batch) as s:
                logits, d = model.step(model.params, s, ids)
            st = st.apply(d)
            trace.append((step, "logits", "logits", logits[list(batch.request_ids).index(0)].clone()))
            ids = logits.argmax(-1)
    finally:
        AttentionSession.forward = forward
    return trace


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default="qwen3_5")
    p.add_argument("--shape", default="0.8b", help="the widths (default the 0.8B shape's)")
    p.add_argument("--layers", type=int, default=4, help="the first N layers of the shape (default 4)")
    p.add_argument("--others", type=int, default=7, help="requests beside request 0 (default 7)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prefer", nargs="*", default=None, help="ModelAttention's prefer (default: its own order)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--switch", action="append", default=[], metavar="NAME=on|off",
                   help="a fast-path switch set for both runs (repeatable), e.g. pdl=off")
    args = p.parse_args()
    switches = {}
    for item in args.switch:
        name, _, value = item.partition("=")
        if value not in ("on", "off") or name not in fnattn.switches.switches():
            p.error(f"--switch: expected NAME=on|off with NAME one of {', '.join(sorted(fnattn.switches.switches()))},"
                    f" got {item!r}")
        switches[name] = value == "on"
    model = model_at(args.family, args.shape, args.device, layers=args.layers)
    with fnattn.switches.set(invariant=True, **switches):
        attn = fa.ModelAttention(model.specs, device=args.device, prefer=args.prefer)
        alone = greedy_trace(model, attn, {0: PROMPTS[0]}, args.steps, args.device)
        beside = greedy_trace(model, attn, batch_of(args.others + 1, model.config.vocab_size), args.steps,
                              args.device)
    first = None
    for (step, layer, name, a), (_, _, name_b, b) in zip(alone, beside):
        if name != name_b or a.shape != b.shape or not torch.equal(a, b):
            diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else None
            backend = attn.backend(layer, "decode").name if isinstance(layer, int) else None
            first = {"step": step, "layer": layer, "field": name, "backend": backend, "max_abs_diff": diff}
            break
    decode = sorted({attn.backend(i, "decode").name for i in range(len(model.specs))})
    print(json.dumps({"family": args.family, "shape": args.shape, "layers": args.layers, "others": args.others,
                      "steps": args.steps, "device": args.device, "switches": switches, "decode_backends": decode,
                      "rows_compared": len(alone), "first_difference": first}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
