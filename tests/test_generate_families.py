"""``fnattn generate`` on a transformers-written tiny checkpoint of every family gives transformers' text.

Each family's tiny parity config (from its test module) is built as the transformers
causal LM with random weights, saved with ``save_pretrained`` next to the byte-level
BPE tokenizer.json that tests/test_generation.py trains (the `bpe` fixture), and run
through ``fnattn.cli.main(["generate", ..., "--json"])``: greedy, then sampled with
a fixed seed, where transformers' ``generate(do_sample=True)`` draws from the global
CPU generator seeded with the same seed (fnattn's `Sampler` applies the same warpers
in the same order and draws once per step). Ids and text must be equal.

Also: the sampling defaults of generation_config.json, and explicit options winning.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_generation import bpe  # noqa: F401 (a fixture: the trained byte-level BPE tokenizer)

from fnattn.cli import main  # imported before any test captures sys.stderr (cli binds it as a default)

transformers = pytest.importorskip("transformers")

PROMPT, NEW = "the café sat on the mat", 8
SAMPLED = dict(temperature=0.8, top_k=20, top_p=0.9, seed=3)


def _qwen(name):
    def build(vocab, seed):
        from test_model_qwen import hf_model

        return hf_model(name, seed=seed, vocab_size=vocab)
    return build


def _deepseek(name):
    def build(vocab, seed):
        from test_model_deepseek import HF, randomize_, tiny_raw

        config_cls, model_cls = HF[name]
        kwargs = {k: v for k, v in tiny_raw(name).items() if k != "model_type"}
        config = config_cls(**{**kwargs, "vocab_size": vocab}, attn_implementation="eager",
                            experts_implementation="eager")
        torch.manual_seed(seed)
        model = model_cls(config).eval()
        randomize_(model, seed)
        return model
    return build


def _deepseek_v4(vocab, seed):
    from test_model_deepseek_v4 import hf_model, tiny_raw

    # No eos (transformers' default for V4 is id 1, which these random weights pick): 8 tokens in both.
    return hf_model(tiny_raw(vocab_size=vocab, eos_token_id=None), seed)


def _kimi(vocab, seed):
    from test_model_kimi import MAIN, build_hf

    return build_hf({**MAIN, "vocab_size": vocab}, seed)


def _llama(name):
    def build(vocab, seed):
        from test_model_llama import hf_model

        return hf_model(name, seed=seed, vocab_size=vocab)
    return build


# family (as registered) -> builder of its tiny transformers model; qwen3_5_moe is read by the qwen3_5 family.
BUILDERS = {
    "qwen3_5": _qwen("qwen3_5"),
    "qwen3_5_moe": _qwen("qwen3_5_moe"),
    "qwen3_next": _qwen("qwen3_next"),
    "deepseek_v3": _deepseek("deepseek_v3"),
    "deepseek_v32": _deepseek("deepseek_v32"),
    "glm5": _deepseek("glm5"),
    "deepseek_v4": _deepseek_v4,
    "kimi_linear": _kimi,
    "llama": _llama("llama"),
    "qwen3": _llama("qwen3"),
    "qwen2": _llama("qwen2"),
}


@pytest.fixture(scope="module")
def torch_paths():
    """transformers' pure-torch GDN and KDA paths (fla may be installed without a GPU)."""
    from hf_recurrent import _GDN_TORCH_PATH, _KDA_TORCH_PATH, _force_torch_path
    from transformers.models.kimi_linear import modeling_kimi_linear
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
    from transformers.models.qwen3_next import modeling_qwen3_next

    with pytest.MonkeyPatch.context() as mp:
        for module in (modeling_qwen3_5, modeling_qwen3_5_moe, modeling_qwen3_next):
            _force_torch_path(mp, module, _GDN_TORCH_PATH)
        _force_torch_path(mp, modeling_kimi_linear, _KDA_TORCH_PATH)
        yield


def checkpoint(name, path, tokenizer, *, seed=0):
    """The transformers model of ``name`` saved to ``path`` with ``tokenizer`` as tokenizer.json."""
    hf = BUILDERS[name](tokenizer.get_vocab_size(), seed)
    hf.save_pretrained(path)
    (path / "generation_config.json").unlink(missing_ok=True)  # no defaults: the options alone decide
    tokenizer.save(str(path / "tokenizer.json"))
    return hf


@pytest.fixture(scope="module", params=list(BUILDERS))
def family(request, torch_paths, bpe, tmp_path_factory):  # noqa: F811
    path = tmp_path_factory.mktemp(request.param)
    return request.param, checkpoint(request.param, path, bpe, seed=len(request.param)), path


