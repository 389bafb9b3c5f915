"""The CPU ``torch`` backend (batched decode, chunk-parallel prefill) against the reference."""

import pytest
import torch

import fnattn as fa
from fnattn.kinds.delta_rule import batched
from fnattn.model_attention import DEFAULT_PREFER

NAN = float("nan")


def _spec(kind, dtype):
    cfg = (fa.GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8) if kind == "gdn"
           else fa.KDAConfig(num_heads=3, head_k_dim=8, head_v_dim=8))
    return fa.LayerSpec(index=0, config=cfg, dtype=dtype)


def _inputs(spec, T, seed):
    c, H = spec.config, spec.config.num_state_heads
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return fa.RecurrentInputs(
        x=r(T, c.conv_dim).to(spec.dtype), conv_weight=(0.5 * r(c.conv_dim, c.conv_kernel)).to(spec.dtype),
        conv_bias=(0.1 * r(c.conv_dim)).to(spec.dtype) if spec.kind == "gdn" else None,
        g=torch.nn.functional.logsigmoid(r(*c.gate_shape(T)) + 3.0), beta=torch.sigmoid(r(T, H)).to(spec.dtype))


def _step(name, spec, st, batch, inp):
    ma = fa.ModelAttention([spec], prefer=(name,), phases=(batch.phase,))
    assert ma.backend(0, batch.phase).name == name
    with ma.session(st, batch) as s:
        out, w = s.forward(0, inp)
    return out, st.apply(fa.StepDeltas.collect(batch, [w]), inplace=False)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ring", [1, 3])
def test_batched_decode_equals_the_reference(kind, dtype, ring):
    spec = _spec(kind, dtype)
    st = fa.State([spec], num_pages=8, page_size=8, max_requests=5, fill=NAN, recurrent_ring=ring)
    for r in range(4):
        st = st.admit(r)
    cached = {0: 5, 1: 1, 3: 9}  # request 2 has nothing cached: its slot is never read
    st = st.reserve({r: cached.get(r, 0) + 1 for r in range(4)})
    b = fa.Batch.prefill(st, cached)
    _, st = _step("reference", spec, st, b, _inputs(spec, b.num_tokens, 1))
    batch = fa.Batch.decode(st, [3, 0, 2, 1], pad_to=6)  # two pad lanes on the NaN null slot
    inp = _inputs(spec, batch.num_tokens, 2)
    want_out, want = _step("reference", spec, st, batch, inp)
    got_out, got = _step(batched.NAME, spec, st, batch, inp)
    live = len(batch.live_ids)
    torch.testing.assert_close(got_out.o[:live], want_out.o[:live], rtol=1e-6, atol=1e-6)
    assert torch.isfinite(got_out.o[:live].float()).all()
    for name, t in want.views(0).items():
        rows = torch.tensor([want.recurrent_row(r) for r in batch.live_ids])
        torch.testing.assert_close(got.views(0)[name][rows], t[rows], rtol=1e-6, atol=1e-6)


def test_it_serves_cpu_decode_by_default_and_refuses_a_gpu():
    spec = _spec("gdn", torch.float32)
    assert DEFAULT_PREFER.index(batched.NAME) < DEFAULT_PREFER.index("reference")
    ma = fa.ModelAttention([spec])
    assert ma.backend(0, "decode").name == ma.backend(0, "prefill").name == batched.NAME
    assert ma.backend(0, "verify").name == "reference"
    assert batched.supports(spec, torch.device("cuda")) and not batched.supports(spec, torch.device("cpu"))


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_parallel_prefill_equals_the_reference(kind, dtype):
    """Fresh and prefixed requests, lengths across the chunk size (1, 63, 64, 130), unused storage NaN: the
    outputs, states and windows the reference leaves, to fp32 rounding."""
    spec = _spec(kind, dtype)
    st = fa.State([spec], num_pages=64, page_size=8, max_requests=6, fill=NAN)
    for r in range(5):
        st = st.admit(r)
    cached = {0: 5, 2: 64, 3: 9}
    new = {0: 130, 1: 64, 2: 1, 3: 63, 4: 70}
    st = st.reserve({r: cached.get(r, 0) + n for r, n in new.items()})
    b = fa.Batch.prefill(st, cached)
    _, st = _step("reference", spec, st, b, _inputs(spec, b.num_tokens, 1))
    batch = fa.Batch.prefill(st, new)
    inp = _inputs(spec, batch.num_tokens, 2)
    want_out, want = _step("reference", spec, st, batch, inp)
    got_out, got = _step(batched.NAME, spec, st, batch, inp)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.isfinite(got_out.o.float()).all()
    torch.testing.assert_close(got_out.o, want_out.o, rtol=tol, atol=tol)
    rows = torch.tensor([want.recurrent_row(r) for r in new])
    for name, t in want.views(0).items():
        torch.testing.assert_close(got.views(0)[name][rows], t[rows], rtol=tol, atol=tol)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("T", [0, 1, 64, 150])
def test_chunked_delta_is_the_reference_chunked_form(per_channel, T):
    """`chunked_delta` against `gated_delta_chunked_seq`: the same chunks and formulas, each chunk's decays
    built and its system solved once for both uses (a short last chunk; no tokens at all)."""
    from fnattn.kernels.gdn_naive import gated_delta_chunked_seq

    g = torch.Generator().manual_seed(3)
    H, K, V = 2, 8, 4
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=g), dim=-1)  # noqa: E731
    q, k, v = unit(T, H, K), unit(T, H, K), torch.randn(T, H, V, generator=g)
    gate = torch.nn.functional.logsigmoid(torch.randn(T, H, *((K,) if per_channel else ()), generator=g))
    beta, S = torch.rand(T, H, generator=g), torch.randn(H, K, V, generator=g)
    want = gated_delta_chunked_seq(q, k, v, gate, beta, S, scale=0.3, chunk_size=64)
    got = batched.chunked_delta(q, k, v, gate, beta, S, scale=0.3, chunk_size=64)
    assert got[0].shape == (T, H, V) and got[1].shape == (H, K, V)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
