"""Kernel time of one MLA decode layer: raw FlashMLA, the usual append + absorb + kernel layer, and fnattn's
pure FlashMLA step (its session and apply), each profiled per call (`fnattn.bench.profile`).

    python benchmarks/mla_profile.py --batch 64 --ctx 4096 [--out mla_profile.json]
    python benchmarks/mla_profile.py --sparse --batch 64 --ctx 32768 [--topk 2048]

What `fnattn bench mla-decode` (``--sparse``: `mla-sparse`) reports as one number per row, split into the
kernels that make it up. ``--sparse``: a layer reusing a given top-k, raw ``flash_mla_sparse_fwd`` against
fnattn's sparse FlashMLA step with each slot translation (`one_pass_slots` off and on).
"""

import argparse
import json

import torch

from fnattn import Batch, LayerSpec, ModelAttention
from fnattn.apply import validate_step, write_step
from fnattn.bench.cases.mla import deepseek_mla, random_inputs, raw_flashmla
from fnattn.bench.profile import kernel_profile, print_profile
from fnattn.bench.setup import cached_state
from fnattn.deltas import StepDeltas


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--sparse", action="store_true", help="sparse MLA over a given top-k")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.sparse:
        return sparse(a)
    cfg = deepseek_mla(a.heads)
    specs = [LayerSpec(index=0, config=cfg, dtype=torch.bfloat16)]
    state = cached_state(specs, batch=a.batch, ctx=a.ctx, page_size=64)
    batch = Batch.decode(state, range(a.batch))
    inputs = random_inputs(cfg, a.batch)
    kernel, usual = raw_flashmla(state, batch, cfg, inputs, [0])
    ma = ModelAttention(specs, prefer=("flashmla",), device="cuda", phases=("decode",))

    def fnattn_step():
        with ma.session(state, batch) as s:
            _, w = s.forward(0, inputs)
            write_step(state.storage.pools, validate_step(state, StepDeltas.collect(batch, [w])))

    results = {}
    for name, fn in (("flashmla kernel (raw)", kernel), ("usual (append + kernel)", usual),
                     ("fnattn flashmla (pure)", fnattn_step)):
        results[name] = kernel_profile(fn, steps=a.calls, device=torch.device("cuda"))
        print_profile(f"mla decode B{a.batch} ctx{a.ctx} h{a.heads}: {name}", results[name], rows=12)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"batch": a.batch, "ctx": a.ctx, "heads": a.heads, "profiles": results}, f, indent=1)


def sparse(a) -> None:
    from fnattn.bench.cases.sparse_mla import sparse_decode_setup
    from fnattn.kinds.sparse_mla.flashmla import one_pass_slots

    specs, state, batch, inputs, kernel, _ = sparse_decode_setup(batch=a.batch, ctx=a.ctx, heads=a.heads, topk=a.topk)
    ma = ModelAttention(specs, prefer=("flashmla",), device="cuda", phases=("decode",))

    def fnattn_step():
        with ma.session(state, batch) as s:
            _, w = s.forward(1, inputs)
            write_step(state.storage.pools, validate_step(state, StepDeltas.collect(batch, [w]), layers=[1]))

    def with_slots(one_pass):
        def step():
            with one_pass_slots(one_pass):
                fnattn_step()
        return step

    results = {}
    for name, fn in (("flash_mla_sparse_fwd (raw)", kernel), ("fnattn flashmla (pure)", with_slots(False)),
                     ("fnattn flashmla (pure, one-pass slots)", with_slots(True))):
        results[name] = kernel_profile(fn, steps=a.calls, device=torch.device("cuda"))
        print_profile(f"sparse mla decode B{a.batch} ctx{a.ctx} h{a.heads} topk{a.topk}: {name}", results[name],
                      rows=16)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"batch": a.batch, "ctx": a.ctx, "heads": a.heads, "topk": a.topk, "profiles": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
