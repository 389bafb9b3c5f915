"""Small builders shared by the core tests."""

from __future__ import annotations

import torch

import fnattn as fa


def full_spec(index=0, *, hq=4, hkv=2, d=8, dv=None, dtype=torch.float32, **kw):
    cfg = fa.FullAttentionConfig(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, **kw)
    return fa.LayerSpec(index=index, config=cfg, dtype=dtype)


def nan_state(specs, *, num_pages=16, page_size=4, max_requests=4, recurrent_ring=2):
    """Storage starts as NaN so that any read of an unwritten row shows up."""
    return fa.State(specs, num_pages=num_pages, page_size=page_size, max_requests=max_requests, fill=float("nan"),
                    recurrent_ring=recurrent_ring)


def full_inputs(spec, T, *, gen=None, sinks=None):
    c = spec.config
    g = gen or torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g).to(spec.dtype)

    return fa.FullAttentionInputs(q=r(T, c.num_q_heads, c.head_dim), k=r(T, c.num_kv_heads, c.head_dim),
                                  v=r(T, c.num_kv_heads, c.head_dim_v), sinks=sinks)


def run(ma, state, batch, layer_inputs):
    """One step over every layer with given inputs; returns (outputs, StepDeltas)."""
    outs, groups = {}, []
    with ma.session(state, batch) as s:
        for layer, inp in layer_inputs.items():
            outs[layer], d = s.forward(layer, inp)
            groups.append(d)
    return outs, fa.StepDeltas.collect(batch, groups)


def snapshot(state):
    return {(p, t): x.clone() for p, pool in state.pools.items() for t, x in pool.tensors.items()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality that treats NaN payloads as equal bytes."""
    def raw(t):
        return t.contiguous().view(-1).view(torch.uint8)

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(raw(a), raw(b))


def unchanged(state, snap) -> bool:
    return all(same_bits(state.pools[p].tensors[t], x) for (p, t), x in snap.items())


def phase_batch(state, phase, counts):
    """A batch of ``phase`` for ``counts`` (request -> new tokens; verify uses 1 + k)."""
    if phase == "prefill":
        return fa.Batch.prefill(state, counts)
    if phase == "decode":
        return fa.Batch.decode(state, list(counts))
    (k,) = {n - 1 for n in counts.values()}
    return fa.Batch.verify(state, list(counts), num_draft=k)


def recurrent_inputs(spec, T, *, seed=0):
    """Conv input, taps and gates of ``T`` tokens for a GDN/KDA layer, like a model's projections would give."""
    from fnattn.backends.reference.recurrent import heads

    c, H = spec.config, heads(spec)
    gen = torch.Generator().manual_seed(seed)
    g_shape = (T, H) if spec.kind == "gdn" else (T, H, c.head_k_dim)
    return fa.RecurrentInputs(
        x=torch.randn(T, c.conv_dim, generator=gen).to(spec.dtype),
        conv_weight=(0.5 * torch.randn(c.conv_dim, c.conv_kernel, generator=gen)).to(spec.dtype),
        conv_bias=(0.1 * torch.randn(c.conv_dim, generator=gen)).to(spec.dtype) if spec.kind == "gdn" else None,
        g=-0.7 * torch.rand(g_shape, generator=gen) - 0.01,
        beta=torch.rand(T, H, generator=gen).to(spec.dtype),
    )
