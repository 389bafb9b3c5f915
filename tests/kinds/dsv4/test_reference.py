"""The DeepSeek-V4 reference backends against a brute-force oracle written from the definitions.

The oracle keeps every raw row of a request and recomputes, for each token,
its window, the compressed entries it may see (HCA: every closed window; CSA:
the indexer's top-k of them) and the attention with sinks, one token at a
time and without any cache. The backends must match it for a prefill, a
chunked prefill, decodes and verifies, and leave storage that does not depend
on how the tokens were split into steps.
"""

from __future__ import annotations

import pytest
import torch
from helpers import same_bits

import fnattn as fa
from fnattn.kinds.dsv4 import DSV4Config, DSV4Inputs
from fnattn.kinds.dsv4.math import rms_norm_fp32w, rope_cos_sin, rope_tail
from fnattn.speculative import replay_writes

H, D, R, W = 2, 16, 8, 5
IX = fa.IndexerConfig(num_heads=3, head_dim=8, topk=2, rope_head_dim=R)
CONFIGS = {
    "sliding": DSV4Config(num_heads=H, head_dim=D, qk_rope_head_dim=R, sliding_window=W, compress_ratio=0),
    "csa": DSV4Config(num_heads=H, head_dim=D, qk_rope_head_dim=R, sliding_window=W, compress_ratio=4, indexer=IX),
    "hca": DSV4Config(num_heads=H, head_dim=D, qk_rope_head_dim=R, sliding_window=W, compress_ratio=6,
                      compressor="hca"),
}
INV_FREQ = 1.0 / 1000.0 ** (torch.arange(0, R, 2, dtype=torch.float32) / R)


