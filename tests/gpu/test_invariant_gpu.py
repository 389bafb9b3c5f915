"""The invariant mode on CUDA for every family: in bf16, a verify's logits are the decode steps' logits bit for bit,
and a request's decode logits do not change beside another request. In the mode a ModelAttention chooses only
backends that honour it (full attention's Triton kernels in their invariant launch, GDN / KDA's, MLA's and
sparse MLA's and DeepSeek-V4's Triton kernels), the projections `models.fused` takes run the decode GEMV in the
mode's launch (fixed by the weight's shape, rows in 16-row tiles) and the others the fixed-tile GEMM, fnattn's own
row-local kernels stay and FlashInfer's and fla's give way. At the Qwen3.5-0.8B widths a request's logits are
also checked beside 2 and 7 requests of other lengths."""

from __future__ import annotations

import pytest
import torch
from fnattn.models.registry import family_names

import fnattn as fa
import fnattn.switches
from fnattn.bench.invariance import batch_of, model_at, request_0_logits

pytestmark = pytest.mark.gpu
DEV, K = "cuda", 3
PROMPTS = {0: [5, 17, 9, 3, 11, 2, 7, 30, 4, 19, 21, 6], 1: [8, 1, 4, 22, 13]}
TOKENS = [3, 14, 15, 9]
FAMILIES = family_names()


def model_of(name):
    from fnattn.models.registry import random_model

    return random_model(name, seed=0, dtype=torch.bfloat16, device=DEV)


def prefilled(model, ids, ring=K + 2):
    attn = fa.ModelAttention(model.specs, device=DEV)
    st = fa.State(model.specs, num_pages=64, page_size=attn.page_size or 16, max_requests=4, recurrent_ring=ring,
                  device=DEV, fill=float("nan"))
    for r in ids:
        st = st.admit(r)
    counts = {r: len(PROMPTS[r]) for r in ids}
    st = st.reserve(counts)
    with attn.session(st, fa.Batch.prefill(st, counts)) as s:
        _, d = model.step(model.params, s, torch.tensor([t for r in ids for t in PROMPTS[r]], device=DEV))
    return attn, st.apply(d)


def decode_logits(model, ids):
    """Request 0's logits over `TOKENS`, decoded one a step beside the other requests in ``ids``."""
    attn, st = prefilled(model, ids)
    rows = []
    for t in TOKENS:
        st = st.reserve({r: 1 for r in ids})
        batch = fa.Batch.decode(st, ids)
        with attn.session(st, batch) as s:
            logits, d = model.step(model.params, s, torch.tensor([t] * len(ids), device=DEV))
        st = st.apply(d)
        rows.append(logits[batch.request_ids.index(0)])
    return attn, torch.stack(rows)


@pytest.mark.parametrize("on", [True, False], ids=["invariant", "default"])
@pytest.mark.parametrize("name", FAMILIES)
def test_verify_equals_decode_and_a_request_ignores_its_batch(name, on, record):
    model = model_of(name)
    with fnattn.switches.set(invariant=on):
        attn, alone = decode_logits(model, [0])
        backends = sorted({attn.backend(i, "decode").name for i in range(len(model.specs))})
        _, beside = decode_logits(model, [0, 1])
        attn, st = prefilled(model, [0])
        st = st.reserve({0: K + 1})
        with attn.session(st, fa.Batch.verify(st, [0], num_draft=K)) as s:
            verified, _ = model.step(model.params, s, torch.tensor(TOKENS, device=DEV))
    verify_equal, batch_equal = bool(torch.equal(verified, alone)), bool(torch.equal(alone, beside))
    ok = (verify_equal and batch_equal) if on else True  # the default mode is recorded, not held to it
    record({"case": f"invariant {name} {'on' if on else 'off'}", "backends": backends,
            "verify_equals_decode": verify_equal, "batch_invariant": batch_equal,
            "max_verify_diff": float((verified.float() - alone.float()).abs().max()), "ok": ok})
    assert ok, (verify_equal, batch_equal)


@pytest.mark.parametrize("others", [2, 7])
def test_at_real_widths_a_requests_logits_ignore_its_batch(others, record):
    # the 0.8B shape's widths (tiny widths take other tiles and launch forms), four layers
    model = model_at("qwen3_5", "0.8b", DEV, layers=4)
    prompts = batch_of(others + 1, model.config.vocab_size)  # request 0's prompt and others of mixed lengths

    def greedy(prompts):  # pages of 4 tokens, so requests cross pages at different steps; unused storage NaN
        st = fa.State(model.specs, num_pages=len(prompts) * 12 + 4, page_size=4, max_requests=len(prompts) + 1,
                      device=DEV, fill=float("nan"))
        return request_0_logits(model, attn, st, prompts, steps=8)

    with fnattn.switches.set(invariant=True):
        attn = fa.ModelAttention(model.specs, device=DEV)
        alone, beside = greedy({0: prompts[0]}), greedy(prompts)
    same = [torch.equal(a, b) for a, b in zip(alone, beside)]
    backends = sorted({attn.backend(i, "decode").name for i in range(len(model.specs))})
    record({"case": f"invariant qwen3_5 0.8b widths beside {others}", "backends": backends,
            "equal_by_step": same, "ok": all(same)})
    assert all(same), same
