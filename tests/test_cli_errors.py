"""`fnattn generate` end to end on a small checkpoint written here, and every user mistake as one line + exit 2.

The checkpoint is a Qwen3.5 tiny config with seeded random weights saved as
safetensors, and a byte-level BPE tokenizer covering its whole vocabulary.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from fnattn.models.registry import family_named, random_weights
from safetensors.torch import save_file

from fnattn.cli import main

VOCAB = 320
SENTENCES = ["the café sat on the mat", "naïve résumé déjà vu", "中文 字符 测试", "emoji 🎉🚀 party",
             "attention is a pure function of its inputs"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("ckpt")
    fam = family_named("qwen3_5")
    raw = {**fam.tiny_config(), "vocab_size": VOCAB, "max_position_embeddings": 96}
    (path / "config.json").write_text(json.dumps(raw))
    save_file(random_weights(fam.weight_shapes(fam.adapt(raw)), seed=3), path / "model.safetensors")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == VOCAB
    tok.save(str(path / "tokenizer.json"))
    return path


def run_json(capsys, *argv) -> list[dict]:
    capsys.readouterr()
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["completions"]


def test_several_prompts_json_and_the_tokens_alias(ckpt, capsys):
    rows = run_json(capsys, "--model", str(ckpt), "--prompt", "the cat", "--prompt", "中文", "--tokens", "5")
    assert [r["prompt"] for r in rows] == ["the cat", "中文"]
    for r in rows:
        assert len(r["ids"]) == 5 and r["finish_reason"] == "length"
        assert r["timings"]["first_token_s"] <= r["timings"]["finished_s"]
    alone = run_json(capsys, "--model", str(ckpt), "--prompt", "中文", "--max-new-tokens", "5")
    assert alone[0]["ids"] == rows[1]["ids"]  # batching does not change greedy tokens
    # One request at a time: the second waits for the first to finish; the tokens are the same.
    queued = run_json(capsys, "--model", str(ckpt), "--prompt", "the cat", "--prompt", "中文", "--tokens", "5",
                      "--max-batch", "1")
    assert [r["ids"] for r in queued] == [r["ids"] for r in rows]
    assert queued[1]["timings"]["first_token_s"] >= queued[0]["timings"]["finished_s"]
    # Mixed: the third prompt is prefilled, two tokens a step, inside the running ones' decode steps.
    three = ["--prompt", "the cat", "--prompt", "中文", "--prompt", "a dog sat", "--tokens", "5"]
    mixed = run_json(capsys, "--model", str(ckpt), *three, "--max-batch", "2", "--mixed", "--chunk", "2")
    plain = run_json(capsys, "--model", str(ckpt), *three, "--max-batch", "2")
    assert [r["ids"] for r in mixed] == [r["ids"] for r in plain]
    assert [r["ids"] for r in mixed[:2]] == [r["ids"] for r in rows]


def test_single_prompt_streams_the_decoded_text(ckpt, capsys):
    from tokenizers import Tokenizer

    [row] = run_json(capsys, "--model", str(ckpt), "--prompt", "the cat", "--max-new-tokens", "6")
    assert main(["generate", "--model", str(ckpt), "--prompt", "the cat", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr()
    assert out.out == "the cat" + Tokenizer.from_file(str(ckpt / "tokenizer.json")).decode(row["ids"])
    assert "[6 tokens" in out.err


def test_seeded_sampling_repeats_and_stop_strings_cut(ckpt, capsys):
    args = ["--model", str(ckpt), "--prompt", "the cat", "--max-new-tokens", "12", "--temperature", "1.0",
            "--top-k", "50", "--top-p", "0.9", "--min-p", "0.01", "--seed", "4"]
    a, b = run_json(capsys, *args), run_json(capsys, *args)
    assert a[0]["ids"] == b[0]["ids"]
    text = a[0]["text"]
    stop = text[len(text) // 2:][:2].strip() or text[-1]
    [cut] = run_json(capsys, *args, "--stop", stop, "--stop", "never-appears")
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.find(stop)]


def test_eos_from_generation_config_stops(ckpt, tmp_path, capsys):
    [row] = run_json(capsys, "--model", str(ckpt), "--prompt", "the cat", "--max-new-tokens", "4")
    copy = tmp_path / "eos"
    shutil.copytree(ckpt, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [row["ids"][1], VOCAB + 5]}))
    [stopped] = run_json(capsys, "--model", str(copy), "--prompt", "the cat", "--max-new-tokens", "4")
    assert stopped["ids"] == row["ids"][:2] and stopped["finish_reason"] == "eos"


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("fnattn ")


def _broken(ckpt, tmp_path, what: str):
    """A copy of the checkpoint with one defect; ``-> its directory``."""
    d = tmp_path / what
    shutil.copytree(ckpt, d)
    weights = d / "model.safetensors"
    if what == "no_config":
        (d / "config.json").unlink()
    elif what == "bad_json":
        (d / "config.json").write_text("{not json")
    elif what == "list_json":
        (d / "config.json").write_text("[1, 2]")
    elif what == "no_weight_map":
        weights.unlink()
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    elif what == "truncated":
        weights.write_bytes(weights.read_bytes()[:2000])
    elif what == "not_safetensors":
        weights.write_bytes(b"PK\x03\x04 this is a zip file, not safetensors" * 10)
    elif what == "int_weights":
        from safetensors.torch import load_file

        tensors = load_file(weights)
        name = next(iter(tensors))
        tensors[name] = tensors[name].to(torch.int32)
        save_file(tensors, weights)
    elif what == "bad_eos":
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    return d


@pytest.mark.parametrize("what, names", [
    ("no_config", "no config.json"),
    ("bad_json", "config.json: not valid JSON"),
    ("list_json", "config.json: must hold a JSON object, got a list"),
    ("no_weight_map", "model.safetensors.index.json: `weight_map`"),
    ("truncated", "model.safetensors: not a readable safetensors file"),
    ("not_safetensors", "model.safetensors: not a readable safetensors file"),
    ("int_weights", "has dtype torch.int32, expected a floating-point dtype"),
    ("bad_eos", "generation_config.json: `eos_token_id`"),
])
def test_broken_checkpoints_exit_2_with_one_line(ckpt, tmp_path, capsys, what, names):
    d = _broken(ckpt, tmp_path, what)
    expect_one_line(capsys, ["generate", "--model", str(d), "--prompt", "hi"], names)


def expect_one_line(capsys, argv, names: str):
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert names in err, err


BAD_OPTIONS = [
    (["--page-size", "0"], "--page-size: must be an int in [1, 65536], got 0"),
    (["--page-size", "-4"], "--page-size: must be an int in [1, 65536], got -4"),
    (["--page-size", "x"], "--page-size: must be an int, got 'x'"),
    (["--max-new-tokens", "1000000000000"], "--max-new-tokens"),
    (["--tokens", "0"], "--max-new-tokens/--tokens"),
    (["--max-new-tokens", "95"], "max_position_embeddings (96)"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--min-p", "2"], "--min-p"),
    (["--top-k", "-1"], "--top-k"),
    (["--seed", "-3"], "--seed"),
    (["--device", "tpu"], "--device"),
    (["--device", "cuda:99" if torch.cuda.is_available() else "cuda"], "--device"),
    (["--stop", ""], "fnattn generate: error: argument --stop: must be a non-empty string, got ''"),
    (["--device", "cpu:1"], "--device: must be cpu or cuda[:N] (the CPU has one device), got 'cpu:1'"),
    (["--max-batch", "0"], "--max-batch"),
    (["--chunk", "0"], "--chunk"),
    (["--sampler", "flashinfer"], "--sampler flashinfer needs --device cuda"),
    (["--sampler", "curand"], "--sampler"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "--prompts-file /nonexistent/prompts.txt"),
]


@pytest.mark.parametrize("extra, names", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_bad_options_exit_2_with_one_line(ckpt, capsys, extra, names):
    expect_one_line(capsys, ["generate", "--model", str(ckpt), "--prompt", "the cat", *extra], names)


def test_a_prompts_file_that_is_not_utf8_is_named_with_the_bad_byte(ckpt, tmp_path, capsys):
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"the cat\n\xffnot utf-8\n")
    expect_one_line(capsys, ["generate", "--model", str(ckpt), "--prompts-file", str(bad)],
                    f"fnattn generate: error: --prompts-file {bad}: must be UTF-8 text, got byte 0xff at offset 8")


def test_missing_directory_and_demo_options(tmp_path, capsys):
    expect_one_line(capsys, ["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"], "not a directory")
    expect_one_line(capsys, ["demo", "--page-size", "0"], "--page-size")
    expect_one_line(capsys, ["demo", "--tokens", "1000000000000"], "--tokens")
    expect_one_line(capsys, ["generate", "--model", str(tmp_path)], "--prompt")


@pytest.mark.parametrize("field, value, names", [
    ("rope_theta", float("nan"), "`rope_theta` must be a finite number > 0, got nan"),
    ("rope_theta", 0, "`rope_theta` must be a finite number > 0, got 0"),
    ("rms_norm_eps", -1e-6, "`rms_norm_eps` must be a finite number >= 0"),
    ("hidden_size", 64.5, "`hidden_size` must be an int >= 1, got 64.5"),
])
def test_bad_config_values_exit_2_with_one_line(ckpt, tmp_path, capsys, field, value, names):
    d = tmp_path / "bad_value"
    shutil.copytree(ckpt, d)
    raw = json.loads((d / "config.json").read_text())
    (raw["rope_parameters"] if field == "rope_theta" else raw)[field] = value
    (d / "config.json").write_text(json.dumps(raw))  # NaN is written as the JSON extension `NaN`
    expect_one_line(capsys, ["generate", "--model", str(d), "--prompt", "hi"], names)


def test_prompts_sharing_a_prefix_share_pages_and_report_the_hit_rate(ckpt, capsys):
    # A recurrent model (this checkpoint is Qwen3.5) shares only a holder's whole prompt, at its cursor.
    long = "the cat sat on the mat and the dog sat on the log " * 2
    argv = ["generate", "--model", str(ckpt), "--prompt", long, "--prompt", long + "中文",
            "--max-new-tokens", "4", "--page-size", "1", "--json"]
    capsys.readouterr()
    assert main(argv) == 0
    shared = json.loads(capsys.readouterr().out)
    assert main([*argv, "--no-prefix-sharing"]) == 0
    cold = json.loads(capsys.readouterr().out)
    assert [r["ids"] for r in shared["completions"]] == [r["ids"] for r in cold["completions"]]
    assert shared["stats"]["prefix_hit_rate"] > 0.2 and cold["stats"]["prefix_hit_rate"] == 0
    assert main(argv[:-1]) == 0
    assert "prefix hit rate" in capsys.readouterr().err


def test_a_closed_pipe_ends_the_command_without_a_traceback():
    import subprocess
    import sys

    r = subprocess.run(f"{sys.executable} -m fnattn demo --tokens 2 | head -1", shell=True, capture_output=True,
                       text=True, timeout=120)
    assert r.stdout.startswith("fnattn demo:") and "Traceback" not in r.stderr, r.stderr


def _family_names() -> list[str]:
    from fnattn.models.registry import FAMILIES, _load_builtin

    _load_builtin()
    return sorted(FAMILIES)


DEMO_MISTAKES = [
    (["--model", "gpt2"], "fnattn demo: error: argument --model: must be tiny or a model family of ["),
    (["--model", "bogus"], "got 'bogus'"),
    (["--model", "qwen3_5_moe"], "read by family qwen3_5: give --model qwen3_5"),
    (["--prompt", ""], "fnattn demo: error: argument --prompt: must be a non-empty string, got ''"),
    (["--mtp", "-1"], "fnattn demo: error: argument --mtp: must be an int >= 0, got -1"),
    (["--device", "cpu:1"], "fnattn demo: error: argument --device: must be cpu or cuda[:N]"),
    (["--seed", str(2**64)], f"fnattn demo: error: argument --seed: must be an int in [0, 2**63), got {2**64}"),
    (["--tokens", "2", "surplus"], "fnattn demo: error: unrecognized arguments: surplus"),
    (["--mtp", "1", "--model", "llama"], "fnattn demo: error: --mtp 1: --model must be tiny or a family with a "
                                         "draft model"),
]


@pytest.mark.parametrize("extra, names", DEMO_MISTAKES, ids=[" ".join(a) for a, _ in DEMO_MISTAKES])
def test_demo_mistakes_exit_2_with_one_line_naming_the_option(capsys, extra, names):
    expect_one_line(capsys, ["demo", "--tokens", "2", *extra], names)


def test_an_unknown_demo_model_lists_every_family_of_the_registry(capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["demo", "--model", "gpt2"])
    err = capsys.readouterr().err
    assert str(_family_names()) in err, err


def test_demo_help_lists_every_family_and_the_model_types_it_reads(capsys):
    from fnattn.models.registry import FAMILIES

    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name in _family_names():
        assert name in text and all(t in text for t in FAMILIES[name].model_types), name
    assert "deepseek_v4" in text and "qwen3_5_moe" in text


def test_no_command_prints_the_usage_and_the_commands(capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith("usage: fnattn")
    for command in ("demo", "generate", "bench"):
        assert f"\n    {command} " in err, err
    assert err.splitlines()[-1] == "fnattn: error: a command is required: one of demo, generate, bench"


@pytest.mark.parametrize("argv, line", [
    (["--bogus"], "fnattn: error: unrecognized arguments: --bogus"),
    (["--bogus", "demo"], "fnattn: error: unrecognized arguments: --bogus"),
    (["generate", "--model", "x", "--prompt", "a", "b"], "fnattn generate: error: unrecognized arguments: b"),
])
def test_unrecognized_words_are_named_by_the_parser_they_were_given_to(capsys, argv, line):
    expect_one_line(capsys, argv, line)


def test_cpu_0_is_the_cpu():
    from fnattn.cli import _device

    assert _device("cpu:0") == "cpu" and _device("cpu") == "cpu"


def test_version_and_help_import_no_torch():
    # `fnattn --version` / `--help` answer at once: torch and the heavy modules load only in the commands
    # that need them (`demo --help` loads the model registry to list its families).
    import subprocess
    import sys

    code = """
import contextlib, io, sys
from fnattn.cli import main
for argv in (["--version"], ["--help"], ["generate", "--help"], ["bench", "--help"], []):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
print(sorted(m for m in ("torch", "triton", "numpy", "fnattn.models", "fnattn.state") if m in sys.modules))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
