"""Qwen3.5 (dense, MoE) and Qwen3-Next model steps against transformers' causal LMs.

Each tiny HF model gets random weights at a scale where mistakes show (norm
weights off 1, routers that spread tokens over several experts), is saved with
``save_pretrained`` and loaded back through ``load_model``; prefill, greedy
decode, a mixed batch and a chunked prefill are compared on logits.
"""

from __future__ import annotations

import re

import pytest
import torch
from fnattn.models.registry import load_model, random_model
from hf_recurrent import _GDN_TORCH_PATH, _force_torch_path

import fnattn as fa
from fnattn.cli import main  # imported before any test captures sys.stderr (cli binds it as a default)
from fnattn.driver import run_step

TOL = dict(atol=1e-4, rtol=0)
_NO_TOKENS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4)
_ATTN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
LIN, FULL = "linear_attention", "full_attention"

# name -> (module, config class, causal LM class, config kwargs)
MODELS = {
    "qwen3_5": ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(**_ATTN, **_GDN, num_hidden_layers=3, layer_types=[LIN, FULL, LIN], intermediate_size=96)),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(**_ATTN, **_GDN, **_MOE, num_hidden_layers=2, layer_types=[LIN, FULL],
                         rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5})),
    "qwen3_next": ("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(**_ATTN, **_GDN, **_MOE, num_hidden_layers=3, layer_types=[LIN, FULL, LIN],
                        intermediate_size=96, mlp_only_layers=[2], norm_topk_prob=True)),
}


@pytest.fixture(scope="module")
def hf_torch_path():
    """transformers' GDN modules on their pure-torch path (fla may be installed without a GPU)."""
    pytest.importorskip("transformers")
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
    from transformers.models.qwen3_next import modeling_qwen3_next

    with pytest.MonkeyPatch.context() as mp:
        for module in (modeling_qwen3_5, modeling_qwen3_5_moe, modeling_qwen3_next):
            _force_torch_path(mp, module, _GDN_TORCH_PATH)
        yield


