"""MLA's and sparse MLA's invariant Triton backends (``triton``: the invariant mode's launches, interpreted here in
fp32) against the references in every phase, and when they are chosen. Its bitwise property (a token's bits
in a prefill, a verify and a decode, alone or beside others) is tests/test_invariant.py's
`test_an_mla_layer_verifies_decodes_and_decodes_alone_the_same_bits`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import same_bits

import fnattn as fa
import fnattn.switches
from fnattn.registry import lookup

from .fast_cases import filled_state, forward_all, mla_config, sparse_specs

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU states, the kernels interpreted; on CUDA "
                                "tests/gpu/test_invariant_gpu.py runs the model's layers")
PHASES = ("prefill", "decode", "verify")


def lifted(kind="mla"):
    """The backend for every phase with its device check lifted (the kernels run interpreted on the CPU)."""
    return tuple(dataclasses.replace(lookup(kind, p, "triton"), supports=lambda spec, device: []) for p in PHASES)


def spec(**kw):
    return fa.LayerSpec(0, mla_config(H=3, R=64, Dr=16, Dn=32, Dv=24, **kw), torch.float32)


@pytest.mark.parametrize("phase, cached, new", [("prefill", [0, 6], [8, 3]), ("decode", [37, 0, 21], [1, 1, 1]),
                                                ("verify", [37, 21], [4, 4])])
@pytest.mark.parametrize("sparse", [False, True])
def test_every_phase_matches_the_reference(phase, cached, new, sparse):
    """Sparse: two layers, the second reusing the first's picks, each token picking all it sees (a top-k above
    every length), so the selection cannot differ from the reference's and the outputs compare."""
    kind = "sparse_mla" if sparse else "mla"
    specs = sparse_specs(topk=64, Hi=4, Di=32, shared=True, dtype=torch.float32, H=3, R=64, Dr=16, Dn=32, Dv=24) \
        if sparse else [spec()]
    st = filled_state(specs, cached, page_size=4, extra=8)
    ids = list(range(len(cached)))
    batch = {"prefill": lambda: fa.Batch.prefill(st, dict(zip(ids, new))),
             "decode": lambda: fa.Batch.decode(st, ids),
             "verify": lambda: fa.Batch.verify(st, ids, num_draft=new[0] - 1)}[phase]()
    with fnattn.switches.set(invariant=True):
        got_ma = fa.ModelAttention(specs, prefer=lifted(kind), phases=(phase,))
        ref_ma = fa.ModelAttention(specs, prefer=("reference",), phases=(phase,))
        assert {got_ma.backend(s.index, phase).name for s in specs} == {"triton"}
        got, gd = forward_all(got_ma, st, batch, specs, seed=4)
        ref, rd = forward_all(ref_ma, st, batch, specs, seed=4)
    for layer, (gw, rw) in enumerate(zip(gd.writes, rd.writes)):
        g, r = got[layer], ref[layer]
        assert g.o.shape == r.o.shape and g.o.dtype == r.o.dtype and torch.isfinite(g.o).all()
        torch.testing.assert_close(g.o, r.o, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(g.lse, r.lse, atol=1e-4, rtol=1e-4)
        assert all(same_bits(gw[k], rw[k]) for k in rw.values)
        if sparse:
            assert torch.equal(g.topk_indices.sort(dim=1).values, r.topk_indices.sort(dim=1).values)


@pytest.mark.parametrize("kind", ["mla", "sparse_mla"])
def test_it_serves_the_invariant_mode_only_and_no_fp8_cache(kind):
    def layer(**kw):
        if kind == "mla":
            return spec(**kw)
        return sparse_specs(topk=8, Hi=4, Di=32, dtype=torch.float32, H=3, R=64, Dr=16, Dn=32, Dv=24, **kw)[0]

    backend = lookup(kind, "decode", "triton")
    assert backend.invariant and backend.capturable and not lookup(kind, "prefill", "triton").capturable
    cuda = torch.device("cuda")
    assert "serves the invariant mode, which is off" in " ".join(backend.supports(layer(), cuda))
    with fnattn.switches.set(invariant=True):
        assert "serves the invariant mode" not in " ".join(backend.supports(layer(), cuda))
        assert "an FP8 latent cache" in " ".join(backend.supports(layer(cache_dtype="fp8_e4m3"), cuda))
        assert "needs a CUDA device" in " ".join(backend.supports(layer(), torch.device("cpu")))
