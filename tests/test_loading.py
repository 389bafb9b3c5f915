"""Loading checkpoint directories (Qwen3-Next and Qwen3.5 saved by transformers) and `fnattn generate`.

Sharded and unsharded saves load the same params; a missing or mis-shaped
tensor is refused with its name; the CLI streams the text of the greedy
tokens transformers generates.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from fnattn.models.loading import CheckpointError
from fnattn.models.registry import load_model
from safetensors.torch import load_file, save_file
from test_model_qwen import hf_checkpoint, hf_greedy, hf_model, hf_torch_path  # noqa: F401 (a fixture)

from fnattn.cli import main  # imported before any test captures sys.stdout / sys.stderr

# transformers' GDN on its pure-torch path for every test here (the fixture lives in test_model_qwen).
pytestmark = pytest.mark.usefixtures("hf_torch_path")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One Qwen3-Next model saved whole and in several shards."""
    whole, sharded = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("sharded")
    hf_checkpoint("qwen3_next", whole)
    hf_checkpoint("qwen3_next", sharded, max_shard_size="60KB")
    return whole, sharded


def tensors(obj, path="params"):
    """Every tensor in a params tree, by its path."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            yield from tensors(x, f"{path}[{i}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors(getattr(obj, f.name), f"{path}.{f.name}")


def test_sharded_and_unsharded_checkpoints_load_the_same_params(saved):
    whole, sharded = saved
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (sharded / "model.safetensors").exists()
    a, b = dict(tensors(load_model(whole).params)), dict(tensors(load_model(sharded).params))
    assert a.keys() == b.keys() and len(a) > 50
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_missing_tensor_is_named(saved, tmp_path):
    whole, _ = saved
    (tmp_path / "config.json").write_text((whole / "config.json").read_text())
    weights = load_file(whole / "model.safetensors")
    del weights["model.layers.1.self_attn.k_norm.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.k_norm\.weight' is missing"):
        load_model(tmp_path)


def test_misshaped_tensor_in_a_shard_is_named(saved, tmp_path):
    _, sharded = saved
    name = "model.layers.0.linear_attn.in_proj_ba.weight"
    for f in sharded.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    shard = tmp_path / json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"][name]
    weights = load_file(shard)
    weights[name] = weights[name][:-1]  # one row short: [7, 64]
    save_file(weights, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name.replace('.', '[.]')}' has shape \(7, 64\), expected \(8, 64\)"):
        load_model(tmp_path)


SENTENCES = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "attention is a pure function of its inputs",
    "state changes come back as values",
    "the driver applies every delta once per step",
]


def test_generate_streams_the_text_of_the_transformers_greedy_tokens(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    # No special tokens: every id the model can produce decodes to a word.
    tokenizer.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=[]))
    vocab = tokenizer.get_vocab_size()
    assert 20 < vocab < 64
    hf = hf_model("qwen3_5", seed=11, vocab_size=vocab)
    hf.save_pretrained(tmp_path)
    tokenizer.save(str(tmp_path / "tokenizer.json"))

    prompt = "the driver applies every delta"
    _, want = hf_greedy(hf, tokenizer.encode(prompt).ids, 5)
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path), "--prompt", prompt, "--tokens", "5"]) == 0
    out = capsys.readouterr()
    assert out.out == prompt + tokenizer.decode(want)
    assert tokenizer.encode(out.out[len(prompt):]).ids == want
    assert "[5 tokens" in out.err
