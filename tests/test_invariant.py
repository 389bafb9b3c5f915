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
from fnattn.bench.invariance import request_0_logits
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
        return request_0_logits(model, fa.ModelAttention(model.specs), fresh_state(model.specs), prompts, steps=6)

    with fnattn.switches.set(invariant=True):
        alone = logits_of_request_0({0: PROMPTS[0]})
        beside = logits_of_request_0({0: PROMPTS[0], 1: PROMPTS[1], 2: [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]})
    assert torch.equal(alone, beside)


MLA_FAMILIES = ["deepseek_v3", "glm5"]  # dense MLA; sparse MLA with a shared top-k (deepseek_v32 is in FAMILIES)


@pytest.mark.parametrize("name", MLA_FAMILIES)
def test_mla_verify_logits_are_the_decode_logits_bit_for_bit(name):
    test_verify_logits_are_the_decode_logits_bit_for_bit(name)


@pytest.mark.parametrize("recovery", ["native", "replay"])
@pytest.mark.parametrize("name", MLA_FAMILIES)
def test_mla_speculative_greedy_is_plain_greedy_with_every_oracle_draft_accepted(name, recovery):
    test_speculative_greedy_is_plain_greedy_with_every_oracle_draft_accepted(name, recovery)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v32", "glm5"])
def test_an_mla_request_decodes_the_same_logits_alone_or_beside_another(name):
    test_a_request_decodes_the_same_logits_alone_or_beside_another(name)


def _mla_args(cached, new, heads, seed, *, R=32, Dr=8, Dn=16, Dv=16):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).bfloat16()

    n = cached + new
    return (r(n, heads, Dn), r(n, heads, Dr), r(n, R + Dr), r(heads, Dn, R, scale=Dn ** -0.5),
            r(heads, Dv, R, scale=R ** -0.5))


@settings(max_examples=20, deadline=None)
@given(cached=st.integers(0, 40), new=st.integers(1, 10), heads=st.sampled_from([1, 3, 8]),
       topk=st.sampled_from([None, 1, 5, 24]), seed=st.integers(0, 2**16))
