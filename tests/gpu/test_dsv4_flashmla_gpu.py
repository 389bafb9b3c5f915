"""DeepSeek-V4's FlashMLA sparse path against the reference on a GPU (bf16).

Layers with FlashMLA's 512-dim K=V head: sliding, CSA (ratio 4, an indexer) and HCA (ratio 128), with
4 query heads (padded to 64 by the caller, `DSV4Config.padded_heads`) and V4-Flash's 64, V4-Flash's
window of 128. Requests hold
0, 1, 130 and 700 cached tokens (so windows and entries come from the pools and from the step), then
each phase runs once through both paths over the same State: outputs within 2e-2 of the reference's
scale, the same top-k and bitwise-equal writes. Last, a whole tiny DeepSeek-V4 model with 512-dim heads
decodes 8 steps through both paths (fed the same tokens; logits within 0.1 of their scale).
"""

from __future__ import annotations

import pytest
import torch

import fnattn as fa
from fnattn.driver import run_step
from fnattn.kinds.dsv4 import DSV4Config, DSV4Inputs

pytestmark = pytest.mark.gpu
DEV, TOL, D, R = "cuda", 2e-2, 512, 64
CACHED = [0, 1, 130, 700]


def config(kind: str, heads: int) -> DSV4Config:
    base = dict(num_heads=heads, head_dim=D, qk_rope_head_dim=R, sliding_window=128,
                padded_heads=64 if heads < 64 else None)
    if kind == "sliding":
        return DSV4Config(**base, compress_ratio=0)
    if kind == "csa":
        return DSV4Config(**base, compress_ratio=4,
                          indexer=fa.IndexerConfig(num_heads=8, head_dim=128, topk=64, rope_head_dim=R))
    return DSV4Config(**base, compress_ratio=128)


def inputs(c: DSV4Config, T: int, seed: int) -> DSV4Inputs:
    g = torch.Generator(device=DEV).manual_seed(seed)

    def r(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)

    # q scaled down: logits of O(1), so each query spreads over its window and entries
    H, Hp = c.num_heads, c.heads  # padding heads: zero queries and sinks that take no weight, as a model pads
    q = torch.nn.functional.pad(r(T, H, D, scale=0.05), (0, 0, 0, Hp - H))
    sinks = torch.nn.functional.pad(r(H, dtype=torch.float32), (0, Hp - H), value=float("-inf"))
    kw = dict(q=q, kv=r(T, D), sinks=sinks)
    if c.compress_ratio:
        ov = c.overlap
        kw.update(comp_kv=r(T, ov * D), comp_gate=r(T, ov * D, dtype=torch.float32),
                  comp_norm=1 + r(D, dtype=torch.float32, scale=0.1),
                  comp_inv_freq=1.0 / 160000.0 ** (torch.arange(0, R, 2, device=DEV, dtype=torch.float32) / R))
    if c.indexer is not None:
        ix = c.indexer
        kw.update(index_q=r(T, ix.num_heads, ix.head_dim, scale=0.1), index_w=r(T, ix.num_heads, dtype=torch.float32),
                  index_kv=r(T, 2 * ix.head_dim), index_gate=r(T, 2 * ix.head_dim, dtype=torch.float32),
                  index_norm=1 + r(ix.head_dim, dtype=torch.float32, scale=0.1))
    return DSV4Inputs(**kw)


def filled(spec, *, extra=8):
    st = fa.State((spec,), num_pages=64, page_size=64, max_requests=len(CACHED), device=DEV, fill=float("nan"))
    counts = {}
    for r, n in enumerate(CACHED):
        st = st.admit(r)
        if n:
            counts[r] = n
    st = st.reserve(counts)
    ma = fa.ModelAttention((spec,), prefer=("reference",), device=DEV)
    b = fa.Batch.prefill(st, counts)
    with ma.session(st, b) as s:
        _, w = s.forward(0, inputs(spec.config, b.num_tokens, 0))
    return st.apply(fa.StepDeltas.collect(b, [w])).reserve({r: extra for r in range(len(CACHED))})


