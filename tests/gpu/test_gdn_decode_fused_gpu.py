"""The opt-in ``triton_fused`` GDN / KDA decode against ``triton`` (two launches) and ``reference``, bf16 on CUDA.

Each case runs reference, triton and triton_fused through sessions on the same state and
batch (triton_fused last: a session over a ring batch takes its spare rows, so its
in-place states are the ones read back). Errors are max |err| / max |ref|; whether
triton_fused gave the same bits as triton is recorded too (it runs the same ops, but
the compiler may order a reduction differently in the fused program). Decode is also
captured in a CUDA graph, which fails on any host-device sync.
"""

import pytest
import torch
import torch.nn.functional as F

import fnattn as fa
from fnattn.registry import lookup

pytestmark = pytest.mark.gpu
TOL = 2e-2  # bf16 activations
DEV = "cuda"
FUSED = "triton_fused"

SPECS = {
    "gdn 16qk/16v d128 (Qwen3.5-0.8B)": fa.GDNConfig(num_k_heads=16, num_v_heads=16, head_k_dim=128, head_v_dim=128),
    "gdn 16qk/32v d128": fa.GDNConfig(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128),
    "gdn 2qk/6v d64": fa.GDNConfig(num_k_heads=2, num_v_heads=6, head_k_dim=64, head_v_dim=64),
    "gdn 4qk/8v d128 bf16 state": fa.GDNConfig(num_k_heads=4, num_v_heads=8, head_k_dim=128, head_v_dim=128,
                                               state_dtype=torch.bfloat16),
    "kda 8h d128": fa.KDAConfig(num_heads=8, head_k_dim=128, head_v_dim=128),
}


def _spec(name):
    return fa.LayerSpec(index=0, config=SPECS[name], dtype=torch.bfloat16)


def _inputs(spec, T, *, seed=0):
    c, H = spec.config, spec.config.num_state_heads
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
    return fa.RecurrentInputs(
        x=r(T, c.conv_dim).to(spec.dtype),
        conv_weight=(0.5 * r(c.conv_dim, c.conv_kernel)).to(spec.dtype),
        conv_bias=(0.1 * r(c.conv_dim)).to(spec.dtype) if spec.kind == "gdn" else None,
        g=F.logsigmoid(r(*c.gate_shape(T)) + 3.0),
        beta=torch.sigmoid(r(T, H)).to(spec.dtype),
    )


def _forward(name, spec, st, batch, inp):
    ma = fa.ModelAttention([spec], prefer=(name,), device=DEV, phases=(batch.phase,))
    assert ma.backend(spec.index, batch.phase).name == name, ma.explain()
    with ma.session(st, batch) as s:
        return s.forward(spec.index, inp)


def _state(spec, cached, *, ring):
    """Requests with ``cached`` tokens prefilled by the reference; every other slot NaN."""
    n = len(cached)
    st = fa.State([spec], num_pages=n * 4, page_size=256, max_requests=n + 2, device=DEV, fill=float("nan"),
                  recurrent_ring=ring)
    for r in range(n):
        st = st.admit(r)
    st = st.reserve({r: c + 1 for r, c in enumerate(cached)})
    b = fa.Batch.prefill(st, dict(enumerate(cached)))
    _, d = _forward("reference", spec, st, b, _inputs(spec, b.num_tokens, seed=1))
    return st.apply(fa.StepDeltas.collect(b, [d]))


def _states(w, st, batch):
    return st.views(w.layer).ssm.index_select(0, batch.recurrent_write_rows) if w["ssm"] is None else w["ssm"]


def _rel(a, b):
    a, b = a.float(), b.float()
    scale = b.abs().max().item() if b.numel() else 0.0
    err = (a - b).abs().max().item() if b.numel() else 0.0
    return err / scale if scale else err