class Stream:
    """Fixed random per-position inputs of one request (a pure function of the position)."""

    def __init__(self, c: DSV4Config, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        ov = c.overlap
        self.c = c
        self.q = torch.randn(n, H, D, generator=g)
        self.kv = torch.randn(n, D, generator=g)
        self.ckv = torch.randn(n, ov * D, generator=g)
        self.cgate = torch.randn(n, ov * D, generator=g)
        self.iq = torch.randn(n, IX.num_heads, IX.head_dim, generator=g)
        self.iw = torch.randn(n, IX.num_heads, generator=g)
        self.ikv = torch.randn(n, 2 * IX.head_dim, generator=g)
        self.igate = torch.randn(n, 2 * IX.head_dim, generator=g)
        g2 = torch.Generator().manual_seed(99)
        self.sinks = torch.randn(H, generator=g2)
        self.cnorm = 1 + 0.1 * torch.randn(D, generator=g2)
        self.inorm = 1 + 0.1 * torch.randn(IX.head_dim, generator=g2)

    def inputs(self, rows: list[tuple["Stream", int, int]]) -> DSV4Inputs:
        """Inputs for a batch: ``rows`` = (stream, first position, count) per request in batch order."""
        c = self.c

        def cat(name):
            return torch.cat([getattr(s, name)[a:a + n] for s, a, n in rows])

        kw = dict(q=cat("q"), kv=cat("kv"), sinks=self.sinks)
        if c.compress_ratio:
            kw.update(comp_kv=cat("ckv"), comp_gate=cat("cgate"), comp_norm=self.cnorm, comp_inv_freq=INV_FREQ)
        if c.indexer is not None:
            kw.update(index_q=cat("iq"), index_w=cat("iw"), index_kv=cat("ikv"), index_gate=cat("igate"),
                      index_norm=self.inorm)
        return DSV4Inputs(**kw)


def oracle_entry(s: Stream, w: int, kv: torch.Tensor, gate: torch.Tensor, norm: torch.Tensor, Dh: int) -> torch.Tensor:
    """Entry of window ``w`` written out: slots of the window (CSA: second halves, after the first halves of
    the previous window), a per-channel softmax, the norm, the rope at the window's first position."""
    m, ov = s.c.compress_ratio, s.c.overlap
    if ov == 1:
        rows_kv, rows_g = kv[w * m:(w + 1) * m], gate[w * m:(w + 1) * m]
    else:
        cur_kv, cur_g = kv[w * m:(w + 1) * m, Dh:], gate[w * m:(w + 1) * m, Dh:]
        if w:
            prev_kv, prev_g = kv[(w - 1) * m:w * m, :Dh], gate[(w - 1) * m:w * m, :Dh]
            rows_kv, rows_g = torch.cat((prev_kv, cur_kv)), torch.cat((prev_g, cur_g))
        else:
            rows_kv, rows_g = cur_kv, cur_g
    pooled = (rows_kv * rows_g.softmax(dim=0)).sum(0, keepdim=True)
    cos, sin = rope_cos_sin(torch.tensor([w * m]), INV_FREQ, torch.float32)
    return rope_tail(rms_norm_fp32w(pooled, norm, s.c.norm_eps), cos, sin)[0]


def oracle(s: Stream, n: int) -> torch.Tensor:
    """``o [n, H, D]`` of positions 0..n-1, token by token."""
    c, out = s.c, []
    m = c.compress_ratio
    for t in range(n):
        keys = [s.kv[j] for j in range(max(0, t - W + 1), t + 1)]
        nw = (t + 1) // m if m else 0
        entries = [oracle_entry(s, w, s.ckv, s.cgate, s.cnorm, D) for w in range(nw)]
        if c.indexer is not None and entries:
            ikeys = torch.stack([oracle_entry(s, w, s.ikv, s.igate, s.inorm, IX.head_dim) for w in range(nw)])
            score = (torch.relu(s.iq[t] @ ikeys.T) * IX.head_dim ** -0.5 * s.iw[t][:, None]).sum(0)
            order = sorted(range(nw), key=lambda w: (-float(score[w]), w))[:IX.topk]
            entries = [entries[w] for w in sorted(order)]
        K = torch.stack(keys + entries)
        logits = torch.cat(((s.q[t] @ K.T) * c.scale, s.sinks[:, None]), dim=1)  # [H, K + 1]
        out.append(logits.softmax(-1)[:, :-1] @ K)
    return torch.stack(out)


def new_state(c, requests=2, ring=2):
    specs = (fa.LayerSpec(0, c, torch.float32),)
    st = fa.State(specs, num_pages=40, page_size=4, max_requests=requests, recurrent_ring=ring, fill=float("nan"))
    for r in range(requests):
        st = st.admit(r)
    return st, fa.ModelAttention(specs)


def step(st, ma, batch, inputs):
    with ma.session(st, batch) as s:
        out, w = s.forward(0, inputs)
    return out, w, s


def feed(st, ma, streams, counts, phase="prefill"):
    """One step feeding ``counts[r]`` tokens of request r after its cursor; ``-> (state, o)``."""
    st = st.reserve(counts)
    batch = fa.Batch.prefill(st, counts) if phase == "prefill" else fa.Batch.decode(st, list(counts))
    rows = [(streams[r], st.request(r).length, counts[r]) for r in batch.request_ids]
    out, w, _ = step(st, ma, batch, streams[0].inputs(rows))
    return st.apply(fa.StepDeltas.collect(batch, [w])), out.o


@pytest.mark.parametrize("name", list(CONFIGS))
def test_storage_declares_window_entries_and_compressor_state(name):
    c = CONFIGS[name]
    decl = {d.name: (d.space, d.shape, d.dtype) for d in c.storage(torch.bfloat16)}
    assert decl["kv"] == ("token", (D,), torch.bfloat16)
    if name == "sliding":
        assert set(decl) == {"kv"}
        return
    assert decl["comp"] == ("token", (D,), torch.bfloat16)
    assert decl["comp_state"] == ("request", (c.overlap * c.compress_ratio, 2, c.overlap * D), torch.float32)
    assert ("index_k" in decl) == ("index_state" in decl) == (name == "csa")
    if name == "csa":
        assert decl["index_state"] == ("request", (8, 2, 2 * IX.head_dim), torch.float32)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_of_mixed_lengths_matches_the_oracle(name):
    c = CONFIGS[name]
    streams = {0: Stream(c, 40, 1), 1: Stream(c, 40, 2)}
    st, ma = new_state(c)
    st, o = feed(st, ma, streams, {0: 23, 1: 3})
    torch.testing.assert_close(o[:23], oracle(streams[0], 23), atol=1e-5, rtol=0)
    torch.testing.assert_close(o[23:], oracle(streams[1], 3), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["csa", "hca"])
def test_chunks_and_decodes_match_the_oracle_and_leave_the_same_storage(name):
    c = CONFIGS[name]
    streams = {0: Stream(c, 40, 3), 1: Stream(c, 40, 4)}
    want = oracle(streams[0], 30)
    one, ma = new_state(c)
    one, o = feed(one, ma, streams, {0: 30})
    torch.testing.assert_close(o, want, atol=1e-5, rtol=0)
    split, _ = new_state(c)
    outs = []
    for n in (5, 1, 7, 3):  # chunks ending inside and at window boundaries
        split, o = feed(split, ma, streams, {0: n})
        outs.append(o)
    for _ in range(14):
        split, o = feed(split, ma, streams, {0: 1}, phase="decode")
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), want, atol=1e-5, rtol=0)
    for name_ in one.views(0):
        a, b = _request_rows(one, name_), _request_rows(split, name_)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def _request_rows(st, name):
    from fnattn.kinds.full.reference import cached_tokens

    r, v = st.request(0), st.views(0)[name]
    if st.storage_spaces[0][name] == "token":
        return cached_tokens(v, torch.tensor(r.pages), r.length, st.page_size)
    return v[r.ring_pos * st.slots_per_ring + r.slot]


def test_entry_rows_sit_at_the_closing_tokens_and_are_zero_elsewhere():
    c = CONFIGS["hca"]
    s = {0: Stream(c, 20, 5)}
    st, ma = new_state(c, requests=1)
    st, _ = feed(st, ma, s, {0: 13})
    rows = _request_rows(st, "comp")
    for t in range(13):
        if (t + 1) % 6 == 0:
            torch.testing.assert_close(rows[t], oracle_entry(s[0], (t + 1) // 6 - 1, s[0].ckv, s[0].cgate,
                                                             s[0].cnorm, D), atol=1e-6, rtol=0)
        else:
            assert not rows[t].any()


