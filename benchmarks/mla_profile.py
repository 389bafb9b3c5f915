"""Kernel time of one MLA decode layer: raw FlashMLA, the usual append + absorb + kernel layer, and fnattn's
pure FlashMLA step (its session and apply), each profiled per call (`fnattn.bench.profile`).

    python benchmarks/mla_profile.py --batch 64 --ctx 4096 [--out mla_profile.json]

What `fnattn bench mla-decode` reports as one number per row, split into the kernels that make it up.
"""

import argparse
import json

import torch

from fnattn import Batch, LayerSpec, ModelAttention
from fnattn.apply import validate_step, write_step
from fnattn.bench.profile import kernel_profile, print_profile
from fnattn.bench.setup import cached_state
from fnattn.deltas import StepDeltas
from fnattn.kinds.mla.bench import deepseek_mla, random_inputs, raw_flashmla


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args()
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
            write_step(state._storage.pools, validate_step(state, StepDeltas.collect(batch, [w])))

    results = {}
    for name, fn in (("flashmla kernel (raw)", kernel), ("usual (append + kernel)", usual),
                     ("fnattn flashmla (pure)", fnattn_step)):
        results[name] = kernel_profile(fn, steps=a.calls, device=torch.device("cuda"))
        print_profile(f"mla decode B{a.batch} ctx{a.ctx} h{a.heads}: {name}", results[name], rows=12)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"batch": a.batch, "ctx": a.ctx, "heads": a.heads, "profiles": results}, f, indent=1)


if __name__ == "__main__":
    main()
