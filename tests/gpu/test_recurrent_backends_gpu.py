"""Triton (and fla-core prefill) GDN / KDA backends against the reference, bf16 activations, fp32 state.

Every backend runs through a session on the same state and batch as the reference;
outputs, recurrent states and conv windows are compared one tensor at a time as
max |err| / max |ref|. Decode and verify are also captured in a CUDA graph, which
fails on any host-device sync.

A session over a batch with a ring hands its spare recurrent rows to that session:
the reference runs first, so the fast backend's in-place states are the last
session's and can be applied.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

import fnattn as fa
from fnattn.registry import lookup

pytestmark = pytest.mark.gpu
TOL = 2e-2  # bf16 activations and bf16 operands of the chunked dots
DEV = "cuda"

SPECS = {  # name -> config
    "gdn 16qk/32v d128": fa.GDNConfig(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128),
    "gdn 2qk/4v d64": fa.GDNConfig(num_k_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=64),
    "kda 8h d128": fa.KDAConfig(num_heads=8, head_k_dim=128, head_v_dim=128),
}


def _spec(name):
    return fa.LayerSpec(index=0, config=SPECS[name], dtype=torch.bfloat16)


def _inputs(spec, T, *, seed=0):
    """Conv input and gates like a model's projections: log decays near 0, beta in (0, 1)."""
    c, H = spec.config, spec.config.num_state_heads
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
    g_shape = c.gate_shape(T)
    return fa.RecurrentInputs(
        x=r(T, c.conv_dim).to(spec.dtype),
        conv_weight=(0.5 * r(c.conv_dim, c.conv_kernel)).to(spec.dtype),
        conv_bias=(0.1 * r(c.conv_dim)).to(spec.dtype) if spec.kind == "gdn" else None,
        g=F.logsigmoid(r(*g_shape) + 3.0),
        beta=torch.sigmoid(r(T, H)).to(spec.dtype),
    )


def _forward(name, spec, st, batch, inp):
    ma = fa.ModelAttention([spec], prefer=(name,), device=DEV, phases=(batch.phase,))
    with ma.session(st, batch) as s:
        return s.forward(spec.index, inp)


def _state(spec, cached, extra, ring=2):
    """Requests with ``cached`` tokens prefilled by the reference; every other slot NaN."""
    n = len(cached)
    st = fa.State([spec], num_pages=n * 8, page_size=256, max_requests=n + 2, device=DEV, fill=float("nan"),
                  recurrent_ring=ring)
    for r in range(n):
        st = st.admit(r)
    st = st.reserve({r: c + extra for r, c in enumerate(cached)})
    counts = {r: c for r, c in enumerate(cached) if c}
    if counts:
        b = fa.Batch.prefill(st, counts)
        _, d = _forward("reference", spec, st, b, _inputs(spec, b.num_tokens, seed=1))
        st = st.apply(fa.StepDeltas.collect(b, [d]))
    return st


def _rel(a, b):
    a, b = a.float(), b.float()
    scale = b.abs().max().item() if b.numel() else 0.0
    err = (a - b).abs().max().item() if b.numel() else 0.0
    return err / scale if scale else err


def _names(spec, phase):
    names = ["triton"]
    if phase == "prefill" and importlib.util.find_spec("fla") is not None:
        names.append("fla")  # installed: it must accept the layer, or the reason shows as a failure
    return names


def _states(w, st, batch):
    """The new states of a layer's writes: its values, or the spare ring rows the backend filled in place
    (``ssm=None``; the rows are the batch's, and hold this session's states until the next one opens)."""
    return st.views(w.layer).ssm.index_select(0, batch.recurrent_write_rows) if w["ssm"] is None else w["ssm"]


