"""benchmarks/model_ab.py's plan: the defaults, then each toggle flipped from its default, under its switch."""


from helpers import benchmark_module

from fnattn.kernels import _triton
from fnattn.models import fused


def _module():
    return benchmark_module("model_ab")


def test_each_toggle_is_flipped_from_its_default_and_switched_while_traced():
    ab = _module()
    plan = ab.variants(["pdl", "swiglu_epilogue"])
    assert [values for _, values in plan] == [{}, {"pdl": not _triton._PDL[-1]},
                                              {"swiglu_epilogue": not fused._SWIGLU_EPILOGUE[-1]}]
    assert plan[0][0] == "defaults" and plan[2][0].startswith("swiglu_epilogue=off")
    before = (_triton._PDL[-1], fused._SWIGLU_EPILOGUE[-1])
    with ab.switched({"pdl": False, "swiglu_epilogue": False}):
        assert (_triton._PDL[-1], fused._SWIGLU_EPILOGUE[-1]) == (False, False)
    assert (_triton._PDL[-1], fused._SWIGLU_EPILOGUE[-1]) == before


def test_joined_toggles_flip_together_and_unknown_names_are_refused():
    import pytest

    ab = _module()
    plan = ab.variants(["prefetch+own_norm_act"])
    assert plan[1][1] == {"prefetch": True, "own_norm_act": not fused._OWN_NORM_ACT[-1]}
    assert plan[1][0].startswith("prefetch=on + own_norm_act=")
    with pytest.raises(SystemExit, match="--toggle: expected names from .* got 'prefetch\\+nope'"):
        ab.variants(["prefetch+nope"])


def test_a_smoke_run_on_the_cpu_times_every_variant():
    """The tiny model, capture-free: one record per variant and batch, the defaults at ratio 1, each with
    the switches it ran under (the kernels of the switched paths need CUDA: here their torch bodies run)."""
    import torch

    torch.set_num_threads(1)
    ab = _module()
    records = ab.run_ab(["pdl", "own_norm_act+output_gates"], batches=[1, 2], steps=2, shape="tiny", device="cpu")
    assert [(r["case"], r["variant"].split(":")[0]) for r in records] == [
        (f"qwen3_5 tiny B{b} ctx512", v) for b in (1, 2)
        for v in ("defaults", "pdl=off", "own_norm_act=off + output_gates=off")]  # each toggle flips its default
    assert all(r["time_us"] > 0 for r in records)
    assert [r["ratio_to_defaults"] for r in records][::3] == [1.0, 1.0]
    assert records[2]["switches"] == {"own_norm_act": False, "output_gates": False}


def test_profile_steps_give_each_variant_its_own_profile_under_its_switches():
    """``--profile N``: each variant's record carries its profile (on a CPU, the torch ops of its steps); the
    variant whose switch routes a norm through another body shows other ops than the defaults."""
    import torch

    torch.set_num_threads(1)
    ab = _module()
    records = ab.run_ab(["invariant"], batches=[2], steps=1, shape="tiny", device="cpu", profile=2)
    assert [r["variant"].split(":")[0] for r in records] == ["defaults", "invariant=on"]
    for r in records:
        p = r["profile"]
        assert p["steps"] == 2 and p["device"] == "cpu" and p["busy_us"] > 0 and p["kernels"] > 0
        assert p["top"] and all(t["us_per_step"] >= 0 for t in p["top"])
    calls = [{t["name"]: t["per_step"] for t in r["profile"]["top"]} for r in records]
    assert calls[0] != calls[1]  # the invariant mode's bodies are not the defaults'


def test_each_variant_chooses_its_backends_under_its_own_switches(monkeypatch):
    """The invariant mode admits only the backends that honour it, and a session refuses the others while it
    is on: each variant's ModelAttention is built inside its switches, decode and prefill alike."""
    import torch
    from fnattn.kernels.invariant import invariant_on

    torch.set_num_threads(1)
    ab = _module()
    built = []
    real = ab.ModelAttention

    def recording(*args, **kwargs):
        built.append(invariant_on())
        return real(*args, **kwargs)

    monkeypatch.setattr(ab, "ModelAttention", recording)
    ab.run_ab(["invariant"], batches=[1], steps=1, shape="tiny", device="cpu")
    assert built == [False, True]
    built.clear()
    ab.run_ab(["invariant"], batches=[1], steps=1, shape="tiny", device="cpu", prefill=32)
    assert built == [False, True]


