"""The DeepSeek-V3.2 / GLM-5 attention block from its checkpoint weights: GLM-5 top-k
sharing fields, and parity with transformers' DeepSeek-V3.2 and GLM-MoE-DSA
attention modules."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fnattn.models.dsa_layer import (
    INDEXER_ROPE_INTERLEAVE,
    IndexerWeights,
    dsa_layer,
    glm_indexer_types,
    indexer_keys,
    indexer_queries,
    topk_source_layers,
)
from fnattn.models.mla_layer import mla_layer, mla_softmax_scale
from hf_mla import (
    COMMON,
    TOPK,
    Di,
    Dm,
    Dn,
    Dr,
    HFRunner,
    R,
    Rq,
    assert_same_selection,
    glm_config,
    randomize_,
    ties_to_earlier,
    v32_config,
    weights_of,
)
from transformers import GlmMoeDsaConfig
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm

from fnattn.kinds.sparse_mla.indexer import indexer_scores, topk_indices, topk_mask


@pytest.fixture(autouse=True)
def _hf_indexer_ties_to_earlier():
    """With 2 indexer heads many scores are exactly 0: ours go to the earlier position, transformers' to
    torch.topk's algorithm, which follows the row's length; transformers' indexers run with ours here."""
    with ties_to_earlier():
        yield


# --------------------------------------------------------------------------- #
# GLM-5 sharing fields
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "fields",
    [
        dict(num_hidden_layers=5),
        dict(num_hidden_layers=7, index_topk_freq=3, index_skip_topk_offset=2),
        dict(num_hidden_layers=6, index_topk_freq=2, index_skip_topk_offset=0),
        dict(num_hidden_layers=4, index_topk_pattern="FSSF"),
        dict(num_hidden_layers=3, indexer_types=["full", "shared", "full"]),
    ],
)
def test_glm_indexer_types_match_transformers(fields):
    hf_types = GlmMoeDsaConfig(**{**COMMON, **fields}).indexer_types
    assert glm_indexer_types(fields) == tuple(hf_types)


def test_topk_source_layers():
    assert topk_source_layers(("full", "shared", "shared", "full", "shared")) == (0, 0, 0, 3, 3)
    with pytest.raises(ValueError, match="no earlier full layer"):
        topk_source_layers(("shared", "full"))
    with pytest.raises(ValueError, match="index_topk_pattern"):
        glm_indexer_types({"index_topk_pattern": "FX"})


# --------------------------------------------------------------------------- #
# layer parity: DeepSeek-V3.2
# --------------------------------------------------------------------------- #


