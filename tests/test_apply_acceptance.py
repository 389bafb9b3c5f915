"""What the apply checks about acceptance: forged counts, and what a replay-mode verify may return.

Every refusal names the argument and leaves the State as it was (`helpers.assert_refused`).
"""

import dataclasses

import pytest
import torch
from helpers import assert_refused, full_inputs, full_spec, gdn_spec, nan_state, recurrent_inputs, registry_scope, run

import fnattn as fa
from fnattn.kinds.delta_rule import reference as delta_rule
from fnattn.speculative import replay_writes

SPECS = (gdn_spec(0), full_spec(1))
K = 2  # drafts per request


@pytest.fixture(autouse=True)
def _own_registry():
    with registry_scope():
        yield


def inputs_for(T, seed=0):
    return {0: recurrent_inputs(SPECS[0], T, seed=seed),
            1: full_inputs(SPECS[1], T, gen=torch.Generator().manual_seed(seed))}


def prefilled(ring=2):
    """Two requests with 3 and 2 tokens cached, room for a verify of 1 + K tokens each."""
    ma = fa.ModelAttention(SPECS, prefer=("reference",))
    st = nan_state(SPECS, recurrent_ring=ring).admit(0).admit(1).reserve({0: 3, 1: 2})
    b = fa.Batch.prefill(st, {0: 3, 1: 2})
    st = st.apply(run(ma, st, b, inputs_for(5))[1])
    return ma, st.reserve({0: K + 1, 1: K + 1})


def forge(deltas, **fields):
    """``deltas`` with fields set past the constructor's checks (what the apply must not trust)."""
    forged = dataclasses.replace(deltas)
    for name, value in fields.items():
        object.__setattr__(forged, name, value)
    return forged


# ------------------------------------------------------------------------------------- forged counts
@pytest.mark.parametrize("accepted", [(2, 2), (4, 2), (3,), (3, 2, 1), (3.0, 2), (True, 2), [3, 2], "32"])
def test_a_prefill_step_with_forged_accepted_counts_is_refused(accepted):
    ma = fa.ModelAttention(SPECS, prefer=("reference",))
    st = nan_state(SPECS).admit(0).admit(1).reserve({0: 3, 1: 2})
    b = fa.Batch.prefill(st, {0: 3, 1: 2})
    _, d = run(ma, st, b, inputs_for(5))
    counts = accepted if isinstance(accepted, tuple) and len(accepted) == 2 and all(
        type(a) is int for a in accepted) else None
    cursor = b.cursor_after(counts) if counts else d.cursor  # the cursor the forged counts would imply
    assert_refused(st, lambda: st.apply(forge(d, accepted=accepted, cursor=cursor)), "`accepted`")
    with pytest.raises(ValueError, match="`accepted`"):  # the constructor says so too
        dataclasses.replace(d, accepted=accepted, cursor=cursor)


def test_a_prefill_step_whose_accepted_counts_are_its_new_lengths_is_applied():
    ma = fa.ModelAttention(SPECS, prefer=("reference",))
    st = nan_state(SPECS).admit(0).admit(1).reserve({0: 3, 1: 2})
    b = fa.Batch.prefill(st, {0: 3, 1: 2})
    _, d = run(ma, st, b, inputs_for(5))
    st = st.apply(dataclasses.replace(d, accepted=(3, 2)))
    assert st.request(0).length == 3 and st.request(1).length == 2


@pytest.mark.parametrize("accepted", [(0, 1), (K + 2, 1), (1,), (1, 1, 1), (1.0, 1), (False, 1)])
@pytest.mark.parametrize("recovery", ["native", "replay"])
def test_a_verify_step_with_forged_accepted_counts_is_refused(accepted, recovery):
    ma, st = prefilled()
    b = fa.Batch.verify(st, [0, 1], num_draft=K, recovery=recovery)
    outs, d = run(ma, st, b, inputs_for(2 * (K + 1), seed=1))
    good = {0: 2, 1: 1}
    replay = replay_writes(ma, st, b, {0: outs[0]}, good) if recovery == "replay" else None
    ok = d.accept(b, good, replay=replay)
    counts = accepted if len(accepted) == 2 and all(type(a) is int for a in accepted) else None
    cursor = b.cursor_after(counts, ring_of=replay.batch if replay else None) if counts else ok.cursor
    assert_refused(st, lambda: st.apply(forge(ok, accepted=accepted, cursor=cursor)), "`accepted`")


