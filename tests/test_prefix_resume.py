"""A shared-prefix hit resumes a GDN / KDA state exactly.

A request admitted on another's prefix (``admit(prefix_of=holder, tokens=n)``)
starts from the holder's cached rows and recurrent state at ``n`` (its cursor,
or a page-boundary checkpoint). Prefilled in the same chunks as a cold run of
the same tokens, every operation is the same, so the request's whole state
(its cache rows and recurrent rows, as `export_request` gives them) and its
logits equal the cold run's bit for bit. Against a cold run chunked otherwise
(one prefill of everything) they are only close: a chunked GDN / KDA prefill
rounds differently from one over other chunks.
"""

from __future__ import annotations

import pytest
import torch
from test_prefix_checkpoints import fresh
from test_transfer import Model, prompt

PAGE = 4
SUFFIX = 5


@pytest.fixture(scope="module", params=["qwen3_5", "kimi_linear"])
def model(request):
    return Model(request.param)


def prefill_chunks(model, st, rid, tokens, chunks):
    logits = None
    for n in chunks:
        st, logits = model.prefill(st, rid, tokens[:n])
        tokens = tokens[n:]
    assert not tokens
    return st, logits


# (the holder's prefill chunks, the prefix the new request takes): at the boundary a two-page chunk ended on,
# at a one-page chunk's boundary the holder went on from, and at the holder's cursor inside a page.
CASES = {"two-page-chunk": ((8, 3), 8), "one-page-chunk": ((4, 7), 4), "holder-cursor": ((5, 6), None)}


@pytest.mark.parametrize("case", CASES)
def test_a_prefix_hit_equals_a_cold_prefill_chunked_alike(model, case):
    holder_chunks, n = CASES[case]
    a = prompt(model, sum(holder_chunks), seed=21)
    taken = sum(holder_chunks) if n is None else n
    b = a[:taken] + prompt(model, SUFFIX, seed=22)
    follow = prompt(model, 2, seed=23)

    st = fresh(model).admit(1)
    st, _ = prefill_chunks(model, st, 1, a, holder_chunks)
    st = st.admit(2, prefix_of=1, tokens=n)
    st, hit = model.prefill(st, 2, b[taken:])
    st, hit_decode = model.decode(st, 2, follow)

    # The cold run prefills the prefix in the chunks the holder used for it, then the same suffix.
    cold_chunks, left = [], taken
    for c in holder_chunks:
        cold_chunks.append(min(c, left))
        left -= cold_chunks[-1]
    cold = fresh(model).admit(2)
    cold, want = prefill_chunks(model, cold, 2, b, [c for c in cold_chunks if c] + [SUFFIX])
    cold, want_decode = model.decode(cold, 2, follow)
    assert torch.equal(hit, want) and torch.equal(hit_decode, want_decode)
    assert st.export_request(2).to_bytes() == cold.export_request(2).to_bytes()

    # Chunked otherwise: close, not necessarily the same bits.
    other = fresh(model).admit(2)
    other, whole = model.prefill(other, 2, b)
    other, whole_decode = model.decode(other, 2, follow)
    torch.testing.assert_close(hit, whole[-SUFFIX:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hit_decode, whole_decode, atol=1e-5, rtol=1e-5)
