"""Captured pad lanes on the GPU never read or write a live row, and their outputs are defined.

Twin of tests/test_padded_lanes.py for CUDA graphs: two requests replayed in a bucket of 4 lanes, the null
page and the null slot filled with NaN before the replay (after the capture's warm-up wrote them). The
graph's live logits must equal the capture-free runner's bit for bit, every row but the null ones must be
what the capture-free step leaves, and the graph's whole output buffer, pad rows included, must be finite.
"""

import dataclasses

import pytest
import torch
from fnattn.models.registry import _load_builtin, family_named, random_checkpoint
from test_padded_lanes import live_rows, poison_null

import fnattn as fa
from fnattn.graph import StepRunner

pytestmark = pytest.mark.gpu
_load_builtin()
BF16 = torch.bfloat16


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_captured_pad_lanes_never_touch_a_live_row_and_their_outputs_are_defined(name):
    fam = family_named(name)
    cfg = dataclasses.replace(fam.adapt(fam.tiny_config()), dtype=BF16)
    params = fam.load(cfg, random_checkpoint(fam, cfg, seed=0, dtype=BF16, device="cuda"))
    attn = fa.ModelAttention(cfg.specs, device="cuda")

    def steps(capture):
        runner = StepRunner(fam.step, params, attn, fam.manifest(cfg), capture=capture, max_context=64,
                            buckets=(4,))
        st = fa.State(cfg.specs, num_pages=16, page_size=16, max_requests=4, device="cuda", fill=float("nan"),
                      recurrent_ring=4).admit(0).admit(1).reserve({0: 5, 1: 3})
        b = fa.Batch.prefill(st, {0: 5, 1: 3})
        with attn.session(st, b) as s:
            _, d = fam.step(params, s, torch.tensor([1, 2, 3, 4, 5, 7, 8, 9], device="cuda"))
        st = st.apply(d).reserve({0: 1, 1: 1})
        st, _ = runner.decode(st, [0, 1], torch.tensor([11, 12], device="cuda"))  # captured here
        st = st.reserve({0: 1, 1: 1})
        poison_null(st)
        st, logits = runner.decode(st, [0, 1], torch.tensor([13, 14], device="cuda"))
        torch.cuda.synchronize()
        (entry,) = runner._entries.values()
        return runner, entry, st, logits

    runner, entry, st, got = steps(None)
    assert runner.capture and entry.graph is not None
    _, _, want_st, want = steps(False)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    assert torch.isfinite(entry.outputs["logits"]).all(), "a pad lane's logits in the graph's buffer are not finite"
    want_rows = live_rows(want_st)
    for key, rows in live_rows(st).items():
        assert torch.equal(rows.isnan(), want_rows[key].isnan()), key
        assert torch.equal(rows.nan_to_num(), want_rows[key].nan_to_num()), key
