"""Builders for comparing the fast MLA / sparse-MLA backends with the references (CPU and GPU tests).

Caches are filled by a rows-only prefill backend registered for the test (the reference prefill's
expanded form over thousands of cached tokens at 128 heads would need gigabytes), so every case can
hold long prefixes; the step under test then runs through sessions exactly as a model's would.
"""

from __future__ import annotations

import contextlib

import torch
from helpers import registry_scope, same_bits

import fnattn as fa
from fnattn.kinds.sparse_mla.config import SparseAttentionOutput
from fnattn.outputs import AttentionOutput

FILL = "test_rows"


def mla_config(*, H=4, padded=None, R=512, Dr=64, Dn=128, Dv=128, cache_dtype=None, cache_scale=1.0):
    return fa.MLAConfig(num_heads=H, kv_lora_rank=R, qk_nope_head_dim=Dn, qk_rope_head_dim=Dr, v_head_dim=Dv,
                        q_lora_rank=None, padded_heads=padded, cache_dtype=cache_dtype, cache_scale=cache_scale)


def sparse_specs(*, topk, Hi=8, Di=128, shared=False, dtype=torch.bfloat16, key_dtype=None, **mla_kw):
    """One layer with its own indexer, then (``shared``) one reusing its top-k (GLM-5)."""
    mla = mla_config(**mla_kw)
    ix = fa.IndexerConfig(num_heads=Hi, head_dim=Di, topk=topk, rope_head_dim=min(64, Di), key_dtype=key_dtype)
    specs = [fa.LayerSpec(0, fa.SparseMLAConfig(mla, ix), dtype)]
    if shared:
        specs.append(fa.LayerSpec(1, fa.SparseMLAConfig(mla, ix, index_source_layer=0), dtype))
    return specs


@contextlib.contextmanager
def fill_backends():
    """Prefill backends that only return the rows to cache (outputs are zeros): fast cache filling."""
    with registry_scope():
        @fa.register("mla", "prefill", FILL, replace=True, invariant=True)  # each row on its own
        def mla_rows(spec, views, inputs):
            T, H = inputs.q_nope.shape[:2]
            o = torch.zeros(T, H, spec.config.mla.v_head_dim, dtype=spec.dtype, device=inputs.latent.device)
            return (AttentionOutput(o=o, lse=torch.zeros(T, H, device=o.device)),
                    fa.writes(latent=spec.config.mla.encode_latent(inputs.latent)))

        @fa.register("sparse_mla", "prefill", FILL, replace=True, invariant=True)
        def sparse_rows(spec, views, inputs):
            m = spec.config.mla
            T, H = inputs.q_nope.shape[:2]
            o = torch.zeros(T, H, m.v_head_dim, dtype=spec.dtype, device=inputs.latent.device)
            idx = torch.full((T, inputs.sparse.topk), -1, dtype=torch.int64, device=o.device)
            out = SparseAttentionOutput(o=o, lse=torch.zeros(T, H, device=o.device), topk_indices=idx)
            if spec.config.index_source_layer is None:
                return out, fa.writes(latent=m.encode_latent(inputs.latent),
                                      **spec.config.index_writes(inputs.index_k))
            return out, fa.writes(latent=m.encode_latent(inputs.latent))

        yield


