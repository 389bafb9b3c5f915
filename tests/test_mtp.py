"""MTP draft models (Qwen3.5 / Qwen3-Next MTP, DeepSeek NextN) and the targets' hidden states.

Drafts are built over random tiny targets (transformers writes no MTP
weights) and fed the target's own final-norm hidden states: the draft at
position p reads hidden[p] and token p + 1. Each draft runs through sessions
over a State of its own specs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fnattn.models.loading import CheckpointError, CheckpointReader
from fnattn.models.registry import family_named, random_model
from safetensors.torch import save_file

import fnattn as fa
from fnattn.driver import run_step
from fnattn.models import deepseek_mtp, qwen3_5_mtp

EXACT = dict(atol=1e-5, rtol=0)
DRAFTS = {"qwen3_5": qwen3_5_mtp, "qwen3_next": qwen3_5_mtp, "deepseek_v3": deepseek_mtp, "deepseek_v32": deepseek_mtp}


@pytest.fixture(scope="module", params=list(DRAFTS))
def target(request):
    return request.param, random_model(request.param, seed=1)


def prompt_of(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def target_hidden(model, prompts: dict[int, list[int]]) -> dict[int, torch.Tensor]:
    """The target's final-norm hidden states of each prompt (one prefill)."""
    st = fa.State(model.specs, num_pages=32, page_size=4, max_requests=len(prompts))
    for r in prompts:
        st = st.admit(r)
    st = st.reserve({r: len(p) for r, p in prompts.items()})
    batch = fa.Batch.prefill(st, {r: len(p) for r, p in prompts.items()})
    tokens = torch.tensor([t for r in batch.request_ids for t in prompts[r]])
    with fa.ModelAttention(model.specs).session(st, batch) as s:
        _, hidden, _ = model.family.step_hidden(model.params, s, tokens)
    cu = batch.host_cu_seqlens
    return {r: hidden[cu[b]:cu[b + 1]] for b, r in enumerate(batch.request_ids)}


class Drafter:
    """A draft model with its own State; `feed` runs one prefill or decode step of draft positions."""

    def __init__(self, draft, requests=(0,)):
        self.draft, self.ma = draft, fa.ModelAttention(draft.specs)
        self.state = fa.State(draft.specs, num_pages=32, page_size=4, max_requests=len(requests))
        for r in requests:
            self.state = self.state.admit(r)

    def feed(self, inputs: dict[int, tuple[list[int], torch.Tensor]], phase="prefill"):
        """``inputs[r] = (tokens, hidden [n, D])``; ``-> {r: (logits [n, V], hidden_out [n, D])}``."""
        counts = {r: len(t) for r, (t, _) in inputs.items()}
        self.state = self.state.reserve(counts)
        batch = fa.Batch.prefill(self.state, counts) if phase == "prefill" else fa.Batch.decode(self.state, counts)
        tokens = torch.tensor([t for r in batch.request_ids for t in inputs[r][0]])
        hidden = torch.cat([inputs[r][1] for r in batch.request_ids])
        d = self.draft
        self.state, (logits, out) = run_step(lambda p, s, t: _pack(d.step(p, s, t, hidden)), d.params, self.ma,
                                             self.state, batch, tokens)
        cu = batch.host_cu_seqlens
        return {r: (logits[cu[b]:cu[b + 1]], out[cu[b]:cu[b + 1]]) for b, r in enumerate(batch.request_ids)}


def _pack(result):
    logits, hidden_out, deltas = result
    return (logits, hidden_out), deltas


def draft_inputs(prompt: list[int], hidden: torch.Tensor, lo: int, hi: int):
    """Draft positions lo..hi-1: hidden of position p with token p + 1."""
    return prompt[lo + 1:hi + 1], hidden[lo:hi]


def test_target_step_hidden_is_step_with_the_lm_head_input():
    for name in ("qwen3_5", "qwen3_next", "deepseek_v3", "deepseek_v32", "glm5"):
        model = random_model(name, seed=2)
        fam, prompt = model.family, prompt_of(9, 0, model.config.vocab_size)
        assert fam.step_hidden is not None and fam.draft is not None
        outs = []
        for step in (fam.step, fam.step_hidden):
            st = fa.State(model.specs, num_pages=8, page_size=4, max_requests=1).admit(0).reserve({0: 9})
            with fa.ModelAttention(model.specs).session(st, fa.Batch.prefill(st, {0: 9})) as s:
                outs.append(step(model.params, s, torch.tensor(prompt)))
        (logits, _), (logits_h, hidden, _) = outs
        torch.testing.assert_close(logits_h, logits, atol=0, rtol=0)
        assert hidden.shape == (9, model.config.hidden_size)
        torch.testing.assert_close(hidden @ model.params.lm_head.T, logits, **EXACT)


