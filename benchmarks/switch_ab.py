"""The other side of a fast-path switch, timed beside its default at a standard case's shape, in one process.

`fnattn bench` times each backend as it ships; this script asks whether a switch's default still earns its place:

    python benchmarks/switch_ab.py mla-decode [--batch 64] [--ctx 4096] [--out switch_ab_mla_decode.json]
    python benchmarks/switch_ab.py mla-sparse [--batch 64] [--ctx 32768] [--topk 2048]
    python benchmarks/switch_ab.py gdn-prefill

- ``mla-decode``: the pure FlashMLA step (`fnattn bench mla-decode`'s "fnattn flashmla (pure)") with the absorbed
  query as the usual batched product (`fnattn.kinds.mla.latent.absorb_kernel(False)`), and with the own row's merge
  and ``W_UV``'s batched product apart (`merge_values_kernel(False)`).
- ``mla-sparse``: the sparse FlashMLA layer reusing a top-k (`fnattn bench mla-sparse`'s fnattn row) with the slots
  translated by the torch form (`one_pass_slots(False)`), the batched absorb, and the own row's merge and ``W_UV``
  in one launch (`fnattn.kinds.sparse_mla.flashmla.merge_values_kernel(True)`).
- ``gdn-prefill``: the "fla" provider with the conv writing one [T, C] output for fla-core to copy
  (`fnattn.kinds.delta_rule.triton.qkv_apart(False)`), at `fnattn bench gdn-prefill`'s shapes.

Each record's peer is the default side (ratios > 1: the other side is faster). A switch is in force while the step
is traced, so a captured graph keeps the side it was captured with. The records are `fnattn bench`'s JSON.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys

import torch

from fnattn import Batch, LayerSpec, ModelAttention
from fnattn.bench import print_table, timed_session, with_ratios, write_json
from fnattn.bench.cases.delta_rule import recurrent_inputs, recurrent_spec, session_time
from fnattn.bench.cases.full import time_fnattn
from fnattn.bench.cases.mla import deepseek_mla, random_inputs
from fnattn.bench.cases.sparse_mla import FNATTN_ROW, record, sparse_decode_setup
from fnattn.bench.setup import cached_state
from fnattn.kinds.delta_rule.triton import qkv_apart
from fnattn.kinds.mla import latent
from fnattn.kinds.sparse_mla import flashmla as sparse_flashmla

CASES = ("mla-decode", "mla-sparse", "gdn-prefill")


def mla_decode(*, batch: int, ctx: int, heads: int, page_size: int, graph: bool) -> list[dict]:
    cfg = deepseek_mla(heads)
    specs = [LayerSpec(index=0, config=cfg, dtype=torch.bfloat16)]
    state = cached_state(specs, batch=batch, ctx=ctx, page_size=page_size)
    b = Batch.decode(state, range(batch))
    inputs = random_inputs(cfg, batch)
    ma = ModelAttention(specs, prefer=("flashmla",), device="cuda", phases=("decode",))
    case = f"mla decode switches B{batch} ctx{ctx} h{heads} p{page_size}" + (" graph" if graph else " eager")
    shape = {"batch": batch, "ctx": ctx, "heads": heads, "page_size": page_size, "latent": "512+64",
             "dtype": "bfloat16"}
    peer = "fnattn flashmla (pure)"

    def step(absorb: bool = True, merge_values: bool = True):
        with latent.absorb_kernel(absorb), latent.merge_values_kernel(merge_values):
            return time_fnattn(ma, state, b, specs, inputs, graph=graph)

    return [record(case, peer, peer, shape, step),
            record(case, "fnattn flashmla (pure, batched absorb)", peer, shape, lambda: step(absorb=False)),
            record(case, "fnattn flashmla (pure, merge kernel + batched W_UV)", peer, shape,
                   lambda: step(merge_values=False))]


def mla_sparse(*, batch: int, ctx: int, heads: int, topk: int, page_size: int, graph: bool) -> list[dict]:
    specs, state, b, inputs, _, _ = sparse_decode_setup(batch=batch, ctx=ctx, heads=heads, topk=topk,
                                                        page_size=page_size)
    ma = ModelAttention(specs, prefer=("flashmla",), device="cuda", phases=("decode",))
    case = f"sparse mla decode switches B{batch} ctx{ctx} h{heads} topk{topk}" + (" graph" if graph else " eager")
    shape = {"batch": batch, "ctx": ctx, "heads": heads, "topk": topk, "page_size": page_size}

    def layer(one_pass: bool = True, absorb: bool = True, merge_values: bool = False):
        with (sparse_flashmla.one_pass_slots(one_pass), latent.absorb_kernel(absorb),
              sparse_flashmla.merge_values_kernel(merge_values)):
            return timed_session(ma, state, b, lambda s: s.forward(1, inputs), graph=graph)

    return [record(case, FNATTN_ROW, FNATTN_ROW, shape, layer),
            record(case, "fnattn flashmla (attention, shared top-k)", FNATTN_ROW, shape,
                   lambda: layer(one_pass=False)),
            record(case, "fnattn flashmla (attention, shared top-k, one-pass slots, batched absorb)", FNATTN_ROW,
                   shape, lambda: layer(absorb=False)),
            record(case, "fnattn flashmla (attention, shared top-k, one-pass slots, merge + W_UV kernel)",
                   FNATTN_ROW, shape, lambda: layer(merge_values=True))]


def gdn_prefill(*, requests: int, length: int) -> list[dict]:
    spec = recurrent_spec("gdn", hk=16, hv=32, dim=128, dtype=torch.bfloat16)
    state = cached_state(spec, batch=requests, ctx=0, page_size=length, extra=length)
    b = Batch.prefill(state, {r: length for r in range(requests)})
    T = requests * length
    inputs = recurrent_inputs(spec, T)
    case = f"gdn prefill switches {requests}x{length} (T={T}) 16qk/32v d128"
    shape = {"requests": requests, "length": length, "tokens": T, "hk": 16, "hv": 32, "dim": 128,
             "dtype": "torch.bfloat16"}
    peer = "fnattn fla"

    def layer(apart: bool):
        with qkv_apart(apart):
            return session_time("fla", spec, state, b, inputs, graph=False)

    rate = lambda us: {"mtok_s": T / us}  # noqa: E731
    return [record(case, peer, peer, shape, lambda: layer(True), rate),
            record(case, "fnattn fla, one conv output", peer, shape, lambda: layer(False), rate)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case", choices=CASES)
    p.add_argument("--batch", type=int, nargs="+", default=[64], help="decode batch sizes (MLA cases)")
    p.add_argument("--ctx", type=int, default=None, help="cached tokens per request (default 4096; mla-sparse 32768)")
    p.add_argument("--heads", type=int, default=128, help="MLA query heads")
    p.add_argument("--topk", type=int, default=2048, help="tokens each query attends (mla-sparse)")
    p.add_argument("--page-size", type=int, default=64, help="tokens per page (MLA cases)")
    p.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA-graph replays")
    p.add_argument("--out", default=None, help="JSON output path (default switch_ab_<case>.json)")
    words = sys.argv[1:] if argv is None else list(argv)
    a = p.parse_args(words)
    if not torch.cuda.is_available():
        print("switch_ab: needs a CUDA device (none found)", file=sys.stderr)
        return 2
    out = a.out or f"switch_ab_{a.case.replace('-', '_')}.json"
    records: list[dict] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # a time limit still writes what finished
    try:
        if a.case == "gdn-prefill":
            for requests, length in ((16, 4096), (1, 65536)):  # fnattn bench gdn-prefill's shapes
                records += gdn_prefill(requests=requests, length=length)
        for batch in a.batch if a.case != "gdn-prefill" else ():
            if a.case == "mla-decode":
                records += mla_decode(batch=batch, ctx=a.ctx or 4096, heads=a.heads, page_size=a.page_size,
                                      graph=not a.eager)
            else:
                records += mla_sparse(batch=batch, ctx=a.ctx or 32768, heads=a.heads, topk=a.topk,
                                      page_size=a.page_size, graph=not a.eager)
    finally:
        with_ratios(records)
        print_table(records)
        if records:
            write_json(records, out, command=shlex.join(["python", "benchmarks/switch_ab.py", *words]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
