"""A tiny model around the MLA and sparse-MLA reference backends, run next to Hugging Face.

Our side runs like a model would: projections (`fnattn.models`) -> a session's
``forward`` -> ``o_proj``, with each step's writes applied once through
``State.apply``. The peer is Hugging Face's DeepseekV3Attention, the
DeepSeek-V3.2 attention + indexer and GLM-MoE-DSA's full + shared layer pair,
each request with its own DynamicCache.

Sparse MLA is MLA over the tokens an indexer picks, so both kinds share this
harness and the checks below; ``tests/kinds/mla/test_reference.py`` runs them
on the dense variants ("v3", "v3_yarn_no_q_lora"), ``tests/kinds/sparse_mla/
test_reference.py`` on the sparse ones ("v32", "glm"), each with the checks
only its kind has.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from fnattn.models.common import rope_cos_sin
from fnattn.models.dsa_layer import INDEXER_ROPE_INTERLEAVE, indexer_keys, indexer_queries
from fnattn.models.mla_layer import mla_project, mla_softmax_scale
from helpers import nan_state, phase_batch, same_bits, snapshot, unchanged
from hf_mla import (
    TOPK,
    YARN,
    Di,
    Dm,
    Dn,
    Dr,
    Dv,
    H,
    HFRunner,
    Hi,
    R,
    assert_same_selection,
    build_glm_pair,
    build_hf,
    build_v32,
    glm_config,
    hf_cache_rows,
    ties_to_earlier,
    tiny_config,
    v32_config,
    weights_of,
)
from transformers.cache_utils import DynamicCache

import fnattn as fa
from fnattn.kinds.full.reference import cached_tokens

DENSE = ("v3", "v3_yarn_no_q_lora")  # DeepseekV3Attention; "v32" and "glm" are sparse
TOL = dict(atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- #
# a tiny model around the backends
# --------------------------------------------------------------------------- #


class Model:
    """The model's side of the contract: projections in, o_proj out, top-k handed along."""

    def __init__(self, kind, *, dtype=torch.float32, seed=0):
        if kind in DENSE:
            extra = dict(q_lora_rank=None, attention_bias=True, rope_parameters=YARN) if kind != "v3" else {}
            config = tiny_config(**extra)
            attn, rotary = build_hf(config, seed)
            attns = (attn,)
        elif kind == "v32":
            config = v32_config()
            attn, rotary = build_v32(config, seed)
            attns = (attn,)
        else:
            config = glm_config()
            attns, rotary = build_glm_pair(config, (seed, seed + 1))
        self.kind, self.config, self.rotary = kind, config, rotary
        self.attns = tuple(a.to(dtype) for a in attns)
        self.weights = [weights_of(a) for a in self.attns]
        self.rope_interleave = getattr(config, "rope_interleave", True)
        self.index_interleave = INDEXER_ROPE_INTERLEAVE.get(config.model_type)
        scale = mla_softmax_scale(qk_head_dim=Dn + Dr, rope_parameters=config.rope_parameters)
        mla = fa.MLAConfig(num_heads=H, kv_lora_rank=R, qk_nope_head_dim=Dn, qk_rope_head_dim=Dr, v_head_dim=Dv,
                           q_lora_rank=config.q_lora_rank, scale=scale)
        if kind in DENSE:
            configs = [mla]
        else:
            ix = fa.IndexerConfig(num_heads=Hi, head_dim=Di, topk=TOPK, rope_head_dim=Dr)
            configs = [fa.SparseMLAConfig(mla, ix)]
            if kind == "glm":
                configs.append(fa.SparseMLAConfig(mla, ix, index_source_layer=0))
        self.specs = [fa.LayerSpec(i, c, dtype) for i, c in enumerate(configs)]
        self.ma = fa.ModelAttention(self.specs)
        self.sparse = kind not in DENSE

    def state(self, **kw):
        return nan_state(self.specs, **{"num_pages": 32, "page_size": 4, **kw})

    def inputs(self, layer, x, batch, sparse=None, topk=None):
        """Projections of one layer for the step's tokens ``x [T, Dm]``."""
        w, ix = self.weights[layer]
        cos, sin = rope_cos_sin(batch.positions, self.rotary.inv_freq,
                                attention_scaling=self.rotary.attention_scaling, dtype=x.dtype)
        p = mla_project(w, x, cos, sin, rope_interleave=self.rope_interleave)
        base = dict(q_nope=p.q_nope, q_pe=p.q_pe, latent=p.latent_rows, w_uk=w.w_uk, w_uv=w.w_uv)
        if not self.sparse:
            return fa.MLAInputs(**base)
        if ix is None:
            return fa.SparseMLAInputs(**base, sparse=sparse, topk_indices=topk)
        q = indexer_queries(ix, p.q_resid, x, cos, sin, rope_interleave=self.index_interleave)
        k = indexer_keys(ix, x, cos, sin, rope_interleave=self.index_interleave)
        return fa.SparseMLAInputs(**base, sparse=sparse, index_q=q.q, index_w=q.w, index_k=k)

    def forward(self, state, batch, xs, *, check_purity=False):
        """One step over every layer: ``-> ([(hidden out, attention out)] per layer, StepDeltas)``."""
        sparse = fa.SparseQueryMetadata.build(batch, topk=TOPK) if self.sparse else None
        outs, layer_writes, topk = [], [], None
        with self.ma.session(state, batch) as s:
            for spec, x in zip(self.specs, xs):
                inp = self.inputs(spec.index, x, batch, sparse, topk)
                before = ([t.clone() for t in tensors_of(inp)], snapshot(state)) if check_purity else None
                att, writes = s.forward(spec.index, inp)
                if before is not None:
                    assert all(same_bits(a, b) for a, b in zip(tensors_of(inp), before[0]))
                    assert unchanged(state, before[1])
                if self.sparse and spec.config.index_source_layer is None:
                    topk = att.topk_indices
                w = self.weights[spec.index][0]
                outs.append((F.linear(att.o.reshape(att.o.shape[0], -1), w.o_proj, w.o_proj_bias), att))
                layer_writes.append(writes)
        return outs, fa.StepDeltas.collect(batch, layer_writes)


