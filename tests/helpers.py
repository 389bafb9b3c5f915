"""Small builders shared by the core tests."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fnattn as fa
from fnattn import registry


def full_spec(index=0, *, hq=4, hkv=2, d=8, dv=None, dtype=torch.float32, **kw):
    cfg = fa.FullAttentionConfig(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, **kw)
    return fa.LayerSpec(index=index, config=cfg, dtype=dtype)


def gdn_spec(index=0, *, hk=1, hv=2, dk=4, dv=4, dtype=torch.float32):
    cfg = fa.GDNConfig(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv)
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


def full_state_with(spec, cached, *, page_size=4):
    """A full-attention layer's State whose request ``r`` holds ``cached[r]`` tokens written through a reference
    prefill; the rest of its storage NaN, so a stray read shows."""
    st = nan_state([spec], num_pages=64, page_size=page_size, max_requests=len(cached))
    for r in range(len(cached)):
        st = st.admit(r)
    counts = {r: c for r, c in enumerate(cached) if c}
    if counts:
        st = st.reserve(counts)
        b = fa.Batch.prefill(st, counts)
        ma = fa.ModelAttention([spec], prefer=("reference",))
        _, d = run(ma, st, b, {spec.index: full_inputs(spec, b.num_tokens, gen=torch.Generator().manual_seed(3))})
        st = st.apply(d)
    return st


def snapshot(state):
    return {(p, t): x.clone() for p, pool in state.pools.items() for t, x in pool.tensors.items()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality that treats NaN payloads as equal bytes."""
    def raw(t):
        return t.contiguous().view(-1).view(torch.uint8)

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(raw(a), raw(b))


def unchanged(state, snap) -> bool:
    return all(same_bits(state.pools[p].tensors[t], x) for (p, t), x in snap.items())


def bookkeeping(state):
    """Everything of a State besides its storage bytes: handle, cursors, allocator, lineage, applied
    steps, ring lending, and which tensors hold the storage."""
    s = state._storage
    tensors = {(p, t): (x.data_ptr(), tuple(x.shape), x.dtype) for p, pool in s.pools.items()
               for t, x in pool.tensors.items()}
    return (state.is_live, state._version, dict(state._requests), state._free_pages, state._free_slots, id(s),
            s.live_version, s.applied_steps, s.lineage, s.ring_lent, tensors)


def assert_refused(state, call, match, error=ValueError):
    """``call()`` raises ``error`` matching ``match`` and leaves ``state`` as it was: every storage byte,
    the handle live, cursors, allocator and ring lending unchanged. ``-> the exception``."""
    snap, book = snapshot(state), bookkeeping(state)
    with pytest.raises(error, match=match) as info:
        call()
    assert state.is_live, "a refused call left the State handle stale"
    assert bookkeeping(state) == book, "a refused call changed the State's bookkeeping"
    assert unchanged(state, snap), "a refused call changed storage bytes"
    return info.value


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
    c = spec.config
    H = c.num_state_heads
    gen = torch.Generator().manual_seed(seed)
    return fa.RecurrentInputs(
        x=torch.randn(T, c.conv_dim, generator=gen).to(spec.dtype),
        conv_weight=(0.5 * torch.randn(c.conv_dim, c.conv_kernel, generator=gen)).to(spec.dtype),
        conv_bias=(0.1 * torch.randn(c.conv_dim, generator=gen)).to(spec.dtype) if spec.kind == "gdn" else None,
        g=-0.7 * torch.rand(c.gate_shape(T), generator=gen) - 0.01,
        beta=torch.rand(T, H, generator=gen).to(spec.dtype),
    )


@contextlib.contextmanager
def registry_scope():
    """Backends a test registers are gone afterwards (user backends rank first by default, so one left
    behind would be chosen by every later test's `ModelAttention`). The built-in kinds are registered first: a
    scope that saw them register inside it (the package imports them on the first public name a test asks for)
    would clear them, and a module imported once never registers again."""
    import fnattn.kinds  # noqa: F401

    before = dict(registry._REGISTRY)
    try:
        yield
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(before)


# --------------------------------------------------------------------------- recurrent test backends
# Decode backends for GDN layers whose new states are a constant, read from ``inputs.x[0, 0]``:
# "test_value" returns them as values, "test_inplace" writes them into the batch's spare ring rows
# (what a fast backend does) and returns ``ssm=None``.


def constant_states(spec, inputs):
    c, batch = spec.config, inputs.meta.batch
    n = batch.recurrent_write_rows.shape[0]
    value = inputs.x[0, 0]
    ssm = value.expand(n, c.num_state_heads, c.head_k_dim, c.head_v_dim).to(c.state_dtype).clone()
    conv = value.expand(n, c.conv_dim, c.conv_kernel - 1).to(spec.dtype).clone()
    o = torch.zeros(batch.num_tokens, c.num_state_heads, c.head_v_dim, dtype=spec.dtype)
    return fa.RecurrentOutput(o=o), ssm, conv


def register_constant_backends(kind="gdn"):
    @fa.register(kind, "decode", "test_value", replace=True)
    def value_backend(spec, views, inputs):
        out, ssm, conv = constant_states(spec, inputs)
        return out, fa.writes(ssm=ssm, conv=conv)

    @fa.register(kind, "decode", "test_inplace", replace=True)
    def inplace_backend(spec, views, inputs):
        out, ssm, conv = constant_states(spec, inputs)
        views.ssm.index_copy_(0, inputs.meta.batch.recurrent_write_rows, ssm)
        return out, fa.writes(ssm=None, conv=conv)


def constant_inputs(spec, T, value):
    c = spec.config
    return fa.RecurrentInputs(x=torch.full((T, c.conv_dim), float(value), dtype=spec.dtype),
                              conv_weight=torch.zeros(c.conv_dim, c.conv_kernel, dtype=spec.dtype),
                              g=torch.zeros(c.gate_shape(T)), beta=torch.zeros(T, c.num_state_heads,
                                                                                 dtype=spec.dtype))


def ring_step(state, rids, *, value=1.0, in_place=False):
    """A decode step of every (GDN) layer of ``state`` writing ``value`` states into the batch's rows;
    ``-> (batch, StepDeltas)``. Needs `register_constant_backends` first."""
    register_constant_backends()
    ma = fa.ModelAttention(state.specs, prefer=("test_inplace" if in_place else "test_value",))
    batch = fa.Batch.decode(state, rids)
    _, deltas = run(ma, state, batch, {s.index: constant_inputs(s, len(rids), value) for s in state.specs})
    return batch, deltas


def spread_prompts(vocab: int, lengths=(300, 37)) -> dict[int, list[int]]:
    """Request r's prompt: ``lengths[r]`` ids spread over the vocabulary (never 0), each request its own stride."""
    strides = (5, 11, 13, 17)
    return {r: [(strides[r] * i) % (vocab - 1) + 1 for i in range(n)] for r, n in enumerate(lengths)}


def benchmark_module(name: str):
    """``benchmarks/<name>.py``, loaded as a module (the benchmarks are scripts, not a package)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_benchmark(name: str, *args: str) -> subprocess.CompletedProcess:
    """``python benchmarks/<name>.py ARGS`` from the repository root under Triton's interpreter, one thread:
    its exit code, stdout and stderr."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, f"benchmarks/{name}.py", *args], cwd=Path(__file__).resolve().parents[1],
                          env=env, capture_output=True, text=True)
