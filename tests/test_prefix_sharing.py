"""Shared prefixes: `State.admit(rid, prefix_of=other, tokens=n)` and page reference counts.

A request admitted on another's prefix decodes the same logits as a cold run
of it alone, and the other request keeps decoding as if alone; a random
sequence of 10,000 admissions, shares, writes and releases never leaks a page, frees
a held one or writes into a page another request reads; the apply refuses a
tampered batch writing into a shared page.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from helpers import assert_refused, full_inputs, full_spec, gdn_spec, nan_state, run
from test_transfer import FAMILIES as TRANSFER_FAMILIES
from test_transfer import Model, prompt

import fnattn as fa

PAGE = 4
A_LEN = 9  # two full pages and one token of a third


def fresh(model):
    return fa.State(model.specs, num_pages=16, page_size=PAGE, max_requests=3, recurrent_ring=2,
                    fill=float("nan"))


def close(got, want, exact=True):
    """Bitwise when the shared rows were computed by a prefill of the same length as the cold run's; else
    within 1e-5 (a 6-token prefill rounds a row's K/V a few ulp differently from a 9-token one, and the layers
    after carry that on: 1.3e-6 on logits of ~0.15 with one CPU's kernels, past the 1e-6 this once had)."""
    if exact:
        assert torch.equal(got, want), (got - want).abs().max()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


FAMILIES = (*TRANSFER_FAMILIES, "llama", "qwen3", "qwen2")


def cases():
    """Every family at A's cursor; a family without recurrent layers also short of it, inside a page (a
    recurrent state is only known at the holder's cursor, `State.admit`)."""
    for family in FAMILIES:
        yield family, A_LEN
        if not fresh(Model(family)).has_recurrent:
            yield family, 6  # ends inside a page, short of A's cursor
    yield "tiny", 8  # exactly two full pages: nothing copied


@pytest.mark.parametrize("family,n", list(cases()))
def test_prefix_hit_equals_cold_run(family, n):
    model = Model(family)
    a_prompt = prompt(model, A_LEN)
    b_prompt = a_prompt[:n] + prompt(model, 5, seed=3)
    a_follow, b_follow = prompt(model, 3, seed=4), prompt(model, 3, seed=5)

    # Cold runs: each request alone in its own State; B's prompt in the same two chunks as with the hit
    # (one chunk differs from two by rounding, ~1 ulp, with or without sharing).
    st = fresh(model).admit(2)
    if n:
        st, _ = model.prefill(st, 2, b_prompt[:n])
    st, cold_b = model.prefill(st, 2, b_prompt[n:])
    _, cold_b_dec = model.decode(st, 2, b_follow)
    st = fresh(model).admit(1)
    st, _ = model.prefill(st, 1, a_prompt)
    _, cold_a_dec = model.decode(st, 1, a_follow)

    st = fresh(model).admit(1)
    st, _ = model.prefill(st, 1, a_prompt)
    st = st.admit(2, prefix_of=1, tokens=n)
    b = st.request(2)
    assert b.length == n and b.pages[: n // PAGE] == st.request(1).pages[: n // PAGE]
    assert all(st.refcount(p) == 2 for p in b.pages[: n // PAGE])
    assert len(b.pages) == -(-n // PAGE) and (n % PAGE == 0 or st.refcount(b.pages[-1]) == 1)
    st = st.reserve({2: len(b_prompt) - n})
    st, got = model.run(st, fa.Batch.prefill(st, {2: len(b_prompt) - n}), b_prompt[n:])
    close(got, cold_b, exact=n == A_LEN)
    # Interleaved: B decodes, then A (whose next page B never wrote), then B again.
    st, got_b1 = model.decode(st, 2, b_follow[:2])
    st, got_a = model.decode(st, 1, a_follow)
    st, got_b2 = model.decode(st, 2, b_follow[2:])
    close(torch.cat([got_b1, got_b2]), cold_b_dec, exact=n == A_LEN)
    close(got_a, cold_a_dec)
    # A's release leaves B the only holder of the pages they shared.
    st = st.release(1)
    assert not st.shared_pages and st.free_pages == 16 - len(st.request(2).pages)
    _, got = model.decode(st, 2, [0])
    assert torch.isfinite(got).all()


def test_recurrent_prefix_only_at_the_cursor():
    model = Model("qwen3_5")
    st = fresh(model).admit(1)
    st, _ = model.prefill(st, 1, prompt(model, A_LEN))
    assert_refused(st, lambda: st.admit(2, prefix_of=1, tokens=8), r"tokens.*recurrent state is only known")
    st2 = st.admit(2, prefix_of=1)  # default: all of A's tokens
    assert st2.request(2).length == A_LEN
    # B's payload (shared pages, a copied tail page and a copied recurrent row) is A's.
    a, b = st2.export_request(1), st2.export_request(2)
    for key, t in a.tensors.items():
        assert torch.equal(t, b.tensors[key]), key


def test_admit_refusals():
    st = nan_state([full_spec()]).admit(0).reserve({0: 5})
    assert_refused(st, lambda: st.admit(1, tokens=3), "tokens")
    assert_refused(st, lambda: st.admit(1, prefix_of=7), "prefix_of")
    assert_refused(st, lambda: st.admit(1, prefix_of=0, tokens=1), "tokens")  # A has 0 cached tokens
    assert_refused(st, lambda: st.admit(1, prefix_of=True), "prefix_of")


def step(ma, spec, st, counts, gen):
    st = st.reserve(counts)
    batch = fa.Batch.decode(st, counts) if set(counts.values()) == {1} else fa.Batch.prefill(st, counts)
    inp = full_inputs(spec, batch.num_tokens, gen=gen)
    _, deltas = run(ma, st, batch, {0: inp})
    return st.apply(deltas), batch, inp


def cached(st, rid):
    """Request ``rid``'s cached K rows, in token order."""
    k = st.views(0).k
    r = st.request(rid)
    rows = (torch.tensor(r.pages, dtype=torch.long)[:, None] * PAGE + torch.arange(PAGE)).flatten()
    return k.flatten(0, 1)[rows[: r.length]]


def check_invariants(st, shadow):
    held = {}
    for r in st.requests.values():
        for p in r.pages:
            held[p] = held.get(p, 0) + 1
    free = set(st._free_pages)
    assert len(free) == len(st._free_pages), "a page freed twice"
    assert not free & set(held), "a page both free and held"
    assert free | set(held) == set(range(1, st.num_pages + 1)), "a leaked page"
    for p in range(1, st.num_pages + 1):
        assert st.refcount(p) == held.get(p, 0)
    assert dict(st.shared_pages) == {p: c for p, c in held.items() if c > 1}
    for rid, rows in shadow.items():
        assert torch.equal(cached(st, rid), rows), f"request {rid}'s cache was overwritten"


def test_random_operations():
    spec = full_spec(hkv=1, d=2)
    ma = fa.ModelAttention([spec])
    rnd, gen = random.Random(0), torch.Generator().manual_seed(0)
    st = fa.State([spec], num_pages=32, page_size=PAGE, max_requests=6)
    shadow: dict[int, torch.Tensor] = {}  # request -> the K rows it must read
    next_id, shares, saved, restored = 0, 0, {}, 0  # saved: request -> (checkpoint, its length)
    for _ in range(4_000):  # some 200 shared admissions and 38 restores
        op = rnd.random()
        ids = sorted(shadow)
        try:
            if op > 0.94 and ids:
                rid = rnd.choice(ids)
                if rid in saved and rnd.random() < 0.5:
                    ck, n = saved.pop(rid)
                    try:
                        st = st.restore(ck)
                        shadow[rid], restored = shadow[rid][:n], restored + 1
                    except ValueError as e:  # pages shared since the checkpoint (or rolled back below it)
                        assert "shared since" in str(e) or "rolled back" in str(e), e
                else:
                    saved[rid] = (st.checkpoint([rid]), st.request(rid).length)
                check_invariants(st, shadow)
                continue
            if op < 0.15 and st.free_slots:
                st, shadow[next_id] = st.admit(next_id), torch.zeros(0, 1, 2)
                next_id += 1
            elif op < 0.35 and st.free_slots and ids:
                other = rnd.choice(ids)
                n = rnd.randint(0, st.request(other).length)
                st = st.admit(next_id, prefix_of=other, tokens=n)
                shadow[next_id] = shadow[other][:n].clone()
                next_id, shares = next_id + 1, shares + 1
            elif op < 0.85 and ids:
                counts = {r: rnd.randint(1, 3) for r in rnd.sample(ids, rnd.randint(1, len(ids)))}
                st, batch, inp = step(ma, spec, st, counts, gen)
                cu = batch.host_cu_seqlens
                for b, rid in enumerate(batch.request_ids):
                    shadow[rid] = torch.cat([shadow[rid], inp.k[cu[b]:cu[b + 1]]])
            elif ids:
                rid = rnd.choice(ids)
                st = st.release(rid)
                del shadow[rid]
                saved.pop(rid, None)
        except fa.PoolExhaustedError:
            pass
        check_invariants(st, shadow)
    assert shares > 150 and restored > 25, (shares, restored)
    for rid in sorted(shadow):
        st = st.release(rid)
    assert st.free_pages == st.num_pages and not st.shared_pages and st.free_slots == st.max_requests


def test_apply_refuses_a_write_into_a_shared_page():
    spec = full_spec()
    ma = fa.ModelAttention([spec])
    gen = torch.Generator().manual_seed(0)
    st, _, _ = step(ma, spec, nan_state([spec]).admit(0), {0: 9}, gen)
    st = st.admit(1, prefix_of=0, tokens=8).reserve({1: 1})
    shared = st.request(0).pages[1]
    assert st.refcount(shared) == 2
    batch = fa.Batch.decode(st, [1])
    _, deltas = run(ma, st, batch, {0: full_inputs(spec, 1, gen=gen)})
    bad = dataclasses.replace(batch, slot_mapping=torch.tensor([shared * PAGE + 3]))
    tampered = fa.StepDeltas(bad, deltas.writes, deltas.cursor)
    assert_refused(st, lambda: st.apply(tampered), r"batch.*shared prefix pages are read-only")
    st.apply(deltas)  # the untampered step goes through


def test_restore_refuses_a_rollback_into_pages_shared_since():
    spec = full_spec()
    ma = fa.ModelAttention([spec])
    gen = torch.Generator().manual_seed(0)
    st, _, _ = step(ma, spec, nan_state([spec]).admit(0), {0: 5}, gen)
    ck = st.checkpoint([0])
    st, _, _ = step(ma, spec, st, {0: 4}, gen)
    st = st.admit(1, prefix_of=0, tokens=8)  # shares A's pages 0 and 1; A's checkpoint is at 5 tokens
    assert_refused(st, lambda: st.restore(ck), r"checkpoint.*shared since")
    st = st.restore(st.checkpoint([0, 1]))  # a checkpoint at the cursors is fine
    st = st.release(1).restore(ck)
    assert st.request(0).length == 5


def test_recurrent_only_state_shares_its_slot_row():
    spec = gdn_spec()
    st = nan_state([spec]).admit(0)
    assert_refused(st, lambda: st.admit(1, prefix_of=0, tokens=1), "tokens")
    st = st.admit(1, prefix_of=0)
    assert st.request(1).length == 0 and st.request(1).pages == ()
