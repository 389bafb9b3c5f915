"""Bug classes hybrid engines have shipped with in speculative decoding, run on our verify paths.

* A verify that accepts two drafts or more, then one that accepts none: the recurrent state kept must be
  the one at the accepted position, not a stale one from the step before.
* Acceptance that lands exactly on a page boundary: the cursor ends on a page's last row, or on the next
  page's first row, and the next tokens' K/V land in the right page.

Each request's tokens are fixed per position (the drafts a step rejects get other inputs), so the
speculative run must give what plain decoding of the same tokens gives, token for token, with native and
replay recovery bit for bit equal. Reference and the CPU fast backends (sdpa for full attention, the
batched decode of GDN / KDA), with the verify in the ring and copying.
"""

import pytest
import torch
from helpers import nan_state, run

import fnattn as fa
from fnattn.speculative import replay_writes

K = 3  # drafts per verify
S = 4  # page size
FULL = fa.LayerSpec(index=0, config=fa.FullAttentionConfig(num_q_heads=4, num_kv_heads=2, head_dim=8),
                    dtype=torch.float32)
GDN = fa.LayerSpec(index=1, config=fa.GDNConfig(num_k_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=4),
                   dtype=torch.float32)
KDA = fa.LayerSpec(index=2, config=fa.KDAConfig(num_heads=2, head_k_dim=4, head_v_dim=4), dtype=torch.float32)
SPECS = (FULL, GDN, KDA)
PROMPT = {0: 5, 1: 3}
# Accepted tokens per verify (the fed one plus accepted drafts): two or three drafts, then none. Request 0
# ends its first verify on a page's last row (length 8) and its second on the next page's first (9);
# request 1 the other way round after its second (8), then its decode goes to the next page's first row.
ACCEPTED = ({0: 3, 1: 4}, {0: 1, 1: 1})


def token_inputs(spec, r, p, variant):
    """One token's inputs to ``spec``: request ``r``, position ``p``; variant 0 is the true token, others a
    rejected draft at that position."""
    g = torch.Generator().manual_seed(1000 * spec.index + 100 * r + 10 * p + variant)
    c = spec.config
    if spec.kind == "full":
        return {"q": torch.randn(1, c.num_q_heads, c.head_dim, generator=g),
                "k": torch.randn(1, c.num_kv_heads, c.head_dim, generator=g),
                "v": torch.randn(1, c.num_kv_heads, c.head_dim_v, generator=g)}
    return {"x": torch.randn(1, c.conv_dim, generator=g), "g": -0.7 * torch.rand(c.gate_shape(1), generator=g) - 0.01,
            "beta": torch.rand(1, c.num_state_heads, generator=g)}


def layer_inputs(tokens):
    """Inputs of every layer for ``tokens`` [(request, position, variant)], in batch order."""
    out = {}
    for spec in SPECS:
        rows = [token_inputs(spec, *t) for t in tokens]
        cat = {name: torch.cat([row[name] for row in rows]) for name in rows[0]}
        if spec.kind == "full":
            out[spec.index] = fa.FullAttentionInputs(**cat)
        else:
            c = spec.config
            g = torch.Generator().manual_seed(7 + spec.index)
            out[spec.index] = fa.RecurrentInputs(
                **cat, conv_weight=0.5 * torch.randn(c.conv_dim, c.conv_kernel, generator=g),
                conv_bias=0.1 * torch.randn(c.conv_dim, generator=g) if spec.kind == "gdn" else None)
    return out


def attention(full, recurrent):
    """The backends: ``full`` for full attention in every phase, ``recurrent`` for GDN / KDA decode (their
    prefill and verify are the reference's, the only ones on the CPU)."""
    return fa.ModelAttention(SPECS, prefer=tuple(dict.fromkeys((full, recurrent, "reference"))))