def tensors_of(inp):
    out = [getattr(inp, f.name) for f in dataclasses.fields(inp) if isinstance(getattr(inp, f.name), torch.Tensor)]
    if getattr(inp, "sparse", None) is not None:
        out += [inp.sparse.request_of_token, inp.sparse.visible_keys]
    return out


class HFRequest:
    """One request through the HF layers, with its own cache."""

    def __init__(self, model):
        self.cache = DynamicCache(config=model.config)
        self.runners = [HFRunner(a, model.rotary, self.cache) for a in model.attns]
        self.n = 0

    def step(self, xs):
        outs, topk = [], None
        for layer, (runner, x) in enumerate(zip(self.runners, xs)):
            kw = {"prev_topk_indices": topk} if layer and topk is not None else {}
            res, _, _ = runner.step(x, self.n, **kw)
            if layer == 0 and runner.hf_topk is not None:
                topk = res[2] if len(res) == 3 else runner.hf_topk[None]
            outs.append(res[0][0])
        self.n += xs[0].shape[0]
        return outs, None if topk is None else topk[0]


def hidden(model, lens, seed=1):
    """Per request, per layer: the layer inputs of every token the request will see."""
    g = torch.Generator().manual_seed(seed)
    dtype = model.specs[0].dtype
    return {r: [torch.randn(n, Dm, generator=g).to(dtype) for _ in model.specs] for r, n in lens.items()}


def take(xs, counts, done):
    """The step's packed layer inputs for ``counts`` new tokens per request."""
    return [torch.cat([xs[r][layer][done[r]:done[r] + n] for r, n in counts.items()])
            for layer in range(len(next(iter(xs.values()))))]


def run_steps(model, st, xs, schedule, *, phase_of=None):
    """Run ``schedule`` (a list of {request: new tokens}); returns the state and per-step outputs."""
    done = {r: st.request(r).length for r in xs}
    results = []
    for i, counts in enumerate(schedule):
        st = st.reserve(counts)
        phase = "prefill" if phase_of is None else phase_of(i)
        batch = fa.Batch.prefill(st, counts) if phase == "prefill" else fa.Batch.decode(st, list(counts))
        outs, deltas = model.forward(st, batch, take(xs, counts, done))
        st = st.apply(deltas)
        results.append((batch, outs, dict(done)))
        done = {r: done[r] + counts.get(r, 0) for r in done}
    return st, results


