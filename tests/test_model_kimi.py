"""Kimi Linear (KDA + NoPE MLA + grouped sigmoid MoE) against transformers' KimiLinearForCausalLM:
prefill and greedy decode, a batch of requests, chunked prefill, the router, the config schedule
and refusals, checkpoint loading (sharded, missing and mis-shaped tensors), random model and demo."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from hf_recurrent import kda_modules

import fnattn as fa
from fnattn.driver import run_step

transformers = pytest.importorskip("transformers")
from fnattn.models.loading import CheckpointError  # noqa: E402
from fnattn.models.registry import load_model, random_model  # noqa: E402

from fnattn.models import kimi_linear  # noqa: E402

ATOL = 1e-4
NO_TOKENS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
# KDA, MLA, KDA, MLA; dense then MoE (8 experts in 2 groups, top-1 group, top-3 experts).
MAIN = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    first_k_dense_replace=1, linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, num_local_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1,
    n_shared_experts=1, routed_scaling_factor=2.5, **NO_TOKENS,
)
# The other MLA variants (q_lora_rank, attention biases, no rope dims at all); top-2 of one group, not renormalised.
VARIANT = dict(
    MAIN, num_hidden_layers=2, layer_types=["full_attention", "linear_attention"],
    mlp_layer_types=["sparse", "dense"], q_lora_rank=24, attention_bias=True, qk_rope_head_dim=0,
    num_experts_per_tok=2, n_group=1, norm_topk_prob=False,
)


def randomize_(model, seed):
    """Random weights everywhere, so every path (router, biases, gates, norms) matters."""
    g = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=g)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.1, 1.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(randn(p.shape))
            elif "norm" in name:
                p.copy_(1 + 0.2 * randn(p.shape))
            elif p.dim() == 1:
                p.copy_(0.2 * randn(p.shape))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(randn(p.shape))
            else:
                p.copy_(randn(p.shape) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * randn(b.shape))


def build_hf(sizes, seed):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    config = KimiLinearConfig(**sizes)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(config).eval()
    randomize_(model, seed)
    return model


@pytest.fixture(scope="module")
def kda_torch():
    with kda_modules():  # transformers' pure-torch KDA and conv, whatever kernels are installed
        yield


@pytest.fixture(scope="module")
def main(kda_torch, tmp_path_factory):
    model = build_hf(MAIN, seed=0)
    plain, sharded = tmp_path_factory.mktemp("kimi_plain"), tmp_path_factory.mktemp("kimi_sharded")
    model.save_pretrained(plain)
    model.save_pretrained(sharded, max_shard_size="100KB")
    return model, plain, sharded, load_model(plain)


def hf_run(model, prompt, n_decode, tokens=None):
    """Prefill logits [n, V] then one [V] per decode step; greedy unless ``tokens`` are given."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = [model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0]]
        fed = []
        for i in range(n_decode):
            fed.append(int(logits[-1][-1].argmax()) if tokens is None else tokens[i])
            logits.append(model(torch.tensor([[fed[-1]]]), cache=cache, use_cache=True).logits[0])
    return logits, fed


