"""Native and replay recovery of recurrent state after a verify step: bitwise equal."""

import itertools

import pytest
import torch
from helpers import full_inputs, full_spec, nan_state, run, same_bits

import fnattn as fa
from fnattn.speculative import accept_step, greedy_accept, replay_writes

K = 3  # drafts per request


def specs():
    gdn = fa.LayerSpec(index=0, config=fa.GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8),
                       dtype=torch.float32)
    kda = fa.LayerSpec(index=1, config=fa.KDAConfig(num_heads=2, head_k_dim=8, head_v_dim=8), dtype=torch.float32)
    return gdn, kda, full_spec(2)


def recurrent_inputs(spec, T, gen):
    c = spec.config
    H = c.num_state_heads
    return fa.RecurrentInputs(x=torch.randn(T, c.conv_dim, generator=gen),
                              conv_weight=torch.randn(c.conv_dim, c.conv_kernel, generator=gen) * 0.5,
                              g=-torch.rand(c.gate_shape(T), generator=gen), beta=torch.rand(T, H, generator=gen))


def layer_inputs(all_specs, T, seed):
    gen = torch.Generator().manual_seed(seed)
    return {s.index: (recurrent_inputs(s, T, gen) if s.kind in ("gdn", "kda") else full_inputs(s, T, gen=gen))
            for s in all_specs}


def prefilled(ring=2):
    all_specs = specs()
    ma = fa.ModelAttention(all_specs)
    st = nan_state(all_specs, recurrent_ring=ring).admit(0).admit(1)
    st = st.reserve({0: 5, 1: 3})
    b = fa.Batch.prefill(st, {0: 5, 1: 3})
    _, d = run(ma, st, b, layer_inputs(all_specs, 8, seed=0))
    st = st.apply(d)
    return all_specs, ma, st.reserve({0: K + 2, 1: K + 2})


def pools_equal(a, b):
    """Token pools bit for bit, and each request's current recurrent rows (which ring row holds
    them may differ: a verify that did not fit the ring copies, its replay writes into the ring)."""
    for name, pool in a.pools.items():
        for t, x in pool.tensors.items():
            y = b.pools[name].tensors[t]
            if pool.index_space == "request":
                x = x[:, [a.recurrent_row(r) for r in a.requests]]
                y = y[:, [b.recurrent_row(r) for r in a.requests]]
            if not same_bits(x, y):
                return False
    return True


@pytest.mark.parametrize("ring", [2, K + 2], ids=["verify-copies", "verify-in-ring"])
@pytest.mark.parametrize("accepted", list(itertools.product(range(1, K + 2), [1, K + 1])))
def test_native_and_replay_leave_bitwise_equal_state(accepted, ring):
    all_specs, ma, st = prefilled(ring)
    acc = {0: accepted[0], 1: accepted[1]}
    inputs = layer_inputs(all_specs, 2 * (K + 1), seed=1)

    b_native = fa.Batch.verify(st, [0, 1], num_draft=K)
    outs_n, d_native = run(ma, st, b_native, inputs)
    native = st.apply(d_native.accept(b_native, acc), inplace=False)

    b_replay = fa.Batch.verify(st, [0, 1], num_draft=K, recovery="replay")
    outs_r, d_replay = run(ma, st, b_replay, inputs)
    recurrent_layers = {s.index for s in all_specs if s.kind in ("gdn", "kda")}
    assert {w.layer for w in d_native.writes} >= recurrent_layers
    assert not any(w.layer in recurrent_layers for w in d_replay.writes)  # only inputs leave
    for layer in outs_n:
        assert torch.equal(outs_n[layer].o, outs_r[layer].o)
    recurrent = {s.index: outs_r[s.index] for s in all_specs if s.kind in ("gdn", "kda")}
    replay = replay_writes(ma, st, b_replay, recurrent, acc)
    assert {w.layer for w in replay.writes} == recurrent_layers
    replayed = st.apply(accept_step(d_replay, b_replay, acc, replay=replay), inplace=False)

    assert native.request(0).length == replayed.request(0).length == 5 + acc[0]
    assert pools_equal(native, replayed)
    for s2 in (native, replayed):  # rejected K/V rows were never written
        kv = s2.views(2).k.flatten(0, 1)
        rejected = b_native.slot_mapping[[i for b in range(2) for i in range(b * (K + 1) + acc[b], (b + 1) * (K + 1))]]
        assert torch.isnan(kv[rejected]).all()
    nxt = layer_inputs(all_specs, 2, seed=2)
    outs = []
    for s2 in (native, replayed):
        b = fa.Batch.decode(s2, [0, 1])
        outs.append(run(ma, s2, b, nxt)[0])
    for layer in outs[0]:
        assert torch.equal(outs[0][layer].o, outs[1][layer].o)


def test_greedy_accept_counts_matching_drafts_and_picks_the_bonus():
    all_specs, ma, st = prefilled()
    b = fa.Batch.verify(st, [0, 1], num_draft=2)
    logits = torch.zeros(6, 10)
    for row, tok in enumerate([4, 5, 6, 1, 2, 3]):
        logits[row, tok] = 1.0
    accepted, bonus = greedy_accept(logits, b, {0: [4, 5], 1: [9, 2]})
    assert accepted == {0: 3, 1: 1} and bonus == {0: 6, 1: 1}
    with pytest.raises(ValueError, match="`drafts\\[0\\]`"):
        greedy_accept(logits, b, {0: [4], 1: [9, 2]})


def test_replay_batch_and_recovery_are_validated():
    all_specs, ma, st = prefilled()
    with pytest.raises(ValueError, match="`recovery`"):
        fa.Batch.verify(st, [0], num_draft=2, recovery="later")
    b = fa.Batch.verify(st, [0], num_draft=2)
    with pytest.raises(ValueError, match="`verify_batch`"):
        replay_writes(ma, st, b, {}, {0: 1})
