"""Mixed steps (`Batch.mixed`): decode tokens of some requests and prompt chunks of others in one step, each
layer's decode backend on the decode lanes and its prefill backend on the rest. In the invariant mode the step
equals the same requests run phase by phase -- a decode step, then a prefill step -- bit for bit, for every
family: the logits of both phases and everything each left in the State (read back by the steps after)."""

import functools

import pytest
import torch
from fnattn.models.registry import family_names

import fnattn as fa
import fnattn.switches
from fnattn.driver import generate, prefill, run_step
from fnattn.prefill_graph import PrefillRunner

OLD = {0: [3, 17, 5, 9, 11], 1: [6, 1, 12]}  # decoding when the new prompts arrive
NEW = {2: [4, 4, 8, 1, 9, 2, 7], 3: [5, 3]}


@functools.cache
def model(name):
    from fnattn.models.registry import random_model

    return random_model(name, seed=0, dtype=torch.bfloat16)


def fresh(m):
    return fa.State(m.specs, num_pages=40, page_size=4, max_requests=5)


def started(m, attn):
    st = fresh(m)
    for r in OLD:
        st = st.admit(r)
    st, last = prefill(m.step, m.params, attn, st, OLD)
    return st, torch.stack([last[r] for r in OLD]).argmax(-1)


def after(m, attn, st, ids):
    """Two decode steps of every request: what the State holds, read back."""
    out, tok = [], ids
    for _ in range(2):
        st = st.reserve({r: 1 for r in st.requests})
        st, logits = run_step(m.step, m.params, attn, st, fa.Batch.decode(st, list(st.requests)), tok)
        out.append(logits)
        tok = logits.argmax(-1)
    return out


def phase_by_phase(m):
    attn = fa.ModelAttention(m.specs)
    st, ids = started(m, attn)
    st = st.reserve({r: 1 for r in OLD})
    st, dec = run_step(m.step, m.params, attn, st, fa.Batch.decode(st, list(OLD)), ids)
    for r in NEW:
        st = st.admit(r)
    st, last = prefill(m.step, m.params, attn, st, NEW)
    first = torch.stack([last[r] for r in NEW])
    nxt = torch.cat([dec.argmax(-1), first.argmax(-1)])
    return [dec, first, *after(m, attn, st, nxt)]


def mixed(m, bucketed=False):
    """The same requests, the decode tokens and the new prompts in one step (``bucketed``: through a
    capture-free PrefillRunner's bucket, pad lanes after the prompts)."""
    attn = fa.ModelAttention(m.specs)
    st, ids = started(m, attn)
    for r in NEW:
        st = st.admit(r)
    counts = {r: len(p) for r, p in NEW.items()}
    st = st.reserve({**{r: 1 for r in OLD}, **counts})
    tokens = torch.cat([ids, torch.tensor([t for p in NEW.values() for t in p])])
    if bucketed:
        runner = PrefillRunner(m.step, m.params, attn, lanes=(8,), tokens=(16,))
        st, logits = runner.prefill(st, counts, tokens, decode_ids=list(OLD))
        assert [(e.lanes, e.tokens) for e in runner.entries()] == [(8, 16)]
    else:
        batch = fa.Batch.mixed(st, list(OLD), counts)
        st, logits = run_step(m.step, m.params, attn, st, batch, tokens)  # [lanes, V]: each lane's last token
    dec, first = logits[:len(OLD)], logits[len(OLD):]
    return [dec, first, *after(m, attn, st, logits.argmax(-1))]


@pytest.mark.parametrize("bucketed", [False, True], ids=["eager", "bucket"])
@pytest.mark.parametrize("name", family_names())
def test_a_mixed_step_equals_decode_then_prefill_bitwise(name, bucketed):
    m = model(name)
    with fnattn.switches.set(invariant=True):
        want, got = phase_by_phase(m), mixed(m, bucketed)
    for i, (w, g) in enumerate(zip(want, got)):
        assert torch.equal(w, g), (name, i)


def test_generate_with_mixed_admission_emits_what_phase_by_phase_admission_does():
    m = model("qwen3_5")
    prompts = {r: [(5 * r + i) % 40 + 1 for i in range(n)] for r, n in enumerate([6, 3, 9, 4, 7])}
    with fnattn.switches.set(invariant=True):
        _, want = generate(m.step, m.params, fa.ModelAttention(m.specs), fresh(m), prompts, max_new_tokens=5,
                           max_running=2)
        _, got = generate(m.step, m.params, fa.ModelAttention(m.specs), fresh(m), prompts, max_new_tokens=5,
                          max_running=2, mixed=True)
        attn = fa.ModelAttention(m.specs)
        runner = PrefillRunner(m.step, m.params, attn, lanes=(2, 4), tokens=(4, 8))  # chunks of 4 at most
        _, bucketed = generate(m.step, m.params, attn, fresh(m), prompts, max_new_tokens=5, max_running=2,
                               mixed=True, prefill_runner=runner)
    assert got == want and bucketed == want
    assert any(e.lanes == 4 for e in runner.entries())  # a mixed step went through a bucket


