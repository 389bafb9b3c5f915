"""DeepSeek's MLA block from its checkpoint weights: rope, softmax scale and weight loading
against transformers' pieces, and layer parity with DeepseekV3Attention (prefill,
token-by-token decode, chunked prefill)."""

from __future__ import annotations

import pytest
import torch
from fnattn.models.common import apply_rope, rope_cos_sin
from fnattn.models.mla_layer import MLAWeights, mla_layer, mla_softmax_scale
from hf_mla import YARN, Dm, Dn, Dr, Dv, H, R, build_hf, hf_cache_rows, hf_step, tiny_config
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

# --------------------------------------------------------------------------- #
# pieces vs transformers
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_matches_transformers(interleave):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, H, Dr, generator=g), torch.randn(5, Dr, generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, Dr, 2).float() / Dr))
    cos, sin = rope_cos_sin(torch.arange(3, 8), inv_freq)
    hf_rope = hf_v3.apply_rotary_pos_emb_interleave if interleave else hf_v3.apply_rotary_pos_emb
    hf_q, hf_k = hf_rope(q.transpose(0, 1)[None], k[None, None], cos[None], sin[None])
    torch.testing.assert_close(apply_rope(q, cos, sin, interleave=interleave), hf_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rope(k, cos, sin, interleave=interleave), hf_k[0, 0])


def test_rope_cos_sin_matches_rotary_module():
    config = tiny_config()
    rotary = hf_v3.DeepseekV3RotaryEmbedding(config)
    positions = torch.tensor([0, 4, 9, 31])
    cos, sin = rotary(torch.zeros(1, 4, Dm), positions[None])
    ours = rope_cos_sin(positions, rotary.inv_freq, attention_scaling=rotary.attention_scaling)
    torch.testing.assert_close(ours[0], cos[0])
    torch.testing.assert_close(ours[1], sin[0])


@pytest.mark.parametrize("rope_parameters", [None, YARN])
def test_softmax_scale_matches_module(rope_parameters):
    config = tiny_config(rope_parameters=rope_parameters)
    attn = hf_v3.DeepseekV3Attention(config, layer_idx=0)
    ours = mla_softmax_scale(qk_head_dim=Dn + Dr, rope_parameters=config.rope_parameters)
    assert ours == pytest.approx(attn.scaling, rel=1e-12)
    if rope_parameters is not None:
        assert ours != pytest.approx((Dn + Dr) ** -0.5)


def test_weights_from_state_dict():
    attn, _ = build_hf(tiny_config(q_lora_rank=24))
    sd = {f"model.layers.2.self_attn.{k}": v for k, v in attn.state_dict().items()}
    w = MLAWeights.from_state_dict(sd, prefix="model.layers.2.self_attn.", num_heads=H)
    assert (w.num_heads, w.qk_nope_head_dim, w.qk_rope_head_dim, w.v_head_dim) == (H, Dn, Dr, Dv)
    assert (w.kv_lora_rank, w.q_lora_rank, w.hidden_size) == (R, 24, Dm)
    kv_b = attn.kv_b_proj.weight.view(H, Dn + Dv, R)
    assert torch.equal(w.w_uk, kv_b[:, :Dn]) and torch.equal(w.w_uv, kv_b[:, Dn:])
    with pytest.raises(ValueError, match="num_heads"):
        MLAWeights.from_state_dict(sd, prefix="model.layers.2.self_attn.", num_heads=H + 1)
    with pytest.raises(ValueError, match="missing key"):
        MLAWeights.from_state_dict(sd)


# --------------------------------------------------------------------------- #
# layer parity with DeepseekV3Attention
# --------------------------------------------------------------------------- #


