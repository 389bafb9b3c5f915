"""What lets a prefill graph hold a layer instead of running it between pieces (`fnattn.prefill_graph`): the
chunk list padded to a bucket's most chunks, built from the device's ``cu_seqlens`` alone, and a session that
plans a capturable backend's group at its first layer (inside the piece being captured), not on entry."""

import torch
from helpers import registry_scope
from hypothesis import given, settings
from hypothesis import strategies as st

import fnattn as fa
from fnattn.kinds.delta_rule.reference import per_request
from fnattn.kinds.delta_rule.triton import _chunk_list, padded_chunk_list
from fnattn.lanes import static_shapes


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 300), min_size=1, max_size=6), chunk=st.sampled_from([16, 64]),
       spare=st.integers(0, 130))
def test_padded_chunk_list_is_the_exact_list_then_entries_past_the_last_request(lens, chunk, spare):
    """The requests' chunks in order, as the host-built list has them; then, up to ``ceil(tokens / chunk) + B``
    entries for a bucket of ``tokens``, entries of the last request past its last chunk (masked whole)."""
    tokens = sum(lens) + spare
    lens = lens[:-1] + [lens[-1] + spare]  # a bucket's tokens are all some lane's (pad lanes take the rest)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    got = padded_chunk_list(cu, tokens, chunk)
    seq, idx = _chunk_list(_Lens(lens, cu), chunk)
    exact = torch.stack([seq, idx], 1).long()
    assert got.shape == (-(-tokens // chunk) + len(lens), 2)
    assert torch.equal(got[:len(exact)], exact)
    last = len(lens) - 1
    past = got[len(exact):]
    assert (past[:, 0] == last).all() and (past[:, 1] >= -(-lens[-1] // chunk)).all()


class _Lens:
    """What `_chunk_list` reads of a batch."""

    def __init__(self, lens, cu):
        self.host_new_lens, self.cu_seqlens = tuple(lens), cu


def test_a_deferred_session_plans_a_capturable_group_at_its_first_layer():
    """``defer_capturable``: no plan on entry for a capturable prefill backend's group; its first layer's
    forward builds it (inside the piece a prefill graph is capturing), its other layers share it, and the
    outputs are those of a session that planned on entry."""
    from fnattn.models.registry import random_model

    m = random_model("qwen3_5", seed=0)
    planned = []

    def plan(specs, batch, lease):
        planned.append((tuple(s.index for s in specs), len(ran)))
        return {"layers": len(specs)}

    ran = []

    def body(spec, views, inputs):
        assert inputs.meta.plan["layers"] == 3
        ran.append(spec.index)
        return per_request(spec, views, inputs, chunked=True)

    with registry_scope():
        fa.register("gdn", "prefill", "test_in_graph", plan=plan, capturable=True)(body)
        attn = fa.ModelAttention(m.specs)
        assert attn.backend(0, "prefill").name == "test_in_graph"

        def run(defer):
            planned.clear()
            ran.clear()
            st_ = fa.State(m.specs, num_pages=16, page_size=4, max_requests=2).admit(0).reserve({0: 6})
            batch = fa.Batch.prefill(st_, {0: 6})
            with static_shapes(), attn.session(st_, batch, defer_capturable=defer) as s:
                assert s.holds_in_graph(0) and not s.holds_in_graph(3)  # GDN layers, then the full one
                entered = list(planned)
                logits, _ = m.step(m.params, s, torch.tensor([3, 1, 4, 1, 5, 9]))
            return entered, list(planned), logits

        entered, after, deferred = run(True)
        assert entered == [] and after == [((0, 1, 2), 0)]  # planned once, before its first layer ran
        entered, after, eager = run(False)
        assert entered == after == [((0, 1, 2), 0)]
        assert torch.equal(deferred, eager)


def test_a_mixed_step_holds_no_layer_in_the_graph():
    """A mixed step's parts are built per step: every layer of it runs between pieces."""
    from fnattn.models.registry import random_model

    from fnattn.driver import prefill

    m = random_model("qwen3_5", seed=0)

    def body(spec, views, inputs):
        return per_request(spec, views, inputs, chunked=True)

    with registry_scope():
        fa.register("gdn", "prefill", "test_in_graph", plan=lambda *a: None, capturable=True)(body)
        attn = fa.ModelAttention(m.specs)
        st_ = fa.State(m.specs, num_pages=16, page_size=4, max_requests=3).admit(0).admit(1)
        st_, _ = prefill(m.step, m.params, attn, st_, {0: [3, 1, 4]})
        st_ = st_.reserve({0: 1, 1: 2})
        with attn.session(st_, fa.Batch.mixed(st_, [0], {1: 2}), defer_capturable=True) as s:
            assert not any(s.holds_in_graph(layer) for layer in range(4))
        with attn.session(st_, fa.Batch.prefill(st_, {1: 2}), defer_capturable=True) as s:
            assert s.holds_in_graph(0)


def test_a_mixed_step_has_a_bucket_of_its_own():
    """A prefill bucket's graphs may hold layers a mixed step must run by phase: the two never share an
    entry, whatever their (lanes, tokens)."""
    from fnattn.models.registry import random_model

    from fnattn.driver import prefill
    from fnattn.prefill_graph import PrefillRunner

    m = random_model("qwen3_5", seed=0)
    attn = fa.ModelAttention(m.specs)
    runner = PrefillRunner(m.step, m.params, attn, lanes=(2, 4), tokens=(8,))
    st_ = fa.State(m.specs, num_pages=24, page_size=4, max_requests=4).admit(0).admit(1)
    st_, _ = prefill(m.step, m.params, attn, st_, {0: [3, 1, 4]}, runner=runner)
    st_ = st_.reserve({0: 1, 1: 7})  # one decode token and 7 prompt tokens: the bucket (2, 8) exactly
    st_, _ = runner.prefill(st_, {1: 7}, torch.tensor([9, 2, 6, 5, 3, 5, 8, 9]), decode_ids=[0])
    assert sorted((e.lanes, e.tokens, e.mixed) for e in runner.entries()) == [(2, 8, False), (2, 8, True)]