def _check(spec, st, batch, record, label, *, seed=2):
    inp = _inputs(spec, batch.num_tokens, seed=seed)
    ref_out, ref_w = _forward("reference", spec, st, batch, inp)
    results = {}
    for name in _names(spec, batch.phase):
        reasons = lookup(spec.kind, batch.phase, name).supports(spec, torch.device(DEV))
        assert not reasons, f"{label} {name} refused: {reasons}"
        out, w = _forward(name, spec, st, batch, inp)
        state = _states(w, st, batch)
        errs = {"o": _rel(out.o, ref_out.o), "state": _rel(state, ref_w["ssm"]),
                "conv": _rel(w["conv"], ref_w["conv"])}
        finite = bool(torch.isfinite(out.o).all() and torch.isfinite(state).all()
                      and torch.isfinite(w["conv"]).all())
        # in place exactly when the batch hands out spare rows (decode, verify); prefill returns its states
        in_place = w["ssm"] is None
        same_meta = (set(w.values) == set(ref_w.values) and w.step == ref_w.step == batch.step_id
                     and in_place == (bool(batch.ring) and batch.phase != "prefill")
                     and (not in_place or bool((batch.recurrent_write_rows >= 0).all()))
                     and out.o.dtype == ref_out.o.dtype and state.dtype == ref_w["ssm"].dtype
                     and w["conv"].dtype == ref_w["conv"].dtype)
        ok = finite and same_meta and max(errs.values()) <= TOL
        record({"case": label, "phase": batch.phase, "backend": name, "max_rel_o": errs["o"],
                "max_rel_state": errs["state"], "max_rel_conv": errs["conv"], "max_rel": max(errs.values()),
                "finite": finite, "ok": ok})
        assert ok, f"{label} {name}: {errs} finite={finite} same rows/dtypes={same_meta}"
        results[name] = (out, w)
    return inp, (ref_out, ref_w), results


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("prefix", [False, True])
def test_prefill(name, prefix, record):
    spec = _spec(name)
    new = [1, 63, 130, 200]
    cached = [5, 0, 64, 129] if prefix else [0, 0, 0, 0]
    st = _state(spec, cached, extra=max(new))
    batch = fa.Batch.prefill(st, dict(enumerate(new)))
    _check(spec, st, batch, record, f"prefill {name} new={new} cached={cached}")


def _prefill_case(name, prefix, *, seed):
    """Four requests' prefill (1 to 200 new tokens, after cached prefixes when ``prefix``) and its inputs."""
    spec = _spec(name)
    new = [1, 63, 130, 200]
    st = _state(spec, [5, 0, 64, 129] if prefix else [0, 0, 0, 0], extra=max(new))
    batch = fa.Batch.prefill(st, dict(enumerate(new)))
    return spec, st, batch, _inputs(spec, batch.num_tokens, seed=seed)


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla-core not installed")
@pytest.mark.parametrize("name", [n for n in SPECS if n.startswith("gdn")])
@pytest.mark.parametrize("prefix", [False, True])
def test_fla_direct_is_the_public_function_bitwise(name, prefix, record):
    """`fla_direct(True)` runs fla-core's chunk forward past its public function's wrappers: the same kernels
    on the same inputs, so the output, the states and the windows must be the public path's bits."""
    from fnattn.kinds.delta_rule import triton as backend

    assert backend._fla_gdn_forward() is not None, "this fla-core's forward is not in the form fla_direct knows"
    _same_bits_either_way(backend.fla_direct, f"fla_direct {name} prefix={prefix}", name, prefix, 3, record)


def _same_bits_either_way(switch, label, name, prefix, seed, record):
    """The fla provider's prefill with ``switch`` off, then on (the default is either): the same bits."""
    spec, st, batch, inp = _prefill_case(name, prefix, seed=seed)
    with switch(False):
        off_out, off_w = _forward("fla", spec, st, batch, inp)
    with switch(True):
        out, w = _forward("fla", spec, st, batch, inp)
    same = {"o": torch.equal(out.o, off_out.o), "ssm": torch.equal(w["ssm"], off_w["ssm"]),
            "conv": torch.equal(w["conv"], off_w["conv"])}
    record({"case": label, "phase": "prefill", "backend": "fla", **same, "ok": all(same.values())})
    assert all(same.values()), same


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla-core not installed")
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("prefix", [False, True])
def test_qkv_apart_gives_the_one_output_paths_bits(name, prefix, record):
    """`qkv_apart(True)`: the conv writes q, k and v each contiguous, so fla-core's chunk copies none of them;
    the same values in, so the output, the states and the windows must be the one-output path's bits (GDN
    through fla_direct, KDA through fla-core's public function)."""
    from fnattn.kinds.delta_rule import triton as backend

    _same_bits_either_way(backend.qkv_apart, f"qkv_apart {name} prefix={prefix}", name, prefix, 4, record)


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla-core not installed")
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("prefix", [False, True])
def test_chunk_tiles_give_the_packed_tiles_bits(name, prefix, record, monkeypatch):
    """`kernels.gdn_conv.chunk_tiles`: the prefill's conv tiled by the plan's chunks (the first chunks, which read
    the saved windows, in a launch of their own) against the packed tiles, at any size: the same bits of the
    output, the states and the windows through the fla provider."""
    from fnattn.kernels import gdn_conv

    monkeypatch.setitem(gdn_conv.CHUNK_LAUNCH, "min_tokens", 0)
    _same_bits_either_way(gdn_conv.chunk_tiles, f"chunk_tiles {name} prefix={prefix}", name, prefix, 5, record)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("cached", [[1, 17, 300, 64], [7] * 33])
