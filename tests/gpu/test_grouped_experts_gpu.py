"""`fused.grouped_experts` on CUDA: a MoE step's routed experts as ``torch._grouped_mm`` over the picked experts.
The kernel against the loop over the picked experts (bf16); the MoE families' graph replays with it on equal to
their capture-free steps with it on, bit for bit, and at the first step close to the graph's logits with every
expert on every token; their eager prefill and decode with it on close to the eager loop, with no host read."""

import pytest
import torch
from fnattn.models.common import StackedExperts, grouped_moe, moe_sum
from test_graph_gpu import build, decode_run, prefill, state

import fnattn as fa
from fnattn.driver import run_step
from fnattn.models import common, fused

MOE = ["deepseek_v32", "kimi_linear", "deepseek_v4"]

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


@pytest.mark.parametrize("T", [1, 8, 64, 5000])  # 5000: past common.GROUPED_TOKENS, two passes
def test_grouped_moe_on_cuda_matches_the_loop(T, record):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    E, D, inner, k = 64, 256, 128, 8
    parts = [tuple(torch.randn(*s, device="cuda", generator=g, dtype=BF16) * 0.05
                   for s in ((inner, D), (inner, D), (D, inner))) for _ in range(E)]
    stacked = StackedExperts.stack(parts)
    x = torch.randn(T, D, device="cuda", generator=g, dtype=BF16)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, device="cuda", generator=g)
    want = moe_sum(x, ids, w, E, lambda e, xs: stacked[e](xs), lambda y, v: y * v)
    got = grouped_moe(x, ids, w, stacked.gate_up, stacked.down, lambda y, v: y * v)
    rel = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    ok = bool(torch.isfinite(got).all()) and rel < 2e-2
    record({"case": f"grouped_moe T{T} E{E} k{k} bf16 vs the loop", "max_rel": rel, "ok": ok})
    assert ok, rel


def counting(monkeypatch):
    calls = []
    real = common.grouped_moe

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(common, "grouped_moe", counted)
    return calls


@pytest.mark.parametrize("name", MOE)
def test_graph_with_grouped_experts_equals_its_capture_free_steps(name, record, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with fused.grouped_experts(False):
        _, every_expert, _ = decode_run(name, True)
    calls = counting(monkeypatch)
    with fused.grouped_experts(True):
        _, graph, rows_ok = decode_run(name, True)
        _, eager, _ = decode_run(name, False)
    equal = all(torch.equal(a, b) for a, b in zip(graph, eager))
    # the first step only: later ones may pick another greedy token where two logits nearly tie
    rel = ((graph[0].float() - every_expert[0].float()).abs().max() / every_expert[0].float().abs().max()).item()
    ok = equal and rows_ok and rel < 5e-2 and bool(calls)
    record({"case": f"grouped experts graph == capture-free, {name}", "bitwise": equal, "finite": rows_ok,
            "max_rel_to_every_expert_graph": rel, "grouped_calls": len(calls), "ok": ok})
    assert ok, (equal, rows_ok, rel, len(calls))


def eager_run(name, steps=6):
    """A prefill of two requests, then ``steps`` eager decode steps fed the first run's tokens; the logits."""
    fam, cfg, params, page = build(name)
    attn = fa.ModelAttention(cfg.specs, device="cuda")
    st, last = prefill(fam, params, attn, state(cfg.specs, page), {0: list(range(1, 12)), 1: [5, 6, 7]})
    seen, tokens = [], [[last[0], last[1]]] + [[(3 * i + 1) % 50, (5 * i + 2) % 50] for i in range(steps - 1)]
    for tok in tokens:
        st = st.reserve({0: 1, 1: 1})
        st, logits = run_step(fam.step, params, attn, st, fa.Batch.decode(st, [0, 1]), torch.tensor(tok, device="cuda"))
        seen.append(logits.float())
    return seen


@pytest.mark.parametrize("name", MOE)
def test_eager_steps_with_grouped_experts_match_the_loop(name, record, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with fused.grouped_experts(False):
        loop = eager_run(name)
    calls = counting(monkeypatch)
    with fused.grouped_experts(True):
        grouped = eager_run(name)
    rel = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(grouped, loop))
    took = 14 in calls and 2 in calls  # the prefill's 11 + 3 tokens and each decode step's 2 went grouped
    ok = rel < 5e-2 and took and all(bool(torch.isfinite(g).all()) for g in grouped)
    record({"case": f"grouped experts eager == the loop, {name}", "max_rel_to_loop": rel,
            "grouped_rows": sorted(set(calls)), "ok": ok})
    assert ok, (rel, sorted(set(calls)))