def test_a_variant_that_fails_is_recorded_and_the_others_still_run(monkeypatch):
    import torch

    torch.set_num_threads(1)
    ab = _module()

    def broken(on):
        raise RuntimeError("no such kernel here")

    monkeypatch.setitem(ab.TOGGLES, "broken", (broken, lambda: False, {True: "on", False: "off"}))
    records = ab.run_ab(["broken", "pdl"], batches=[1], steps=2, shape="tiny", device="cpu")
    assert [r["variant"].split(":")[0] for r in records] == ["broken=on", "defaults", "pdl=off"]
    assert records[0]["error"] == "RuntimeError: no such kernel here" and "time_us" not in records[0]


def test_prefill_steps_interleave_the_variants_too():
    """``--prefill``: eager prefill steps, one record per variant, under its switches (fla_direct has no fla
    here, so both run the same path: the plan and the records are what is checked)."""
    import torch

    torch.set_num_threads(1)
    ab = _module()
    records = ab.run_ab(["fla_direct"], batches=[1], steps=2, shape="tiny", device="cpu", prefill=64)
    assert [(r["case"], r["variant"].split(":")[0], r["phase"]) for r in records] == [
        ("qwen3_5 tiny prefill B1 P64", "defaults", "prefill"), ("qwen3_5 tiny prefill B1 P64", "fla_direct=off",
                                                                 "prefill")]
    assert records[1]["switches"] == {"fla_direct": False} and records[0]["ratio_to_defaults"] == 1.0
    # the defaults against themselves, round by round: 1.0, never faster; quartiles around the median
    assert records[0]["paired_ratio"] == 1.0 and records[0]["faster_rounds"] == 0.0
    assert all(r["quartiles_us"][0] <= r["quartiles_us"][1] and 0 <= r["faster_rounds"] <= 1 for r in records)
    assert all(r["time_us"] > 0 and r["tok_s"] > 0 for r in records)


def test_a_variant_whose_step_fails_leaves_the_state_live_for_the_others(monkeypatch):
    """The step raises after its tokens were reserved: the A/B goes on with that live state (a stale one
    would refuse the next variant's step)."""
    import contextlib

    import torch

    from fnattn.models import qwen3_5

    torch.set_num_threads(1)
    ab = _module()

    @contextlib.contextmanager
    def broken_step(on):
        def fail(*a, **k):
            raise RuntimeError("the step's kernel did not compile")

        with monkeypatch.context() as m:
            m.setattr(qwen3_5, "gate_up_silu", fail)
            yield

    monkeypatch.setitem(ab.TOGGLES, "broken_step", (broken_step, lambda: False, {True: "on", False: "off"}))
    records = ab.run_ab(["broken_step", "pdl"], batches=[1], steps=2, shape="tiny", device="cpu")
    assert [r["variant"].split(":")[0] for r in records] == ["broken_step=on", "defaults", "pdl=off"]
    assert records[0]["error"] == "RuntimeError: the step's kernel did not compile"
    assert all(r["time_us"] > 0 for r in records[1:])


def test_another_family_runs_its_own_shape_with_grouped_experts():
    """``--family deepseek_v32 --shape tiny``: its records name the family and context; the grouped experts'
    variant (on by default, so the flipped one is off: every expert on every token) ran under its switch."""
    import torch

    torch.set_num_threads(1)
    ab = _module()
    records = ab.run_ab(["grouped_experts"], batches=[1], steps=2, shape="tiny", device="cpu",
                        family="deepseek_v32", ctx=32)
    assert [(r["case"], r["variant"].split(":")[0]) for r in records] == [
        ("deepseek_v32 tiny B1 ctx32", "defaults"), ("deepseek_v32 tiny B1 ctx32", "grouped_experts=off")]
    assert records[1]["switches"] == {"grouped_experts": False}