def fnattn_generate(path, capsys, *options):
    capsys.readouterr()
    assert main(["generate", "--model", str(path), "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--json",
                 *options]) == 0
    [row] = json.loads(capsys.readouterr().out)["completions"]
    return row


def hf_generate(hf, ids, **kw):
    seed = kw.pop("seed", 0)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, **kw)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_generate_matches_transformers(family, bpe, capsys, mode):  # noqa: F811
    name, hf, path = family
    ids = bpe.encode(PROMPT).ids
    if mode == "greedy":
        want = hf_generate(hf, ids, do_sample=False)
        row = fnattn_generate(path, capsys)
    else:
        want = hf_generate(hf, ids, do_sample=True, **SAMPLED)
        row = fnattn_generate(path, capsys, *[f"--{k.replace('_', '-')}={v}" for k, v in SAMPLED.items()])
        assert want != hf_generate(hf, ids, do_sample=False), name  # the draws decided some tokens
    assert row["prompt_ids"] == ids
    assert row["ids"] == want, name
    assert row["text"] == bpe.decode(want), name


# generation_config.json's sampling fields -> what transformers' generate uses with no options.
GEN_CONFIGS = [
    dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9),
    dict(do_sample=True, temperature=1.2, min_p=0.05),  # top_k: transformers' default of 50
    dict(do_sample=False, temperature=0.7, top_k=5),  # greedy: the file's temperature is not used
]


@pytest.fixture(scope="module")
def llama_dir(bpe, tmp_path_factory):  # noqa: F811
    path = tmp_path_factory.mktemp("llama_gen")
    return checkpoint("llama", path, bpe, seed=11), path


@pytest.mark.parametrize("gen", GEN_CONFIGS, ids=["top_k_top_p", "min_p", "greedy"])
def test_generation_config_sampling_defaults_match_transformers(llama_dir, bpe, capsys, gen):  # noqa: F811
    hf, path = llama_dir
    (path / "generation_config.json").write_text(json.dumps(gen))
    hf.generation_config = transformers.GenerationConfig.from_pretrained(path)
    ids = bpe.encode(PROMPT).ids
    want = hf_generate(hf, ids, seed=5)
    row = fnattn_generate(path, capsys, "--seed", "5")
    assert row["ids"] == want and row["text"] == bpe.decode(want)
    if gen["do_sample"]:  # the file sampled: the greedy ids differ
        assert want != hf_generate(hf, ids, do_sample=False)


def test_explicit_options_win_over_generation_config(llama_dir, bpe, capsys):  # noqa: F811
    hf, path = llama_dir
    hf.generation_config = transformers.GenerationConfig()  # the kwargs below alone, not an earlier file
    (path / "generation_config.json").write_text(json.dumps(dict(do_sample=True, temperature=1.5, top_k=3,
                                                                 top_p=0.5, min_p=0.2)))
    ids = bpe.encode(PROMPT).ids
    greedy = hf_generate(hf, ids, do_sample=False)
    assert fnattn_generate(path, capsys, "--temperature", "0")["ids"] == greedy
    want = hf_generate(hf, ids, do_sample=True, temperature=0.9, top_k=40, top_p=1.0, min_p=0.0, seed=2)
    row = fnattn_generate(path, capsys, "--temperature", "0.9", "--top-k", "40", "--top-p", "1", "--min-p", "0",
                          "--seed", "2")
    assert row["ids"] == want
    # Options not given still come from the file: here top_k 3, top_p 0.5 and min_p 0.2.
    want = hf_generate(hf, ids, do_sample=True, temperature=0.9, top_k=3, top_p=0.5, min_p=0.2, seed=2)
    assert fnattn_generate(path, capsys, "--temperature", "0.9", "--seed", "2")["ids"] == want


@pytest.mark.parametrize("gen, field", [(dict(do_sample="yes"), "do_sample"), (dict(temperature=-1), "temperature"),
                                        (dict(top_k=1.5), "top_k"), (dict(top_p=0), "top_p"),
                                        (dict(min_p=2), "min_p")])
def test_bad_generation_config_field_exits_2_naming_it(llama_dir, capsys, gen, field):
    _, path = llama_dir
    (path / "generation_config.json").write_text(json.dumps(gen))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(path), "--prompt", PROMPT, "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "generation_config.json" in err and f"`{field}`" in err
    assert len(err.strip().splitlines()) == 1
