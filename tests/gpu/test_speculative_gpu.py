"""Speculative decoding on the GPU in bf16 through the reference backends: native == replay, bitwise."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import fnattn as fa
from fnattn.speculative import Speculator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import test_speculative as cpu  # noqa: E402

pytestmark = pytest.mark.gpu


def bf16_specs(specs):
    return tuple(fa.LayerSpec(index=s.index, config=s.config, dtype=torch.bfloat16) for s in specs)


def greedy(m, n_tokens):
    from fnattn.driver import generate

    specs = bf16_specs(m["target_specs"])
    ma = fa.ModelAttention(specs, prefer=("reference",), device="cuda")
    st = fa.State(specs, num_pages=64, page_size=16, max_requests=4, device="cuda")
    return generate(m["plain_step"], m["target_params"], ma, st, cpu.PROMPTS, max_new_tokens=n_tokens)[1]


def run(m, recovery, steps, k, ref):
    specs_t, specs_d = bf16_specs(m["target_specs"]), bf16_specs(m["draft_specs"])

    def st(specs):
        return fa.State(specs, num_pages=64, page_size=16, max_requests=4, device="cuda")

    spec = Speculator(trace=True, target_step=m["target_step"], target_params=m["target_params"],
                      target_attn=fa.ModelAttention(specs_t, prefer=("reference",), device="cuda"),
                      target_state=st(specs_t), draft_step=m["draft_step"], draft_params=m["draft_params"],
                      draft_attn=fa.ModelAttention(specs_d, prefer=("reference",), device="cuda"),
                      draft_state=st(specs_d), num_draft=k, recovery=recovery)
    out = {r: [] for r in cpu.PROMPTS}
    spec.propose_hook = cpu.forced(ref, out, m["vocab"])  # forces 0..k accepted drafts
    for r, t in spec.start(cpu.PROMPTS).items():
        out[r].append(t)
    accepted = []
    for _ in range(steps):
        for r, toks in spec.step().items():
            out[r] += toks
            accepted.append(len(toks))
    for r in cpu.PROMPTS:
        spec.release(r)
    return spec, out, accepted


@pytest.mark.parametrize("name", ["tiny", "qwen3_5", "deepseek_v3"])
def test_native_and_replay_bitwise_on_gpu_bf16(name, record):
    m = cpu.MODELS[name]()  # steps and shapes of the CPU test; weights rebuilt on the GPU in bf16
    if name == "tiny":
        from fnattn.models import tiny

        cfg = dataclasses.replace(m["target_params"]["config"], dtype=torch.bfloat16)
        params = tiny.init_params(cfg, seed=3, device="cuda")
        m.update(target_params=params, draft_params=tiny.init_draft(cfg, params))
    else:
        from fnattn.models.registry import family_named, random_model

        fam = family_named(name)
        model = random_model(name, seed=0, dtype=torch.bfloat16, device="cuda")
        draft = fam.draft(model.config, model.params, None, seed=1)
        m.update(target_params=model.params, draft_params=draft.params, target_specs=model.specs,
                 draft_specs=draft.specs)
    steps, k = 16, cpu.K
    ref = greedy(m, steps * (k + 1) + 2)
    native, out_n, acc_n = run(m, "native", steps, k, ref)
    replay, out_r, acc_r = run(m, "replay", steps, k, ref)
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(native.trace, replay.trace))
    ok = out_n == out_r and acc_n == acc_r and diff == 0.0
    record({"case": f"speculative {name} bf16 k={k} {steps} steps", "phase": "verify", "backend": "reference",
            "max_abs": diff, "max_rel": 0.0, "ok": ok, "accepted_lengths": sorted(set(acc_n)),
            "equals_plain_greedy": all(out_n[r] == ref[r][: len(out_n[r])] for r in out_n)})
    assert ok, f"native vs replay: max abs {diff}"