def request_cache(st, layer, r, name="latent"):
    req = st.request(r)
    pages = getattr(st.views(layer), name)
    return cached_tokens(pages, torch.tensor(req.pages, dtype=torch.int32), req.length, st.page_size)


def prefixed(model, xs, prefix):
    st, _ = run_steps(model, model.state().admit(0).admit(1), xs, [prefix])
    return st


def step_inputs(st, xs, phase, counts):
    """A batch of ``phase`` for ``counts`` new tokens per request, and its layer inputs."""
    done = {r: st.request(r).length for r in counts}
    return phase_batch(st, phase, counts), take(xs, counts, done)


def phase_step(model, st, xs, phase, counts):
    batch, layer_xs = step_inputs(st, xs, phase, counts)
    outs, deltas = model.forward(st, batch, layer_xs)
    return batch, outs, deltas


# --------------------------------------------------------------------------- #
# checks shared by the MLA and sparse-MLA tests
# --------------------------------------------------------------------------- #


def check_two_requests_prefill_then_decode_match_hf(kind):
    """Outputs per step, cached latent (and index key) rows against HF; ``-> (model, state, results, hf)``.
    HF's indexers give equal scores to the earlier position here, as ours do (`ties_to_earlier`)."""
    with ties_to_earlier():
        return _two_requests_prefill_then_decode_match_hf(kind)


def _two_requests_prefill_then_decode_match_hf(kind):
    model = Model(kind)
    lens = {0: 12, 1: 5}
    xs = hidden(model, {r: n + 3 for r, n in lens.items()})
    st = model.state().admit(0).admit(1)
    schedule = [lens] + [{0: 1, 1: 1}] * 3
    st, results = run_steps(model, st, xs, schedule, phase_of=lambda i: "prefill" if i == 0 else "decode")
    hf = {r: HFRequest(model) for r in lens}
    for batch, outs, done in results:
        cu = batch.host_cu_seqlens
        for b, (r, n) in enumerate(zip(batch.request_ids, batch.host_new_lens)):
            rows = slice(cu[b], cu[b + 1])
            hf_outs, hf_topk = hf[r].step([x[done[r]:done[r] + n] for x in xs[r]])
            for (ours, att), want in zip(outs, hf_outs):
                torch.testing.assert_close(ours[rows], want, **TOL)
                assert att.o.dtype == torch.float32 and att.lse.dtype == torch.float32
            if model.sparse:
                assert_same_selection(outs[0][1].topk_indices[rows], hf_topk, done[r])
    for r in lens:
        assert st.request(r).length == lens[r] + 3
        for spec in model.specs:
            torch.testing.assert_close(request_cache(st, spec.index, r), hf_cache_rows(hf[r].cache, spec.index), **TOL)
        if model.sparse:
            torch.testing.assert_close(request_cache(st, 0, r, "index_k"), hf[r].cache.layers[0].indexer_keys[0],
                                       **TOL)
    return model, st, results, hf


def check_chunked_prefill_equals_one_shot(kind):
    model = Model(kind, seed=2)
    xs = hidden(model, {0: 12}, seed=3)
    st_a, one = run_steps(model, model.state().admit(0), xs, [{0: 12}])
    st_b, two = run_steps(model, model.state(page_size=5).admit(0), xs, [{0: 7}, {0: 5}])
    for layer in range(len(model.specs)):
        whole, parts = one[0][1][layer], [res[1][layer] for res in two]
        torch.testing.assert_close(torch.cat([p[0] for p in parts]), whole[0], **TOL)
        torch.testing.assert_close(torch.cat([p[1].lse for p in parts]), whole[1].lse, **TOL)
        if model.sparse:
            assert torch.equal(torch.cat([p[1].topk_indices for p in parts]), whole[1].topk_indices)
        torch.testing.assert_close(request_cache(st_a, layer, 0), request_cache(st_b, layer, 0), **TOL)


