"""The batched CPU decode (``torch``) against the reference, request by request."""

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
    assert ma.backend(0, "decode").name == batched.NAME
    assert ma.backend(0, "prefill").name == ma.backend(0, "verify").name == "reference"
    assert batched.supports(spec, torch.device("cuda")) and not batched.supports(spec, torch.device("cpu"))
