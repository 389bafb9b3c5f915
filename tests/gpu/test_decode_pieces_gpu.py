"""Decode captured in pieces on the GPU: a model with a kind whose decode backend is not capturable (a
notebook's) replays graphs around that kind's layers, and its logits are the capture-free runner's bit for bit
(the same runs as tests/gpu/test_graph_gpu.py: 32 steps, requests joining and leaving, NaN-filled storage)."""

import pytest
import torch
from helpers import registry_scope
from test_graph_gpu import build, decode_run

import fnattn as fa

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["qwen3_5", "llama", "kimi_linear"])
def test_decode_in_pieces_around_an_uncapturable_kind_equals_the_capture_free_step(name, record):
    """A kind whose decode backend is registered without ``capturable=True`` (a notebook's, here a copy of the
    chosen backend of the last layer's kind) no longer turns the runner's decode eager: each of its layers runs
    between captured pieces, and the logits are the capture-free runner's bit for bit (32 steps, requests
    joining and leaving, NaN-filled storage)."""
    fam, cfg, _, _ = build(name)
    chosen = fa.ModelAttention(cfg.specs, device="cuda").backend(cfg.specs[-1].index, "decode")
    with registry_scope():
        def notebook_copy(spec, views, inputs):  # defined outside fnattn: a user's backend, ranked first
            return chosen.source(spec, views, inputs)

        fa.register(chosen.kind, "decode", "notebook_copy", plan=chosen.plan, supports=chosen.supports,
                    page_size=chosen.page_size)(notebook_copy)
        runner, pieces, rows_ok = decode_run(name, True)
        _, eager, _ = decode_run(name, False)
    islands = {e.bucket.lanes: len(e.islands) for e in runner.entries()}
    layers = sum(spec.kind == chosen.kind for spec in cfg.specs)
    equal = len(pieces) == len(eager) and all(torch.equal(a, b) for a, b in zip(pieces, eager))
    shaped = runner.in_pieces and all(e.graph is None and len(e.graphs) == len(e.islands) + 1 == layers + 1
                                      for e in runner.entries())
    replays = sum(e.replays for e in runner.entries())
    finite = all(torch.isfinite(a).all() for a in pieces) and rows_ok
    record({"case": f"decode in pieces around {chosen.kind!r} ({layers} layers), {name}", "steps": 32,
            "islands": islands, "replays": replays, "bitwise": equal, "finite": finite,
            "ok": equal and shaped and finite and replays == 32})
    assert equal and shaped and finite and replays == 32