def prefilled(attn, ring):
    st = nan_state(SPECS, num_pages=16, page_size=S, max_requests=3, recurrent_ring=ring)
    st = st.admit(0).admit(1).reserve(PROMPT)
    b = fa.Batch.prefill(st, PROMPT)
    tokens = [(r, p, 0) for r in b.request_ids for p in range(PROMPT[r])]
    return st.apply(run(attn, st, b, layer_inputs(tokens))[1])


def decode(attn, st, rids):
    """One plain decode step of the true next token of ``rids``: ``-> (state, {(r, p): outputs})``."""
    st = st.reserve({r: 1 for r in rids})
    b = fa.Batch.decode(st, rids)
    tokens = [(r, st.request(r).length, 0) for r in b.request_ids]
    outs, d = run(attn, st, b, layer_inputs(tokens))
    return st.apply(d), {t[:2]: {layer: o.o[i] for layer, o in outs.items()} for i, t in enumerate(tokens)}


def speculate(attn, st, recovery):
    """Two verify steps accepting ``ACCEPTED``, then a decode: ``-> (state, {(r, p): outputs})``."""
    seen = {}
    for step, accepted in enumerate(ACCEPTED):
        st = st.reserve({r: K + 1 for r in accepted})
        b = fa.Batch.verify(st, list(accepted), num_draft=K, recovery=recovery)
        # The fed token and the drafts this step accepts are the true ones; the rest are wrong drafts.
        tokens = [(r, st.request(r).length + i, 0 if i < accepted[r] else step + 1)
                  for r in b.request_ids for i in range(K + 1)]
        with attn.session(st, b) as s:
            outs = {layer: s.forward(layer, inp) for layer, inp in layer_inputs(tokens).items()}
            replay_outputs = s.replay_outputs
        deltas = fa.StepDeltas.collect(b, [w for _, w in outs.values()])
        replay = replay_writes(attn, st, b, replay_outputs, accepted) if recovery == "replay" else None
        st = st.apply(deltas.accept(b, accepted, replay=replay))
        for i, t in enumerate(tokens):
            if t[2] == 0:
                seen[t[:2]] = {layer: o.o[i] for layer, (o, _) in outs.items()}
    st, last = decode(attn, st, list(PROMPT))
    return st, seen | last


