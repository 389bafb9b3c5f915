"""paged_decode / paged_prefill with ``invariant=True``: a token's output is the same bits in a decode step, in a
verify step (among its request's drafts), in a prefill (a whole sequence, or a chunk of it), alone or beside other
requests; and
it is the reference attention to rounding. Pool rows no step may read are NaN, so a stray read shows."""

import itertools
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels import paged_attention  # noqa: E402
from fnattn.kernels.paged_attention import paged_decode, paged_prefill, paged_prefill_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CACHED = [0, 5, 37, 70]  # past one 64-key tile, and past two of fp32's 32-key tiles
NEW = [1, 3, 4, 2]  # a verify's 1 + drafts per request
# The prefill: the short requests from their first token, the long ones as a chunk from before their cache's end
# (fresh keys across a key tile's edge; a whole 72-token prefill would take most of an interpreted case's time).
PREFILL_FROM = [0, 0, 30, 64]
S, D = 4, 16


def randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


class Sequences:
    """Every request's whole sequence (cached then new tokens) and one page layout for all of it; ``totals``:
    each request's length (default: `CACHED` + `NEW`)."""

    def __init__(self, Hq, Hkv, dtype, totals=None):
        self.total = [c + n for c, n in zip(CACHED, NEW)] if totals is None else list(totals)
        self.k = [randn(t, Hkv, D, dtype=dtype, seed=10 + b) for b, t in enumerate(self.total)]
        self.v = [randn(t, Hkv, D, dtype=dtype, seed=20 + b) for b, t in enumerate(self.total)]
        self.q = [randn(t, Hq, D, dtype=dtype, seed=30 + b) for b, t in enumerate(self.total)]
        pages = [-(-t // S) for t in self.total]
        order = torch.randperm(sum(pages) + 2, generator=torch.Generator().manual_seed(0)) + 1  # page 0: null
        self.table = torch.zeros(len(pages), max(pages) + 1, dtype=torch.int32)
        used = 0
        for b, n in enumerate(pages):
            self.table[b, :n] = order[used:used + n].int()
            used += n
        self.table = self.table.to(DEVICE)
        self.pool_pages, self.Hkv, self.dtype = sum(pages) + 3, Hkv, dtype

    def pools(self, held):
        """K and V pools holding the first ``held[b]`` tokens of each request, NaN everywhere else."""
        k = torch.full((self.pool_pages, S, self.Hkv, D), float("nan"), dtype=self.dtype, device=DEVICE)
        v = torch.full_like(k, float("nan"))
        for b, n in enumerate(held):
            t = torch.arange(n, device=DEVICE)
            pages = self.table[b, t // S].long()
            k[pages, t % S], v[pages, t % S] = self.k[b][:n], self.v[b][:n]
        return k, v

    def step(self, requests, held, new, *, invariant=True, **kw):
        """One varlen step: request ``requests[i]`` holds ``held[i]`` tokens and brings ``new[i]`` more."""
        k_pool, v_pool = self.pools([held[requests.index(b)] if b in requests else 0
                                     for b in range(len(self.total))])
        rows = lambda xs: torch.cat([xs[b][h:h + n] for b, h, n in zip(requests, held, new)])  # noqa: E731
        cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        lens = torch.tensor(held, dtype=torch.int32, device=DEVICE)
        args = (rows(self.q), rows(self.k), rows(self.v), cu, k_pool, v_pool, self.table[requests], lens)
        if invariant and all(n == 1 for n in new) and kw.pop("as_decode", False):
            return paged_decode(args[0], k_pool, v_pool, self.table[requests], lens, k_new=args[1], v_new=args[2],
                                invariant=True, **kw)
        kw.pop("as_decode", None)
        fn = paged_prefill_ref if invariant is None else paged_prefill
        extra = {} if invariant is None else {"invariant": invariant, "max_new_len": max(new)}
        return fn(*args, **extra, **kw)


DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
HEADS = {"mha": (2, 2), "gqa4": (8, 2)}
FEATURES = ("plain", "window", "softcap+sinks")
# Every combination on CUDA; interpreted, a covering set in which each pair of (dtype, heads, features) values
# meets at least once (half the cases: the interpreter takes ~15 s a case).
CASES = [(f, h, d) for f in FEATURES for h in HEADS for d in DTYPES] if DEVICE == "cuda" else [
    ("plain", "mha", "fp32"), ("plain", "gqa4", "fp16"), ("window", "mha", "fp16"), ("window", "gqa4", "fp32"),
    ("softcap+sinks", "mha", "fp32"), ("softcap+sinks", "gqa4", "fp16")]


def check_every_phase_and_batch(features, heads, dtype, launches=(None,)):
    """Verify, prefill, decode alone and decode beside the others: the same bits for every token, and the
    reference to rounding. ``launches``: the ``num_splits`` each invariant call takes in turn (1: a token's
    splits in one program; 2: as programs of their own; None: chosen by the grid)."""
    heads, dtype = HEADS[heads], DTYPES[dtype]
    Hq, Hkv = heads
    seq = Sequences(Hq, Hkv, dtype)
    kw = dict(scale=D ** -0.5)
    if features == "window":
        kw["sliding_window"] = 6
    if features == "softcap+sinks":
        kw.update(softcap=20.0, sinks=randn(Hq, dtype=torch.float32, seed=5))
    turn = itertools.cycle(launches)
    ids = list(range(len(CACHED)))
    verify_o, verify_lse = seq.step(ids, CACHED, NEW, num_splits=next(turn), **kw)
    prefill_new = [t - h for t, h in zip(seq.total, PREFILL_FROM)]
    prefill_o, prefill_lse = seq.step(ids, PREFILL_FROM, prefill_new, num_splits=next(turn), **kw)
    ref_o, ref_lse = seq.step(ids, CACHED, NEW, invariant=None, **kw)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(verify_o.float(), ref_o.float(), **tol)
    torch.testing.assert_close(verify_lse, ref_lse, **tol)
    first_row = [sum(NEW[:b]) for b in ids]  # a request's first new token's row in the verify
    for b in ids:  # alone: each request's first and last new token (its first and last position in the verify)
        for i in sorted({0, NEW[b] - 1}):
            alone = seq.step([b], [CACHED[b] + i], [1], as_decode=True, num_splits=next(turn), **kw)
            assert torch.equal(alone[0][0], verify_o[first_row[b] + i]), (b, i)
            assert torch.equal(alone[1][0], verify_lse[first_row[b] + i]), (b, i)
    for i in range(max(NEW)):  # together: every request decodes its i-th new token (its last, if it has fewer)
        at = [min(i, n - 1) for n in NEW]
        together = seq.step(ids, [c + j for c, j in zip(CACHED, at)], [1] * len(ids), as_decode=True,
                            num_splits=next(turn), **kw)
        for b, j in zip(ids, at):
            in_prefill = sum(prefill_new[:b]) + CACHED[b] + j - PREFILL_FROM[b]
            for o, lse, r in ((together[0], together[1], b), (prefill_o, prefill_lse, in_prefill)):
                assert torch.equal(o[r], verify_o[first_row[b] + j]), (b, j, r)
                assert torch.equal(lse[r], verify_lse[first_row[b] + j]), (b, j, r)


# Interpreted, two of the cases above with splits in place of their plain run (fp32 with sinks, fp16 with a window).
SPLIT_CASES = CASES if DEVICE == "cuda" else [("window", "mha", "fp16"), ("softcap+sinks", "mha", "fp32")]
PLAIN_CASES = CASES if DEVICE == "cuda" else [c for c in CASES if c not in SPLIT_CASES]


@pytest.mark.parametrize("features, heads, dtype", PLAIN_CASES, ids=["-".join(c) for c in PLAIN_CASES])
def test_a_token_is_the_same_bits_in_every_phase_and_batch(features, heads, dtype):
    check_every_phase_and_batch(features, heads, dtype)


@pytest.mark.parametrize("features, heads, dtype", SPLIT_CASES, ids=["-".join(c) for c in SPLIT_CASES])
def test_keys_in_several_splits_are_the_same_bits_wherever_the_splits_run(features, heads, dtype, monkeypatch):
    """Splits of one key tile (32 keys in fp32, 64 in fp16): the contexts here span up to three. Each call
    takes the next launch form in turn, so a token's verify, prefill and decodes mix them."""
    monkeypatch.setattr(paged_attention, "INVARIANT_SPLIT_KEYS", 32 if dtype == "fp32" else 64)
    check_every_phase_and_batch(features, heads, dtype, launches=(2, 1, None))


def test_the_split_arithmetic_is_not_the_unsplit_one(monkeypatch):
    """The splits change a long context's rounding (so the test above compares launches that do split)."""
    seq = Sequences(2, 2, torch.float32)
    whole = seq.step([3], [70], [2], scale=D ** -0.5)
    monkeypatch.setattr(paged_attention, "INVARIANT_SPLIT_KEYS", 32)
    apart = seq.step([3], [70], [2], scale=D ** -0.5, num_splits=2)
    torch.testing.assert_close(apart[0], whole[0], rtol=1e-5, atol=1e-5)
    assert not torch.equal(apart[0], whole[0])


@settings(max_examples=4, deadline=None)
@given(P=st.integers(2, 80), cached=st.floats(0, 1), launch=st.sampled_from([None, 1, 2]),
       others=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 4)), max_size=2), last=st.booleans())
