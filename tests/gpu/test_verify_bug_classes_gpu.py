"""The verify bug classes of tests/test_verify_bug_classes.py on captured steps: a CUDA-graph verify that
accepts two drafts or more, then one that accepts none, across page boundaries, gives plain (captured)
decoding's logits, with native and replay recovery bit for bit equal."""

import sys
from pathlib import Path

import pytest
import torch

import fnattn as fa
from fnattn.graph import StepRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import test_verify_bug_classes as cpu  # noqa: E402

pytestmark = pytest.mark.gpu

K, S, PROMPT, ACCEPTED = cpu.K, 16, cpu.PROMPT, ({0: 3, 1: 4}, {0: 1, 1: 1})


def prompt_lengths():
    """Request 0 ends its first verify on a page's last row (16 tokens) and its second on the next page's
    first; request 1's decode after them writes a page's last row."""
    return {0: S - 3, 1: S - 5 - 1}


def run(model, recovery):
    """``-> {(request, position): logits row}``; ``recovery`` None: plain decoding of the same tokens."""
    fam, vocab, prompt = model.family, model.config.vocab_size, prompt_lengths()
    attn = fa.ModelAttention(model.specs, device="cuda")
    tokens = {r: [(7 * r + 3 * p + 1) % vocab for p in range(2 * S)] for r in PROMPT}
    st = fa.State(model.specs, num_pages=16, page_size=S, max_requests=3, device="cuda", recurrent_ring=K + 2)
    st = st.admit(0).admit(1).reserve(prompt)
    logits = {}
    b = fa.Batch.prefill(st, prompt)
    with attn.session(st, b) as s:
        out, deltas = fam.step(model.params, s, torch.tensor(
            [tokens[r][p] for r in b.request_ids for p in range(prompt[r])], device="cuda"))
    st = st.apply(deltas)
    runner = StepRunner(fam.step, model.params, attn, model.manifest(), max_context=2 * S, buckets=(2,))
    schedule = [{r: 1 for r in PROMPT}] * (sum(max(a.values()) for a in ACCEPTED) + 1) if recovery is None \
        else [*ACCEPTED, {r: 1 for r in PROMPT}]
    for i, accepted in enumerate(schedule):
        verify = recovery is not None and i < len(ACCEPTED)
        n = K + 1 if verify else 1
        st = st.reserve({r: n for r in PROMPT})
        fed = [(r, st.request(r).length + j) for r in PROMPT for j in range(n)]
        ids = [tokens[r][p] if p < st.request(r).length + accepted[r] else (tokens[r][p] + 1) % vocab
               for r, p in fed]
        if verify:
            verified = runner.verify(st, list(PROMPT), torch.tensor(ids, device="cuda"), num_draft=K,
                                     recovery=recovery)
            rows = verified.logits
            keep = [(r, p) for r, p in fed if p < st.request(r).length + accepted[r]]
            st = verified.accept(accepted)
        else:
            st, rows = runner.decode(st, list(PROMPT), torch.tensor(ids, device="cuda"))
            keep = fed
        logits |= {key: rows[fed.index(key)].float().cpu() for key in keep}
    return logits


def test_captured_verify_two_drafts_then_none_across_page_boundaries(record):
    from fnattn.models.registry import random_model

    model = random_model("qwen3_5", seed=0, device="cuda")
    plain, native, replay = run(model, None), run(model, "native"), run(model, "replay")
    assert set(native) == set(replay) and set(native) <= set(plain)
    bitwise = all(torch.equal(native[k], replay[k]) for k in native)
    diff = max((native[k] - plain[k]).abs().max().item() for k in native)
    ok = bitwise and diff <= 1e-3
    record({"case": f"captured verify 2+ then 0 drafts, page {S}", "phase": "verify", "backend": "default",
            "max_abs": diff, "max_rel": 0.0, "ok": ok, "native_equals_replay": bitwise})
    assert ok, f"captured verify vs plain decoding: max abs {diff}, native == replay: {bitwise}"
