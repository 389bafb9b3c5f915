"""Launchers bound once (`fnattn.kernels.launch`, switch `bound_launches`) on a GPU: a bound launch writes the bits
Triton's own launch of the same call writes, and only a form seen before is bound. Set FNATTN_GPU_RESULTS=path.json
to record every comparison."""

import pytest
import torch
from fnattn.models.registry import random_model
from helpers import spread_prompts

import fnattn as fa
from fnattn.driver import prefill, run_step
from fnattn.graph import StepRunner
from fnattn.kernels import launch as bound
from fnattn.kernels.skinny_linear import _skinny_gemv_kernel, skinny_linear

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _randn(*shape, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g).to(BF16)


@pytest.fixture
def through_triton(monkeypatch):
    """Counts the GEMV's launches that went through Triton's `JITFunction.run`."""
    calls, real = [], _skinny_gemv_kernel.run

    def run(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_skinny_gemv_kernel, "run", run)
    bound.forget()
    yield calls
    bound.forget()


@pytest.mark.parametrize("rows", [1, 8, 16])
@pytest.mark.parametrize("N, K", [(6144, 1024), (1024, 2048), (248320 // 8, 1024)])
def test_a_bound_gemv_writes_triton_s_bits(rows, N, K, through_triton, record):
    """The same call three times under the switch (the first through Triton, the others bound), then with x at
    an address that is no multiple of 16 (another form: through Triton first), each against the switch off."""
    w, buf = _randn(N, K, seed=1), _randn(rows, K + 8, seed=2)
    aligned, unaligned = buf[:, :K], buf[:, 1:K + 1]
    want = {name: skinny_linear(x, w) for name, x in (("aligned", aligned), ("unaligned", unaligned))}
    before = len(through_triton)
    with bound.bound_launches(True):
        got = [skinny_linear(aligned, w) for _ in range(3)] + [skinny_linear(unaligned, w) for _ in range(2)]
    torch.cuda.synchronize()
    triton_calls = len(through_triton) - before
    same = all(torch.equal(g, want["aligned"]) for g in got[:3]) and all(torch.equal(g, want["unaligned"])
                                                                         for g in got[3:])
    ok = same and triton_calls == 2  # one first launch a form
    record({"case": f"bound GEMV {rows}x{K} @ {N}x{K}", "bitwise": same, "through_triton": triton_calls, "ok": ok})
    assert ok, f"bitwise {same}, {triton_calls} launches through Triton (2 expected)"


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_model_s_steps_are_the_same_bits_with_bound_launches(graph, record):
    """The fused Qwen3.5 tiny model: a prefill and 8 decode steps of two requests, then of one, eager (or each
    decode step captured in a graph and replayed), with the switch on against off."""
    model = random_model("qwen3_5", dtype=BF16, device="cuda", seed=2)
    ma = fa.ModelAttention(model.specs, device="cuda")
    prompts = spread_prompts(model.config.vocab_size)

    def run():
        st = fa.State(model.specs, num_pages=64, page_size=16, max_requests=2, device="cuda")
        st = st.admit(0).admit(1)
        out = []
        runner = StepRunner(model.step, model.params, ma, model.manifest(), buckets=(2,), max_context=400)
        with torch.no_grad():
            st, last = prefill(model.step, model.params, ma, st, prompts)
            out.append(torch.stack([last[0], last[1]]))
            for t in range(12):
                ids = [0, 1] if t < 8 else [1]
                st = st.reserve({r: 1 for r in ids})
                tokens = torch.tensor([t + 1 + r for r in ids], device="cuda")
                if graph:
                    st, logits = runner.decode(st, ids, tokens)
                else:
                    st, logits = run_step(model.step, model.params, ma, st, fa.Batch.decode(st, ids), tokens)
                out.append(torch.nn.functional.pad(logits, (0, 0, 0, 2 - len(ids))))
        torch.cuda.synchronize()
        return torch.cat(out)

    bound.forget()
    want = run()
    with bound.bound_launches(True):
        got, again = run(), run()
    forms = len(bound._FORMS)
    bound.forget()
    same = torch.equal(got, want) and torch.equal(again, want)
    ok = same and forms > 0
    record({"case": f"qwen3_5 tiny {'graph' if graph else 'eager'}: prefill + 12 decode steps, bound launches",
            "bitwise": same, "forms": forms, "ok": ok})
    assert ok, f"bitwise {same}, {forms} forms remembered"
