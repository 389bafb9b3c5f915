"""Speculative decoding end to end: forced acceptance patterns, native vs replay, greedy equality."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst

import fnattn as fa
from fnattn.driver import generate
from fnattn.models import tiny
from fnattn.speculative import Speculator

K = 3
STEPS = 64


def tiny_models():
    cfg = tiny.TinyConfig(hidden_size=32, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8,
                          intermediate_size=48, vocab_size=64)
    params = tiny.init_params(cfg, seed=3)
    return {"target_step": tiny.step_hidden, "target_params": params, "target_specs": tiny.layer_specs(cfg),
            "plain_step": tiny.step, "draft_step": tiny.draft_step, "draft_params": tiny.init_draft(cfg, params),
            "draft_specs": tiny.draft_specs(cfg), "vocab": cfg.vocab_size}


def family_models(name):
    from fnattn.models.registry import family_named, random_model

    fam = family_named(name)
    if fam.draft is None or fam.step_hidden is None:
        pytest.skip(f"family {name} has no draft model")
    model = random_model(name, seed=0)
    draft = fam.draft(model.config, model.params, None, seed=1)
    return {"target_step": fam.step_hidden, "target_params": model.params, "target_specs": model.specs,
            "plain_step": fam.step, "draft_step": draft.step, "draft_params": draft.params,
            "draft_specs": draft.specs, "vocab": model.config.vocab_size}


MODELS = {"tiny": tiny_models, "qwen3_5": lambda: family_models("qwen3_5"),
          "deepseek_v3": lambda: family_models("deepseek_v3")}
PROMPTS = {0: [5, 17, 9, 3, 11, 2, 7], 1: [8, 1, 4]}


def state(specs, tokens):
    return fa.State(specs, num_pages=len(PROMPTS) * (tokens // 8 + 4), page_size=8, max_requests=len(PROMPTS) + 1)


def greedy_reference(m, n_tokens):
    ma = fa.ModelAttention(m["target_specs"])
    _, out = generate(m["plain_step"], m["target_params"], ma, state(m["target_specs"], n_tokens + 16), PROMPTS,
                      max_new_tokens=n_tokens)
    return out


def forced(ref, emitted, vocab):
    """A hook that makes request r accept exactly pattern[step] drafts (0..K)."""
    pattern = [0, 1, 2, 3, 3, 1, 0, 2]

    def hook(step, drafts):
        out = {}
        for i, r in enumerate(drafts):
            m = pattern[(step + i) % len(pattern)]
            pos = len(emitted[r])  # the next token the target will produce after `last`
            right = ref[r][pos : pos + K]
            wrong = [(t + 1) % vocab for t in right]
            out[r] = right[:m] + wrong[m:K]
        return out

    return hook


def run(m, recovery, ref):
    emitted = {r: [] for r in PROMPTS}
    spec = Speculator(trace=True, target_step=m["target_step"], target_params=m["target_params"],
                      target_attn=fa.ModelAttention(m["target_specs"]),
                      target_state=state(m["target_specs"], STEPS * (K + 1) + 32),
                      draft_step=m["draft_step"], draft_params=m["draft_params"],
                      draft_attn=fa.ModelAttention(m["draft_specs"]),
                      draft_state=state(m["draft_specs"], STEPS * (K + 1) + 32 + K),
                      num_draft=K, recovery=recovery, propose_hook=forced(ref, emitted, m["vocab"]))
    for r, t in spec.start(PROMPTS).items():
        emitted[r].append(t)
    accepted = []
    for _ in range(STEPS):
        for r, toks in spec.step().items():
            emitted[r] += toks
            accepted.append(len(toks))
    for r in PROMPTS:
        spec.release(r)
    return spec, emitted, accepted


@pytest.mark.parametrize("name", list(MODELS))
def test_native_and_replay_are_bitwise_equal_and_emit_greedy_tokens(name):
    m = MODELS[name]()
    ref = greedy_reference(m, STEPS * (K + 1) + 2)
    native, out_n, acc_n = run(m, "native", ref)
    replay, out_r, acc_r = run(m, "replay", ref)
    assert out_n == out_r and acc_n == acc_r
    assert set(acc_n) == set(range(1, K + 2))  # every acceptance length 0..K drafts (+ the bonus)
    for r in PROMPTS:
        assert out_n[r] == ref[r][: len(out_n[r])]
    assert len(native.trace) == len(replay.trace)
    assert all(torch.equal(a, b) for a, b in zip(native.trace, replay.trace))  # max abs error exactly 0
    for s in (native, replay):
        for st in (s.tstate, s.dstate):
            assert st.free_pages == st.num_pages and st.free_slots == st.max_requests and not st.requests


def test_aborted_request_releases_everything_mid_speculation():
    m = tiny_models()
    spec = Speculator(trace=True, target_step=m["target_step"], target_params=m["target_params"],
                      target_attn=fa.ModelAttention(m["target_specs"]), target_state=state(m["target_specs"], 64),
                      draft_step=m["draft_step"], draft_params=m["draft_params"],
                      draft_attn=fa.ModelAttention(m["draft_specs"]), draft_state=state(m["draft_specs"], 64),
                      num_draft=K)
    spec.start(PROMPTS)
    spec.step()
    spec.release(1)  # aborted while its next proposal is pending
    spec.step()
    assert set(spec.last) == {0}
    spec.release(0)
    for st in (spec.tstate, spec.dstate):
        assert st.free_pages == st.num_pages and st.free_slots == st.max_requests
    with pytest.raises(ValueError, match="`requests`"):
        spec.step()


def test_bad_settings_are_refused():
    m = tiny_models()
    common = dict(target_step=m["target_step"], target_params=m["target_params"], target_attn=None,
                  target_state=None, draft_step=m["draft_step"], draft_params=m["draft_params"], draft_attn=None,
                  draft_state=None)
    with pytest.raises(ValueError, match="`num_draft`"):
        Speculator(**common, num_draft=0)
    with pytest.raises(ValueError, match="`recovery`"):
        Speculator(**common, num_draft=2, recovery="maybe")


@settings(max_examples=40, deadline=None)
@given(k=hst.integers(1, 5), seed=hst.integers(0, 2**16), data=hst.data())
def test_acceptance_on_the_device_is_greedy_accept(k, seed, data):
    """`greedy_accept_rows` (a speculative step's acceptance with both runners) against `greedy_accept` over
    requests whose drafts agree with the target's choices for every prefix length 0..k."""
    from fnattn.speculative import greedy_accept, greedy_accept_rows

    n, vocab = 4, 7
    logits = torch.randn(n * (k + 1), vocab, generator=torch.Generator().manual_seed(seed))
    choice = logits.argmax(-1).view(n, k + 1)
    drafts = choice[:, :k].clone()
    for b in range(n):  # request b's drafts agree for its first `agree` positions, then one differs
        agree = data.draw(hst.integers(0, k), label=f"agree[{b}]")
        if agree < k:
            drafts[b, agree] = (drafts[b, agree] + 1) % vocab
    batch = SimpleNamespace(host_cu_seqlens=[b * (k + 1) for b in range(n + 1)], request_ids=list(range(n)),
                            host_new_lens=[k + 1] * n)
    accepted, bonus = greedy_accept(logits, batch, {b: drafts[b].tolist() for b in range(n)})
    rows = greedy_accept_rows(logits, drafts).tolist()
    for b in range(n):
        assert rows[b][0] == accepted[b] and rows[b][accepted[b]] == bonus[b]
        assert rows[b][1:accepted[b]] == drafts[b, :accepted[b] - 1].tolist()  # the kept drafts, emitted


def test_acceptance_on_the_device_refuses_logits_of_another_shape():
    from fnattn.speculative import greedy_accept_rows

    with pytest.raises(ValueError, match="greedy_accept_rows: `logits`"):
        greedy_accept_rows(torch.zeros(7, 5), torch.zeros(2, 3, dtype=torch.long))  # 2 x (1 + 3) = 8 rows wanted