def test_a_token_s_bits_follow_nothing_but_its_context(P, cached, launch, others, last):
    """Over batch compositions: a request of P tokens, any part of them cached and the rest new, beside any
    others, first or last in the step, its keys in 32-key splits walked in one program, as programs of their
    own or as the grid chooses: its last token is the bits of its decode alone (the splits in one program)."""
    c = int(cached * (P - 1))
    seq = Sequences(2, 2, torch.float32, totals=[P, *(oc + on for oc, on in others)])  # request 0: the one followed
    order = [*range(1, len(others) + 1), 0] if last else [0, *range(1, len(others) + 1)]
    held = {0: c, **{b + 1: oc for b, (oc, _) in enumerate(others)}}
    new = {0: P - c, **{b + 1: on for b, (_, on) in enumerate(others)}}
    was = paged_attention.INVARIANT_SPLIT_KEYS
    paged_attention.INVARIANT_SPLIT_KEYS = 32  # fp32's key tile: the contexts span up to three splits
    try:
        o, lse = seq.step(order, [held[b] for b in order], [new[b] for b in order], scale=D ** -0.5,
                          num_splits=launch)
        alone = seq.step([0], [P - 1], [1], as_decode=True, scale=D ** -0.5, num_splits=1)
    finally:
        paged_attention.INVARIANT_SPLIT_KEYS = was
    row = sum(new.values()) - 1 if last else P - c - 1  # the followed request's last new token
    assert torch.equal(o[row], alone[0][0]) and torch.equal(lse[row], alone[1][0])


def test_the_invariant_decode_needs_the_steps_own_token():
    seq = Sequences(2, 2, torch.float32)
    k_pool, v_pool = seq.pools(CACHED)
    lens = torch.tensor(CACHED, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="k_new / v_new: the invariant launch needs"):
        paged_decode(randn(4, 2, D, dtype=torch.float32, seed=1), k_pool, v_pool, seq.table, lens, scale=0.25,
                     invariant=True)