def test_an_mla_query_reduces_the_same_bits_in_prefill_verify_and_decode(cached, new, heads, topk, seed):
    """`mla_fixed_order` is `mla_absorbed` to rounding, and query i's result is the same bits computed with the
    step's queries (a verify), with every query from position 0 (a prefill) and alone over the rows up to its
    own (a decode). Sparse (``topk``): the same selected positions, in any order and -1 padded, give the same
    bits too."""
    from fnattn.kinds.mla.math import mla_absorbed, mla_fixed_order, topk_mask

    q_nope, q_pe, latent, w_uk, w_uv = _mla_args(cached, new, heads, seed)
    total, kw = cached + new, {"scale": 0.3}
    g = torch.Generator().manual_seed(seed + 1)
    picks = [torch.randperm(p + 1, generator=g)[:topk] for p in range(total)] if topk else None

    def allowed(first, stop, n_keys, shuffle=False):  # the picks of positions first..stop-1, as a mask
        if picks is None:
            return None
        rows = []
        for p in range(first, stop):
            row = picks[p][torch.randperm(len(picks[p]), generator=g)] if shuffle else picks[p]
            rows.append(torch.nn.functional.pad(row, (0, topk - len(row)), value=-1))
        return topk_mask(torch.stack(rows), n_keys=n_keys)

    step_o, step_lse = mla_fixed_order(q_nope[cached:], q_pe[cached:], latent, w_uk, w_uv, n_cached=cached,
                                       allowed=allowed(cached, total, total), **kw)
    want_o, want_lse = mla_absorbed(q_nope[cached:], q_pe[cached:], latent, w_uk, w_uv, n_cached=cached,
                                    allowed=allowed(cached, total, total), **kw)
    torch.testing.assert_close(step_o.float(), want_o.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(step_lse, want_lse, rtol=1e-5, atol=1e-5)
    all_o, all_lse = mla_fixed_order(q_nope, q_pe, latent, w_uk, w_uv, n_cached=0,
                                     allowed=allowed(0, total, total), **kw)
    for i in range(new):
        p = cached + i
        one_o, one_lse = mla_fixed_order(q_nope[p:p + 1], q_pe[p:p + 1], latent[:p + 1], w_uk, w_uv, n_cached=p,
                                         allowed=allowed(p, p + 1, p + 1, shuffle=True), **kw)
        assert torch.equal(step_o[i], one_o[0]) and torch.equal(step_lse[i], one_lse[0])
        assert torch.equal(all_o[p], one_o[0]) and torch.equal(all_lse[p], one_lse[0])


@settings(max_examples=15, deadline=None)
@given(cached=st.integers(0, 60), new=st.integers(1, 12), heads=st.sampled_from([1, 4, 64]),
       dim=st.sampled_from([16, 128]), seed=st.integers(0, 2**16))
def test_the_indexer_scores_a_token_the_same_bits_in_prefill_verify_and_decode(cached, new, heads, dim, seed):
    """`indexer_scores_fixed_order` is `indexer_scores` to rounding, and a token's scores are the same bits
    computed with the step's tokens, from position 0, or alone over the keys up to its own."""
    from fnattn.kinds.sparse_mla.indexer import indexer_scores, indexer_scores_fixed_order

    total = cached + new
    q, w, keys = randn(total, heads, dim, seed=seed), randn(total, heads, seed=seed + 1), randn(total, dim,
                                                                                               seed=seed + 2)
    step = indexer_scores_fixed_order(q[cached:], w[cached:], keys)
    torch.testing.assert_close(step, indexer_scores(q[cached:], w[cached:], keys), rtol=1e-5, atol=1e-4)
    every = indexer_scores_fixed_order(q, w, keys)
    for i in range(new):
        p = cached + i
        one = indexer_scores_fixed_order(q[p:p + 1], w[p:p + 1], keys[:p + 1])[0]
        assert torch.equal(step[i, :p + 1], one) and torch.equal(every[p, :p + 1], one)


LAYER_DIMS = dict(H=4, R=64, Dr=16, Dn=32, Dv=32)


def _layer_rows(specs, n, seed):
    """Per layer, ``n`` new tokens' rows of one request and its weights, fp32: ``{layer: (rows, weights)}``."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    out = {}
    for spec in specs:
        m = spec.config.mla if spec.kind == "sparse_mla" else spec.config
        H = m.num_heads
        rows = dict(q_nope=r(n, H, m.qk_nope_head_dim), q_pe=r(n, H, m.qk_rope_head_dim), latent=r(n, m.latent_dim))
        weights = dict(w_uk=r(H, m.qk_nope_head_dim, m.kv_lora_rank, scale=0.2),
                       w_uv=r(H, m.v_head_dim, m.kv_lora_rank, scale=0.2))
        if spec.kind == "sparse_mla" and spec.config.index_source_layer is None:
            ix = spec.config.indexer
            rows.update(index_q=r(n, ix.num_heads, ix.head_dim), index_w=r(n, ix.num_heads),
                        index_k=r(n, ix.head_dim))
        out[spec.index] = (rows, weights)
    return out


def _layer_step(attn, state, batch, specs, rows_of, picks):
    """One step of every layer, request r contributing its new tokens ``picks[r]``; ``-> (outputs, state)``."""
    outs, groups = {}, []
    with attn.session(state, batch) as s:
        for spec in specs:
            weights = rows_of[batch.live_ids[0]][spec.index][1]
            rows = {k: torch.cat([rows_of[r][spec.index][0][k][picks[r]] for r in batch.live_ids])
                    for k in rows_of[batch.live_ids[0]][spec.index][0]}
            if spec.kind == "mla":
                inputs = fa.MLAInputs(**rows, **weights)
            else:
                src = spec.config.index_source_layer
                inputs = fa.SparseMLAInputs(**rows, **weights,
                                            sparse=fa.SparseQueryMetadata.build(batch, topk=spec.config.indexer.topk),
                                            topk_indices=None if src is None else outs[src].topk_indices)
            outs[spec.index], d = s.forward(spec.index, inputs)
            groups.append(d)
    return outs, state.apply(fa.StepDeltas.collect(batch, groups))


def _lifted(kind, name):
    """Backend ``name`` of ``kind`` for every phase, its device check lifted (Triton runs interpreted here)."""
    import dataclasses

    from fnattn.registry import lookup

    return tuple(dataclasses.replace(lookup(kind, phase, name), supports=lambda spec, device: [])
                 for phase in ("prefill", "decode", "verify"))


@pytest.mark.parametrize("backend", ["reference", "sdpa", "triton"])
@pytest.mark.parametrize("sparse", [False, True])
def test_an_mla_layer_verifies_decodes_and_decodes_alone_the_same_bits(sparse, backend):
    """fp32 MLA layers (sparse: an indexer's layer and one reusing its top-k) with the step's inputs given, so
    that only the attention can differ: with the mode on, two requests' verify, their decode steps together and
    request 0's decode steps alone give each token the same outputs and LSEs, bit for bit (the mode off, the
    fused kernels' and step-sized products' orders differ in the last bits)."""
    from kinds.mla.fast_cases import filled_state, mla_config, sparse_specs

    if sparse:
        specs = sparse_specs(topk=8, Hi=4, Di=32, shared=True, dtype=torch.float32, **LAYER_DIMS)
    else:
        specs = [fa.LayerSpec(0, mla_config(**LAYER_DIMS), torch.float32)]
    cached, ids = [37, 21], [0, 1]
    rows_of = {r: _layer_rows(specs, K + 1, seed=10 + r) for r in ids}
    kind = "sparse_mla" if sparse else "mla"
    attn = fa.ModelAttention(specs, prefer=_lifted(kind, "triton") if backend == "triton" else (backend,))

    def fresh():
        return filled_state(specs, cached, page_size=4, extra=K + 2)

    with fnattn.switches.set(invariant=True):
        st = fresh()
        verified, _ = _layer_step(attn, st, fa.Batch.verify(st, ids, num_draft=K), specs, rows_of,
                                  {r: slice(0, K + 1) for r in ids})
        together, alone, st_together, st_alone = [], [], fresh(), fresh()
        for i in range(K + 1):
            out, st_together = _layer_step(attn, st_together, fa.Batch.decode(st_together, ids), specs, rows_of,
                                           {r: slice(i, i + 1) for r in ids})
            together.append(out)
            out, st_alone = _layer_step(attn, st_alone, fa.Batch.decode(st_alone, [0]), specs, rows_of,
                                        {0: slice(i, i + 1)})
            alone.append(out)
    for layer in (spec.index for spec in specs):
        for i in range(K + 1):
            for b in ids:
                v = verified[layer]
                assert torch.equal(v.o[b * (K + 1) + i], together[i][layer].o[b]), (layer, i, b)
                assert torch.equal(v.lse[b * (K + 1) + i], together[i][layer].lse[b]), (layer, i, b)
            assert torch.equal(alone[i][layer].o[0], together[i][layer].o[0]), (layer, i)
            assert torch.equal(alone[i][layer].lse[0], together[i][layer].lse[0]), (layer, i)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 12), k=st.sampled_from([8, 64, 200]), n=st.sampled_from([8, 64, 96]),
       bias=st.booleans(), dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2**16))
def test_a_projection_row_is_the_same_bits_beside_other_rows(rows, k, n, bias, dtype, seed):
    """The models' projections in the invariant mode: a row's product alone (a decode step) equals its product
    among others (a verify, a batch, an expert's share of a MoE step). Plain F.linear does not promise it: on
    AVX-512 machines a [4, 64] @ [64, 64] bf16 product differs from four one-row ones in the last bit."""
    from fnattn.models.norm_rope import row_linear

    x, w = randn(rows, k, seed=seed).to(dtype), randn(n, k, seed=seed + 1).to(dtype)
    b = randn(n, seed=seed + 2).to(dtype) if bias else None
    with fnattn.switches.set(invariant=True):
        together = row_linear(x.view(1, rows, k), w, b)[0]
        alone = [row_linear(x[i:i + 1], w, b)[0] for i in range(rows)]
    assert together.shape == (rows, n)
    for i in range(rows):
        assert torch.equal(together[i], alone[i])
    torch.testing.assert_close(together, torch.nn.functional.linear(x, w, b), rtol=2e-2, atol=2e-2)