def test_decode(name, cached, record):
    spec = _spec(name)
    st = _state(spec, cached, extra=1)
    batch = fa.Batch.decode(st, range(len(cached)))
    _check(spec, st, batch, record, f"decode {name} B{len(cached)}")


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("ring", [2, 6], ids=["ring2", "ring6"])
def test_verify_and_accept(name, k, ring, record):
    spec = _spec(name)
    cached = [3, 64, 513]
    st = _state(spec, cached, extra=k + 1, ring=ring)
    batch = fa.Batch.verify(st, range(3), num_draft=k)
    mode = "in ring" if batch.ring else "copied"
    _, (_, ref_d), results = _check(spec, st, batch, record, f"verify k={k} {name} states {mode}")
    out, d = results["triton"]  # the last session over the batch: its in-place states are the ones applied
    assert out.replay is not None and out.replay.meta is None
    accepted = {0: 1, 1: k + 1, 2: max(1, k // 2)}
    ours = st.apply(fa.StepDeltas.collect(batch, [d]).accept(batch, accepted), inplace=False)
    ref = st.apply(fa.StepDeltas.collect(batch, [ref_d]).accept(batch, accepted), inplace=False)
    errs = {}
    for r in accepted:
        for t in ("ssm", "conv"):
            errs[f"{t}[{r}]"] = _rel(getattr(ours.views(0), t)[ours.recurrent_row(r)],
                                     getattr(ref.views(0), t)[ref.recurrent_row(r)])
    ok = max(errs.values()) <= TOL and all(ours.request(r).length == ref.request(r).length for r in accepted)
    record({"case": f"verify k={k} {name} states {mode} accept {accepted}", "phase": "verify", "backend": "triton",
            "max_rel": max(errs.values()), "ok": ok})
    assert ok, errs


@pytest.mark.parametrize("name", ["gdn 16qk/32v d128", "kda 8h d128"])
@pytest.mark.parametrize("phase", ["decode", "verify"])
def test_decode_and_verify_replay_from_a_cuda_graph(name, phase, record):
    """Captured in an open session (its plan built before), replayed: same results as eager.

    Each layer runs once per session: the eager run, the allocator warm-up and the capture
    are three sessions over the same batch (each hands the spare ring rows to itself).
    """
    spec = _spec(name)
    cached = [4, 90, 17, 1]
    st = _state(spec, cached, extra=4, ring=5)  # verify's 4 states per request fit the ring: written in place
    ids = range(len(cached))
    batch = fa.Batch.decode(st, ids) if phase == "decode" else fa.Batch.verify(st, ids, num_draft=3)
    inp = _inputs(spec, batch.num_tokens, seed=5)
    ma = fa.ModelAttention([spec], prefer=("triton",), device=DEV, phases=(phase,))
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
        st.views(0).ssm.index_fill_(0, batch.recurrent_write_rows, float("nan"))  # the replay must write them again
        graph.replay()
        torch.cuda.synchronize()
    ok = w["ssm"] is None and eager_w["ssm"] is None and all(torch.equal(a, b) for a, b in (
        (out.o, eager_out.o), (_states(w, st, batch), eager_states), (w["conv"], eager_w["conv"])))
    record({"case": f"cuda graph {phase} {name}", "phase": phase, "backend": "triton", "max_rel": 0.0, "ok": ok})
    assert ok
