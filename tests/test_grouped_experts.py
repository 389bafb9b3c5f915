"""`fused.grouped_experts`: a static-shape step's routed experts as grouped GEMMs over the picked experts
(`models.common.grouped_moe`), against the eager loop over the experts the tokens picked."""

import pytest
import torch
from fnattn.models.common import StackedExperts, grouped_moe, moe_sum
from fnattn.models.registry import FAMILIES, _load_builtin, random_model
from test_graph import _decode_run

import fnattn as fa
from fnattn.graph import StepRunner
from fnattn.models import common, fused

_load_builtin()


def _experts(E=6, D=16, inner=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    parts = [tuple((torch.randn(*shape, generator=g) * 0.3).to(dtype) for shape in ((inner, D), (inner, D), (D, inner)))
             for _ in range(E)]
    return parts, StackedExperts.stack(parts)


@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("T", [1, 5])
def test_grouped_moe_matches_the_loop_over_picked_experts(T, limit):
    parts, stacked = _experts()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, 16, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(T)])  # [T, 3], some experts unpicked
    w = torch.rand(T, 3, generator=g)

    def run(e, xs):
        gate, up = xs @ parts[e][0].T, xs @ parts[e][1].T
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (torch.nn.functional.silu(gate) * up) @ parts[e][2].T

    want = moe_sum(x, ids, w, 6, run, lambda y, v: y * v)  # eager: reads the routing on the host
    got = grouped_moe(x, ids, w, stacked.gate_up, stacked.down, lambda y, v: y * v, limit=limit)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_long_prefill_goes_in_passes_with_each_token_s_result(monkeypatch):
    """Past `common.GROUPED_TOKENS` tokens the pairs are grouped a pass at a time: each token's result is the
    one-pass result (bounded buffers for a long prefill)."""
    _, stacked = _experts()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(11, 16, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(11)])
    w = torch.rand(11, 3, generator=g)
    whole = grouped_moe(x, ids, w, stacked.gate_up, stacked.down, lambda y, v: y * v)
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    monkeypatch.setattr(common, "GROUPED_TOKENS", 4)
    passes = grouped_moe(x, ids, w, stacked.gate_up, stacked.down, lambda y, v: y * v)
    assert calls == [12, 12, 12, 12, 9, 9]  # 4 + 4 + 3 tokens, 3 pairs each, two GEMMs a pass
    torch.testing.assert_close(passes, whole, rtol=1e-6, atol=1e-6)


def test_stacked_experts_index_as_views_and_refuse_a_mismatched_down():
    parts, stacked = _experts()
    assert len(stacked) == 6
    for e, (gate, up, down) in enumerate(parts):
        s = stacked[e]
        assert torch.equal(s.gate, gate) and torch.equal(s.up, up) and torch.equal(s.down, down)
        assert s.gate.untyped_storage().data_ptr() == stacked.gate_up.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match=r"StackedExperts: `down` must be shape \(6, 16, 8\)"):
        StackedExperts(stacked.gate_up, stacked.down[:, :, :4])


MOE_FAMILIES = [n for n in sorted(FAMILIES) if n in ("deepseek_v3", "deepseek_v32", "glm5", "kimi_linear",
                                                        "deepseek_v4", "qwen3_next")]


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_static_steps_with_grouped_experts_equal_eager_steps(name, monkeypatch):
    calls = []
    real = common.grouped_moe

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(common, "grouped_moe", counted)
    model = random_model(name)
    attn = fa.ModelAttention(model.specs)
    want, _ = _decode_run(model, attn, None)  # eager: the loop over the picked experts
    with fused.grouped_experts(True):
        runner = StepRunner(model.step, model.params, attn, model.manifest(), host_reads="error", max_context=64,
                            buckets=(1, 2, 4))
        got, _ = _decode_run(model, attn, runner)
    assert calls, "no step took the grouped experts"
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
