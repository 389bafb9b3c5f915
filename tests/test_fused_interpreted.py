"""A whole tiny Qwen3.5 through every fused kernel path, on the CPU under the Triton interpreter (fp16):
what `models.fused` routes to each kernel (the GEMV, with GDN's gating, SwiGLU's activation or a residual add
and the row-local half of the next norm in its epilogue at decode sizes; q / k norms and rope; GDN gating; the
output gates; the residual add + norm and SiLU-and-mul) must give the unfused
model's logits over a prefill and decode steps. On a GPU the same comparison runs in bf16
(tests/gpu/test_fused_gpu.py); here it checks the wiring."""

import os

import pytest
import torch

if torch.cuda.is_available():  # there the kernels run compiled, in bf16: tests/gpu/test_fused_gpu.py
    pytest.skip("the interpreter's wiring check runs without CUDA", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.models.registry import random_model  # noqa: E402

import fnattn as fa  # noqa: E402
from fnattn.driver import prefill, run_step  # noqa: E402
from fnattn.models import fused  # noqa: E402

KERNELS = {  # module: the functions models.fused calls
    "skinny_linear": ["skinny_linear"],
    "skinny_folds": ["skinny_linear_gating", "skinny_linear_swiglu", "skinny_linear_add_"],
    "qk_norm_rope": ["qk_norm_rope"],
    "gdn_gate": ["gdn_gating"],
    "output_gate": ["gated_rms_norm_silu", "sigmoid_gate"],
    "norm_act": ["add_rms_norm_", "silu_and_mul"],
}


def _run(model, ma):
    st = fa.State(model.specs, num_pages=16, page_size=16, max_requests=2, device="cpu").admit(0).admit(1)
    with torch.no_grad():
        # 21 prompt rows: the prefill's projections stay on F.linear (at most 16 rows take the GEMV)
        st, last = prefill(model.step, model.params, ma, st, {0: list(range(1, 13)), 1: list(range(7, 16))})
        out = [torch.stack([last[0], last[1]])]
        for t in range(2):
            st = st.reserve({0: 1, 1: 1})
            st, logits = run_step(model.step, model.params, ma, st, fa.Batch.decode(st, [0, 1]),
                                  torch.tensor([t + 1, t + 2]))
            out.append(logits)
    return torch.cat(out).float()


def _model_and_unfused_logits():
    model = random_model("qwen3_5", dtype=torch.float16, device="cpu", seed=2)
    ma = fa.ModelAttention(model.specs, device="cpu")
    with fused.unfused():
        return model, ma, _run(model, ma)


def _allow_triton_on_cpu(monkeypatch):
    """The Triton paths allowed on this CPU (the interpreter runs them) by `fused._kernel_rule`, as on CUDA (in
    the invariant mode too); FlashInfer's and fla's are not."""
    monkeypatch.setattr(fused, "_kernel", lambda package, *ts: package == "triton" and fused._kernel_rule(package, *ts))


def _count_calls(monkeypatch, module, name, calls, key):
    """``module.name`` still runs, and each call counts in ``calls[key(...)]`` (a key of None: not counted)."""
    real = getattr(module, name)

    def counted(*a, **k):
        which = key(*a, **k)
        if which is not None:
            calls[which] = calls.get(which, 0) + 1
        return real(*a, **k)

    monkeypatch.setattr(module, name, counted)


def _count_kernel_calls(monkeypatch) -> dict[str, int]:
    """Every function of `KERNELS` still runs, and counts its calls by name in the dict returned."""
    import importlib

    calls: dict[str, int] = {}
    for module_name, names in KERNELS.items():
        module = importlib.import_module(f"fnattn.kernels.{module_name}")
        for name in names:
            _count_calls(monkeypatch, module, name, calls, key=lambda *a, name=name, **k: name)
    return calls


def _assert_close_logits(got, want):
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 2e-3 * scale
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.75


def test_every_kernel_path_gives_the_unfused_logits(monkeypatch):
    model, ma, want = _model_and_unfused_logits()
    _allow_triton_on_cpu(monkeypatch)
    calls = _count_kernel_calls(monkeypatch)
    with fused.own_norm_act(True), fused.output_gates(True), fused.gating_epilogue(True), fused.swiglu_epilogue(True):
        got = _run(model, ma)
    assert sorted(calls) == sorted(n for names in KERNELS.values() for n in names), calls
    _assert_close_logits(got, want)


def test_split_norm_takes_each_add_norm_launch_into_the_projections(monkeypatch):
    """Under `fused.split_norm` a decode step's residual adds run in the output projections' GEMVs
    (`skinny_linear_add_`) and every norm after one but the final is finished by the GEMV that reads it: the
    only add + RMSNorm launch left a decode step is the final norm's; the logits stay the unfused model's."""
    from fnattn.kernels import norm_act, skinny_folds

    model, ma, want = _model_and_unfused_logits()
    _allow_triton_on_cpu(monkeypatch)
    calls: dict[str, int] = {}
    _count_calls(monkeypatch, skinny_folds, "skinny_linear_add_", calls, key=lambda *a, **k: "add")
    _count_calls(monkeypatch, norm_act, "add_rms_norm_", calls, key=lambda *a, **k: "add_rms_norm_")
    assert fused.switches()["split_norm"]  # on by default
    got = _run(model, ma)
    layers = len(model.specs)
    # the prefill's 2 L add + norms stay launches (21 rows); each of the 2 decode steps folds all but the final
    assert calls == {"add": 2 * (2 * layers - 1), "add_rms_norm_": 2 * layers + 2}, calls
    _assert_close_logits(got, want)
    calls.clear()
    with fused.split_norm(False):
        _run(model, ma)
    assert calls == {"add_rms_norm_": 2 * layers + 2 * 2 * layers}, calls


def test_split_norm_in_the_unchained_decoder_layer(monkeypatch):
    """`qwen3_5.decoder_layer` (the MTP draft's layers) hands its post-attention norm to the MLP as a
    `fused.SplitNorm` under `fused.split_norm`: a step built from it gives the unfused model's logits."""
    import types

    import torch.nn.functional as F
    from fnattn.models.common import logit_rows, rms_norm, rope_cos_sin

    from fnattn.models import qwen3_5 as q

    def unchained(params, session, tokens):
        cos, sin = rope_cos_sin(session.batch.positions, params.inv_freq)
        x, layer_deltas = F.embedding(tokens, params.embed), []
        for i, layer in enumerate(params.layers):
            x, deltas = q.decoder_layer(session, i, layer, x, cos, sin, params.config)
            layer_deltas.append(deltas)
        out = rms_norm(x, params.norm, params.config.rms_norm_eps, offset=1.0)
        logits = F.linear(logit_rows(session.batch, out), params.lm_head).float()
        return logits, fa.StepDeltas.collect(session.batch, layer_deltas)

    model, ma, want = _model_and_unfused_logits()
    model = types.SimpleNamespace(specs=model.specs, params=model.params, step=unchained)
    _allow_triton_on_cpu(monkeypatch)
    from fnattn.kernels import skinny_folds

    calls: dict[str, int] = {}
    _count_calls(monkeypatch, skinny_folds, "skinny_linear_add_", calls, key=lambda *a, **k: "add")
    got = _run(model, ma)
    assert calls == {"add": 2 * len(model.specs)}, calls  # each layer's post-attention norm, 2 decode steps
    _assert_close_logits(got, want)


def test_the_invariant_mode_keeps_the_kernels_that_honour_it(monkeypatch):
    """In the invariant mode `models.fused` keeps fnattn's own kernels (the GEMV at any row count, with its
    epilogues; the norms, gates and activations, a row per program): request 0's logits are the same bits
    alone and beside a request of another length, through a prefill of more than one 16-row tile and decode
    steps; FlashInfer's and fla's kernels stay out."""
    from fnattn.kernels.invariant import invariant

    from fnattn.bench.invariance import request_0_logits

    model = random_model("qwen3_5", dtype=torch.float16, device="cpu", seed=2)
    _allow_triton_on_cpu(monkeypatch)
    calls = _count_kernel_calls(monkeypatch)
    prompt = [(7 * i) % 50 + 1 for i in range(18)]  # 18 rows: two row tiles of the mode's GEMV
    with invariant(True):
        ma = fa.ModelAttention(model.specs, device="cpu")
        alone, beside = (request_0_logits(model, ma, fa.State(model.specs, num_pages=32, page_size=4,
                                                               max_requests=len(p), device="cpu"), p, steps=2)
                         for p in ({0: prompt}, {0: prompt, 1: prompt[:5]}))
    assert torch.equal(alone, beside)
    taken = {"skinny_linear", "skinny_linear_gating", "skinny_linear_swiglu", "skinny_linear_add_",
             "qk_norm_rope", "gated_rms_norm_silu", "sigmoid_gate", "add_rms_norm_"}
    assert taken <= set(calls), calls
