"""The invariant mode (`fnattn.kernels.invariant`): a token's result does not depend on the phase or the batch.

Its fixed-order attention against the plain reference, its bit-for-bit agreement whatever else is computed
with a query (a property over positions, heads, windows and caps), and, in bf16 on the CPU paths, the
families with an MTP draft: a verify's logits equal the decode logits of the same tokens, an oracle draft is
accepted every time and speculative greedy emits plain greedy's tokens; a request decodes the same logits
alone or beside another.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fnattn as fa
import fnattn.switches
from fnattn.driver import generate
from fnattn.kernels import attention_naive as naive
from fnattn.speculative import Speculator

K = 3
NEW = 16  # tokens each request decodes
PROMPTS = {0: [5, 17, 9, 3, 11, 2, 7, 30, 4], 1: [8, 1, 4, 22]}


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("window, softcap, sinks", [(0, 0.0, False), (5, 0.0, False), (0, 20.0, True)])
def test_fixed_order_attention_is_the_reference_attention(window, softcap, sinks):
    q, k, v = randn(11, 4, 16, seed=0), randn(40, 2, 16, seed=1), randn(40, 2, 16, seed=2)
    q_pos, k_pos = torch.arange(29, 40), torch.arange(40)
    s = torch.randn(4) if sinks else None
    want = naive.attention(q, k, v, q_pos, k_pos, scale=0.25, softcap=softcap, sliding_window=window, sinks=s)
    got = naive.attention_fixed_order(q, k, v, q_pos, k_pos, scale=0.25, softcap=softcap, sliding_window=window,
                                      sinks=s)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(cached=st.integers(0, 45), new=st.integers(1, 12), heads=st.sampled_from([(4, 2), (8, 1), (2, 2)]),
       dim=st.sampled_from([8, 16, 64]), window=st.sampled_from([0, 3, 17]), softcap=st.sampled_from([0.0, 30.0]),
       seed=st.integers(0, 2**16))
def test_a_query_reduces_the_same_bits_in_prefill_verify_and_decode(cached, new, heads, dim, window, softcap, seed):
    """Query i computed with all the step's queries over every key (a verify, or a prefill when nothing is
    cached), alone over the keys up to its own position (a decode), and among the queries of a bigger step
    whose keys run past it: the same bits."""
    (hq, hkv), total = heads, cached + new
    q, k, v = randn(total, hq, dim, seed=seed), randn(total, hkv, dim, seed=seed + 1), randn(total, hkv, dim,
                                                                                              seed=seed + 2)
    pos = torch.arange(total)
    kw = {"scale": dim ** -0.5, "softcap": softcap, "sliding_window": window}
    step_o, step_lse = naive.attention_fixed_order(q[cached:], k, v, pos[cached:], pos, **kw)
    all_o, all_lse = naive.attention_fixed_order(q, k, v, pos, pos, **kw)
    for i in range(new):
        p = cached + i
        one_o, one_lse = naive.attention_fixed_order(q[p:p + 1], k[:p + 1], v[:p + 1], pos[p:p + 1], pos[:p + 1],
                                                     **kw)
        assert torch.equal(step_o[i], one_o[0]) and torch.equal(step_lse[i], one_lse[0])
        assert torch.equal(all_o[p], one_o[0]) and torch.equal(all_lse[p], one_lse[0])


def family(name):
    from fnattn.models.registry import family_named, random_model

    fam = family_named(name)
    model = random_model(name, seed=0, dtype=torch.bfloat16)
    draft = fam.draft(model.config, model.params, None, seed=1)
    return fam, model, draft


def fresh_state(specs, ring=2):
    return fa.State(specs, num_pages=48, page_size=4, max_requests=3, recurrent_ring=ring)


def prefilled(model, ring):
    attn, st = fa.ModelAttention(model.specs), fresh_state(model.specs, ring).admit(0)
    prompt = PROMPTS[0]
    st = st.reserve({0: len(prompt)})
    with attn.session(st, fa.Batch.prefill(st, {0: len(prompt)})) as s:
        _, d = model.step(model.params, s, torch.tensor(prompt))
    return attn, st.apply(d)


FAMILIES = ["qwen3_5", "deepseek_v32", "deepseek_v4"]


@pytest.mark.parametrize("name", FAMILIES)
def test_verify_logits_are_the_decode_logits_bit_for_bit(name):
    _, model, _ = family(name)
    tokens = [3, 14, 15, 9]
    with fnattn.switches.set(invariant=True):
        attn, st = prefilled(model, ring=2)
        decoded = []
        for t in tokens:
            st = st.reserve({0: 1})
            with attn.session(st, fa.Batch.decode(st, [0])) as s:
                logits, d = model.step(model.params, s, torch.tensor([t]))
            st = st.apply(d)
            decoded.append(logits[0])
        attn, st = prefilled(model, ring=K + 2)
        st = st.reserve({0: K + 1})
        with attn.session(st, fa.Batch.verify(st, [0], num_draft=K)) as s:
            verified, _ = model.step(model.params, s, torch.tensor(tokens))
    assert torch.equal(verified, torch.stack(decoded))


@pytest.mark.parametrize("recovery", ["native", "replay"])
@pytest.mark.parametrize("name", FAMILIES)
def test_speculative_greedy_is_plain_greedy_with_every_oracle_draft_accepted(name, recovery):
    fam, model, draft = family(name)
    with fnattn.switches.set(invariant=True):
        _, plain = generate(fam.step, model.params, fa.ModelAttention(model.specs), fresh_state(model.specs),
                            PROMPTS, max_new_tokens=NEW + K + 1)
        emitted = {r: [] for r in PROMPTS}

        def oracle(step, drafts):  # the tokens plain greedy emitted next
            return {r: plain[r][len(emitted[r]):len(emitted[r]) + K] for r in drafts}

        spec = Speculator(target_step=fam.step_hidden, target_params=model.params,
                          target_attn=fa.ModelAttention(model.specs), target_state=fresh_state(model.specs, K + 2),
                          draft_step=draft.step, draft_params=draft.params, draft_attn=fa.ModelAttention(draft.specs),
                          draft_state=fresh_state(draft.specs), num_draft=K, recovery=recovery, propose_hook=oracle)
        for r, t in spec.start(PROMPTS).items():
            emitted[r].append(t)
        steps = 0
        while min(len(e) for e in emitted.values()) < NEW:
            for r, toks in spec.step().items():
                emitted[r] += toks
                assert len(toks) == K + 1, f"{name}: request {r} accepted {len(toks) - 1} of {K} oracle drafts"
            steps += 1
    for r in PROMPTS:
        assert emitted[r] == plain[r][:len(emitted[r])]
    assert steps == -(-(NEW - 1) // (K + 1))


@pytest.mark.parametrize("name", ["qwen3_5", "deepseek_v4", "llama"])
def test_a_request_decodes_the_same_logits_alone_or_beside_another(name):
    from fnattn.models.registry import random_model

    model = random_model(name, seed=0, dtype=torch.bfloat16)

    def logits_of_request_0(prompts):
        attn, st = fa.ModelAttention(model.specs), fresh_state(model.specs)
        for r in prompts:
            st = st.admit(r)
        counts = {r: len(p) for r, p in prompts.items()}
        st = st.reserve(counts)
        with attn.session(st, fa.Batch.prefill(st, counts)) as s:
            logits, d = model.step(model.params, s, torch.tensor([t for p in prompts.values() for t in p]))
        st = st.apply(d)
        ends = torch.tensor(list(counts.values())).cumsum(0) - 1
        out, last = [logits[ends[0]]], logits[ends].argmax(-1)
        for _ in range(6):
            st = st.reserve({r: 1 for r in prompts})
            with attn.session(st, fa.Batch.decode(st, list(prompts))) as s:
                logits, d = model.step(model.params, s, last)
            st = st.apply(d)
            out.append(logits[0])
            last = logits.argmax(-1)
        return torch.stack(out)

    with fnattn.switches.set(invariant=True):
        alone = logits_of_request_0({0: PROMPTS[0]})
        beside = logits_of_request_0({0: PROMPTS[0], 1: PROMPTS[1], 2: [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]})
    assert torch.equal(alone, beside)