def randomize(model, seed: int) -> None:
    """Weights at O(1) activation scale; zero-centred norms moved off zero so ``1 + w`` is tested."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.1, 1.0, generator=g).log())
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0  # the gated norm is not centred
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def hf_model(name: str, *, seed: int = 0, **overrides):
    import importlib

    module_name, config_cls, model_cls, kwargs = MODELS[name]
    mod = importlib.import_module(f"transformers.models.{module_name}")
    config = getattr(mod, config_cls)(**{**kwargs, **overrides}, **_NO_TOKENS)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(mod, model_cls)(config).eval()
    randomize(model, seed)
    return model


def hf_checkpoint(name: str, path, *, seed: int = 0, **save_kw):
    model = hf_model(name, seed=seed)
    model.save_pretrained(path, **save_kw)
    return model


def hf_greedy(model, prompt: list[int], steps: int):
    """HF prefill logits ``[T, V]``, then ``steps`` greedy decode steps: (logits per step, tokens fed)."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        logits, cache = [out.logits[0]], out.cache
        tokens = []
        for _ in range(steps):
            tokens.append(int(logits[-1][-1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            logits.append(out.logits[0])
    return logits, tokens


def new_state(model, *, requests: int = 3, tokens: int = 40):
    return fa.State(model.specs, num_pages=requests * (tokens // 8 + 2), page_size=8, max_requests=requests)


def our_step(model, ma, state, new_tokens: dict[int, list[int]], phase: str = "prefill"):
    """One step feeding ``new_tokens[r]`` to each request; ``-> (state, {r: logits [n, V]})``."""
    counts = {r: len(t) for r, t in new_tokens.items()}
    state = state.reserve(counts)
    batch = fa.Batch.prefill(state, counts) if phase == "prefill" else fa.Batch.decode(state, list(counts))
    tokens = torch.tensor([t for r in batch.request_ids for t in new_tokens[r]], dtype=torch.long)
    state, logits = run_step(model.step, model.params, ma, state, batch, tokens)
    cu = batch.host_cu_seqlens
    return state, {r: logits[cu[b]:cu[b + 1]] for b, r in enumerate(batch.request_ids)}


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request, hf_torch_path, tmp_path_factory):
    """(name, HF model, our model loaded from its save_pretrained directory)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = hf_checkpoint(request.param, path, seed=len(request.param))
    return request.param, hf, load_model(path)


def test_prefill_then_16_greedy_decode_steps_match_transformers(pair):
    name, hf, model = pair
    prompt = prompt_of(11, seed=1)
    want, fed = hf_greedy(hf, prompt, 16)
    ma = fa.ModelAttention(model.specs)
    state = new_state(model).admit(0)
    state, got = our_step(model, ma, state, {0: prompt})
    torch.testing.assert_close(got[0], want[0], **TOL)
    for i, token in enumerate(fed):
        assert int(got[0][-1].argmax()) == token
        state, got = our_step(model, ma, state, {0: [token]}, phase="decode")
        torch.testing.assert_close(got[0], want[i + 1], **TOL)
    assert state.request(0).length == len(prompt) + 16


def test_requests_of_different_lengths_in_one_batch(pair):
    name, hf, model = pair
    prompts = {0: prompt_of(7, seed=2), 1: prompt_of(12, seed=3), 2: prompt_of(3, seed=4)}
    want = {r: hf_greedy(hf, p, 3) for r, p in prompts.items()}
    ma = fa.ModelAttention(model.specs)
    state = new_state(model)
    for r in prompts:
        state = state.admit(r)
    state, got = our_step(model, ma, state, prompts)
    for r in prompts:
        torch.testing.assert_close(got[r], want[r][0][0], **TOL)
    for i in range(3):
        state, got = our_step(model, ma, state, {r: [want[r][1][i]] for r in (2, 0, 1)}, phase="decode")
        for r in prompts:
            torch.testing.assert_close(got[r], want[r][0][i + 1], **TOL)


def test_chunked_prefill_equals_one_shot_and_decodes_on(pair):
    name, hf, model = pair
    prompt = prompt_of(13, seed=5)
    want, fed = hf_greedy(hf, prompt, 2)
    ma = fa.ModelAttention(model.specs)
    one_state, one = our_step(model, ma, new_state(model).admit(0), {0: prompt})
    state, parts = new_state(model).admit(0), []
    for lo, hi in ((0, 5), (5, 10), (10, 13)):
        state, got = our_step(model, ma, state, {0: prompt[lo:hi]})
        parts.append(got[0])
    torch.testing.assert_close(torch.cat(parts), one[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(parts), want[0], **TOL)
    for i, token in enumerate(fed):
        state, got = our_step(model, ma, state, {0: [token]}, phase="decode")
        torch.testing.assert_close(got[0], want[i + 1], **TOL)


@pytest.mark.parametrize("pair", ["qwen3_5_moe", "qwen3_next"], indirect=True)
def test_moe_routes_tokens_to_several_experts(pair):
    name, hf, model = pair
    picked = []
    hook = hf.model.layers[0].mlp.gate.register_forward_hook(lambda m, i, out: picked.append(out[2]))
    with torch.no_grad():
        hf(torch.tensor([prompt_of(16, seed=6)]))
    hook.remove()
    assert picked[0].shape[-1] == 2 and len(picked[0].unique()) >= 3
    assert model.config.num_experts_per_tok == 2 and any(model.config.moe_layers)


def test_specs_follow_layer_types(pair):
    name, hf, model = pair
    kinds = ["gdn" if t == LIN else "full" for t in hf.config.layer_types]
    assert [s.kind for s in model.specs] == kinds
    full = next(s.config for s in model.specs if s.kind == "full")
    assert full.output_gate and full.num_q_heads == 4 and full.num_kv_heads == 2 and full.head_dim == 16


def test_multimodal_wrapper_checkpoint_with_tied_embeddings(hf_torch_path, tmp_path):
    """A ``qwen3_5`` wrapper config: the decoder under model.language_model., no lm_head.weight."""
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    text = dict(**MODELS["qwen3_5"][3], tie_word_embeddings=True, **_NO_TOKENS)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    wrapper = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision,
                                                            tie_word_embeddings=True))
    randomize(wrapper, 3)
    wrapper.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.config.weight_prefix == "model.language_model." and model.config.tie_word_embeddings
    hf = Qwen3_5ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    prompt = prompt_of(9, seed=7)
    want, _ = hf_greedy(hf, prompt, 0)
    _, got = our_step(model, fa.ModelAttention(model.specs), new_state(model).admit(0), {0: prompt})
    torch.testing.assert_close(got[0], want[0], **TOL)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_random_model_and_demo(name, capsys):
    model = random_model(name)
    assert len(model.specs) == 4 and {s.kind for s in model.specs} == {"gdn", "full"}
    assert main(["demo", "--model", name, "--tokens", "3"]) == 0
    assert "generated token ids" in capsys.readouterr().out


def _tiny(**changes):
    from fnattn.models import qwen3_5

    return {**qwen3_5.tiny_config(), **changes}


@pytest.mark.parametrize("changes, field", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "layer_types[3]"),
    (dict(layer_types=["linear_attention"]), "layer_types"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_parameters.rope_type"),
    (dict(num_key_value_heads=3), "num_attention_heads"),
    (dict(hidden_size=None), "hidden_size"),
    (dict(model_type="qwen3_5", text_config=None), "text_config"),
    (dict(model_type="qwen3_5", text_config={"model_type": "qwen3_5_moe_text"}), "text_config.model_type"),
])
def test_bad_config_values_name_the_field(changes, field):
    from fnattn.models.registry import family_named

    with pytest.raises(ValueError, match=re.escape(f"`{field}`")):
        family_named("qwen3_5").adapt(_tiny(**changes))


def test_qwen3_next_config_errors_and_moe_layer_choice():
    from fnattn.models.registry import family_named

    fam = family_named("qwen3_next")
    tiny = fam.tiny_config()
    assert fam.adapt(tiny).moe_layers == (False, True, True, True)
    assert fam.adapt({**tiny, "decoder_sparse_step": 2, "mlp_only_layers": []}).moe_layers == (False, True, False, True)
    with pytest.raises(ValueError, match="`mlp_only_layers`"):
        fam.adapt({**tiny, "mlp_only_layers": [4]})
    with pytest.raises(ValueError, match="`num_experts_per_tok`"):
        fam.adapt({**tiny, "num_experts_per_tok": 5})