def _run(spec, st, batch, inp):
    got = {}
    for name in ("reference", "triton", FUSED):
        out, w = _forward(name, spec, st, batch, inp)
        got[name] = (out, w, _states(w, st, batch).clone())
    return got


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("B", [1, 4, 33, 256])
@pytest.mark.parametrize("ring", [1, 2], ids=["copy", "ring"])
def test_decode_matches_triton_and_reference(name, B, ring, record):
    spec = _spec(name)
    cached = [1 + (37 * i) % 300 for i in range(B)]
    st = _state(spec, cached, ring=ring)
    pad = 2 if B < 256 else 0  # pad lanes (empty cache, null slot), as a captured bucket has
    batch = fa.Batch.decode(st, range(B), pad_to=B + pad if pad else None)
    got = _run(spec, st, batch, _inputs(spec, batch.num_tokens, seed=2))
    live = batch.num_requests - batch.num_pad  # pad lanes of a ring batch share one spare row: live states only
    (r_out, r_w, r_s), (t_out, t_w, t_s), (out, w, s) = (got[n] for n in ("reference", "triton", FUSED))
    errs = {"o": _rel(out.o, r_out.o), "state": _rel(s[:live], r_s[:live]), "conv": _rel(w["conv"], r_w["conv"]),
            "o vs triton": _rel(out.o, t_out.o), "state vs triton": _rel(s[:live], t_s[:live]),
            "conv vs triton": _rel(w["conv"], t_w["conv"])}
    bitwise = all(torch.equal(a, b) for a, b in ((out.o, t_out.o), (s[:live], t_s[:live]), (w["conv"], t_w["conv"])))
    finite = bool(torch.isfinite(out.o).all() and torch.isfinite(s).all() and torch.isfinite(w["conv"]).all())
    contract = ((w["ssm"] is None) == (t_w["ssm"] is None) == bool(batch.ring) and set(w.values) == {"ssm", "conv"}
                and s.dtype == t_s.dtype and w["conv"].dtype == t_w["conv"].dtype and out.o.dtype == t_out.o.dtype)
    ok = finite and contract and max(errs.values()) <= TOL
    record({"case": f"fused decode {name} B{B} pad{pad} {'ring' if batch.ring else 'copy'}", "phase": "decode",
            "backend": FUSED, **{f"max_rel_{k.replace(' ', '_')}": v for k, v in errs.items()},
            "max_rel": max(errs.values()), "bitwise_vs_triton": bitwise, "finite": finite, "ok": ok})
    assert ok, f"{name} B{B}: {errs} finite={finite} contract={contract}"


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("B", [1, 4, 33, 256])
def test_with_the_usual_tile_the_fused_decode_gives_triton_bits_at_every_batch(name, B, record):
    """With the usual V tile at every batch (`fill_device` off: the tile the invariant mode keeps) the fused
    decode's outputs, states and windows are ``triton``'s (the verify path's) bit for bit at every batch size:
    what would let the invariant mode take it for decode."""
    from fnattn.kernels import gdn_decode_fused

    spec = _spec(name)
    st = _state(spec, [1 + (37 * i) % 300 for i in range(B)], ring=1)
    batch = fa.Batch.decode(st, range(B))
    with gdn_decode_fused.fill_device(False):
        got = _run(spec, st, batch, _inputs(spec, batch.num_tokens, seed=7))
    (t_out, t_w, t_s), (out, w, s) = (got[n] for n in ("triton", FUSED))
    same = {"o": torch.equal(out.o, t_out.o), "state": torch.equal(s, t_s), "conv": torch.equal(w["conv"], t_w["conv"])}
    record({"case": f"fused decode {name} B{B} usual tile vs triton", "phase": "decode", "backend": FUSED,
            **{f"bitwise_{k}": v for k, v in same.items()}, "max_rel": _rel(out.o, t_out.o), "ok": all(same.values())})
    assert all(same.values()), same


