"""Captured decode and verify on the GPU: graph replay == the capture-free step, bitwise, for every family.

Each family's tiny model in bf16 (MLA families with FlashMLA's latent shape, 512 + 64, and 64 padded heads,
so their decode runs on FlashMLA), 32 decode steps with requests joining and leaving, NaN-filled storage (the
null page and slot included): the logits of the graph runner and of the capture-free runner over the same
buckets must be equal bit for bit, and every live logit finite. MTP through the verify graph, native and
replay recovery, must emit what the eager Speculator emits, with bitwise-equal logits.
"""

import contextlib
import dataclasses

import pytest
import torch
from fnattn.models.registry import FAMILIES, _load_builtin, family_named, random_checkpoint
from helpers import same_bits

import fnattn as fa
from fnattn import kernels
from fnattn.graph import StepRunner
from fnattn.speculative import Speculator

pytestmark = pytest.mark.gpu
_load_builtin()
MLA = {"deepseek_v3", "deepseek_v32", "glm5", "kimi_linear"}
NAMES = sorted(FAMILIES)
BF16 = torch.bfloat16


def build(name):
    fam = family_named(name)
    raw = fam.tiny_config()
    if name in MLA:
        raw.update(kv_lora_rank=512, qk_rope_head_dim=64)
        if "index_head_dim" in raw:  # the indexer's rope part is the layer's
            raw.update(index_head_dim=64)
    if name == "deepseek_v4":  # FlashMLA's head size: 448 + 64 rope dims
        raw.update(head_dim=512, partial_rotary_factor=0.125, index_head_dim=128)
    cfg = dataclasses.replace(fam.adapt(raw), dtype=BF16)
    if (name in MLA or name == "deepseek_v4") and hasattr(cfg, "padded_heads"):
        cfg = dataclasses.replace(cfg, padded_heads=64)
    params = fam.load(cfg, random_checkpoint(fam, cfg, seed=0, dtype=BF16, device="cuda"))
    return fam, cfg, params, (64 if name in MLA or name == "deepseek_v4" else 16)


def state(specs, page, ring=4):
    return fa.State(specs, num_pages=48, page_size=page, max_requests=6, device="cuda", fill=float("nan"),
                    recurrent_ring=ring)


def prefill(fam, params, attn, st, prompts):
    for r in prompts:
        st = st.admit(r)
    st = st.reserve({r: len(p) for r, p in prompts.items()})
    b = fa.Batch.prefill(st, {r: len(p) for r, p in prompts.items()})
    tok = torch.tensor([t for r in b.request_ids for t in prompts[r]], device="cuda")
    with attn.session(st, b) as s:
        logits, d = fam.step(params, s, tok)
    cu = b.host_cu_seqlens
    return st.apply(d), {r: int(logits[cu[i + 1] - 1].argmax()) for i, r in enumerate(b.request_ids)}


def decode_run(name, capture):
    fam, cfg, params, page = build(name)
    attn = fa.ModelAttention(cfg.specs, device="cuda")
    runner = StepRunner(fam.step, params, attn, fam.manifest(cfg), capture=capture, max_context=256,
                        buckets=(1, 2, 4, 8), host_reads="error" if not capture else "allow")
    st, last = prefill(fam, params, attn, state(cfg.specs, page), {0: list(range(1, 12)), 1: [5, 6, 7]})
    logits_seen = []
    for i in range(32):
        if i in (3, 11):  # requests join between replays
            st, first = prefill(fam, params, attn, st, {10 + i: [3, 1, 4, 1, 5][: 2 + i % 3]})
            last.update(first)
        if i in (8, 20):  # and leave
            gone = min(last)
            st = st.release(gone)
            del last[gone]
        ids = list(last)
        st = st.reserve({r: 1 for r in ids})
        st, logits = runner.decode(st, ids, torch.tensor([last[r] for r in ids], device="cuda"))
        logits_seen.append(logits.clone())
        last = {r: int(logits[j].argmax()) for j, r in enumerate(ids)}
    return runner, logits_seen, live_rows_finite(st)


