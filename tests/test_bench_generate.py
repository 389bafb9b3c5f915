"""``fnattn bench generate`` on a CPU (tiny shapes) and `Speculator`'s ``accept_hook``."""

import json

import pytest

import fnattn as fa
from fnattn.cli import main
from fnattn.speculative import Speculator


def test_bench_generate_records_every_figure(tmp_path, capsys):
    out = tmp_path / "gen.json"
    rc = main(["bench", "generate", "--family", "qwen3_5", "--batch", "1", "2", "--prompt", "12", "--long-prompt",
               "40", "--steps", "3", "--mix", "3", "5", "20", "4", "--draft-vocab", "40", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("fnattn bench generate --family qwen3_5")
    cases = [r["case"] for r in doc["records"]]
    assert cases == ["ttft eager", "prefill long eager", "decode", "decode", "decode eager",
                     *["mtp", "mtp draft vocab"] * 4,
                     "serving mix", "serving mix continuous", "serving mix mixed", "generate summary"]
    assert "--draft-vocab 40" in doc["command"]
    for case, vocab in (("mtp", None), ("mtp draft vocab", 40)):
        mtp = [r for r in doc["records"] if r["case"] == case]
        assert [(r["batch"], r["accept"], r["tokens_per_step"], r["draft_vocab"]) for r in mtp] == [
            (1, "all", 4.0, vocab), (1, "none", 1.0, vocab), (2, "all", 4.0, vocab), (2, "none", 1.0, vocab)]
    mix = doc["records"][-4]
    assert [r["mixed"] for r in doc["records"][-3:-1]] == [False, True] and doc["records"][-2]["running"] == 2
    assert doc["records"][-3]["mixed_steps"] == 0 and doc["records"][-2]["mixed_steps"] > 0
    assert mix["requests"] == 3 and mix["new_tokens"] == 12 and mix["tok_s"] > 0 and mix["busy_s"] > 0
    summary = doc["records"][-1]
    for name in ("ttft_ms", "prefill_long_tok_s", "eager_decode_ms", "mtp_oracle_speedup", "mtp_wrong_step_ratio",
                 "mtp_oracle_speedup_draft_vocab", "mtp_wrong_step_ratio_draft_vocab", "serving_tok_s",
                 "serving_busy_share", "serving_continuous_tok_s", "serving_mixed_tok_s"):
        assert summary[name] > 0, name
    assert "prefill_8192_tok_s" not in summary  # the long prompt was 40 tokens
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary


@pytest.mark.parametrize("args, says", [(["--mix", "3", "20", "5", "4"], "--mix LO must be <= HI"),
                                        (["--draft-vocab", "0"], "--draft-vocab values must be >= 1"),
                                        (["--draft-vocab", "1000"], "--draft-vocab must be at most the vocabulary")])
def test_bench_generate_refuses_bad_options_in_one_line(args, says, capsys):
    assert main(["bench", "generate", *args, "--out", "/dev/null"]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


def tiny():
    from fnattn.models import tiny as t

    cfg = t.TinyConfig(hidden_size=32, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=48, vocab_size=64)
    params = t.init_params(cfg, seed=3)
    return t, cfg, params


def speculator(accept_hook, k=3):
    t, cfg, params = tiny()

    def st(specs):
        return fa.State(specs, num_pages=40, page_size=8, max_requests=3)

    target, draft = t.layer_specs(cfg), t.draft_specs(cfg)
    return Speculator(target_step=t.step_hidden, target_params=params, target_attn=fa.ModelAttention(target),
                      target_state=st(target), draft_step=t.draft_step, draft_params=t.init_draft(cfg, params),
                      draft_attn=fa.ModelAttention(draft), draft_state=st(draft), num_draft=k,
                      accept_hook=accept_hook)


def test_accept_hook_forces_the_counts_and_the_bonus_is_the_targets_choice_after_them():
    spec = speculator(lambda step, accepted: {r: 1 + (step + r) % 4 for r in accepted})
    spec.start({0: [5, 17, 9], 1: [8, 1, 4, 2]})
    for step in range(4):
        emitted = spec.step()
        assert {r: len(t) for r, t in emitted.items()} == {r: 1 + (step + r) % 4 for r in (0, 1)}


@pytest.mark.parametrize("bad", [0, 5, True, "2"])
def test_accept_hook_counts_outside_1_to_k_plus_1_are_refused_by_name(bad):
    spec = speculator(lambda step, accepted: {r: bad for r in accepted})
    spec.start({0: [5, 17, 9]})
    with pytest.raises(ValueError, match=r"Speculator.accept_hook: `accepted\[0\]` must be an int in 1..4"):
        spec.step()