def test_mixed_batch_refusals():
    m = model("llama")
    st = fresh(m).admit(0).admit(1).reserve({0: 2, 1: 2})
    with pytest.raises(ValueError, match="decode_ids"):
        fa.Batch.mixed(st, [], {1: 2})
    with pytest.raises(ValueError, match="counts"):
        fa.Batch.mixed(st, [0], {0: 1})  # a request in both phases
    with pytest.raises(ValueError, match="counts"):
        fa.Batch.mixed(st, [0], {})
    b = fa.Batch.mixed(st, [0], {1: 2})
    assert b.phase == "prefill" and b.decode_lanes == 1 and b.host_new_lens == (1, 2)
    d, p = b.parts(st)
    assert (d.phase, d.request_ids, p.phase, p.request_ids) == ("decode", (0,), "prefill", (1,))
    import dataclasses

    forged = dataclasses.replace(b, decode_lanes=2)  # every lane "decode": nothing left to prefill
    with pytest.raises(ValueError, match="decode_lanes"):
        with fa.ModelAttention(m.specs).session(st, forged):
            pass


def test_each_request_may_have_its_own_length_and_mixed_steps_are_counted():
    from fnattn.generation import StopCriteria

    m = model("llama")
    prompts = {0: [3, 4, 5], 1: [6, 7], 2: [8, 9, 1, 2]}
    lens = {0: 2, 1: 6, 2: 3}
    result = generate(m.step, m.params, fa.ModelAttention(m.specs), fresh(m), prompts, max_new_tokens=lens,
                      max_running=2, mixed=True)
    assert {r: len(t) for r, t in result[1].items()} == lens
    assert result.stats["mixed_steps"] == 1  # request 2 joined while 1 decoded, its prompt in one step
    stops = {r: StopCriteria(max_new_tokens=n) for r, n in lens.items()}
    again = generate(m.step, m.params, fa.ModelAttention(m.specs), fresh(m), prompts, stop=stops)
    assert {r: len(t) for r, t in again[1].items()} == lens
    with pytest.raises(ValueError, match="`max_new_tokens`"):
        generate(m.step, m.params, fa.ModelAttention(m.specs), fresh(m), prompts, max_new_tokens={0: 2})
    with pytest.raises(ValueError, match="`max_new_tokens`"):
        generate(m.step, m.params, fa.ModelAttention(m.specs), fresh(m), prompts, stop=stops, max_new_tokens=3)
    with pytest.raises(ValueError, match="`stop`"):
        generate(m.step, m.params, fa.ModelAttention(m.specs), fresh(m), prompts, stop={0: stops[0]})
    with pytest.raises(ValueError, match="`mixed`"):
        generate(m.step, m.params, fa.ModelAttention(m.specs), fresh(m), prompts, max_new_tokens=2, mixed=True,
                 share_prefixes=True)


def test_a_mixed_step_joins_a_decode_backend_that_wrote_its_ring_rows_in_place():
    """A fast GDN decode writes the new states straight into the batch's spare ring rows (``ssm=None``) while
    the prefill backend returns its states as values: the mixed step reads the decode lanes' rows back so the
    writes join, and the step equals one whose decode backend returned values."""
    from helpers import registry_scope

    from fnattn.kinds.delta_rule.reference import per_request

    m = model("qwen3_5")

    def in_place(spec, views, inputs):
        out, w = per_request(spec, views, inputs, chunked=False)
        views.ssm.index_copy_(0, inputs.meta.batch.recurrent_write_rows, w["ssm"])
        return out, fa.writes(ssm=None, conv=w["conv"])

    def run(prefer):
        attn = fa.ModelAttention(m.specs, prefer=prefer)
        st = fa.State(m.specs, num_pages=40, page_size=4, max_requests=5, recurrent_ring=2)
        for r in OLD:
            st = st.admit(r)
        st, last = prefill(m.step, m.params, attn, st, OLD)
        ids = torch.stack([last[r] for r in OLD]).argmax(-1)
        for r in NEW:
            st = st.admit(r)
        counts = {r: len(p) for r, p in NEW.items()}
        st = st.reserve({**{r: 1 for r in OLD}, **counts})
        tokens = torch.cat([ids, torch.tensor([t for p in NEW.values() for t in p])])
        st, logits = run_step(m.step, m.params, attn, st, fa.Batch.mixed(st, list(OLD), counts), tokens)
        return [logits, *after(m, attn, st, logits.argmax(-1))]

    with registry_scope():
        fa.register("gdn", "decode", "test_ring_in_place")(in_place)
        want, got = run(("reference",)), run(("test_ring_in_place", "reference"))
    for w, g in zip(want, got):
        assert torch.equal(w, g)