def test_a_replay_mode_verify_whose_counts_were_dropped_is_refused():
    ma, st = prefilled()
    b = fa.Batch.verify(st, [0, 1], num_draft=K, recovery="replay")
    outs, d = run(ma, st, b, inputs_for(2 * (K + 1), seed=1))
    ok = d.accept(b, {0: 2, 1: 1}, replay=replay_writes(ma, st, b, {0: outs[0]}, {0: 2, 1: 1}))
    forged = forge(ok, accepted=None, cursor=b.cursor_after(b.host_new_lens))
    assert_refused(st, lambda: st.apply(forged), "`deltas`")


def test_a_replay_whose_own_deltas_were_filtered_is_refused():
    ma, st = prefilled()
    b = fa.Batch.verify(st, [0, 1], num_draft=K, recovery="replay")
    outs, d = run(ma, st, b, inputs_for(2 * (K + 1), seed=1))
    replay = replay_writes(ma, st, b, {0: outs[0]}, {0: 2, 1: 1})
    ok = d.accept(b, {0: 2, 1: 1}, replay=forge(replay, accepted=(1, 1)))
    assert_refused(st, lambda: st.apply(ok), "`replay`")


def test_verify_accepted_counts_in_range_are_applied():
    ma, st = prefilled()
    b = fa.Batch.verify(st, [0, 1], num_draft=K)
    _, d = run(ma, st, b, inputs_for(2 * (K + 1), seed=1))
    after = st.apply(d.accept(b, {0: K + 1, 1: 1}))
    assert after.request(0).length == 3 + K + 1 and after.request(1).length == 2 + 1


# --------------------------------------------------------------------- what a replay-mode verify returns
def register_verify(name, body):
    fa.register("gdn", "verify", name, replace=True)(body)
    return fa.ModelAttention(SPECS, prefer=(name, "reference"))


@pytest.mark.parametrize("ring", [2, 5], ids=["verify-copies", "verify-in-ring"])
def test_recurrent_writes_from_a_replay_mode_verify_are_refused(ring):
    def leaky(spec, views, inputs):  # the replay inputs, and the states a native verify would return
        out, _ = delta_rule.per_token(spec, views, inputs)
        _, states, windows = delta_rule.run(spec, views, inputs, per_token=True)
        return out, fa.writes(ssm=states + 1, conv=windows + 1)

    leaky_ma = register_verify("leaky", leaky)
    ma, st = prefilled(ring)
    b = fa.Batch.verify(st, [0, 1], num_draft=K, recovery="replay")
    outs, d = run(leaky_ma, st, b, inputs_for(2 * (K + 1), seed=1))
    acc = {0: 2, 1: 1}
    replay = replay_writes(ma, st, b, {0: outs[0]}, acc)
    e = assert_refused(st, lambda: st.apply(d.accept(b, acc, replay=replay)), "layer 0")
    assert "recovery" in str(e) and "replay" in str(e)


def test_a_replay_mode_verify_without_replay_inputs_is_named():
    def no_replay(spec, views, inputs):  # forgets Output(replay=...)
        out, _ = delta_rule.per_token(spec, views, inputs)
        return dataclasses.replace(out, replay=None), None

    ma = register_verify("no_replay", no_replay)
    _, st = prefilled()
    b = fa.Batch.verify(st, [0, 1], num_draft=K, recovery="replay")
    with ma.session(st, b) as s:
        out, _ = s.forward(0, recurrent_inputs(SPECS[0], 2 * (K + 1), seed=1))
    with pytest.raises(ValueError, match=r"replay=.*no_replay|no_replay.*replay="):
        replay_writes(ma, st, b, s.replay_outputs, {0: 2, 1: 1})
    with pytest.raises(ValueError, match=r"replay"):  # the layer handed in without replay inputs: named too
        replay_writes(ma, st, b, {0: out}, {0: 2, 1: 1})


def test_a_verify_backend_returning_no_writes_for_the_replay_batch_is_named():
    def forgetful(spec, views, inputs):  # replay-mode verify is right; the replay batch gets no states back
        out, w = delta_rule.per_token(spec, views, inputs)
        return out, None

    ma = register_verify("forgetful", forgetful)
    _, st = prefilled()
    b = fa.Batch.verify(st, [0, 1], num_draft=K, recovery="replay")
    outs, _ = run(ma, st, b, inputs_for(2 * (K + 1), seed=1))
    with pytest.raises(ValueError, match="forgetful.*layer 0|layer 0.*forgetful") as info:
        replay_writes(ma, st, b, {0: outs[0]}, {0: 2, 1: 1})
    assert "`writes`" in str(info.value)
