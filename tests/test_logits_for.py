"""Prefill logits for each request's last token only (``Batch.prefill(..., logits_for="last")``)."""

import pytest
import torch
from fnattn.models.registry import FAMILIES, _load_builtin, random_model

import fnattn as fa
from fnattn.driver import prefill

_load_builtin()
PROMPTS = {0: [3, 1, 4, 1, 5, 9, 2], 1: [6, 5, 3]}


def _state(specs):
    st = fa.State(specs, num_pages=16, page_size=8, max_requests=2)
    for r in PROMPTS:
        st = st.admit(r)
    return st.reserve({r: len(p) for r, p in PROMPTS.items()})


def _run(model, logits_for):
    attn = fa.ModelAttention(model.specs)
    st = _state(model.specs)
    b = fa.Batch.prefill(st, {r: len(p) for r, p in PROMPTS.items()}, logits_for=logits_for)
    tokens = torch.tensor([t for r in b.request_ids for t in PROMPTS[r]])
    with attn.session(st, b) as s:
        logits, deltas = model.step(model.params, s, tokens)
    return b, logits, st.apply(deltas)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_last_token_logits_are_the_last_rows_of_every_tokens_logits(name):
    model = random_model(name)
    b_all, every, st_all = _run(model, "all")
    b_last, last, st_last = _run(model, "last")
    assert every.shape[0] == b_all.num_tokens and last.shape == (b_last.num_requests, every.shape[1])
    rows = [end - 1 for end in b_all.host_cu_seqlens[1:]]
    torch.testing.assert_close(last, every[rows], rtol=1e-5, atol=1e-5)
    for spec in model.specs:  # the step's writes do not depend on which logits it returns
        for name_, t in st_all.views(spec.index).items():
            assert torch.equal(t, st_last.views(spec.index)[name_]), (spec.index, name_)


def test_driver_prefill_reads_either_shape_and_refuses_another_before_the_apply():
    model = random_model("llama")
    attn = fa.ModelAttention(model.specs)
    _, want = prefill(model.step, model.params, attn, _state(model.specs), PROMPTS)

    def every_row(params, session, tokens):  # a step that ignores logits_for
        batch = session.batch
        import dataclasses

        with_all = dataclasses.replace(batch, logits_for="all")
        session.batch = with_all
        try:
            return model.step(params, session, tokens)
        finally:
            session.batch = batch

    _, got = prefill(every_row, model.params, attn, _state(model.specs), PROMPTS)
    for r in PROMPTS:
        torch.testing.assert_close(got[r], want[r], rtol=1e-5, atol=1e-5)

    def bad(params, session, tokens):
        logits, deltas = model.step(params, session, tokens)
        return logits[:1], deltas

    with pytest.raises(ValueError, match="`step` must be logits of 2 rows") as err:
        prefill(bad, model.params, attn, _state(model.specs), PROMPTS)
    live = err.value.state  # the reserve made the caller's handle stale; the live one comes with the error
    assert live.is_live and all(live.request(r).length == 0 for r in PROMPTS)  # nothing applied
    live, got = prefill(model.step, model.params, attn, live, PROMPTS)  # and it carries on from there
    for r in PROMPTS:
        torch.testing.assert_close(got[r], want[r], rtol=1e-5, atol=1e-5)


def test_logits_for_is_checked():
    st = _state(random_model("llama").specs)
    with pytest.raises(ValueError, match="`logits_for` must be one of \\('all', 'last'\\)"):
        fa.Batch.prefill(st, {0: 7}, logits_for="first")