CASES = {
    "q_lora": dict(q_lora_rank=24),
    "no_q_lora_yarn_bias": dict(q_lora_rank=None, attention_bias=True, rope_parameters=YARN),
    "no_interleave": dict(q_lora_rank=24, rope_interleave=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_hf_prefill_then_decode(case):
    config = tiny_config(**CASES[case])
    attn, rotary = build_hf(config, seed=1)
    weights = MLAWeights.from_state_dict(attn.state_dict())
    scale = mla_softmax_scale(qk_head_dim=Dn + Dr, rope_parameters=config.rope_parameters)
    interleave = config.rope_interleave
    g = torch.Generator().manual_seed(2)
    prompt, steps = torch.randn(12, Dm, generator=g), torch.randn(3, Dm, generator=g)

    cache = DynamicCache(config=config)
    hf_out, cos, sin = hf_step(attn, rotary, prompt, 0, cache)
    ours = mla_layer(weights, prompt, cos, sin, torch.zeros(0, R + Dr), scale=scale, rope_interleave=interleave)
    torch.testing.assert_close(ours.output, hf_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.latent_rows, hf_cache_rows(cache), atol=1e-5, rtol=1e-5)
    rows = ours.latent_rows

    for t in range(steps.shape[0]):
        hf_out, cos, sin = hf_step(attn, rotary, steps[t : t + 1], rows.shape[0], cache)
        form = "expanded" if t % 2 else "absorbed"
        ours = mla_layer(weights, steps[t : t + 1], cos, sin, rows, scale=scale, rope_interleave=interleave, form=form)
        torch.testing.assert_close(ours.output, hf_out, atol=1e-5, rtol=1e-5)
        rows = torch.cat((rows, ours.latent_rows))
        torch.testing.assert_close(rows, hf_cache_rows(cache), atol=1e-5, rtol=1e-5)


def test_chunked_prefill_equals_one_shot():
    config = tiny_config(q_lora_rank=24)
    attn, rotary = build_hf(config, seed=4)
    weights = MLAWeights.from_state_dict(attn.state_dict())
    scale = mla_softmax_scale(qk_head_dim=Dn + Dr, rope_parameters=config.rope_parameters)
    x = torch.randn(12, Dm, generator=torch.Generator().manual_seed(5))
    cos, sin = rotary(x[None], torch.arange(12)[None])
    cos, sin = cos[0], sin[0]
    whole = mla_layer(weights, x, cos, sin, torch.zeros(0, R + Dr), scale=scale)
    first = mla_layer(weights, x[:7], cos[:7], sin[:7], torch.zeros(0, R + Dr), scale=scale)
    second = mla_layer(weights, x[7:], cos[7:], sin[7:], first.latent_rows, scale=scale, form="expanded")
    torch.testing.assert_close(torch.cat((first.output, second.output)), whole.output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat((first.latent_rows, second.latent_rows)), whole.latent_rows)
    torch.testing.assert_close(torch.cat((first.lse, second.lse)), whole.lse, atol=1e-5, rtol=1e-5)


def test_layer_matches_hf_bf16_loose():
    config = tiny_config(q_lora_rank=24)
    attn, rotary = build_hf(config, seed=6)
    attn = attn.to(torch.bfloat16)
    weights = MLAWeights.from_state_dict(attn.state_dict())
    scale = mla_softmax_scale(qk_head_dim=Dn + Dr, rope_parameters=config.rope_parameters)
    g = torch.Generator().manual_seed(7)
    prompt, step = torch.randn(12, Dm, generator=g).bfloat16(), torch.randn(1, Dm, generator=g).bfloat16()
    cache = DynamicCache(config=config)
    hf_out, cos, sin = hf_step(attn, rotary, prompt, 0, cache)
    assert cos.dtype == torch.bfloat16
    ours = mla_layer(weights, prompt, cos, sin, torch.zeros(0, R + Dr, dtype=torch.bfloat16), scale=scale)
    assert ours.output.dtype == torch.bfloat16
    torch.testing.assert_close(ours.latent_rows, hf_cache_rows(cache))
    torch.testing.assert_close(ours.output, hf_out, atol=3e-2, rtol=3e-2)
    hf_out, cos, sin = hf_step(attn, rotary, step, 12, cache)
    ours = mla_layer(weights, step, cos, sin, ours.latent_rows, scale=scale)
    torch.testing.assert_close(ours.output, hf_out, atol=3e-2, rtol=3e-2)


def test_layer_inputs_not_mutated():
    attn, rotary = build_hf(tiny_config(q_lora_rank=24), seed=8)
    weights = MLAWeights.from_state_dict(attn.state_dict())
    weights_before = {k: v.clone() for k, v in vars(weights).items() if isinstance(v, torch.Tensor)}
    x = torch.randn(3, Dm)
    cached = torch.randn(5, R + Dr)
    cos, sin = rotary(x[None], torch.arange(5, 8)[None])
    args = (x, cos[0], sin[0], cached)
    before = [a.clone() for a in args]
    mla_layer(weights, *args, scale=0.2)
    mla_layer(weights, *args, scale=0.2, form="expanded")
    for a, b in zip(args, before):
        assert torch.equal(a, b)
    for k, v in weights_before.items():
        assert torch.equal(getattr(weights, k), v), k


def test_layer_bad_cache_shape():
    attn, rotary = build_hf(tiny_config(q_lora_rank=None))
    weights = MLAWeights.from_state_dict(attn.state_dict())
    x = torch.randn(2, Dm)
    cos, sin = rotary(x[None], torch.arange(2)[None])
    with pytest.raises(ValueError, match=r"cached_latent: expected shape \[\*, 40\], got \[3, 39\]"):
        mla_layer(weights, x, cos[0], sin[0], torch.zeros(3, R + Dr - 1), scale=0.2)
    with pytest.raises(ValueError, match=r"hidden: expected shape \[\*, 64\]"):
        mla_layer(weights, torch.randn(2, Dm + 1), cos[0], sin[0], torch.zeros(0, R + Dr), scale=0.2)
