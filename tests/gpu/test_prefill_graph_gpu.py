"""Captured prefill on the GPU: the pieces replayed around eager attention == the capture-free padded step,
bit for bit, for every family; and close to the unpadded eager prefill.

Each family's tiny model in bf16 (the shapes `test_graph_gpu` gives the MLA families), NaN-filled storage
(the null page and slot the pad lanes write included), prompts that fill a bucket exactly, leave pad lanes,
and come in chunks after a cached prefix; several buckets replayed more than once; then decode steps over the
State each prefill left; last a mixed step (decode tokens of two requests beside a new prompt) through a
bucket. The last logits of every step of the captured runner and of the capture-free runner must be equal bit
for bit, every live row finite.
"""

import pytest
import torch
from test_graph_gpu import NAMES, build, live_rows_finite, state

import fnattn as fa
from fnattn.driver import prefill
from fnattn.prefill_graph import PrefillRunner

pytestmark = pytest.mark.gpu
WAVES = [{0: list(range(1, 17))}, {1: [5, 6, 7], 2: list(range(2, 40))}, {3: [9] * 70}, {4: list(range(3, 19))}]


def run(name, capture):
    fam, cfg, params, page = build(name)
    attn = fa.ModelAttention(cfg.specs, device="cuda")
    runner = PrefillRunner(fam.step, params, attn, lanes=(1, 2, 4), tokens=(16, 32, 64), max_context=256,
                           capture=capture)
    st, seen = state(cfg.specs, page), []
    for wave in WAVES:  # requests arrive in waves; the 70-token prompt goes in chunks of 64
        for r in wave:
            st = st.admit(r)
        st, last = prefill(fam.step, params, attn, st, wave, runner=runner)
        seen += [last[r].float().clone() for r in wave]
        ids = list(st.requests)
        for _ in range(2):
            st = st.reserve({r: 1 for r in ids})
            with attn.session(st, fa.Batch.decode(st, ids)) as s:
                logits, d = fam.step(params, s, torch.tensor([1] * len(ids), device="cuda"))
            st = st.apply(d)
            seen.append(logits.float().clone())
    # a mixed step through a bucket: a decode token of two requests beside a new prompt (`Batch.mixed`; a
    # bucket of 4 lanes takes 3 requests and a pad lane)
    ids = list(st.requests)[:2]
    st = st.admit(9)
    st = st.reserve({**{r: 1 for r in ids}, 9: 20})
    tokens = torch.tensor([1] * len(ids) + list(range(4, 24)), device="cuda")
    st, logits = runner.prefill(st, {9: 20}, tokens, decode_ids=ids)
    seen.append(logits.float().clone())
    return runner, seen, live_rows_finite(st)


# Qwen3.5 first: the family whose GDN layers the graphs hold (fla's chunk forward over a padded chunk list)
@pytest.mark.parametrize("name", sorted(NAMES, key=lambda name: name != "qwen3_5"))
def test_captured_prefill_equals_the_capture_free_padded_step_bitwise(name, record):
    try:
        graph_runner, graph, rows_ok = run(name, True)
    except Exception as e:  # a model whose pieces cannot be captured: recorded with its reason
        record({"case": f"prefill graph == eager, {name}", "ok": False, "why": f"{type(e).__name__}: {e}"[:300]})
        raise
    _, eager, _ = run(name, False)
    equal = all(torch.equal(a, b) for a, b in zip(graph, eager))
    finite = all(torch.isfinite(a).all() for a in graph) and rows_ok
    replays = sum(e.replays for e in graph_runner.entries())
    record({"case": f"prefill graph == eager, {name}", "buckets": sorted(
        (e.lanes, e.tokens) for e in graph_runner.entries()), "pieces": max(len(e.graphs) for e in
                                                                            graph_runner.entries()),
        "replays": replays, "bitwise": equal, "finite": finite, "ok": equal and finite})
    assert equal and finite


@pytest.mark.parametrize("name", ["qwen3_5", "llama"])
def test_captured_prefill_is_close_to_the_unpadded_eager_prefill(name, record):
    fam, cfg, params, page = build(name)
    attn = fa.ModelAttention(cfg.specs, device="cuda")
    runner = PrefillRunner(fam.step, params, attn, tokens=(16, 64), max_context=256)
    prompts = {0: list(range(1, 30)), 1: [4, 2, 8]}
    out = []
    for r in (None, runner):
        st = state(cfg.specs, page)
        for q in prompts:
            st = st.admit(q)
        st, last = prefill(fam.step, params, attn, st, prompts, runner=r)
        out.append(torch.stack([last[q] for q in prompts]).float())
    err = (out[0] - out[1]).abs().max().item()
    record({"case": f"prefill graph ~ unpadded eager, {name}", "max_abs_err": err, "ok": err < 5e-2})
    torch.testing.assert_close(out[1], out[0], rtol=5e-2, atol=5e-2)
