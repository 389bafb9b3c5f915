"""The invariant mode with recurrent layers (GDN, KDA): prefill runs token by token, as decode does.

So in bf16 a shared-prefix hit resumes bit for bit as one cold prefill of the same tokens would (not only as a
cold prefill chunked alike, tests/test_prefix_resume.py), a prompt's last logits do not depend on how it was
split into prefill and decode, and a request decodes the same logits alone or beside others.
"""

import pytest
import torch
from test_prefix_checkpoints import fresh
from test_transfer import Model, prompt

import fnattn.switches

SUFFIX = 5


@pytest.fixture(scope="module", params=["qwen3_5", "kimi_linear"])
def model(request):
    return Model(request.param, dtype=torch.bfloat16)


@pytest.mark.parametrize("holder_chunks, taken", [((8, 3), 8), ((5, 6), None)], ids=["page-boundary", "cursor"])
def test_a_prefix_hit_equals_one_cold_prefill_bit_for_bit(model, holder_chunks, taken):
    a = prompt(model, sum(holder_chunks), seed=21)
    n = sum(holder_chunks) if taken is None else taken
    b = a[:n] + prompt(model, SUFFIX, seed=22)
    follow = prompt(model, 3, seed=23)
    with fnattn.switches.set(invariant=True):
        st = fresh(model).admit(1)
        for lo, hi in ((0, holder_chunks[0]), (holder_chunks[0], sum(holder_chunks))):
            st, _ = model.prefill(st, 1, a[lo:hi])
        st = st.admit(2, prefix_of=1, tokens=taken)
        st, hit = model.prefill(st, 2, b[n:])
        st, hit_decode = model.decode(st, 2, follow)
        cold = fresh(model).admit(2)
        cold, whole = model.prefill(cold, 2, b)  # one chunk: the holder's split is nowhere in it
        cold, whole_decode = model.decode(cold, 2, follow)
    assert torch.equal(hit, whole[-SUFFIX:]) and torch.equal(hit_decode, whole_decode)
    assert st.export_request(2).to_bytes() == cold.export_request(2).to_bytes()


def test_a_tokens_logits_are_the_same_prefilled_or_decoded(model):
    tokens = prompt(model, 13, seed=5)
    with fnattn.switches.set(invariant=True):
        st, prefilled = model.prefill(fresh(model).admit(0), 0, tokens)
        st2, _ = model.prefill(fresh(model).admit(0), 0, tokens[:9])
        st2, decoded = model.decode(st2, 0, tokens[9:])
    assert torch.equal(prefilled[-4:], decoded)