def cache_and_states(st):
    """Every cached token's K/V rows and each request's current recurrent rows."""
    out = {}
    for r in PROMPT:
        req = st.request(r)
        slots = torch.tensor([req.pages[p // S] * S + p % S for p in range(req.length)])
        for name in ("k", "v"):
            out[(r, name)] = st.views(FULL.index)[name].flatten(0, 1)[slots]
        for spec in (GDN, KDA):
            for name, t in st.views(spec.index).items():
                out[(r, spec.index, name)] = t[st.recurrent_row(r)]
    return out


@pytest.mark.parametrize("ring", [2, K + 2], ids=["verify-copies", "verify-in-ring"])
@pytest.mark.parametrize("full,recurrent", [("reference", "reference"), ("sdpa", "torch")])
def test_two_drafts_then_none_and_page_boundaries_give_plain_decoding(full, recurrent, ring):
    attn = attention(full, recurrent)
    lengths = {r: PROMPT[r] + sum(a[r] for a in ACCEPTED) + 1 for r in PROMPT}
    assert lengths[0] % S == 2 and lengths[1] % S == 1  # the decode after the verifies: rows 9 and 8
    plain, want = prefilled(attn, ring), {}
    while any(plain.request(r).length < lengths[r] for r in PROMPT):
        plain, outs = decode(attn, plain, [r for r in PROMPT if plain.request(r).length < lengths[r]])
        want |= outs
    results = {}
    for recovery in ("native", "replay"):
        st, got = speculate(attn, prefilled(attn, ring), recovery)  # the same prompt's cache again
        assert {r: st.request(r).length for r in PROMPT} == lengths
        assert set(got) == set(want)
        for key, layers in want.items():
            for layer, o in layers.items():
                where = f"{recovery}, token {key}, layer {layer}"
                torch.testing.assert_close(got[key][layer], o, rtol=1e-5, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}")
        rows = cache_and_states(st)
        for key, x in cache_and_states(plain).items():
            torch.testing.assert_close(rows[key], x, rtol=1e-5, atol=1e-5)
        results[recovery] = (got, rows)
    native, replay = results["native"], results["replay"]
    for key in native[0]:  # native and replay recovery: the same bits
        assert all(torch.equal(native[0][key][la], replay[0][key][la]) for la in native[0][key])
    assert all(torch.equal(native[1][key], replay[1][key]) for key in native[1])


# --------------------------------------------------------------------------------- a whole hybrid model
def model_run(model, fam, recovery):
    """``ACCEPTED`` over a GDN + full-attention model with page size ``S``; ``recovery`` None: plain decoding
    of the same tokens. ``-> {(request, position): logits row}``."""
    ma = fa.ModelAttention(model.specs)
    vocab = model.config.vocab_size
    tokens = {r: [(7 * r + 3 * p + 1) % vocab for p in range(16)] for r in PROMPT}
    st = fa.State(model.specs, num_pages=16, page_size=S, max_requests=3).admit(0).admit(1).reserve(PROMPT)
    logits = {}

    def step(st, batch, fed):
        with ma.session(st, batch) as s:
            out, deltas = fam.step(model.params, s, torch.tensor([t for _, _, t in fed]))
        for i, (r, p, _) in enumerate(fed):
            logits.setdefault((r, p), out[i])  # a rejected draft's row comes after its position's true one
        return deltas, s.replay_outputs

    b = fa.Batch.prefill(st, PROMPT)
    st = st.apply(step(st, b, [(r, p, tokens[r][p]) for r in b.request_ids for p in range(PROMPT[r])])[0])
    schedule = [{r: 1 for r in PROMPT}] * sum(max(a.values()) for a in ACCEPTED) if recovery is None else ACCEPTED
    for accepted in schedule:
        if recovery is None:
            st = st.reserve(accepted)
            b = fa.Batch.decode(st, list(accepted))
        else:
            st = st.reserve({r: K + 1 for r in accepted})
            b = fa.Batch.verify(st, list(accepted), num_draft=K, recovery=recovery)
        fed = []
        for r in b.request_ids:
            n = st.request(r).length
            fed += [(r, n + i, tokens[r][n + i] if i < accepted[r] else (tokens[r][n + i] + 1) % vocab)
                    for i in range(b.host_new_lens[b.request_ids.index(r)])]
        deltas, replay_outputs = step(st, b, fed)
        if recovery is not None:
            replay = replay_writes(ma, st, b, replay_outputs, accepted) if recovery == "replay" else None
            deltas = deltas.accept(b, accepted, replay=replay)
            for r, p, _ in fed:  # the rows of rejected drafts are no token's logits
                if p >= st.request(r).length + accepted[r]:
                    logits.pop((r, p))
        st = st.apply(deltas)
    st = st.reserve({r: 1 for r in PROMPT})
    b = fa.Batch.decode(st, list(PROMPT))
    step(st, b, [(r, st.request(r).length, tokens[r][st.request(r).length]) for r in b.request_ids])
    return logits


def test_a_hybrid_model_speculating_across_page_boundaries_gives_plain_decoding_logits():
    from fnattn.models.registry import family_named, random_model

    fam, model = family_named("qwen3_5"), random_model("qwen3_5", seed=0)
    kinds = {s.kind for s in model.specs}
    assert {"gdn", "full"} <= kinds
    plain = model_run(model, fam, None)
    native, replay = model_run(model, fam, "native"), model_run(model, fam, "replay")
    assert set(native) == set(replay) and set(native) <= set(plain)
    assert {(0, 9), (1, 8)} <= set(native)  # the decodes after the verifies: a page's second row, its first
    for key, row in native.items():
        assert torch.equal(row, replay[key]), f"native vs replay, token {key}"
        torch.testing.assert_close(row, plain[key], rtol=1e-4, atol=1e-4, msg=lambda m, k=key: f"token {k}: {m}")