@pytest.mark.parametrize("heads", [4, 64])
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("phase, k", [("prefill", 0), ("decode", 0), ("verify", 1), ("verify", 3)])
def test_flashmla_matches_reference(kind, heads, phase, k, record):
    spec = fa.LayerSpec(0, config(kind, heads), torch.bfloat16)
    st = filled(spec)
    ids = list(range(len(CACHED)))
    if phase == "prefill":
        b = fa.Batch.prefill(st, {r: 5 for r in ids})
    elif phase == "decode":
        b = fa.Batch.decode(st, ids)
    else:
        b = fa.Batch.verify(st, ids, num_draft=k)
    x = inputs(spec.config, b.num_tokens, 1)
    res = {}
    for name in ("reference", "flashmla"):
        ma = fa.ModelAttention((spec,), prefer=(name,), device=DEV)
        assert ma.backend(0, phase).name == name, ma.explain()
        with ma.session(st, b) as s:
            res[name] = s.forward(0, x)
    (o_r, w_r), (o_f, w_f) = res["reference"], res["flashmla"]
    H = spec.config.num_heads  # the layer's own heads (the padding ones are dropped by a model)
    err = float((o_f.o[:, :H].float() - o_r.o[:, :H].float()).abs().max() / o_r.o[:, :H].float().abs().max())
    same = all(torch.equal(w_f[n], w_r[n]) for n in w_r.values)
    # as sets: decode scores with the paged Triton indexer and selects with sgl_kernel's top-k (its picks in entry
    # order), the reference best first
    topk_ok = o_r.topk_indices is None or torch.equal(o_f.topk_indices.sort(dim=-1).values,
                                                      o_r.topk_indices.sort(dim=-1).values)
    ok = bool(torch.isfinite(o_f.o).all()) and err <= TOL and same and topk_ok
    record({"case": f"dsv4 {kind} h{heads} {phase} k{k}", "o_rel": err, "writes_equal": same, "topk_equal": topk_ok,
            "ok": ok})
    assert ok, (err, same, topk_ok)


