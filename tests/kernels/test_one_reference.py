"""The one attention reference (`fnattn.kernels.attention_naive`) against textbook formulas, and the
references that delegate to it: a softmax over an explicit mask, query by query, and a merge that equals
attention over the union of the key sets."""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # as the kernel tests: the kernels this file imports then load interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fnattn.kernels import attention_naive as naive  # noqa: E402


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def textbook(q, k, v, q_pos, k_pos, *, scale, softcap=0.0, window=0, sinks=None):
    """Attention spelled out one query and one head at a time, in fp64: which keys it sees, their softmax
    weights (plus a sink logit in the denominator), the weighted sum of values and the log of the sum."""
    n, Hq, _ = q.shape
    group = Hq // k.shape[1]
    o = torch.zeros(n, Hq, v.shape[2], dtype=torch.float64)
    lse = torch.full((n, Hq), -math.inf, dtype=torch.float64)
    for i in range(n):
        keys = [j for j in range(k.shape[0]) if k_pos[j] <= q_pos[i] and (window <= 0 or q_pos[i] - k_pos[j] < window)]
        for h in range(Hq):
            if not keys:
                continue
            scores = torch.stack([scale * q[i, h] @ k[j, h // group] for j in keys])
            if softcap > 0:
                scores = softcap * torch.tanh(scores / softcap)
            denominator = scores.exp().sum()
            lse[i, h] = denominator.log()
            if sinks is not None:
                denominator = denominator + math.exp(float(sinks[h]))
            for weight, j in zip(scores.exp() / denominator, keys):
                o[i, h] += weight * v[j, h // group]
    return o, lse


@pytest.mark.parametrize("softcap, window, with_sinks", [(0.0, 0, False), (0.0, 3, False), (2.5, 0, True),
                                                        (1.5, 4, True)])
def test_attention_is_the_textbook_softmax_over_its_mask(softcap, window, with_sinks):
    n, m, Hq, Hkv, D, Dv = 5, 9, 4, 2, 8, 6
    q, k, v = randn(n, Hq, D, seed=1), randn(m, Hkv, D, seed=2), randn(m, Hkv, Dv, seed=3)
    sinks = randn(Hq, seed=4) if with_sinks else None
    q_pos = torch.tensor([0, 2, 4, 7, 8])  # query 0 sees one key; the window hides the oldest from the rest
    k_pos = torch.arange(m)
    want_o, want_lse = textbook(q, k, v, q_pos, k_pos, scale=0.3, softcap=softcap, window=window, sinks=sinks)
    o, lse = naive.attention(q.float(), k.float(), v.float(), q_pos, k_pos, scale=0.3, softcap=softcap,
                             sliding_window=window, sinks=None if sinks is None else sinks.float())
    assert o.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(o.double(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_a_query_that_sees_no_key_attends_nothing():
    q, k, v = randn(2, 2, 4, seed=1).float(), randn(3, 1, 4, seed=2).float(), randn(3, 1, 5, seed=3).float()
    o, lse = naive.attention(q, k, v, torch.tensor([0, 10]), torch.tensor([1, 2, 3]), scale=1.0, sliding_window=2,
                             sinks=torch.zeros(2))
    assert (o == 0).all() and torch.isneginf(lse).all()
    probs, lse = naive.masked_softmax(torch.randn(2, 3), torch.tensor([[True, False, True], [False, False, False]]))
    torch.testing.assert_close(probs.sum(-1), torch.tensor([1.0, 0.0]))
    assert probs[0, 1] == 0 and torch.isneginf(lse[1])


@pytest.mark.parametrize("split", [0, 4, 9])
def test_merge_is_attention_over_the_union_of_the_key_sets(split):
    """Keys cut at ``split`` (one side may be empty) and merged give the attention over all of them; an empty
    part's output is ignored whatever it holds."""
    n, m, Hq, Hkv = 4, 9, 4, 2
    q, k, v = randn(n, Hq, 8, seed=5).float(), randn(m, Hkv, 8, seed=6).float(), randn(m, Hkv, 6, seed=7).float()
    q_pos, k_pos = torch.full((n,), m), torch.arange(m)
    whole = naive.attention(q, k, v, q_pos, k_pos, scale=0.4, softcap=3.0)
    first = naive.attention(q, k[:split], v[:split], q_pos, k_pos[:split], scale=0.4, softcap=3.0)
    second = naive.attention(q, k[split:], v[split:], q_pos, k_pos[split:], scale=0.4, softcap=3.0)
    if split == 0:
        first = (torch.full_like(first[0], math.nan), first[1])
    o, lse = naive.merge_states(*first, *second)
    torch.testing.assert_close(o, whole[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, whole[1], rtol=1e-5, atol=1e-5)
    # Sinks join once, after the merge: the same as attending the union with them.
    sinks = randn(Hq, seed=8).float()
    torch.testing.assert_close(naive.apply_sinks(o, lse, sinks),
                               naive.attention(q, k, v, q_pos, k_pos, scale=0.4, softcap=3.0, sinks=sinks)[0])


def test_two_empty_parts_merge_to_nothing():
    o = torch.full((2, 3, 4), math.nan)
    lse = torch.full((2, 3), -math.inf)
    merged, merged_lse = naive.merge_states(o, lse, o, lse)
    assert (merged == 0).all() and torch.isneginf(merged_lse).all()


def test_the_kinds_and_the_kernels_references_are_this_one():
    """`fnattn.kinds.full.math` and the kernels' torch references return the shared reference's values, bit for
    bit: no second copy of the math to drift."""
    from fnattn.kernels.lse_merge import merge_attention_states_ref
    from fnattn.kernels.paged_attention import attend_ref

    from fnattn.kinds.full import math as full_math

    q, k, v = randn(3, 4, 8, seed=9).float(), randn(6, 2, 8, seed=10).float(), randn(6, 2, 5, seed=11).float()
    q_pos, k_pos, sinks = torch.tensor([3, 4, 5]), torch.arange(6), randn(4, seed=12).float()
    o, lse = naive.attention(q, k, v, q_pos, k_pos, scale=0.5, softcap=2.0, sliding_window=3)
    for got in (full_math.attend(q, k, v, q_pos=q_pos, k_pos=k_pos, scale=0.5, softcap=2.0, sliding_window=3),
                attend_ref(q, k, v, q_pos, k_pos, scale=0.5, softcap=2.0, sliding_window=3)):
        assert torch.equal(got[0], o) and torch.equal(got[1], lse)
    assert torch.equal(full_math.apply_sinks(o, lse, sinks), naive.apply_sinks(o, lse, sinks))
    assert torch.equal(attend_ref(q, k, v, q_pos, k_pos, scale=0.5, sinks=sinks)[0],
                       naive.attention(q, k, v, q_pos, k_pos, scale=0.5, sinks=sinks)[0])
    o2, lse2 = naive.attention(q, k * 2, v, q_pos, k_pos, scale=0.5)
    want = naive.merge_states(o, lse, o2, lse2)
    for got in (full_math.merge(o, lse, o2, lse2), merge_attention_states_ref(o, lse, o2, lse2)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
