"""Llama (3.x), Qwen3 and Qwen2 model steps against transformers' causal LMs.

Each tiny HF model gets random weights (norm weights off 1, non-zero biases),
is saved with ``save_pretrained`` and loaded back through ``load_model``;
prefill, greedy decode and a chunked prefill are compared on logits, and
greedy generation through the driver on tokens.
"""

from __future__ import annotations

import re

import pytest
import torch
from fnattn.models.registry import family_named, load_model, random_model

import fnattn as fa
from fnattn.cli import main  # imported before any test captures sys.stderr (cli binds it as a default)
from fnattn.driver import generate, run_step

TOL = dict(atol=1e-4, rtol=0)
_NO_TOKENS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
_BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96, max_position_embeddings=256)
_LLAMA3 = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# name -> (config class, causal LM class, config kwargs)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(**_BASE, rope_parameters=_LLAMA3)),
    "llama_bias_tied": ("LlamaConfig", "LlamaForCausalLM",
                        dict(**_BASE, attention_bias=True, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(**_BASE, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(**_BASE)),
}


def hf_model(name: str, *, seed: int = 0, **overrides):
    import transformers

    config_cls, model_cls, kwargs = MODELS[name]
    config = getattr(transformers, config_cls)(**{**kwargs, **overrides}, **_NO_TOKENS)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # biases
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return model


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request, tmp_path_factory):
    """(name, HF model, our model loaded from its save_pretrained directory)."""
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp(request.param)
    hf = hf_model(request.param, seed=len(request.param))
    hf.save_pretrained(path)
    return request.param, hf, load_model(path)


def hf_greedy(model, prompt: list[int], steps: int):
    """HF prefill logits ``[T, V]``, then ``steps`` greedy decode steps: (logits per step, tokens fed)."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        logits, cache, tokens = [out.logits[0]], out.cache, []
        for _ in range(steps):
            tokens.append(int(logits[-1][-1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            logits.append(out.logits[0])
    return logits, tokens


def new_state(model, *, requests: int = 2, tokens: int = 48):
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


def test_prefill_then_greedy_decode_match_transformers(pair):
    name, hf, model = pair
    # Positions past original_max_position_embeddings=32 reach the llama3-scaled frequencies' effect.
    prompt = prompt_of(30, seed=1)
    want, fed = hf_greedy(hf, prompt, 6)
    ma = fa.ModelAttention(model.specs)
    state, got = our_step(model, ma, new_state(model).admit(0), {0: prompt})
    torch.testing.assert_close(got[0], want[0], **TOL)
    for i, token in enumerate(fed):
        assert int(got[0][-1].argmax()) == token
        state, got = our_step(model, ma, state, {0: [token]}, phase="decode")
        torch.testing.assert_close(got[0], want[i + 1], **TOL)
    assert state.request(0).length == len(prompt) + 6


def test_chunked_prefill_and_two_requests_match_transformers(pair):
    name, hf, model = pair
    prompts = {0: prompt_of(13, seed=5), 1: prompt_of(6, seed=6)}
    want = {r: hf_greedy(hf, p, 2) for r, p in prompts.items()}
    ma = fa.ModelAttention(model.specs)
    state, parts = new_state(model).admit(0).admit(1), []
    for lo, hi in ((0, 5), (5, 10), (10, 13)):
        state, got = our_step(model, ma, state, {0: prompts[0][lo:hi], **({1: prompts[1]} if lo == 5 else {})})
        parts.append(got[0])
        if lo == 5:
            torch.testing.assert_close(got[1], want[1][0][0], **TOL)
    torch.testing.assert_close(torch.cat(parts), want[0][0][0], **TOL)
    for i in range(2):
        state, got = our_step(model, ma, state, {r: [want[r][1][i]] for r in (1, 0)}, phase="decode")
        for r in prompts:
            torch.testing.assert_close(got[r], want[r][0][i + 1], **TOL)


def test_greedy_generate_matches_transformers_generate(pair):
    name, hf, model = pair
    prompt = prompt_of(9, seed=7)
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10)
    _, out = generate(model.step, model.params, fa.ModelAttention(model.specs), new_state(model), {0: prompt},
                      max_new_tokens=10)
    assert out[0] == want[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_fnattn_generate_on_a_transformers_checkpoint_matches_transformers(name, tmp_path, capsys):
    """``fnattn generate --json`` (tokenizer.json, config.json, safetensors) gives transformers' greedy ids."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = hf_model(name, seed=3, vocab_size=300)
    hf.save_pretrained(tmp_path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the cat sat on the mat", "a pure function"], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    prompt = tok.encode("the cat sat").ids
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path), "--prompt", "the cat sat", "--max-new-tokens", "8",
                 "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["completions"]
    assert row["ids"] == want[0, len(prompt):].tolist()


def test_config_reads_each_family(pair):
    name, hf, model = pair
    cfg = model.config
    assert cfg.qk_norm == (name == "qwen3") and len(model.specs) == 2
    assert cfg.qkv_bias == (name in ("qwen2", "llama_bias_tied")) and cfg.o_bias == (name == "llama_bias_tied")
    assert dict(cfg.rope)["rope_type"] == ("llama3" if name == "llama" else "default")
    spec = model.specs[0].config
    assert (spec.num_q_heads, spec.num_kv_heads, spec.head_dim) == (4, 2, 16)


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen2"])
def test_random_model_and_demo(name, capsys):
    model = random_model(name)
    assert {s.kind for s in model.specs} == {"full"} and model.config.model_type == name
    assert main(["demo", "--model", name, "--tokens", "3"]) == 0
    assert "generated token ids" in capsys.readouterr().out


@pytest.mark.parametrize("name, changes, field", [
    ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "rope_parameters.rope_type"),
    ("llama", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    ("llama", dict(mlp_bias=True), "mlp_bias"),
    ("llama", dict(hidden_act="gelu"), "hidden_act"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), "use_sliding_window"),
    ("qwen3", dict(layer_types=["full_attention", "sliding_attention"]), "layer_types[1]"),
    ("qwen3", dict(num_key_value_heads=3), "num_attention_heads"),
])
def test_unsupported_configs_name_the_field(name, changes, field):
    fam = family_named(name)
    with pytest.raises(ValueError, match=re.escape(f"`{field}`")):
        fam.adapt({**fam.tiny_config(), **changes})


def test_legacy_rope_scaling_and_top_level_theta():
    fam = family_named("llama")
    raw = {k: v for k, v in fam.tiny_config().items() if k != "rope_parameters"}
    cfg = fam.adapt({**raw, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8.0,
                     "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})
    rope = dict(cfg.rope)
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0
    assert dict(fam.adapt({**raw, "model_type": "qwen2"}).rope)["rope_theta"] == 10000.0