def fresh_state(model, prompts, extra, page_size=4):
    pages = sum(-(-(len(p) + extra) // page_size) for p in prompts.values()) + 2
    state = fa.State(model.specs, num_pages=pages, page_size=page_size, max_requests=len(prompts))
    for r in prompts:
        state = state.admit(r)
    return fa.ModelAttention(model.specs), state


def prefill(model, ma, state, counts, chunks):
    """One prefill step for ``counts``; ``chunks[r]`` are the tokens; returns (state, {r: logits [n, V]})."""
    state = state.reserve(counts)
    batch = fa.Batch.prefill(state, counts)
    tokens = torch.tensor([t for r in batch.request_ids for t in chunks[r]])
    state, logits = run_step(model.step, model.params, ma, state, batch, tokens)
    cu = batch.host_cu_seqlens
    return state, {r: logits[cu[b]:cu[b + 1]] for b, r in enumerate(batch.request_ids)}


def decode(model, ma, state, tokens):
    """One decode step for ``{r: token}``; returns (state, {r: logits [V]})."""
    state = state.reserve({r: 1 for r in tokens})
    batch = fa.Batch.decode(state, list(tokens))
    state, logits = run_step(model.step, model.params, ma, state, batch,
                             torch.tensor([tokens[r] for r in batch.request_ids]))
    return state, {r: logits[b] for b, r in enumerate(batch.request_ids)}


def close(a, b):
    err = (a.float() - b.float()).abs().max().item()
    assert err <= ATOL, f"max abs error {err:.3g} > {ATOL}"


def prompt_of(n, seed):
    return torch.randint(0, MAIN["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --------------------------------------------------------------------------- parity with transformers


def test_prefill_then_16_decode_steps_match_hf(main):
    hf, _, _, model = main
    prompt = prompt_of(12, 1)
    ref, fed = hf_run(hf, prompt, 16)
    ma, state = fresh_state(model, {0: prompt}, 16)
    state, out = prefill(model, ma, state, {0: len(prompt)}, {0: prompt})
    close(out[0], ref[0])
    for i, tok in enumerate(fed):
        state, out = decode(model, ma, state, {0: tok})
        close(out[0], ref[i + 1][0])
        assert int(out[0].argmax()) == int(ref[i + 1][0].argmax())


def test_batch_of_three_requests_each_matches_its_own_hf_run(main):
    hf, _, _, model = main
    prompts = {0: prompt_of(5, 2), 1: prompt_of(11, 3), 2: prompt_of(8, 4)}
    refs = {r: hf_run(hf, p, 4) for r, p in prompts.items()}
    ma, state = fresh_state(model, prompts, 4)
    state, out = prefill(model, ma, state, {r: len(p) for r, p in prompts.items()}, prompts)
    for r in prompts:
        close(out[r], refs[r][0][0])
    for i in range(4):
        state, out = decode(model, ma, state, {r: refs[r][1][i] for r in prompts})
        for r in prompts:
            close(out[r], refs[r][0][i + 1][0])


def test_chunked_prefill_equals_one_shot(main):
    hf, _, _, model = main
    prompt = prompt_of(15, 5)
    ma, state = fresh_state(model, {0: prompt}, 0)
    _, one_shot = prefill(model, ma, state, {0: 15}, {0: prompt})
    ma, state = fresh_state(model, {0: prompt}, 0)
    parts, start = [], 0
    for n in (5, 4, 6):  # the second and third steps run after a cached prefix
        state, out = prefill(model, ma, state, {0: n}, {0: prompt[start:start + n]})
        parts.append(out[0])
        start += n
    close(torch.cat(parts), one_shot[0])
    close(one_shot[0], hf_run(hf, prompt, 0)[0][0])


def test_router_matches_hf_and_uses_several_experts(main):
    hf, _, _, model = main
    seen = {}
    layer = 2
    hook = hf.model.layers[layer].mlp.gate.register_forward_hook(
        lambda mod, args, out: seen.update(h=args[0].reshape(-1, MAIN["hidden_size"]), w=out[1], ids=out[2]))
    try:
        hf_run(hf, prompt_of(16, 6), 0)
    finally:
        hook.remove()
    ids, w = kimi_linear.route(seen["h"], model.params.layers[layer].mlp, model.config)
    assert ids.shape[1] == 3 and len(seen["ids"].unique()) >= 4  # top-3 spread over the experts
    # One group of four out of two is kept per token: every choice lies in one half.
    assert ((ids // 4) == (ids[:, :1] // 4)).all()
    order, hf_order = ids.sort(-1), seen["ids"].sort(-1)
    assert torch.equal(order.values, hf_order.values)
    close(w.gather(1, order.indices), seen["w"].gather(1, hf_order.indices))


def test_mla_variants_q_lora_bias_and_no_rope_dims_match_hf(kda_torch, tmp_path):
    hf = build_hf(VARIANT, seed=7)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    mla = model.specs[0].config
    assert model.specs[0].kind == "mla" and mla.qk_rope_head_dim == 1 and mla.scale == pytest.approx(16**-0.5)
    prompt = prompt_of(7, 8)
    ref, fed = hf_run(hf, prompt, 4)
    ma, state = fresh_state(model, {0: prompt}, 4)
    state, out = prefill(model, ma, state, {0: 7}, {0: prompt})
    close(out[0], ref[0])
    for i, tok in enumerate(fed):
        state, out = decode(model, ma, state, {0: tok})
        close(out[0], ref[i + 1][0])


# --------------------------------------------------------------------------- config


def test_schedules_follow_transformers_precedence():
    from transformers import KimiLinearConfig

    original = dict(  # the original checkpoint's spelling: 1-based layer lists in linear_attn_config
        model_type="kimi_linear", num_hidden_layers=5, first_k_dense_replace=2, num_experts=8,
        linear_attn_config={"kda_layers": [1, 2, 4, 5], "full_attn_layers": [3], "num_heads": 3, "head_dim": 8,
                            "short_conv_kernel_size": 3},
        linear_num_heads=99, **NO_TOKENS)
    for raw in (original, dict(model_type="kimi_linear", num_hidden_layers=9, num_experts=8, **NO_TOKENS)):
        ours = kimi_linear.adapt(raw)
        theirs = KimiLinearConfig(**{k: v for k, v in raw.items() if k != "model_type"})
        assert list(ours.layer_types) == theirs.layer_types
        assert list(ours.mlp_types) == theirs.mlp_layer_types
        assert (ours.kda_heads, ours.kda_head_dim, ours.conv_kernel) == (
            theirs.linear_num_heads, theirs.linear_head_dim, theirs.linear_conv_kernel_dim)
        assert ours.num_experts == theirs.num_local_experts == 8
    assert kimi_linear.adapt(original).layer_types[2] == "full_attention"
    assert [s.kind for s in kimi_linear.adapt(original).specs] == ["kda", "kda", "mla", "kda", "kda"]


@pytest.mark.parametrize("field, value", [
    ("moe_router_activation_func", "softmax"),
    ("mla_use_nope", False),
    ("moe_layer_freq", 2),
    ("num_key_value_heads", 2),
    ("hidden_act", "gelu"),
    ("layer_types", ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
    ("mlp_layer_types", ["dense", "sparse"]),
    ("num_expert_group", 3),
    ("topk_group", 3),
    ("use_grouped_topk", False),
    ("num_experts_per_token", 9),
    ("qk_nope_head_dim", 0),
])
def test_unsupported_config_values_are_refused_by_name(field, value):
    raw = kimi_linear.tiny_config()
    raw[field] = value
    with pytest.raises(ValueError, match=field):
        kimi_linear.adapt(raw)


def test_conflicting_spellings_are_refused():
    raw = dict(kimi_linear.tiny_config(), num_local_experts=16)
    with pytest.raises(ValueError, match="num_experts"):
        kimi_linear.adapt(raw)


# --------------------------------------------------------------------------- loading


def tensors(obj):
    """Every tensor of a params tree, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors(getattr(obj, f.name))]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in tensors(x)]
    return []


def test_sharded_and_unsharded_checkpoints_load_the_same_params(main):
    _, plain, sharded, model = main
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    ours, theirs = tensors(model.params), tensors(load_model(sharded).params)
    assert len(ours) == len(theirs) > 50
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("name, broken", [
    ("model.layers.2.self_attn.A_log", None),
    ("model.layers.3.block_sparse_moe.experts.5.w2.weight", None),
    ("model.layers.1.self_attn.kv_b_proj.weight", (127, 32)),
    ("model.layers.3.block_sparse_moe.gate.e_score_correction_bias", (7,)),
])
def test_missing_or_misshaped_tensor_is_named(main, tmp_path, name, broken):
    from safetensors.torch import load_file, save_file

    _, plain, _, _ = main
    shutil.copy(plain / "config.json", tmp_path / "config.json")
    weights = load_file(plain / "model.safetensors")
    if broken is None:
        del weights[name]
    else:
        weights[name] = torch.zeros(broken)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_model(tmp_path)


def test_released_checkpoint_layout_loads_the_same_params(main, tmp_path):
    """The release files dense MLPs under ``mlp`` and its config.json has the 1-based
    ``linear_attn_config`` lists instead of transformers' ``layer_types`` / ``mlp_layer_types``."""
    from safetensors.torch import load_file, save_file

    _, plain, _, model = main
    raw = json.loads((plain / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
        del raw[key]
    raw["linear_attn_config"] = {"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 2, "head_dim": 16,
                                 "short_conv_kernel_size": 4}
    raw.update(first_k_dense_replace=1, moe_layer_freq=1, mla_use_nope=True, moe_router_activation_func="sigmoid")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    weights = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v
               for k, v in load_file(plain / "model.safetensors").items()}
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    released = load_model(tmp_path)
    assert released.config == model.config.__class__(**{**vars(model.config), "dense_mlp_name": "mlp"})
    assert all(torch.equal(a, b) for a, b in zip(tensors(model.params), tensors(released.params)))


# --------------------------------------------------------------------------- random model and demo


def test_random_model_and_demo_run(capsys):
    from fnattn import cli

    model = random_model("kimi_linear")
    assert [s.kind for s in model.specs] == ["kda", "mla", "kda", "mla"]
    assert cli.main(["demo", "--model", "kimi_linear", "--tokens", "3"]) == 0
    assert "kimi_linear" in capsys.readouterr().out
