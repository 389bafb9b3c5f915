"""``fnattn bench invariance`` and ``--invariant`` on the command line."""

import json
import subprocess
import sys

import pytest
import torch
from fnattn.models.registry import random_model
from helpers import registry_scope

import fnattn as fa
from fnattn import registry
from fnattn.bench import invariance
from fnattn.bench.invariance import summary


def fnattn(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fnattn", *args], capture_output=True, text=True, cwd=cwd,
                          env={**__import__("os").environ, "FNATTN_THREADS": "1"})


def test_bench_invariance_records_every_figure_with_the_mode_off_and_on(tmp_path):
    out = tmp_path / "inv.json"
    r = fnattn("bench", "invariance", "--family", "qwen3_5", "--batch", "1", "2", "--new-tokens", "4", "--steps",
               "2", "--prompt", "40", "--out", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("fnattn bench invariance --family qwen3_5")
    off, on, total = doc["records"]
    assert (off["invariant"], on["invariant"]) == (False, True)
    assert off["prompt"] == on["prompt"] == 40  # the timed decode step's context
    assert on["verify_equals_decode"] and on["speculative_equals_greedy"] and on["batch_invariant"]
    assert on["oracle_acceptance"] == 1.0 and on["graph_equals_eager"] is None  # no graphs on a CPU
    assert on["batch_invariant_sizes"] == [2, 3]
    assert off["verify_equals_decode"] is False  # bf16 Qwen3.5 without the mode: verify rounds otherwise
    assert set(on["invariant_cost_by_batch"]) == {"1", "2"} and on["invariant_cost"] > 0
    assert total == {**summary([off, on]), "families": ["qwen3_5"]} | {"invariant_cost": total["invariant_cost"]}
    assert total["speculative_equals_greedy"] is True and json.loads(r.stdout.strip().splitlines()[-1]) == total


@pytest.mark.parametrize("args, message", [
    (["--family", "gpt9"], "--family must be 'all' or one of"),
    (["--batch", "0"], "--batch values must be >= 1"),
    (["--shape", "huge"], "--shape: must be one of"),
    (["--prompt", "16", "512"], "--prompt: invariance times one context, got 2 values"),
    (["--prompt", "0"], "--prompt values must be >= 1"),
])
def test_bench_invariance_refuses_bad_options_in_one_line(args, message, capsys):
    from fnattn.cli import main

    assert main(["bench", "invariance", *args, "--new-tokens", "2", "--out", "/dev/null"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_invariant_is_an_option_of_demo_and_generate():
    for command in ("demo", "generate"):
        assert "--invariant" in fnattn(command, "--help").stdout
    r = fnattn("demo", "--model", "qwen3_5", "--tokens", "3", "--invariant", "--mtp", "2")
    assert r.returncode == 0 and "generated token ids" in r.stdout, r.stderr


def test_speculative_figures_hold_when_requests_accept_at_different_rates(monkeypatch):
    """A request that accepts every draft runs ahead of one that accepts none: it leaves once it has its tokens,
    so its oracle never runs past the plain ids (the 0.8B shape with the mode off once failed so)."""
    import torch
    from fnattn.models.registry import family_named, random_model

    import fnattn.bench.invariance as inv
    from fnattn.bench.model import config_for

    fam = family_named("qwen3_5")
    model = random_model("qwen3_5", seed=0, dtype=torch.float32, device="cpu", config=config_for("qwen3_5", "tiny"))
    draft = fam.draft(model.config, model.params, None, seed=1)
    real, vocab = inv.generate, model.config.vocab_size

    def plain_of_request_1_wrong(*args, **kw):
        state, plain = real(*args, **kw)
        return state, {**plain, 1: plain[1][:1] + [(t + 1) % vocab for t in plain[1][1:]]}

    monkeypatch.setattr(inv, "generate", plain_of_request_1_wrong)
    same, accepted, proposed = inv.speculative(fam, model, draft, "cpu", k=3, tokens=6)
    assert not same  # request 1's oracle was wrong
    assert 0 < accepted < proposed


def test_bench_invariance_cost_only_times_the_step_and_leaves_the_properties_out(tmp_path):
    out = tmp_path / "cost.json"
    r = fnattn("bench", "invariance", "--family", "llama", "--batch", "1", "2", "--steps", "2", "--cost-only",
               "--out", str(out))
    assert r.returncode == 0, r.stderr
    off, on, total = json.loads(out.read_text())["records"]
    for rec in (off, on):
        assert set(rec["decode_us"]) == {"1", "2"} and "verify_equals_decode" not in rec
    assert on["invariant_cost"] == max(on["invariant_cost_by_batch"].values()) > 0
    assert total["batch_invariant"] is None and total["invariant_cost"] == on["invariant_cost"]


def test_its_states_take_the_page_size_the_chosen_backends_serve(monkeypatch):
    """A backend that serves one page size (FlashMLA's 64 at a released MLA shape) is chosen: every State the
    figures build has that size, so no session refuses their batches."""
    sizes = []
    state = fa.State

    def recording_state(*args, **kw):
        sizes.append(kw["page_size"])
        return state(*args, **kw)

    model = random_model("qwen3", seed=0, dtype=torch.float32)
    with registry_scope():
        for phase in ("prefill", "decode", "verify"):
            ref = registry.lookup("full", phase, "reference")

            def paged(spec, views, inputs, _ref=ref.source):
                return _ref(spec, views, inputs)

            fa.register("full", phase, "test_pages_of_64", supports=ref.supports, plan=ref.plan, page_size=64)(paged)
        assert fa.ModelAttention(model.specs).page_size == 64
        monkeypatch.setattr(fa, "State", recording_state)
        assert invariance.verify_equals_decode(model, "cpu") in (True, False)
        assert invariance.batch_invariant(model, "cpu", steps=2, sizes=(3,)) in (True, False)
    assert sizes and set(sizes) == {64}
