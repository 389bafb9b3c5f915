"""Triton and FlashInfer full-attention backends against the reference, bf16, on a GPU."""

import itertools

import pytest
import torch

import fnattn as fa
from fnattn.registry import lookup

pytestmark = pytest.mark.gpu
TOL = 2e-2  # bf16 operands: max |err| / max |ref|

SHAPES = [  # (hq, hkv, d)
    (8, 8, 64), (8, 2, 128), (8, 1, 128), (16, 4, 256), (32, 4, 128), (8, 1, 256),
]
PAGES = [1, 16, 64]


def _state(spec, cached, page_size, extra):
    """Requests with ``cached`` tokens written through a reference prefill step, the rest NaN."""
    st = fa.State([spec], num_pages=sum(-(-(c + extra) // page_size) for c in cached) + 1, page_size=page_size,
                  max_requests=len(cached), device="cuda", fill=float("nan"))
    for r in range(len(cached)):
        st = st.admit(r)
    st = st.reserve({r: c + extra for r, c in enumerate(cached)})
    counts = {r: c for r, c in enumerate(cached) if c}
    if counts:
        b = fa.Batch.prefill(st, counts)
        inp = _inputs(spec, b.num_tokens)
        ma = fa.ModelAttention([spec], prefer=("reference",), device="cuda")
        with ma.session(st, b) as s:
            _, d = s.forward(0, inp)
        st = st.apply(fa.StepDeltas.collect(b, [d]))
    return st


def _inputs(spec, T):
    c = spec.config
    r = lambda *s: torch.randn(*s, device="cuda", dtype=spec.dtype)  # noqa: E731
    sinks = torch.randn(c.num_q_heads, device="cuda") if c.sinks else None
    return fa.FullAttentionInputs(q=r(T, c.num_q_heads, c.head_dim), k=r(T, c.num_kv_heads, c.head_dim),
                                  v=r(T, c.num_kv_heads, c.head_dim_v), sinks=sinks)


def _check(spec, st, batch, record, label):
    names = [n for n in ("triton", "flashinfer")
             if not lookup("full", batch.phase, n).supports(spec, torch.device("cuda"))]
    # FlashInfer compiles one module per (head dim, mask, softcap) variant, 15-90 s each: its
    # matrix covers head dim 128 without softcap; the Triton kernels cover everything.
    if spec.config.head_dim != 128 or spec.config.softcap:
        names = [n for n in names if n != "flashinfer"]
    inputs = _inputs(spec, batch.num_tokens)
    report = fa.probe(spec, state=st, batch=batch, inputs=inputs, backends=names)
    for row in report.rows:
        ok = row.max_rel <= TOL
        record({"case": label, "phase": batch.phase, "backend": row.backend, "max_abs": row.max_abs,
                "max_rel": row.max_rel, "ok": ok})
        assert ok, f"{label} {row.backend}: max rel {row.max_rel:.3e}"


@pytest.mark.parametrize("shape, page_size", list(itertools.product(SHAPES, PAGES)))
def test_decode(shape, page_size, record):
    hq, hkv, d = shape
    spec = fa.LayerSpec(index=0, config=fa.FullAttentionConfig(num_q_heads=hq, num_kv_heads=hkv, head_dim=d),
                        dtype=torch.bfloat16)
    cached = [1, 17, 300, 1029, 64]
    st = _state(spec, cached, page_size, extra=1)
    _check(spec, st, fa.Batch.decode(st, range(len(cached))), record, f"decode {hq}/{hkv} d{d} p{page_size}")


@pytest.mark.parametrize("shape, page_size", list(itertools.product(SHAPES, PAGES)))
@pytest.mark.parametrize("prefix", [False, True])
def test_prefill(shape, page_size, prefix, record):
    hq, hkv, d = shape
    spec = fa.LayerSpec(index=0, config=fa.FullAttentionConfig(num_q_heads=hq, num_kv_heads=hkv, head_dim=d),
                        dtype=torch.bfloat16)
    cached = [0, 0, 0] if not prefix else [5, 130, 0]
    new = [1, 77, 200]
    st = _state(spec, cached, page_size, extra=max(new))
    b = fa.Batch.prefill(st, dict(enumerate(new)))
    _check(spec, st, b, record, f"prefill {hq}/{hkv} d{d} p{page_size} prefix={prefix}")


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_verify(shape, k, record):
    hq, hkv, d = shape
    spec = fa.LayerSpec(index=0, config=fa.FullAttentionConfig(num_q_heads=hq, num_kv_heads=hkv, head_dim=d),
                        dtype=torch.bfloat16)
    cached = [3, 64, 513]
    st = _state(spec, cached, 16, extra=k + 1)
    _check(spec, st, fa.Batch.verify(st, range(3), num_draft=k), record, f"verify k={k} {hq}/{hkv} d{d}")


@pytest.mark.parametrize("opts", [{"sliding_window": 100}, {"softcap": 30.0}, {"sinks": True},
                                  {"sliding_window": 64, "sinks": True, "softcap": 20.0}])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_options(opts, phase, record):
    cfg = fa.FullAttentionConfig(num_q_heads=16, num_kv_heads=4, head_dim=128, **opts)
    spec = fa.LayerSpec(index=0, config=cfg, dtype=torch.bfloat16)
    cached = [7, 400, 260]
    st = _state(spec, cached, 16, extra=50)
    b = fa.Batch.decode(st, range(3)) if phase == "decode" else fa.Batch.prefill(st, {0: 1, 1: 50, 2: 33})
    _check(spec, st, b, record, f"{phase} {opts}")


def test_apply_scatter_matches_reference_write(record):
    """The pooled GPU scatter writes exactly the rows the CPU path writes."""
    specs = [fa.LayerSpec(index=i, config=fa.FullAttentionConfig(num_q_heads=8, num_kv_heads=2, head_dim=128),
                          dtype=torch.bfloat16) for i in range(3)]
    st = fa.State(specs, num_pages=40, page_size=16, max_requests=3, device="cuda", fill=float("nan"))
    for r in range(3):
        st = st.admit(r)
    st = st.reserve({0: 5, 1: 100, 2: 33})
    b = fa.Batch.prefill(st, {0: 5, 1: 100, 2: 33})
    ma = fa.ModelAttention(specs, prefer=("reference",), device="cuda")
    groups = []
    with ma.session(st, b) as s:
        for i in range(3):
            groups.append(s.forward(i, _inputs(specs[i], b.num_tokens))[1])
    deltas = fa.StepDeltas.collect(b, groups)
    gpu = st.apply(deltas, inplace=False)
    ok = True
    for i, w in enumerate(deltas.writes):
        got = gpu.views(i).k.flatten(0, 1)[b.slot_mapping]
        ok &= torch.equal(got, w["k"])
    record({"case": "apply scatter 3 layers", "phase": "prefill", "backend": "scatter_rows", "max_abs": 0.0,
            "max_rel": 0.0, "ok": bool(ok)})
    assert ok