def test_whole_model_decodes_through_flashmla(record):
    import dataclasses

    from fnattn.models.registry import Model, family_named, random_checkpoint

    fam = family_named("deepseek_v4")
    raw = {**fam.tiny_config(), "head_dim": D, "partial_rotary_factor": R / D,
           "num_attention_heads": 4, "q_lora_rank": 64, "index_head_dim": 128, "sliding_window": 16,
           "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}}
    cfg = dataclasses.replace(fam.adapt(raw), dtype=torch.bfloat16, padded_heads=64)
    m = Model(fam, cfg, fam.load(cfg, random_checkpoint(fam, cfg, seed=3, dtype=torch.bfloat16, device=DEV)))
    prompt = list(range(3, 40))
    logits, fed = {}, []  # both paths are fed the reference's greedy tokens
    for name in ("reference", "flashmla"):
        ma = fa.ModelAttention(m.specs, prefer=(name,), device=DEV)
        st = fa.State(m.specs, num_pages=16, page_size=64, max_requests=1, device=DEV).admit(0)
        st = st.reserve({0: len(prompt)})
        st, lg = run_step(m.step, m.params, ma, st, fa.Batch.prefill(st, {0: len(prompt)}),
                          torch.tensor(prompt, device=DEV))
        out = [lg[-1:]]
        if not fed:
            fed.append(int(lg[-1].argmax()))
        for i in range(8):
            st = st.reserve({0: 1})
            st, lg = run_step(m.step, m.params, ma, st, fa.Batch.decode(st, [0]),
                              torch.tensor([fed[i]], device=DEV))
            out.append(lg)
            if len(fed) == i + 1:
                fed.append(int(lg[0].argmax()))
        logits[name] = torch.cat(out)
    err = float((logits["flashmla"] - logits["reference"]).abs().max() / logits["reference"].abs().max())
    ok = err <= 0.1  # bf16 end to end: the reference's own bf16 products differ from the kernel's fp32 ones
    record({"case": "dsv4 whole tiny model, 512-dim heads, prefill + 8 decodes", "o_rel": err, "ok": ok})
    assert ok, err


def test_captured_decode_replays_bitwise_like_the_capture_free_step(record):
    """A tiny DeepSeek-V4 with 512-dim heads decodes 24 steps as CUDA-graph replays and capture-free: the
    FlashMLA decode (compressor, indexer top-k and attention) runs inside the graph."""
    import dataclasses

    from fnattn.models.registry import family_named, random_weights

    from fnattn.graph import StepRunner

    fam = family_named("deepseek_v4")
    raw = {**fam.tiny_config(), "head_dim": D, "partial_rotary_factor": R / D, "q_lora_rank": 64,
           "index_head_dim": 128, "sliding_window": 16,
           "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}}
    cfg = dataclasses.replace(fam.adapt(raw), dtype=torch.bfloat16, padded_heads=64)
    params = fam.load(cfg, {**random_weights(fam.weight_shapes(cfg), seed=0, dtype=torch.bfloat16, device=DEV),
                            **{n: torch.randint(0, b, s, device=DEV) for n, (s, b) in fam.index_shapes(cfg).items()}})
    attn = fa.ModelAttention(cfg.specs, device=DEV)
    assert all(attn.backend(s.index, "decode").name == "flashmla" for s in cfg.specs), attn.explain()
    runs = {}
    for capture in (True, False):
        runner = StepRunner(fam.step, params, attn, fam.manifest(cfg), capture=capture, max_context=256,
                            buckets=(2, 4))
        st = fa.State(cfg.specs, num_pages=24, page_size=64, max_requests=4, device=DEV, fill=float("nan"))
        st = st.admit(0).admit(1).reserve({0: 11, 1: 3})
        b = fa.Batch.prefill(st, {0: 11, 1: 3})
        with attn.session(st, b) as s:
            logits, d = fam.step(params, s, torch.arange(1, 15, device=DEV))
        st = st.apply(d)
        last, seen = {0: int(logits[10].argmax()), 1: int(logits[13].argmax())}, []
        for _ in range(24):
            st = st.reserve({0: 1, 1: 1})
            st, logits = runner.decode(st, [0, 1], torch.tensor([last[0], last[1]], device=DEV))
            seen.append(logits.clone())
            last = {0: int(logits[0].argmax()), 1: int(logits[1].argmax())}
        runs[capture] = seen
    equal = all(torch.equal(a, b) for a, b in zip(runs[True], runs[False]))
    record({"case": "dsv4 graph == capture-free, 24 decode steps", "bitwise": equal, "ok": equal})
    assert equal


@pytest.mark.parametrize("new", [1, 4], ids=["decode", "verify k3"])
@pytest.mark.parametrize("topk", [512, 1024])
def test_csa_indexer_at_the_real_shape(topk, new, record):
    """The CSA indexer as DeepSeek-V4 runs it (64 index heads of 128, entries every 4 tokens, top-k 512 or 1024):
    the paged Triton scores and sgl_kernel's selection (the ordered top-k where the build lacks it) against the
    torch form over gathered keys, rows that see
    0 .. 8192 entries (fewer than top-k, windows closing in the step or not); the picks as sets, in entry order,
    the same twice."""
    from types import SimpleNamespace

    from fnattn.kernels.indexer import sgl_kernel_op
    from fnattn.kinds.dsv4.batched import V4_TOPK, gathered_scores, ordered, paged_reasons, token_requests, top_k

    g = torch.Generator(device=DEV).manual_seed(topk + new)
    m, S, Hi, Di = 4, 64, 64, 128
    lens = [0, 3, 500, 2047, 4099, 20000, 32760]
    B, M = len(lens), 32768 // S + 1
    pool = torch.randn(B * M + 1, S, Di, device=DEV, generator=g).to(torch.bfloat16)
    table = (torch.randperm(B * M, device=DEV, generator=g) + 1).view(B, M).to(torch.int32)
    c0 = torch.tensor(lens, device=DEV)
    cu = torch.arange(B + 1, device=DEV) * new
    pos = (c0[:, None] + torch.arange(new, device=DEV)[None, :]).flatten()
    batch = SimpleNamespace(cache_lens=c0, block_table=table, page_size=S, num_requests=B, cu_seqlens=cu,
                            positions=pos)
    T = B * new
    rows = torch.randn(T, Di, device=DEV, generator=g).to(torch.bfloat16)
    rows = torch.where(((pos + 1) % m == 0)[:, None], rows, torch.zeros_like(rows))
    q = torch.randn(T, Hi, Di, device=DEV, generator=g).to(torch.bfloat16)
    w = torch.randn(T, Hi, device=DEV, generator=g)
    views, ix = SimpleNamespace(index_k=pool), SimpleNamespace(head_dim=Di, topk=topk)
    args = (views, batch, token_requests(batch), pos, q, w, rows, ix, m)
    assert not paged_reasons(views, batch, q, m)
    got, again = top_k(*args), top_k(*args)
    want = ordered(gathered_scores(*args), topk)
    same = bool(torch.equal(got.sort(dim=-1).values, want.sort(dim=-1).values))
    # sgl_kernel's selection comes sorted latest first; without it (builds that lack the op) the ordered top-k lists
    # best first by the Triton scores, whose last bits may order near-equal entries unlike the torch form's
    radix = sgl_kernel_op(V4_TOPK)
    in_order = bool(((got[:, :-1] > got[:, 1:]) | (got[:, 1:] == -1)).all()) if radix else True
    ok = same and in_order and bool(torch.equal(got, again))
    record({"case": f"dsv4 csa indexer topk{topk} {new} a request", "selection": V4_TOPK if radix else "ordered",
            "same_set": same, "entry_order": in_order if radix else None, "ok": ok})
    assert ok, (same, in_order)
