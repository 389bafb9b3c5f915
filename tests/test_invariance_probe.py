"""benchmarks/invariance_probe.py on the tiny model: no difference where the reference path holds the mode, and
the first differing (step, layer, field) named where request 0's own tokens differ."""

import json
import sys

import torch
from helpers import benchmark_module

import fnattn as fa
import fnattn.switches


def test_the_reference_path_shows_no_difference(monkeypatch, capsys):
    torch.set_num_threads(1)
    monkeypatch.setattr(sys, "argv", ["invariance_probe.py", "--shape", "tiny", "--layers", "4", "--others", "3",
                                      "--steps", "3", "--device", "cpu"])
    assert benchmark_module("invariance_probe").main() == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["first_difference"] is None and out["rows_compared"] > 3 * 4


def test_a_difference_is_named_by_step_layer_and_field():
    from fnattn.models.registry import random_model

    probe = benchmark_module("invariance_probe")
    model = random_model("qwen3_5", seed=0, dtype=torch.bfloat16)
    with fnattn.switches.set(invariant=True):
        attn = fa.ModelAttention(model.specs)
        a = probe.greedy_trace(model, attn, {0: [5, 17, 9]}, 2, "cpu")
        b = probe.greedy_trace(model, attn, {0: [5, 17, 8]}, 2, "cpu")  # another context: differs at once
    assert [t[:3] for t in a] == [t[:3] for t in b]
    step, layer, field, _ = next(x for x, y in zip(a, b) if not torch.equal(x[3], y[3]))
    assert (step, layer) == (0, 0) and field.startswith("inputs.")


def test_a_switch_that_is_not_one_exits_2_naming_it(monkeypatch, capsys):
    import pytest

    for item in ("nosuch=on", "pdl=maybe"):
        monkeypatch.setattr(sys, "argv", ["invariance_probe.py", "--switch", item, "--device", "cpu"])
        with pytest.raises(SystemExit) as exit_:
            benchmark_module("invariance_probe").main()
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "--switch: expected NAME=on|off with NAME one of" in err and repr(item) in err
