"""The own-row merge + ``W_UV`` kernel's tiles inside whole MLA decode layers (each layer's forward, graph-replayed):
dense FlashMLA (B x ctx 4k) and sparse FlashMLA (B x ctx 32k, top-k 2048), 128 heads, each against the merge
kernel and ``W_UV``'s batched product (each kind's ``merge_values_kernel(False)``), in one run.

    python benchmarks/mla_merge_layers.py [--batch 8 64] [--out mla_merge_layers.json]

A kernel's best tile alone (``mla_absorb_sweep.py``, the cache flushed before each call) need not be its best
between the attention kernel and the next layer: this times the tiles where they run.
"""

import argparse
import json

import torch
from fnattn.kernels.latent_absorb import configured_merge

from fnattn import Batch, LayerSpec, ModelAttention
from fnattn.bench import environment, timed_session
from fnattn.bench.cases.mla import deepseek_mla, random_inputs
from fnattn.bench.cases.sparse_mla import sparse_decode_setup
from fnattn.bench.setup import cached_state
from fnattn.kinds.mla.latent import merge_values_kernel
from fnattn.kinds.sparse_mla.flashmla import merge_values_kernel as sparse_merge_values_kernel

# (block_t, block_r, block_v, num_warps); None: the shipped tile for the step's token count
TILES = [None, (16, 64, None, 8), (16, 128, None, 8), (32, 64, None, 8), (64, 64, None, 8), (16, 64, 64, 8),
         (16, 64, None, 4), (64, 64, None, 4)]


def layers(batch: int):
    cfg = deepseek_mla(128)
    specs = [LayerSpec(index=0, config=cfg, dtype=torch.bfloat16)]
    state = cached_state(specs, batch=batch, ctx=4096, page_size=64)
    b, inputs = Batch.decode(state, range(batch)), random_inputs(cfg, batch)
    ma = ModelAttention(specs, prefer=("flashmla",), device="cuda", phases=("decode",))
    yield f"mla decode B{batch} ctx4096", ma, state, b, lambda s: s.forward(0, inputs)
    specs, state, b, inputs, _, _ = sparse_decode_setup(batch=batch, ctx=32768)
    ma = ModelAttention(specs, prefer=("flashmla",), device="cuda", phases=("decode",))
    yield f"sparse mla decode B{batch} ctx32768 topk2048", ma, state, b, lambda s: s.forward(1, inputs)


def step(ma, state, b, body, on: bool, tile) -> float:
    fields = {} if tile is None else {k: v for k, v in zip(("block_t", "block_r", "block_v", "num_warps"), tile)
                                      if v is not None}
    # in force while the step is traced (a graph keeps what it captured)
    with merge_values_kernel(on), sparse_merge_values_kernel(on), configured_merge(**fields):
        return timed_session(ma, state, b, body)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    records = []
    for batch in a.batch:
        for case, ma, state, b, body in layers(batch):
            base = step(ma, state, b, body, False, None)
            records.append({"case": case, "way": "merge kernel + batched W_UV", "time_us": base})
            print(f"{case:44s} {'merge kernel + batched W_UV':44s} {base:8.2f} us")
            for tile in TILES:
                us = step(ma, state, b, body, True, tile)
                way = "merge_own_values " + ("shipped tile" if tile is None else
                                             "block_t {} block_r {} block_v {} warps {}".format(*tile))
                records.append({"case": case, "way": way, "tile": tile, "time_us": us, "vs_apart": base / us})
                print(f"{case:44s} {way:44s} {us:8.2f} us  x{base / us:.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": "python benchmarks/mla_merge_layers.py --batch " + " ".join(map(str, a.batch)),
                       "environment": environment(), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
