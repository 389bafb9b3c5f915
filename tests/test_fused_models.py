"""Fused projections and fused pieces against the unfused math, on CPU.

Qwen3.5 / Qwen3-Next load q/k/v/gate, gate/up and the four GDN input
projections as concatenated weights; their step chains layers through fused
residual-add + RMSNorm. Here an unfused step written from the checkpoint's own
tensors (one GEMM per projection, `models.common` norms, rope and SwiGLU)
gives the same logits within fp32 tolerance over prefill and decode steps.
The kernel bodies of `models.fused` run on the H200 (tests/gpu/test_fused_gpu.py).
"""

import pytest
import torch
import torch.nn.functional as F
from fnattn.models.common import apply_rope, rms_norm, rope_cos_sin, swiglu
from fnattn.models.gdn_layer import GDNWeights, gdn_finish, gdn_project
from fnattn.models.qwen3_5 import LINEAR, moe
from fnattn.models.registry import family_named, random_checkpoint

import fnattn as fa
from fnattn.driver import prefill, run_step
from fnattn.models import fused


def unfused_step(cfg, w, params, session, tokens):
    """Qwen3.5's decoder from the checkpoint tensors ``w``, one projection at a time (MoE from ``params``)."""
    P, eps, batch = cfg.weight_prefix, cfg.rms_norm_eps, session.batch
    cos, sin = rope_cos_sin(batch.positions, params.inv_freq)
    x, deltas, T = F.embedding(tokens, w[P + "embed_tokens.weight"]), [], tokens.shape[0]
    for i, layer in enumerate(params.layers):
        L = f"{P}layers.{i}."
        h = rms_norm(x, w[L + "input_layernorm.weight"], eps, offset=1.0)
        if cfg.layer_types[i] == LINEAR:
            g = GDNWeights.from_state_dict(w, num_k_heads=cfg.linear_num_key_heads, eps=eps, prefix=L + "linear_attn.")
            split = GDNWeights(**{**vars(g), "in_proj": None, "neg_decay": None, "dt_bias_f32": None})
            conv_input, z, gg, beta = gdn_project(split, h)
            out, d = session.forward(i, fa.RecurrentInputs(x=conv_input, conv_weight=split.conv_weight,
                                                           conv_bias=split.conv_bias, g=gg, beta=beta))
            y = gdn_finish(split, out.o, z)
        else:
            a, Dh = L + "self_attn.", cfg.head_dim
            q, gate = F.linear(h, w[a + "q_proj.weight"]).view(T, -1, 2 * Dh).chunk(2, dim=-1)
            q = apply_rope(rms_norm(q, w[a + "q_norm.weight"], eps, offset=1.0), cos, sin)
            k = F.linear(h, w[a + "k_proj.weight"]).view(T, -1, Dh)
            k = apply_rope(rms_norm(k, w[a + "k_norm.weight"], eps, offset=1.0), cos, sin)
            v = F.linear(h, w[a + "v_proj.weight"]).view(T, -1, Dh)
            out, d = session.forward(i, fa.FullAttentionInputs(q=q, k=k, v=v))
            y = F.linear(out.o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1)), w[a + "o_proj.weight"])
        x = x + y
        h = rms_norm(x, w[L + "post_attention_layernorm.weight"], eps, offset=1.0)
        m = L + "mlp."
        if cfg.moe_layers[i]:
            x = x + moe(h, layer.mlp, cfg)
        else:
            x = x + swiglu(h, *(w[f"{m}{n}_proj.weight"] for n in ("gate", "up", "down")))
        deltas.append(d)
    hidden = rms_norm(x, w[P + "norm.weight"], eps, offset=1.0)
    return F.linear(hidden, params.lm_head).float(), fa.StepDeltas.collect(batch, deltas)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_fused_load_and_step_match_the_unfused_step(family):
    fam = family_named(family)
    cfg = fam.adapt(fam.tiny_config())
    w = random_checkpoint(fam, cfg, seed=4)
    params = fam.load(cfg, w)
    ma = fa.ModelAttention(cfg.specs, prefer=("reference",))
    logits = {}
    for name, step in (("fused", fam.step), ("unfused", lambda p, s, t: unfused_step(cfg, w, p, s, t))):
        st = fa.State(cfg.specs, num_pages=32, page_size=4, max_requests=2).admit(0).admit(1)
        st, last = prefill(step, params, ma, st, {0: [3, 5, 7, 11, 13, 17], 1: [2, 4, 8]})
        got = [last[0], last[1]]
        for t in range(4):
            st = st.reserve({0: 1, 1: 1})
            st, lg = run_step(step, params, ma, st, fa.Batch.decode(st, [0, 1]), torch.tensor([t + 1, t + 9]))
            got.append(lg)
        logits[name] = torch.cat([g.reshape(-1) for g in got])
    torch.testing.assert_close(logits["fused"], logits["unfused"], atol=2e-5, rtol=1e-5)


def test_fused_weights_are_views_of_one_tensor_not_copies():
    fam = family_named("qwen3_5")
    cfg = fam.adapt(fam.tiny_config())
    params = fam.load(cfg, random_checkpoint(fam, cfg))
    gdn = next(layer.attn for layer in params.layers if isinstance(layer.attn, GDNWeights))
    base = gdn.in_proj.untyped_storage().data_ptr()
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
        assert getattr(gdn, name).untyped_storage().data_ptr() == base, name
    attn = next(layer.attn for layer in params.layers if not isinstance(layer.attn, GDNWeights))
    H = cfg.num_attention_heads * cfg.head_dim
    assert attn.qkv.shape == (2 * H + 2 * cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size)
    mlp = params.layers[0].mlp
    assert mlp.gate_up.shape == (2 * cfg.intermediate_size, cfg.hidden_size)


def test_fused_pieces_on_cpu_are_the_unfused_math():
    g = torch.Generator().manual_seed(0)
    x, y, w = (torch.randn(5, 32, generator=g) for _ in range(3))
    w = w[0]
    r, h = fused.add_rms_norm_offset_(y.clone(), x.clone(), w, 1e-6)
    torch.testing.assert_close(r, x + y, rtol=0, atol=0)
    torch.testing.assert_close(h, rms_norm(x + y, w, 1e-6, offset=1.0), rtol=0, atol=0)
    gu = torch.randn(5, 64, generator=g)
    torch.testing.assert_close(fused.silu_and_mul(gu), F.silu(gu[:, :32]) * gu[:, 32:], rtol=0, atol=0)
    q, k = torch.randn(5, 4, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    cos, sin = rope_cos_sin(torch.arange(5), torch.rand(4, generator=g))
    rq, rk = fused.rope_(q, k, cos, sin, fused.rope_table(cos, sin))
    torch.testing.assert_close(rq, apply_rope(q, cos, sin), rtol=0, atol=0)
    torch.testing.assert_close(rk, apply_rope(k, cos, sin), rtol=0, atol=0)
    table = fused.rope_table(cos, sin)
    assert table.shape == (5, 8) and torch.equal(table[:, :4], cos[:, :4]) and torch.equal(table[:, 4:], sin[:, 4:])
    with fused.unfused():
        assert not fused._ENABLED[-1]
    assert fused._ENABLED[-1]
