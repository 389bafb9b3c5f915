"""DeepSeek-V4 speculative decoding with its MTP draft: native and replay recovery of the compressor state.

The target's CSA / HCA layers keep a compressor state per request; a verify
step either returns it after every token (native) or is replayed over the
accepted tokens (replay). 64 speculative steps with forced acceptance
patterns (every length 0..K) must give bitwise-equal logits in both modes
and transformers-free greedy tokens (the plain decode's).
"""

from __future__ import annotations

import pytest
import torch
from fnattn.models.registry import family_named, random_model
from test_speculative import PROMPTS, STEPS, K, family_models, greedy_reference, run

import fnattn as fa
from fnattn.driver import run_step


def test_native_and_replay_are_bitwise_equal_over_64_steps_and_emit_greedy_tokens():
    m = family_models("deepseek_v4")
    ref = greedy_reference(m, STEPS * (K + 1) + 2)
    native, out_n, acc_n = run(m, "native", ref)
    replay, out_r, acc_r = run(m, "replay", ref)
    assert out_n == out_r and acc_n == acc_r
    assert set(acc_n) == set(range(1, K + 2))
    for r in PROMPTS:
        assert out_n[r] == ref[r][: len(out_n[r])]
        assert len(out_n[r]) > 64  # the compression windows closed many times inside verify steps
    assert len(native.trace) == len(replay.trace)
    assert all(torch.equal(a, b) for a, b in zip(native.trace, replay.trace))
    for s in (native, replay):
        for st in (s.tstate, s.dstate):
            assert st.free_pages == st.num_pages and st.free_slots == st.max_requests and not st.requests


def test_draft_specs_follow_the_target_and_own_a_compressor():
    model = random_model("deepseek_v4", seed=0)
    d = family_named("deepseek_v4").draft(model.config, model.params, None, seed=1)
    [spec] = d.specs
    assert spec.index == model.config.num_layers and spec.config.compress_ratio > 0
    st = fa.State(d.specs, num_pages=8, page_size=4, max_requests=1).admit(0).reserve({0: 9})
    batch = fa.Batch.prefill(st, {0: 9})
    tokens = torch.arange(9)
    hidden = torch.randn(9, model.config.hidden_size)
    with pytest.raises(ValueError, match="`hidden`"):
        with fa.ModelAttention(d.specs).session(st, batch) as s:
            d.step(d.params, s, tokens, hidden[:, :3])
    _, (logits, out) = run_step(lambda p, s, t: (lambda r: ((r[0], r[1]), r[2]))(d.step(p, s, t, hidden)),
                                d.params, fa.ModelAttention(d.specs), st, batch, tokens)
    assert logits.shape == (9, model.config.vocab_size) and torch.isfinite(logits).all()
    assert out.shape == (9, model.config.hidden_size)