def test_prefill_then_decode_equals_one_prefill(target):
    name, model = target
    draft = model.family.draft(model.config, model.params, None, seed=0)
    n, prompt = 10, prompt_of(12, 1, model.config.vocab_size)
    hidden = target_hidden(model, {0: prompt})[0]
    whole = Drafter(draft).feed({0: draft_inputs(prompt, hidden, 0, n + 1)})[0]
    d = Drafter(draft)
    first = d.feed({0: draft_inputs(prompt, hidden, 0, n)})[0]
    last = d.feed({0: draft_inputs(prompt, hidden, n, n + 1)}, phase="decode")[0]
    torch.testing.assert_close(torch.cat([first[0], last[0]]), whole[0], **EXACT)
    torch.testing.assert_close(torch.cat([first[1], last[1]]), whole[1], **EXACT)
    # hidden_out is the draft's lm_head input; its rows predict token p + 2.
    head = draft.params.lm_head if name.startswith("qwen") else draft.params.head
    torch.testing.assert_close(whole[1] @ head.T, whole[0], **EXACT)


def test_batch_of_two_equals_each_alone(target):
    _, model = target
    draft = model.family.draft(model.config, model.params, None, seed=0)
    V = model.config.vocab_size
    prompts = {0: prompt_of(8, 2, V), 1: prompt_of(12, 3, V)}
    hidden = target_hidden(model, prompts)
    both = Drafter(draft, requests=(0, 1))
    got = both.feed({r: draft_inputs(p, hidden[r], 0, len(p) - 2) for r, p in prompts.items()})
    got_next = both.feed({r: draft_inputs(p, hidden[r], len(p) - 2, len(p) - 1) for r, p in prompts.items()},
                         phase="decode")
    for r, p in prompts.items():
        alone = Drafter(draft)
        want = alone.feed({0: draft_inputs(p, hidden[r], 0, len(p) - 2)})[0]
        want_next = alone.feed({0: draft_inputs(p, hidden[r], len(p) - 2, len(p) - 1)}, phase="decode")[0]
        for a, b in zip(got[r] + got_next[r], want + want_next):
            torch.testing.assert_close(a, b, **EXACT)


def _one_step(draft, model, seed=4):
    prompt = prompt_of(7, seed, model.config.vocab_size)
    return Drafter(draft).feed({0: draft_inputs(prompt, target_hidden(model, {0: prompt})[0], 0, 6)})[0]


def test_checkpoint_names_load_the_weights_they_were_made_from(target, tmp_path):
    name, model = target
    module, cfg, params = DRAFTS[name], model.config, model.params
    weights = module.random_weights(cfg, params, seed=5)
    assert set(weights) == set(module.mtp_weight_shapes(cfg))
    assert all(n.startswith("mtp.") for n in weights) if module is qwen3_5_mtp else \
        all(n.startswith(f"model.layers.{cfg.num_layers}.") for n in weights)
    want = _one_step(module.draft(cfg, params, None, seed=5), model)
    assert not torch.equal(want[0], _one_step(module.draft(cfg, params, None, seed=6), model)[0])
    save_file({n: t.contiguous() for n, t in weights.items()}, tmp_path / "model.safetensors")
    reader = CheckpointReader(tmp_path, dtype=torch.float32)
    for source in (weights, reader):
        got = _one_step(module.draft(cfg, params, source), model)
        torch.testing.assert_close(got[0], want[0], **EXACT)
        torch.testing.assert_close(got[1], want[1], **EXACT)
    assert not [n for n in reader.unread() if n in weights]


def test_partial_or_misshaped_draft_weights_name_the_tensor(tmp_path):
    model = random_model("deepseek_v3", seed=1)
    cfg, params = model.config, model.params
    weights = deepseek_mtp.random_weights(cfg, params)
    bad = "model.layers.3.self_attn.kv_b_proj.weight"
    with pytest.raises(CheckpointError, match=bad):
        deepseek_mtp.draft(cfg, params, {n: t for n, t in weights.items() if n != bad})
    qwen = random_model("qwen3_5", seed=1)
    weights = qwen3_5_mtp.random_weights(qwen.config, qwen.params)
    save_file({**weights, "mtp.norm.weight": torch.zeros(3)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="mtp.norm.weight"):
        qwen3_5_mtp.draft(qwen.config, qwen.params, CheckpointReader(tmp_path, dtype=torch.float32))


def test_specs_follow_the_target_layers():
    fam = family_named("qwen3_5")
    raw = {**fam.tiny_config(), "mtp_num_hidden_layers": 2}
    model = random_model("qwen3_5", config=raw)
    assert model.config.mtp_num_hidden_layers == 2
    draft = fam.draft(model.config, model.params)
    full = next(s for s in model.specs if s.kind == "full")
    assert [s.index for s in draft.specs] == [4, 5]
    assert all(dataclasses.replace(s, index=full.index) == full for s in draft.specs)
    moe = random_model("qwen3_next")  # its MTP layer routes like the target's MoE layers
    assert isinstance(moe.family.draft(moe.config, moe.params).params.layers[0].mlp, type(moe.params.layers[1].mlp))
    v32 = random_model("deepseek_v32")
    (spec,) = v32.family.draft(v32.config, v32.params).specs
    assert spec.index == 3 and spec.kind == "sparse_mla" and spec.config.index_source_layer is None
    glm = random_model("glm5")
    (spec,) = glm.family.draft(glm.config, glm.params).specs
    assert spec.index == 4 and spec.config.index_source_layer is None