def randn(g, *shape, device, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def step_inputs(spec, batch, *, seed=0, topk_indices=None, cheap=False):
    """Random inputs of one layer for ``batch``, zero in the padding heads as a model pads them.

    ``cheap``: only the cache rows are random (for filling caches).
    """
    m, dev, dt = spec.config.mla, batch.positions.device, spec.dtype
    T, H, Hp = batch.num_tokens, m.num_heads, m.heads
    g = torch.Generator().manual_seed(seed * 7919 + spec.index)
    latent = randn(g, T, m.latent_dim, device=dev, dtype=dt)
    if cheap:
        z = torch.zeros((), device=dev, dtype=dt)
        base = dict(q_nope=z.expand(T, Hp, m.qk_nope_head_dim), q_pe=z.expand(T, Hp, m.qk_rope_head_dim),
                    latent=latent, w_uk=z.expand(Hp, m.qk_nope_head_dim, m.kv_lora_rank),
                    w_uv=z.expand(Hp, m.v_head_dim, m.kv_lora_rank))
    else:
        live = (torch.arange(Hp, device=dev) < H).to(dt)  # the model's own heads; the rest are its zero padding
        base = dict(q_nope=randn(g, T, Hp, m.qk_nope_head_dim, device=dev, dtype=dt) * live[:, None],
                    q_pe=randn(g, T, Hp, m.qk_rope_head_dim, device=dev, dtype=dt) * live[:, None],
                    latent=latent,
                    w_uk=randn(g, Hp, m.qk_nope_head_dim, m.kv_lora_rank, device=dev, dtype=dt,
                               scale=m.qk_nope_head_dim ** -0.5) * live[:, None, None],
                    w_uv=randn(g, Hp, m.v_head_dim, m.kv_lora_rank, device=dev, dtype=dt,
                               scale=m.kv_lora_rank ** -0.5) * live[:, None, None])
    if spec.kind == "mla":
        return fa.MLAInputs(**base)
    ix = spec.config.indexer
    sparse = fa.SparseQueryMetadata.build(batch, topk=ix.topk)
    if spec.config.index_source_layer is not None:
        return fa.SparseMLAInputs(**base, sparse=sparse, topk_indices=topk_indices)
    return fa.SparseMLAInputs(**base, sparse=sparse, index_q=randn(g, T, ix.num_heads, ix.head_dim, device=dev,
                                                                   dtype=dt),
                              index_w=randn(g, T, ix.num_heads, device=dev, dtype=torch.float32),
                              index_k=randn(g, T, ix.head_dim, device=dev, dtype=dt))


def forward_all(ma, state, batch, specs, *, seed, cheap=False):
    """One step over every layer (shared layers get their source's top-k); ``-> (outputs, StepDeltas)``."""
    outs, writes = {}, []
    with ma.session(state, batch) as s:
        for spec in specs:
            src = getattr(spec.config, "index_source_layer", None)
            inp = step_inputs(spec, batch, seed=seed, cheap=cheap,
                              topk_indices=None if src is None else outs[src].topk_indices)
            outs[spec.index], w = s.forward(spec.index, inp)
            writes.append(w)
    return outs, fa.StepDeltas.collect(batch, writes)


def filled_state(specs, cached, *, page_size, extra=8, device="cpu", fill=float("nan"), seed=0, chunk=8192):
    """Requests ``0..B-1`` holding ``cached[b]`` random cached rows, with room for ``extra`` more."""
    B = len(cached)
    pages = sum(-(-(c + extra) // page_size) for c in cached) + 1
    st = fa.State(specs, num_pages=pages, page_size=page_size, max_requests=B, device=device, fill=fill)
    for r in range(B):
        st = st.admit(r)
    st = st.reserve({r: c + extra for r, c in enumerate(cached)})
    left = dict(enumerate(cached))
    with fill_backends():
        ma = fa.ModelAttention(specs, prefer=(FILL,), device=device, phases=("prefill",))
        step = 0
        while any(left.values()):
            counts, budget = {}, chunk
            for r, n in left.items():
                if n and budget:
                    counts[r] = min(n, budget)
                    budget -= counts[r]
            b = fa.Batch.prefill(st, counts)
            _, deltas = forward_all(ma, st, b, specs, seed=1000 + step, cheap=True)
            st = st.apply(deltas)
            left = {r: n - counts.get(r, 0) for r, n in left.items()}
            step += 1
    return st


def compare(specs, state, batch, backend, *, seed=0, live=None):
    """Outputs and writes of ``backend`` next to the reference's on one step.

    Returns one dict per layer: max relative error of ``o`` (over live lanes' tokens), max absolute
    LSE error, the fraction of tokens whose top-k set differs, and whether the writes match bitwise.
    ``live`` ([T] bool) leaves out pad lanes' tokens, whose outputs the caller drops.
    """
    dev = batch.positions.device
    got_ma = fa.ModelAttention(specs, prefer=(backend,), device=dev, phases=(batch.phase,))
    ref_ma = fa.ModelAttention(specs, prefer=("reference",), device=dev, phases=(batch.phase,))
    for spec in specs:
        chosen = got_ma.backend(spec.index, batch.phase).name
        assert chosen == backend, f"layer {spec.index}: {backend} refused:\n{got_ma.explain()}"
    got, gd = forward_all(got_ma, state, batch, specs, seed=seed)
    ref, rd = forward_all(ref_ma, state, batch, specs, seed=seed)
    T = batch.num_tokens
    live = torch.ones(T, dtype=torch.bool, device=dev) if live is None else live
    rows = []
    for spec, gw, rw in zip(specs, gd.writes, rd.writes):
        H = spec.config.mla.num_heads  # the model's own heads; padding heads are dropped by the model
        g, r = got[spec.index], ref[spec.index]
        go, ro = g.o[live, :H].float(), r.o[live, :H].float()
        row = {"layer": spec.index, "finite": bool(torch.isfinite(go).all()),
               "o_rel": float((go - ro).abs().max() / ro.abs().max().clamp_min(1e-6)),
               "lse_abs": float((g.lse[live, :H] - r.lse[live, :H]).abs().nan_to_num(0.0).max())
               if r.lse is not None and g.lse is not None else 0.0,
               "writes_equal": all(same_bits(gw[k], rw[k]) for k in rw.values)}
        if hasattr(r, "topk_indices"):
            gs, rs = g.topk_indices[live].sort(dim=1).values, r.topk_indices[live].sort(dim=1).values
            row["topk_mismatch"] = float((gs != rs).any(dim=1).float().mean())
        rows.append(row)
    return rows
