"""MLA's invariant Triton backend (``triton``: the invariant mode's launches, interpreted here in fp32) against the
reference in every phase, and when it is chosen. Its bitwise property (a token's bits in a prefill, a verify and a
decode, alone or beside others) is `tests/test_invariant.py::test_an_mla_layer_verifies_decodes_and_decodes_alone_
the_same_bits`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import same_bits

import fnattn as fa
import fnattn.switches
from fnattn.registry import lookup

from .fast_cases import filled_state, forward_all, mla_config

pytest.importorskip("triton")
PHASES = ("prefill", "decode", "verify")


def lifted():
    """The backend for every phase with its device check lifted (the kernels run interpreted on the CPU)."""
    return tuple(dataclasses.replace(lookup("mla", p, "triton"), supports=lambda spec, device: []) for p in PHASES)


def spec(**kw):
    return fa.LayerSpec(0, mla_config(H=3, R=64, Dr=16, Dn=32, Dv=24, **kw), torch.float32)


@pytest.mark.parametrize("phase, cached, new", [("prefill", [0, 6], [8, 3]), ("decode", [37, 0, 21], [1, 1, 1]),
                                                ("verify", [37, 21], [4, 4])])
def test_every_phase_matches_the_reference(phase, cached, new):
    specs = [spec()]
    st = filled_state(specs, cached, page_size=4, extra=8)
    ids = list(range(len(cached)))
    batch = {"prefill": lambda: fa.Batch.prefill(st, dict(zip(ids, new))),
             "decode": lambda: fa.Batch.decode(st, ids),
             "verify": lambda: fa.Batch.verify(st, ids, num_draft=new[0] - 1)}[phase]()
    with fnattn.switches.set(invariant=True):
        got_ma = fa.ModelAttention(specs, prefer=lifted(), phases=(phase,))
        ref_ma = fa.ModelAttention(specs, prefer=("reference",), phases=(phase,))
        assert got_ma.backend(0, phase).name == "triton"
        got, gd = forward_all(got_ma, st, batch, specs, seed=4)
        ref, rd = forward_all(ref_ma, st, batch, specs, seed=4)
    g, r = got[0], ref[0]
    assert g.o.shape == r.o.shape and g.o.dtype == r.o.dtype and torch.isfinite(g.o).all()
    torch.testing.assert_close(g.o, r.o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(g.lse, r.lse, atol=1e-4, rtol=1e-4)
    assert all(same_bits(gd.writes[0][k], rd.writes[0][k]) for k in rd.writes[0].values)


def test_it_serves_the_invariant_mode_only_and_no_fp8_cache():
    backend = lookup("mla", "decode", "triton")
    assert backend.invariant and backend.capturable and not lookup("mla", "prefill", "triton").capturable
    cuda = torch.device("cuda")
    reasons = " ".join(backend.supports(spec(), cuda))
    assert "serves the invariant mode, which is off" in reasons
    with fnattn.switches.set(invariant=True):
        assert "serves the invariant mode" not in " ".join(backend.supports(spec(), cuda))
        assert "an FP8 latent cache" in " ".join(backend.supports(spec(cache_dtype="fp8_e4m3"), cuda))
        assert "needs a CUDA device" in " ".join(backend.supports(spec(), torch.device("cpu")))
