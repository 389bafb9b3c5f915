"""The built-in preference orders are usable as ``prefer`` on any machine: every name in them is a registered
backend (a backend whose library is missing is registered all the same and refused by its capability check), and
passing them gives the choices the default gives. A name no backend has is still an error listing the known ones."""

import pytest
import torch
from helpers import full_spec, gdn_spec

import fnattn as fa
from fnattn.model_attention import DEFAULT_PREFER, DEFAULT_PREFER_PREFILL
from fnattn.registry import backend_names


@pytest.mark.parametrize("order", [DEFAULT_PREFER, DEFAULT_PREFER_PREFILL], ids=["decode", "prefill"])
def test_every_name_in_the_default_orders_is_a_registered_backend(order):
    assert set(order) <= set(backend_names()), sorted(set(order) - set(backend_names()))


def test_the_default_orders_work_as_prefer_and_choose_what_the_default_chooses():
    specs = [full_spec(0, hq=4, hkv=2, d=16), gdn_spec(1), full_spec(2, dtype=torch.bfloat16)]
    default = fa.ModelAttention(specs)
    for order in (DEFAULT_PREFER, DEFAULT_PREFER_PREFILL):
        ma = fa.ModelAttention(specs, prefer=order)
        phases = ("prefill",) if order is DEFAULT_PREFER_PREFILL else ("decode", "verify")
        for spec in specs:
            for phase in phases:
                assert ma.backend(spec.index, phase).name == default.backend(spec.index, phase).name


def test_a_name_no_backend_has_is_still_refused_with_the_known_names():
    with pytest.raises(ValueError, match=r"`prefer` must be names of registered backends \(known: .*'sdpa'"):
        fa.ModelAttention([full_spec(0)], prefer=("sdpa", "no_such_backend"))