def check_prefill_verify_and_decode_agree(kind):
    """Expanded (prefill) vs absorbed (decode, verify) forms over the same prefix."""
    model = Model(kind, seed=8)
    prefix, n = {0: 9, 1: 6}, 4
    xs = hidden(model, {r: p + n for r, p in prefix.items()}, seed=9)
    st = prefixed(model, xs, prefix).reserve({0: n, 1: n})
    counts = {0: n, 1: n}
    _, by_prefill, _ = phase_step(model, st, xs, "prefill", counts)
    verify_batch, by_verify, _ = phase_step(model, st, xs, "verify", counts)
    assert verify_batch.phase == "verify"
    for (o_p, a_p), (o_v, a_v) in zip(by_prefill, by_verify):
        torch.testing.assert_close(o_v, o_p, **TOL)
        torch.testing.assert_close(a_v.lse, a_p.lse, **TOL)
        if model.sparse:
            assert torch.equal(a_v.topk_indices, a_p.topk_indices)
    # decode token by token from the same prefix: step i equals verify row i
    cu = verify_batch.host_cu_seqlens
    chain = st
    for i in range(n):
        batch, outs, deltas = phase_step(model, chain, xs, "decode", {0: 1, 1: 1})
        chain = chain.apply(deltas, inplace=False)  # the prefix state stays live for the other branches
        for (o_d, a_d), (o_v, a_v) in zip(outs, by_verify):
            rows = [cu[0] + i, cu[1] + i]
            torch.testing.assert_close(o_d, o_v[rows], **TOL)
            if model.sparse:
                assert torch.equal(a_d.topk_indices, a_v.topk_indices[rows])
    assert st.is_live


def check_accept_keeps_only_accepted_rows(kind, *, writes_of_layer):
    """``writes_of_layer``: the storage names each layer's writes hold (what its kind declared)."""
    model = Model(kind, seed=10)
    prefix, k = {0: 5, 1: 8}, 3
    xs = hidden(model, {r: p + 1 + k + 1 for r, p in prefix.items()}, seed=11)
    st = prefixed(model, xs, prefix).reserve({0: 1 + k, 1: 1 + k})
    batch, outs, deltas = phase_step(model, st, xs, "verify", {0: 1 + k, 1: 1 + k})
    written = deltas.writes
    accepted = {0: 2, 1: 4}
    token_rows = batch.token_rows(tuple(accepted[r] for r in batch.request_ids))
    st = st.apply(deltas.accept(batch, accepted))
    cu = batch.host_cu_seqlens
    for b, r in enumerate(batch.request_ids):
        assert st.request(r).length == prefix[r] + accepted[r]
        for w in written:
            for name, value in w.values.items():
                flat = st.views(w.layer)[name].flatten(0, 1)  # [P * S, X]
                for i in range(1 + k):
                    slot = int(batch.slot_mapping[cu[b] + i])
                    if i < accepted[r]:
                        assert int(token_rows[cu[b] + i]) == slot
                        assert torch.equal(flat[slot], value[cu[b] + i])
                    else:
                        assert int(token_rows[cu[b] + i]) == -1
                        assert torch.isnan(flat[slot]).all()
    assert {w.layer: sorted(w.values) for w in written} == writes_of_layer
    # the next step continues from the accepted tokens only, as if the drafts never existed
    st = st.reserve({0: 1, 1: 1})
    _, after, _ = phase_step(model, st, xs, "decode", {0: 1, 1: 1})
    clean = prefixed(model, xs, {r: p + accepted[r] for r, p in prefix.items()}).reserve({0: 1, 1: 1})
    _, want, _ = phase_step(model, clean, xs, "decode", {0: 1, 1: 1})
    for (o, a), (o_w, a_w) in zip(after, want):
        assert torch.isfinite(o).all()
        torch.testing.assert_close(o, o_w, **TOL)
        torch.testing.assert_close(a.lse, a_w.lse, **TOL)


