"""Every model step rejects token ids outside ``0..vocab_size - 1`` before it computes anything.

An embedding lookup would otherwise read row ``-1`` (the last row) silently, or
fail with an IndexError one past the end. Steps run here against a session
that fails on any layer call, so the error must come first.
"""

from __future__ import annotations

import pytest
import torch
from fnattn.models.registry import family_named, random_model

import fnattn as fa
from fnattn.models import common, tiny

TARGETS = ("qwen3_5", "qwen3_next", "deepseek_v32", "deepseek_v3", "glm5", "kimi_linear")
DRAFTS = ("qwen3_5", "qwen3_next", "deepseek_v32", "deepseek_v3")  # families with an MTP / NextN draft


class NoLayerSession:
    """A stand-in session for one prefill batch: any layer call fails the test."""

    def __init__(self, specs, n: int):
        state = fa.State(specs, num_pages=8, page_size=4, max_requests=1).admit(0).reserve({0: n})
        self.batch = fa.Batch.prefill(state, {0: n})

    def forward(self, layer, inputs):
        raise AssertionError(f"layer {layer} ran before the token ids were checked")


def _tiny_target():
    cfg = tiny.TinyConfig()
    params = tiny.init_params(cfg)
    return tiny.layer_specs(cfg), cfg.vocab_size, lambda s, t: tiny.step(params, s, t)


def _tiny_draft():
    cfg = tiny.TinyConfig()
    draft = tiny.init_draft(cfg, tiny.init_params(cfg))
    return (tiny.draft_specs(cfg), cfg.vocab_size,
            lambda s, t: tiny.draft_step(draft, s, t, torch.zeros(t.shape[0], cfg.hidden_size)))


def _target(name):
    model = random_model(name)
    return model.specs, model.config.vocab_size, lambda s, t: model.step(model.params, s, t)


def _draft(name):
    model = random_model(name)
    draft = family_named(name).draft(model.config, model.params, None, seed=0)
    hidden_size = model.config.hidden_size
    return (draft.specs, model.config.vocab_size,
            lambda s, t: draft.step(draft.params, s, t, torch.zeros(t.shape[0], hidden_size)))


CASES = {"tiny": _tiny_target, "tiny-draft": _tiny_draft}
CASES.update({name: (lambda n=name: _target(n)) for name in TARGETS})
CASES.update({f"{name}-draft": (lambda n=name: _draft(n)) for name in DRAFTS})


@pytest.mark.parametrize("bad", ["-1", "vocab_size"])
@pytest.mark.parametrize("case", list(CASES))
def test_step_rejects_out_of_range_token_ids(case, bad):
    specs, vocab, step = CASES[case]()
    bad_id = -1 if bad == "-1" else vocab
    tokens = torch.tensor([1, bad_id, 2])
    with pytest.raises(ValueError, match=rf"`tokens` must be ids in 0\.\.{vocab - 1}, got {bad_id}$"):
        step(NoLayerSession(specs, 3), tokens)


def test_check_tokens_reads_device_tokens_only_with_checks(monkeypatch):
    # A meta tensor stands in for GPU tokens: it has no data, so any read back to the host raises.
    tokens = torch.zeros(3, dtype=torch.int64, device="meta")
    monkeypatch.setattr(fa.checks, "CHECKS_ENABLED", False)
    common.check_tokens("owner", tokens, 10)  # not read
    monkeypatch.setattr(fa.checks, "CHECKS_ENABLED", True)
    with pytest.raises((NotImplementedError, RuntimeError)):
        common.check_tokens("owner", tokens, 10)
    common.check_tokens("owner", torch.tensor([0, 9]), 10)
    common.check_tokens("owner", torch.zeros(0, dtype=torch.int64), 10)
    with pytest.raises(ValueError, match=r"owner: `tokens` must be ids in 0\.\.9, got -1"):
        common.check_tokens("owner", torch.tensor([0, 10, -1]), 10)  # the negative id is named first