def live_rows_finite(st) -> bool:
    """Every stored row of every live request (its cached tokens, its current recurrent row) is finite:
    the NaN of the null page and slot never reached one."""
    for layer in st.storage_spaces:
        views = st.views(layer)
        for name, space in st.storage_spaces[layer].items():
            t = views[name]
            for rid, req in st.requests.items():
                if space == "token":
                    rows = t.flatten(0, 1)[[req.pages[p // st.page_size] * st.page_size + p % st.page_size
                                            for p in range(req.length)]]
                else:
                    rows = t[st.recurrent_row(rid)]
                if rows.dtype.is_floating_point and not torch.isfinite(rows.float()).all():
                    return False
    return True


@pytest.mark.parametrize("name", NAMES)
def test_graph_replay_equals_the_capture_free_step_bitwise(name, record):
    fam, cfg, _, _ = build(name)
    attn = fa.ModelAttention(cfg.specs, device="cuda")
    refused = StepRunner(fam.step, None, attn, fam.manifest(cfg)).uncapturable("decode")
    if refused:
        record({"case": f"graph == eager, {name}", "ok": False, "why": refused[:3]})
        pytest.fail(f"{name}: not capturable: {refused[:3]}")
    graph_runner, graph, rows_ok = decode_run(name, True)
    _, eager, _ = decode_run(name, False)
    equal = all(torch.equal(a, b) for a, b in zip(graph, eager))
    finite = all(torch.isfinite(a).all() for a in graph) and rows_ok
    replays = sum(e.replays for e in graph_runner._entries.values())
    record({"case": f"graph == eager, {name}", "steps": 32, "buckets": sorted(
        e.bucket.lanes for e in graph_runner._entries.values()), "replays": replays, "bitwise": equal,
        "finite": finite, "ok": equal and finite and replays == 32})
    assert equal and finite and replays == 32


def mtp_run(recovery, capture):
    fam, cfg, params, page = build("qwen3_5")
    draft = fam.draft(cfg, params, None, seed=1)
    t_attn = fa.ModelAttention(cfg.specs, device="cuda")
    d_attn = fa.ModelAttention(draft.specs, device="cuda")
    runner = StepRunner(fam.step_hidden, params, t_attn, fam.manifest(cfg, hidden=True), capture=capture,
                        max_context=512, buckets=(2,))
    spec = Speculator(trace=True, target_step=fam.step_hidden, target_params=params, target_attn=t_attn,
                      target_state=state(cfg.specs, page, ring=5), draft_step=draft.step, draft_params=draft.params,
                      draft_attn=d_attn, draft_state=state(draft.specs, page), num_draft=3, recovery=recovery,
                      target_runner=runner)
    spec.start({0: [1, 2, 3, 4, 5], 1: [9, 8, 7]})
    emitted = [spec.step() for _ in range(32)]
    return runner, emitted, spec.trace


@pytest.mark.parametrize("recovery", ["native", "replay"])
def test_mtp_through_the_verify_graph_equals_eager(recovery, record):
    runner, emitted_g, trace_g = mtp_run(recovery, True)
    _, emitted_e, trace_e = mtp_run(recovery, False)
    same = emitted_g == emitted_e and len(trace_g) == len(trace_e) and all(
        torch.equal(a, b) for a, b in zip(trace_g, trace_e))
    captured = all(e.graph is not None for e in runner._entries.values())
    record({"case": f"MTP k=3 through the verify graph, {recovery}", "steps": 32, "bitwise": same,
            "captured": captured, "ok": same and captured})
    assert same and captured


def _own_kernels():
    """Every switch that routes a small op of the step to fnattn's own PDL kernels, and the GEMVs' prefetch."""
    from fnattn.kernels.skinny_linear import configured

    from fnattn.models import fused

    stack = contextlib.ExitStack()
    for switch in (fused.own_norm_act(True), fused.output_gates(True), configured(prefetch=True)):
        stack.enter_context(switch)
    return stack


@pytest.mark.parametrize("own", [False, True], ids=["", "own kernels"])
@pytest.mark.parametrize("name", ["qwen3_5", "qwen3", "kimi_linear"])
def test_graph_replay_with_pdl_equals_the_plain_step_bitwise(name, own, record):
    """Under `kernels.pdl(True)` each of fnattn's decode kernels may start while the launch before it
    finishes (the capture keeps the programmatic edges): the replayed logits must be the capture-free step's
    without PDL, bit for bit, over NaN-filled storage (a read before its gdc_wait would see stale rows).
    ``own``: both with the small ops on fnattn's own kernels, which hand over at their start, and the GEMVs
    asking L2 for their weights before they wait."""
    with _own_kernels() if own else contextlib.nullcontext():
        with kernels.pdl(True):
            graph_runner, graph, rows_ok = decode_run(name, True)
        with kernels.pdl(False):
            _, eager, _ = decode_run(name, False)
    equal = all(torch.equal(a, b) for a, b in zip(graph, eager))
    finite = all(torch.isfinite(a).all() for a in graph) and rows_ok
    replays = sum(e.replays for e in graph_runner._entries.values())
    what = ", own kernels" if own else ""
    record({"case": f"graph with pdl == eager without, {name}{what}", "steps": 32, "replays": replays,
            "bitwise": equal, "finite": finite, "ok": equal and finite and replays == 32})
    assert equal and finite and replays == 32


def test_a_captured_runner_refuses_another_states_step():
    """The graph replays into the pools it was captured on: a twin State's step is refused by name, and
    neither State's storage changes."""
    fam, cfg, params, page = build("llama")
    attn = fa.ModelAttention(cfg.specs, device="cuda")
    runner = StepRunner(fam.step, params, attn, fam.manifest(cfg), buckets=(2,))
    prompts = {0: [1, 2, 3], 1: [4, 5]}
    states = []
    for _ in range(2):
        st, last = prefill(fam, params, attn, state(cfg.specs, page), prompts)
        states.append((st.reserve({0: 1, 1: 1}), torch.tensor([last[0], last[1]], device="cuda")))
    (st, tokens), (twin, _) = states
    st, _ = runner.decode(st, [0, 1], tokens)  # captured on st
    before = {k: t.clone() for k, t in twin.views(0).items()}
    with pytest.raises(ValueError, match=r"`state` must be a handle of the State"):
        runner.decode(twin, [0, 1], tokens)
    assert all(same_bits(t, before[k]) for k, t in twin.views(0).items())


def test_a_session_refuses_a_state_on_another_device_than_its_model_attention():
    """Backends are chosen for one device: a CPU-built ModelAttention over a CUDA State is refused by name,
    before any CPU kernel meets a CUDA tensor."""
    fam, cfg, params, page = build("llama")
    st = state(cfg.specs, page).admit(0).reserve({0: 3})
    with pytest.raises(ValueError, match=r"AttentionSession: .*state.* a State on cpu"):
        fa.ModelAttention(cfg.specs).session(st, fa.Batch.prefill(st, {0: 3})).__enter__()
