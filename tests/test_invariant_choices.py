"""Which backends a ModelAttention may choose while the invariant mode is on, and what happens when the mode and
the choices disagree: every backend declares whether it honours the mode (`fnattn.register`'s ``invariant``),
one built while the mode is on chooses only those, and a session or a replay in the mode over choices or graphs
made outside it is refused, naming the mode, before anything runs."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import registry_scope

import fnattn as fa
import fnattn.switches
from fnattn.registry import all_backends, lookup

#: The built-in backends that do not honour the mode: the peers' kernels, whose splits and tiles follow the step.
#: (The fused GDN / KDA decode does since its V tile stopped narrowing with the batch in the mode.)
NOT_HONOURING = {("full", "flashinfer"), ("mla", "flashinfer"), ("mla", "flashmla"), ("sparse_mla", "flashmla"),
                 ("dsv4", "flashmla"), ("gdn", "fla"), ("kda", "fla")}


def test_every_built_in_backend_declares_whether_it_honours_the_mode():
    for kind in ("full", "mla", "sparse_mla", "dsv4", "delta_rule"):  # the package loads its kinds on first use
        importlib.import_module(f"fnattn.kinds.{kind}")
    declared = {(b.kind, b.name) for b in all_backends() if b.builtin and not b.invariant}
    assert declared == NOT_HONOURING
    # every kind keeps a path that honours the mode in every phase it has
    for kind in {b.kind for b in all_backends() if b.builtin}:
        for phase in {b.phase for b in all_backends() if b.kind == kind}:
            assert any(b.invariant for b in all_backends() if (b.kind, b.phase) == (kind, phase)), (kind, phase)


def full_spec():
    return fa.LayerSpec(index=0, config=fa.FullAttentionConfig(num_q_heads=4, num_kv_heads=2, head_dim=16),
                        dtype=torch.float32)


def register_mine(*, invariant: bool):
    """A user backend for full decode (the reference's body under another name), honouring the mode or not."""
    reference = lookup("full", "decode", "reference").source

    def mine(spec, views, inputs):
        return reference(spec, views, inputs)

    fa.register("full", "decode", "mine", invariant=invariant, replace=True)(mine)


def test_in_the_mode_a_backend_that_does_not_honour_it_is_refused_with_the_reason():
    with registry_scope():
        register_mine(invariant=False)
        assert fa.ModelAttention([full_spec()]).backend(0, "decode").name == "mine"  # a user's ranks first
        with fnattn.switches.set(invariant=True):
            attn = fa.ModelAttention([full_spec()])
        assert attn.invariant and attn.backend(0, "decode").name != "mine" and attn.not_invariant == ()
        assert "mine (does not honour the invariant mode, which is on" in attn.explain()
        register_mine(invariant=True)
        with fnattn.switches.set(invariant=True):
            assert fa.ModelAttention([full_spec()]).backend(0, "decode").name == "mine"


def test_a_session_in_the_mode_over_choices_made_outside_it_is_refused_before_it_runs():
    spec = full_spec()
    with registry_scope():
        register_mine(invariant=False)
        attn = fa.ModelAttention([spec])
        assert attn.not_invariant == ("mine",)
        st = fa.State([spec], num_pages=8, page_size=4, max_requests=2).admit(0)
        st = st.reserve({0: 1})
        with fnattn.switches.set(invariant=True), pytest.raises(ValueError) as e:
            attn.session(st, fa.Batch.decode(st, [0]))
        assert "the invariant mode" in str(e.value) and "mine" in str(e.value) and "got 'on'" in str(e.value)
        st.check_live()  # nothing ran: the handle is still the live one, and outside the mode the step runs
        with attn.session(st, fa.Batch.decode(st, [0])):
            pass
    # choices made inside the mode serve outside it too: every one of them honours it (and runs its usual order)
    with fnattn.switches.set(invariant=True):
        inside = fa.ModelAttention([spec])
    st = fa.State([spec], num_pages=8, page_size=4, max_requests=2).admit(0).reserve({0: 1})
    with inside.session(st, fa.Batch.decode(st, [0])):
        pass


def test_register_takes_only_a_bool_for_invariant():
    with registry_scope(), pytest.raises(ValueError, match="`invariant` must be a bool"):
        fa.register("full", "decode", "mine", invariant="yes")


def test_a_replay_in_the_mode_of_a_graph_captured_outside_it_is_refused_naming_why():
    from fnattn.graph import refuse_replay_in_the_mode

    spec = full_spec()
    with pytest.raises(ValueError, match="as when this bucket's graph was captured"):
        refuse_replay_in_the_mode("StepRunner", fa.ModelAttention([spec]))
    with registry_scope():
        register_mine(invariant=False)
        with pytest.raises(ValueError, match="those that do not honour the mode: mine"):
            refuse_replay_in_the_mode("StepRunner", fa.ModelAttention([spec]))