@pytest.mark.parametrize("name", ["gdn 16qk/16v d128 (Qwen3.5-0.8B)", "kda 8h d128"])
def test_decode_replays_from_a_cuda_graph(name, record):
    """Captured in an open session, replayed (also after the spare rows were NaN-filled): eager's bits."""
    spec = _spec(name)
    st = _state(spec, [4, 90, 17, 1], ring=3)
    batch = fa.Batch.decode(st, range(4), pad_to=6)
    inp = _inputs(spec, batch.num_tokens, seed=5)
    assert lookup(spec.kind, "decode", FUSED).capturable
    ma = fa.ModelAttention([spec], prefer=(FUSED,), device=DEV, phases=("decode",))
    with ma.session(st, batch) as s:
        eager_out, eager_w = s.forward(0, inp)
    eager_states = _states(eager_w, st, batch).clone()
    with ma.session(st, batch) as s:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            s.forward(0, inp)  # allocator warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(side)
    with ma.session(st, batch) as s:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, w = s.forward(0, inp)
        graph.replay()
        torch.cuda.synchronize()
        st.views(0).ssm.index_fill_(0, batch.recurrent_write_rows, float("nan"))
        graph.replay()
        torch.cuda.synchronize()
    live = len(batch.live_ids)  # pad lanes read the NaN null slot: their rows are NaN in both runs
    ok = w["ssm"] is None and eager_w["ssm"] is None and all(torch.equal(a[:live], b[:live]) for a, b in (
        (out.o, eager_out.o), (_states(w, st, batch), eager_states), (w["conv"], eager_w["conv"])))
    record({"case": f"cuda graph fused decode {name}", "phase": "decode", "backend": FUSED, "max_rel": 0.0, "ok": ok})
    assert ok


def test_supported_on_cuda_and_chosen_first_for_decode():
    spec = _spec("gdn 16qk/16v d128 (Qwen3.5-0.8B)")
    assert lookup("gdn", "decode", FUSED).supports(spec, torch.device(DEV)) == []
    default = fa.ModelAttention([spec], device=DEV)
    assert default.backend(0, "decode").name == FUSED and default.backend(0, "prefill").name == "fla"
    two_launches = fa.ModelAttention([spec], prefer=["triton"], device=DEV)
    assert two_launches.backend(0, "decode").name == "triton"


def _switched_both_ways(switch, name, B, *, seed):
    """One fused decode step of B requests with ``switch`` off, then on: ``-> (out, writes, states)`` of each."""
    spec = _spec(name)
    st = _state(spec, [1 + 37 * i for i in range(B)], ring=1)
    batch = fa.Batch.decode(st, range(B))
    inp = _inputs(spec, batch.num_tokens, seed=seed)
    runs = []
    for on in (False, True):
        with switch(on):
            out, w = _forward(FUSED, spec, st, batch, inp)
        runs += [out, w, _states(w, st, batch)]
    return tuple(runs)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("B", [1, 4])
def test_fill_device_tiles_match_the_usual_tiles(name, B, record):
    """`kernels.gdn_decode_fused.fill_device`: narrower V tiles at small batches give the usual tile's
    windows bit for bit and its outputs and states to float rounding (a tile's layout sets the order of the
    sums over K, so the last bits may differ; recorded)."""
    from fnattn.kernels import gdn_decode_fused

    out, w, s, f_out, f_w, f_s = _switched_both_ways(gdn_decode_fused.fill_device, name, B, seed=3)
    errs = {"o": _rel(f_out.o, out.o), "state": _rel(f_s, s)}
    bitwise = torch.equal(f_out.o, out.o) and torch.equal(f_s, s)
    state_tol = 1e-5 if s.dtype == torch.float32 else 1e-2
    ok = torch.equal(f_w["conv"], w["conv"]) and errs["o"] <= 1e-2 and errs["state"] <= state_tol
    record({"case": f"fused decode {name} B{B} fill_device", "phase": "decode", "backend": FUSED,
            **{f"max_rel_{k}": v for k, v in errs.items()}, "bitwise": bitwise, "ok": ok})
    assert ok, errs


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("B", [1, 4])
def test_state_first_gives_the_same_bits(name, B, record):
    """`kernels.gdn_decode_fused.state_first`: the state, window and batch rows read before the PDL wait, the
    same arithmetic in the same order: outputs, states and windows bit for bit (the whole model under it, in
    replayed graphs: tests/gpu/test_fused_gpu.py)."""
    from fnattn.kernels import gdn_decode_fused

    out, w, s, f_out, f_w, f_s = _switched_both_ways(gdn_decode_fused.state_first, name, B, seed=5)
    ok = torch.equal(f_out.o, out.o) and torch.equal(f_s, s) and torch.equal(f_w["conv"], w["conv"])
    record({"case": f"fused decode {name} B{B} state_first", "phase": "decode", "backend": FUSED,
            "bitwise": ok, "ok": ok})
    assert ok