def test_v32_layer_matches_hf_prefill_then_decode():
    config = v32_config()
    attn = hf_v32.DeepseekV32Attention(config, layer_idx=0).eval()
    randomize_(attn, seed=0)
    runner = HFRunner(attn, hf_v32.DeepseekV32RotaryEmbedding(config), DynamicCache(config=config))
    weights, indexer = weights_of(attn)
    scale = mla_softmax_scale(qk_head_dim=Dn + Dr, rope_parameters=config.rope_parameters)
    kw = dict(scale=scale, index_topk=TOPK, indexer_rope_interleave=INDEXER_ROPE_INTERLEAVE["deepseek_v32"])
    g = torch.Generator().manual_seed(1)
    prompt, steps = torch.randn(12, Dm, generator=g), torch.randn(3, Dm, generator=g)

    (hf_out, _), cos, sin = runner.step(prompt, 0)
    ours = dsa_layer(weights, indexer, prompt, cos, sin, torch.zeros(0, R + Dr), torch.zeros(0, Di), **kw)
    torch.testing.assert_close(ours.output, hf_out[0], atol=1e-5, rtol=1e-5)
    assert_same_selection(ours.topk, runner.hf_topk, 0)
    # sparsity matters here: dense MLA gives another answer
    dense = mla_layer(weights, prompt, cos, sin, torch.zeros(0, R + Dr), scale=scale)
    assert not torch.allclose(dense.output, ours.output, atol=1e-3)
    rows, keys = ours.latent_rows, ours.index_key_rows

    for t in range(steps.shape[0]):
        x = steps[t : t + 1]
        (hf_out, _), cos, sin = runner.step(x, rows.shape[0])
        ours = dsa_layer(weights, indexer, x, cos, sin, rows, keys, **kw, form="expanded" if t % 2 else "absorbed")
        torch.testing.assert_close(ours.output, hf_out[0], atol=1e-5, rtol=1e-5)
        assert_same_selection(ours.topk, runner.hf_topk, rows.shape[0])
        rows, keys = torch.cat((rows, ours.latent_rows)), torch.cat((keys, ours.index_key_rows))

    layer = runner.cache.layers[0]
    torch.testing.assert_close(rows, torch.cat((layer.keys[0, 0], layer.values[0, 0]), -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(keys, layer.indexer_keys[0], atol=1e-5, rtol=1e-5)


def test_v32_chunked_prefill_equals_one_shot():
    config = v32_config()
    attn = hf_v32.DeepseekV32Attention(config, layer_idx=0).eval()
    randomize_(attn, seed=2)
    weights, indexer = weights_of(attn)
    rotary = hf_v32.DeepseekV32RotaryEmbedding(config)
    x = torch.randn(12, Dm, generator=torch.Generator().manual_seed(3))
    cos, sin = (t[0] for t in rotary(x[None], torch.arange(12)[None]))
    kw = dict(scale=0.2, index_topk=TOPK, indexer_rope_interleave=False)
    whole = dsa_layer(weights, indexer, x, cos, sin, torch.zeros(0, R + Dr), torch.zeros(0, Di), **kw)
    a = dsa_layer(weights, indexer, x[:7], cos[:7], sin[:7], torch.zeros(0, R + Dr), torch.zeros(0, Di), **kw)
    b = dsa_layer(weights, indexer, x[7:], cos[7:], sin[7:], a.latent_rows, a.index_key_rows, **kw)
    torch.testing.assert_close(torch.cat((a.output, b.output)), whole.output, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.cat((a.topk, b.topk)), whole.topk)
    torch.testing.assert_close(torch.cat((a.index_key_rows, b.index_key_rows)), whole.index_key_rows)
    torch.testing.assert_close(torch.cat((a.latent_rows, b.latent_rows)), whole.latent_rows)


# --------------------------------------------------------------------------- #
# layer parity: GLM-MoE-DSA (interleaved indexer rope, shared top-k)
# --------------------------------------------------------------------------- #


def test_glm_layers_match_hf_with_shared_topk():
    config = glm_config()
    assert config.indexer_types == ["full", "shared"]
    attn0 = hf_glm.GlmMoeDsaAttention(config, layer_idx=0).eval()
    attn1 = hf_glm.GlmMoeDsaAttention(config, layer_idx=1).eval()
    assert attn1.indexer is None
    randomize_(attn0, seed=4)
    randomize_(attn1, seed=5)
    rotary, cache = hf_glm.GlmMoeDsaRotaryEmbedding(config), DynamicCache(config=config)
    run0, run1 = HFRunner(attn0, rotary, cache), HFRunner(attn1, rotary, cache)
    (w0, i0), (w1, _) = weights_of(attn0), weights_of(attn1)
    scale = mla_softmax_scale(qk_head_dim=Dn + Dr, rope_parameters=config.rope_parameters)
    kw = dict(scale=scale, index_topk=TOPK, indexer_rope_interleave=INDEXER_ROPE_INTERLEAVE["glm_moe_dsa"])
    g = torch.Generator().manual_seed(6)
    x0, x1 = torch.randn(14, Dm, generator=g), torch.randn(14, Dm, generator=g)

    rows0, keys0, rows1 = torch.zeros(0, R + Dr), torch.zeros(0, Di), torch.zeros(0, R + Dr)
    for lo, hi in ((0, 12), (12, 13), (13, 14)):  # prefill, then two decode steps
        (hf0, _, hf_topk), cos, sin = run0.step(x0[lo:hi], lo)
        (hf1, _, _), _, _ = run1.step(x1[lo:hi], lo, prev_topk_indices=hf_topk)
        r0 = dsa_layer(w0, i0, x0[lo:hi], cos, sin, rows0, keys0, **kw)
        r1 = dsa_layer(w1, None, x1[lo:hi], cos, sin, rows1, None, scale=scale, shared_topk=r0.topk)
        assert r1.index_key_rows is None and torch.equal(r1.topk, r0.topk)
        torch.testing.assert_close(r0.output, hf0[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r1.output, hf1[0], atol=1e-5, rtol=1e-5)
        assert_same_selection(r0.topk, hf_topk[0], lo)
        # the indexer rope is interleaved for GLM: the half-split keys differ
        half_split = indexer_keys(i0, x0[lo:hi], cos, sin, rope_interleave=False)
        assert not torch.allclose(half_split, r0.index_key_rows, atol=1e-3)
        rows0, keys0 = torch.cat((rows0, r0.latent_rows)), torch.cat((keys0, r0.index_key_rows))
        rows1 = torch.cat((rows1, r1.latent_rows))

    torch.testing.assert_close(keys0, cache.layers[0].indexer_keys[0], atol=1e-5, rtol=1e-5)
    assert not cache.layers[1].is_indexer_initialized


def test_shared_topk_equals_recomputing_with_identical_keys():
    """A layer reusing another layer's top-k == the same layer recomputing it
    with an indexer that sees identical keys and queries."""
    config = glm_config()
    attn_a = hf_glm.GlmMoeDsaAttention(config, layer_idx=0).eval()
    attn_b = hf_glm.GlmMoeDsaAttention(config, layer_idx=0).eval()
    randomize_(attn_a, seed=7)
    randomize_(attn_b, seed=8)
    (wa, ia), (wb, _) = weights_of(attn_a), weights_of(attn_b)
    # same q latent path as layer A, so the indexer queries are identical too
    wb = dataclasses.replace(wb, q_a_proj=wa.q_a_proj, q_a_norm=wa.q_a_norm, q_a_proj_bias=wa.q_a_proj_bias)
    g = torch.Generator().manual_seed(9)
    n_cached, T = 6, 5
    x = torch.randn(T, Dm, generator=g)
    cached_a, cached_b = torch.randn(n_cached, R + Dr, generator=g), torch.randn(n_cached, R + Dr, generator=g)
    cached_keys = torch.randn(n_cached, Di, generator=g)
    rotary = hf_glm.GlmMoeDsaRotaryEmbedding(config)
    cos, sin = (t[0] for t in rotary(x[None], torch.arange(n_cached, n_cached + T)[None]))
    kw = dict(scale=0.2, index_topk=TOPK, indexer_rope_interleave=True)

    source = dsa_layer(wa, ia, x, cos, sin, cached_a, cached_keys, **kw)
    shared = dsa_layer(wb, None, x, cos, sin, cached_b, None, scale=0.2, shared_topk=source.topk)
    recomputed = dsa_layer(wb, ia, x, cos, sin, cached_b, cached_keys, **kw)
    assert torch.equal(shared.topk, recomputed.topk)
    torch.testing.assert_close(shared.output, recomputed.output, atol=0, rtol=0)
    torch.testing.assert_close(shared.latent_rows, recomputed.latent_rows, atol=0, rtol=0)
    assert not torch.allclose(shared.output, source.output, atol=1e-3)  # different MLA weights


# --------------------------------------------------------------------------- #
# purity and argument errors
# --------------------------------------------------------------------------- #


def _layer_inputs(seed=10):
    config = v32_config()
    attn = hf_v32.DeepseekV32Attention(config, layer_idx=0).eval()
    randomize_(attn, seed=seed)
    weights, indexer = weights_of(attn)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, Dm, generator=g)
    cos, sin = (t[0] for t in hf_v32.DeepseekV32RotaryEmbedding(config)(x[None], torch.arange(5, 8)[None]))
    cached, cached_keys = torch.randn(5, R + Dr, generator=g), torch.randn(5, Di, generator=g)
    return weights, indexer, x, cos, sin, cached, cached_keys


def test_inputs_not_mutated():
    weights, indexer, *tensors = _layer_inputs()
    before = [t.clone() for t in tensors]
    w_before = {k: v.clone() for k, v in vars(weights).items() if isinstance(v, torch.Tensor)}
    i_before = {k: v.clone() for k, v in vars(indexer).items() if isinstance(v, torch.Tensor)}
    result = dsa_layer(weights, indexer, *tensors, scale=0.2, index_topk=TOPK, indexer_rope_interleave=False)
    shared = result.topk.clone()
    dsa_layer(weights, None, *tensors[:-1], None, scale=0.2, shared_topk=shared, form="expanded")
    queries = indexer_queries(indexer, torch.randn(3, Rq), tensors[0], tensors[1], tensors[2], rope_interleave=True)
    q_before, w_copy = queries.q.clone(), queries.w.clone()
    scores = indexer_scores(queries.q, queries.w, tensors[-1])
    scores_before = scores.clone()
    topk_mask(topk_indices(scores[:, :5].contiguous(), n_cached=2, topk=2), n_keys=5)
    assert torch.equal(scores, scores_before) and torch.equal(queries.q, q_before) and torch.equal(queries.w, w_copy)
    assert torch.equal(shared, result.topk)
    for t, b in zip(tensors, before):
        assert torch.equal(t, b)
    for owner, saved in ((weights, w_before), (indexer, i_before)):
        for k, v in saved.items():
            assert torch.equal(getattr(owner, k), v), k


def test_dsa_layer_argument_errors():
    weights, indexer, x, cos, sin, cached, cached_keys = _layer_inputs()
    kw = dict(scale=0.2, index_topk=TOPK, indexer_rope_interleave=False)
    with pytest.raises(ValueError, match=r"cached_index_keys: expected shape \[5, 16\], got \[4, 16\]"):
        dsa_layer(weights, indexer, x, cos, sin, cached, cached_keys[:4], **kw)
    with pytest.raises(ValueError, match="shared_topk: required"):
        dsa_layer(weights, None, x, cos, sin, cached, None, scale=0.2)
    with pytest.raises(ValueError, match=r"shared_topk: expected shape \[3, \*\], got \[2, 4\]"):
        dsa_layer(weights, None, x, cos, sin, cached, None, scale=0.2, shared_topk=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="index_topk"):
        dsa_layer(weights, indexer, x, cos, sin, cached, cached_keys, scale=0.2)
    with pytest.raises(ValueError, match="missing key 'indexer.wq_b.weight'"):
        IndexerWeights.from_state_dict({})