@pytest.mark.parametrize("ring", [2, 6])
def test_verify_native_states_equal_the_decodes_and_replay_writes_none(ring):
    c = CONFIGS["csa"]
    streams = {0: Stream(c, 30, 6)}
    st, ma = new_state(c, requests=1, ring=ring)
    st, _ = feed(st, ma, streams, {0: 10})
    seq, _ = new_state(c, requests=1, ring=ring)
    seq, _ = feed(seq, ma, streams, {0: 10})
    st = st.reserve({0: 4})
    batch = fa.Batch.verify(st, [0], num_draft=3)
    out, w, _ = step(st, ma, batch, streams[0].inputs([(streams[0], 10, 4)]))
    torch.testing.assert_close(out.o, oracle(streams[0], 14)[10:], atol=1e-5, rtol=0)
    assert w["comp_state"].shape[0] == 4 and out.replay is not None
    for i in range(4):
        seq, _ = feed(seq, ma, streams, {0: 1}, phase="decode")
        for name in ("comp_state", "index_state"):
            assert same_bits(w[name][i], _request_rows(seq, name)), (i, name)
    rb = fa.Batch.verify(st, [0], num_draft=3, recovery="replay")
    out_r, w_r, s = step(st, ma, rb, streams[0].inputs([(streams[0], 10, 4)]))
    assert set(w_r.values) == {"kv", "comp", "index_k"} and same_bits(out_r.o, out.o)
    replay = replay_writes(ma, st, rb, s.replay_outputs, {0: 3})
    after = st.apply(fa.StepDeltas.collect(rb, [w_r]).accept(rb, {0: 3}, replay=replay), inplace=False)
    native = st.apply(fa.StepDeltas.collect(batch, [w]).accept(batch, {0: 3}))
    for name in after.views(0):
        assert same_bits(_request_rows(after, name), _request_rows(native, name)), name


def test_index_ties_go_to_the_earlier_entry():
    c = CONFIGS["csa"]
    s = Stream(c, 30, 7)
    s.iw.fill_(0.0)  # every score 0: the top-2 are the two earliest visible entries
    st, ma = new_state(c, requests=1)
    st = st.reserve({0: 25})
    batch = fa.Batch.prefill(st, {0: 25})
    out, _, _ = step(st, ma, batch, s.inputs([(s, 0, 25)]))
    assert out.topk_indices[24].tolist() == [0, 1]
    assert out.topk_indices[2].tolist() == [-1, -1] and out.topk_indices[3].tolist() == [0, -1]


def test_sinks_take_the_mass_they_are_given():
    c = CONFIGS["sliding"]
    s = {0: Stream(c, 8, 8)}
    s[0].sinks = torch.full((H,), 80.0)
    st, ma = new_state(c, requests=1)
    _, o = feed(st, ma, s, {0: 8})
    assert o.abs().max() < 1e-20


@pytest.mark.parametrize("field, change, match", [
    ("comp_kv", None, "comp_kv"), ("index_q", "drop", "index_q"), ("comp_gate", "half", "comp_gate"),
    ("sinks", None, "sinks")])
def test_bad_inputs_name_the_field(field, change, match):
    c = CONFIGS["csa"] if field != "index_q" else CONFIGS["hca"]
    s = Stream(c, 8, 9)
    st, ma = new_state(c, requests=1)
    st = st.reserve({0: 4})
    batch = fa.Batch.prefill(st, {0: 4})
    inputs = s.inputs([(s, 0, 4)])
    import dataclasses

    if change == "drop":  # an indexer input given to a layer without one
        inputs = dataclasses.replace(inputs, index_q=torch.zeros(4, IX.num_heads, IX.head_dim))
    elif change == "half":
        inputs = dataclasses.replace(inputs, comp_gate=inputs.comp_gate.half())
    else:
        inputs = dataclasses.replace(inputs, **{field: None})
    with pytest.raises(ValueError, match=f"`{match}`"):
        step(st, ma, batch, inputs)


@pytest.mark.parametrize("kw, field", [(dict(compress_ratio=1), "compress_ratio"),
                                       (dict(compress_ratio=8), "compress_ratio"),
                                       (dict(compress_ratio=8, compressor="csa"), "indexer"),
                                       (dict(compress_ratio=0, compressor="hca"), "compressor"),
                                       (dict(compress_ratio=4, compressor="xyz", indexer=IX), "compressor"),
                                       (dict(compress_ratio=128, indexer=IX), "indexer"),
                                       (dict(compress_ratio=0, qk_rope_head_dim=7), "qk_rope_head_dim")])
def test_config_invariants_name_the_field(kw, field):
    base = dict(num_heads=H, head_dim=D, qk_rope_head_dim=R, sliding_window=W)
    with pytest.raises(ValueError, match=f"`{field}`"):
        DSV4Config(**{**base, **kw})
