"""Pad lanes of a bucket never read or write a live row, and their outputs are defined.

The null page and the null recurrent slot (every ring row of it) are filled with NaN before a padded step:
a live lane that read them would turn NaN. The padded step must give the live lanes exactly what the
unpadded step gives, write exactly the live rows the unpadded step writes, and give its pad lanes finite
outputs (a NaN there is what a batch-wide reduction, such as a quantization scale, spreads to live rows).
On the reference and the CPU fast backends, and through `StepRunner`, whose CPU form wraps the eager step.
"""

import dataclasses

import pytest
import torch
from fnattn.models.registry import _load_builtin, random_model
from helpers import full_inputs, full_spec, gdn_spec, nan_state, recurrent_inputs, run, same_bits

import fnattn as fa
from fnattn.graph import StepRunner

_load_builtin()
NAN = float("nan")
SPECS = (full_spec(0), gdn_spec(1))
PREFER = [None, ("reference",)]  # the CPU fast backends (sdpa, torch), then the references


def poison_null(st):
    """NaN into the null page and every ring row of the null slot, in every float pool."""
    N = st.slots_per_ring
    for layer, spaces in st.storage_spaces.items():
        views = st.views(layer)
        for name, space in spaces.items():
            t = views[name]
            if t.dtype.is_floating_point:
                t[0 if space == "token" else slice(0, None, N)] = NAN  # page 0; rows pos * N + slot 0


def live_rows(st):
    """Every storage row but the null page's and the null slot's: ``{(layer, name): rows}``."""
    N, out = st.slots_per_ring, {}
    for layer, spaces in st.storage_spaces.items():
        for name, space in spaces.items():
            t = st.views(layer)[name]
            keep = torch.ones(t.shape[0], dtype=torch.bool, device=t.device)
            keep[0 if space == "token" else slice(0, None, N)] = False
            out[layer, name] = t[keep]
    return out


def first_tokens(inputs, n):
    """``inputs`` of the first ``n`` tokens (per-token fields cut; the conv taps are the layer's)."""
    cut = {f.name: getattr(inputs, f.name)[:n] for f in dataclasses.fields(inputs)
           if isinstance(getattr(inputs, f.name), torch.Tensor) and not f.name.startswith("conv_")}
    return dataclasses.replace(inputs, **cut)


def prefilled(prefer):
    ma = fa.ModelAttention(SPECS, prefer=prefer)
    st = nan_state(SPECS, recurrent_ring=4).admit(0).admit(1).reserve({0: 3, 1: 2})
    b = fa.Batch.prefill(st, {0: 3, 1: 2})
    prompt = {0: full_inputs(SPECS[0], 5), 1: recurrent_inputs(SPECS[1], 5)}
    return ma, st.apply(run(ma, st, b, prompt)[1]).reserve({0: 2, 1: 2})


@pytest.mark.parametrize("prefer", PREFER)
@pytest.mark.parametrize("num_draft", [0, 1])
def test_pad_lanes_never_touch_a_live_row_and_their_outputs_are_defined(prefer, num_draft):
    ma, st = prefilled(prefer)
    poison_null(st)
    if num_draft:
        padded = fa.Batch.verify(st, [0, 1], num_draft=num_draft, pad_to=4, columns=3)
        plain = fa.Batch.verify(st, [0, 1], num_draft=num_draft)
    else:
        padded, plain = fa.Batch.decode(st, [0, 1], pad_to=4, columns=3), fa.Batch.decode(st, [0, 1])
    T, live = padded.num_tokens, plain.num_tokens
    inputs = {0: full_inputs(SPECS[0], T, gen=torch.Generator().manual_seed(1)),
              1: recurrent_inputs(SPECS[1], T, seed=2)}
    out_pad, d_pad = run(ma, st, padded, inputs)
    out_plain, d_plain = run(ma, st, plain, {k: first_tokens(v, live) for k, v in inputs.items()})
    for layer in inputs:
        o = out_pad[layer].o
        assert torch.isfinite(o).all(), f"layer {layer}: a pad lane's output is not finite"
        assert torch.equal(o[:live], out_plain[layer].o), f"layer {layer}: padding changed a live lane"
    after_pad, after_plain = st.apply(d_pad, inplace=False), st.apply(d_plain, inplace=False)
    got, want = live_rows(after_pad), live_rows(after_plain)
    for key in want:
        assert same_bits(got[key], want[key]), f"{key}: a pad lane wrote a live row"
    assert {r: after_pad.request(r).length for r in (0, 1)} == {r: after_plain.request(r).length for r in (0, 1)}


@pytest.mark.parametrize("name", ["qwen3_next", "glm5"])  # GDN + full attention; sparse MLA + indexer
def test_a_padded_runner_step_equals_the_unpadded_one_with_a_nan_null_page_and_slot(name):
    """Through the runner (bucket 4 for 2 requests): live logits finite and equal to the unpadded eager
    step's, and every row but the null ones as the unpadded step leaves it."""
    model = random_model(name)
    attn = fa.ModelAttention(model.specs)
    runner = StepRunner(model.step, model.params, attn, model.manifest(), max_context=32, buckets=(4,))

    def start():
        st = fa.State(model.specs, num_pages=16, page_size=8, max_requests=4, fill=NAN, recurrent_ring=4)
        st = st.admit(0).admit(1).reserve({0: 5, 1: 3})
        b = fa.Batch.prefill(st, {0: 5, 1: 3})
        with attn.session(st, b) as s:
            _, d = model.step(model.params, s, torch.tensor([1, 2, 3, 4, 5, 7, 8, 9]))
        st = st.apply(d).reserve({0: 1, 1: 1})
        poison_null(st)
        return st

    tokens = torch.tensor([11, 12])
    st = start()
    b = fa.Batch.decode(st, [0, 1])
    with attn.session(st, b) as s:
        want, d = model.step(model.params, s, tokens)
    want_rows = live_rows(st.apply(d))
    st, got = runner.decode(start(), [0, 1], tokens)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for key, rows in live_rows(st).items():
        torch.testing.assert_close(rows, want_rows[key], rtol=1e-5, atol=1e-5, equal_nan=True, msg=str(key))