def check_inputs_and_views_bit_identical_after_every_call(kind):
    model = Model(kind, seed=12)
    xs = hidden(model, {0: 12, 1: 12}, seed=13)
    st = prefixed(model, xs, {0: 5, 1: 3})
    for phase, counts in (("prefill", {0: 2, 1: 3}), ("decode", {0: 1, 1: 1}), ("verify", {0: 3, 1: 3})):
        st = st.reserve(counts)
        batch, layer_xs = step_inputs(st, xs, phase, counts)
        batch_tensors = [t.clone() for t in (batch.cu_seqlens, batch.positions, batch.block_table,
                                             batch.slot_mapping)]
        outs, deltas = model.forward(st, batch, layer_xs, check_purity=True)
        assert all(torch.equal(a, b) for a, b in zip((batch.cu_seqlens, batch.positions, batch.block_table,
                                                      batch.slot_mapping), batch_tensors))
        st = st.apply(deltas)


def check_nan_in_unused_pages_never_reaches_outputs(kind):
    model = Model(kind, seed=14)
    xs = hidden(model, {0: 8, 1: 8}, seed=15)
    st = prefixed(model, xs, {0: 5, 1: 2})  # partly filled last pages; the rest of the pool is NaN
    assert torch.isnan(st.views(0).latent).any()
    if model.sparse:
        assert torch.isnan(st.views(0).index_k).any()
    for phase, counts in (("decode", {0: 1, 1: 1}), ("verify", {0: 2, 1: 2}), ("prefill", {0: 1, 1: 3})):
        st2 = st.reserve(counts)
        _, outs, _ = phase_step(model, st2, xs, phase, counts)
        for o, att in outs:
            assert torch.isfinite(o).all() and torch.isfinite(att.lse).all()
        st = st2


def valid_inputs(kind):
    """A model, a prefill state and batch, and valid inputs for each of its layers."""
    model = Model(kind, seed=16)
    st = model.state().admit(0).reserve({0: 6})
    batch = fa.Batch.prefill(st, {0: 6})
    x = torch.randn(6, Dm, generator=torch.Generator().manual_seed(17))
    sparse = fa.SparseQueryMetadata.build(batch, topk=TOPK) if model.sparse else None
    first = model.inputs(0, x, batch, sparse)
    good = [first]
    if kind == "glm":
        topk = torch.full((6, TOPK), -1, dtype=torch.int64)
        topk[:, 0] = torch.arange(6)
        good.append(model.inputs(1, x, batch, sparse, topk))
    return model, st, batch, good


def forward_one(model, st, batch, layer, inp):
    with model.ma.session(st, batch) as s:
        return s.forward(layer, inp)


def check_bad_inputs_name_the_field(kind, cases):
    """``cases``: (layer, field, {field: bad value}); each is refused with an error naming the field."""
    model, st, batch, good = valid_inputs(kind)
    for layer, inp in enumerate(good):
        forward_one(model, st, batch, layer, inp)  # the valid inputs pass
    for layer, field, change in cases:
        with pytest.raises(ValueError, match=f"`{field}`"):
            forward_one(model, st, batch, layer, dataclasses.replace(good[layer], **change))
    return model, st, batch, good


def check_prefill_runs_expanded_decode_and_verify_absorbed(kind, monkeypatch):
    from fnattn.kinds.mla import reference as backend

    calls = []

    def spy(name):
        real = getattr(backend, name)
        return lambda *a, **kw: calls.append(name) or real(*a, **kw)

    for name in ("mla_expanded", "mla_absorbed"):
        monkeypatch.setattr(backend, name, spy(name))
    model = Model(kind, seed=18)
    model.ma = fa.ModelAttention(model.specs, prefer=("reference",))  # the reference's forms (CPU prefill: sdpa)
    xs = hidden(model, {0: 10, 1: 10}, seed=19)
    st = prefixed(model, xs, {0: 4, 1: 3})
    for phase, counts, form in (("prefill", {0: 2, 1: 1}, "mla_expanded"), ("decode", {0: 1, 1: 1}, "mla_absorbed"),
                                ("verify", {0: 3, 1: 3}, "mla_absorbed")):
        st = st.reserve(counts)
        calls.clear()
        _, _, deltas = phase_step(model, st, xs, phase, counts)
        assert calls == [form] * (2 * len(model.specs))  # once per request and layer
        st = st.apply(deltas)
