"""MLA attention core: absorbed == expanded, semantics against a naive loop, argument checks.

The DeepSeek attention block around it (projections, rope, ``o_proj``) and its
parity with transformers are tested in ``tests/test_model_mla_layer.py``."""

from __future__ import annotations

import math

import pytest
import torch
from hf_mla import Dn, Dr, Dv, H, R

from fnattn.kinds.mla.math import key_visibility, mla_absorbed, mla_expanded

# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #


def core_inputs(T: int, n_cached: int, *, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    N = n_cached + T

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    return dict(
        q_nope=rnd(T, H, Dn),
        q_pe=rnd(T, H, Dr),
        latent=rnd(N, R + Dr),
        w_uk=rnd(H, Dn, R, std=R**-0.5),
        w_uv=rnd(H, Dv, R, std=R**-0.5),
    )


def random_mask(T: int, N: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(T, N, generator=g) < 0.5


def naive_mla(q_nope, q_pe, latent, w_uk, w_uv, *, scale, n_cached, allowed=None):
    """Per-query loop over explicitly listed keys, in float64."""
    d = torch.float64
    q_nope, q_pe, latent, w_uk, w_uv = (x.to(d) for x in (q_nope, q_pe, latent, w_uk, w_uv))
    T, N = q_nope.shape[0], latent.shape[0]
    c, k_pe = latent[:, :R], latent[:, R:]
    o = torch.zeros(T, H, Dv, dtype=d)
    lse = torch.full((T, H), -math.inf, dtype=d)
    for i in range(T):
        keys = [j for j in range(n_cached + i + 1) if allowed is None or bool(allowed[i, j])]
        if not keys:
            continue
        for h in range(H):
            s = torch.stack([(q_nope[i, h] @ (w_uk[h] @ c[j]) + q_pe[i, h] @ k_pe[j]) * scale for j in keys])
            p = torch.softmax(s, 0)
            o[i, h] = sum(p[n] * (w_uv[h] @ c[j]) for n, j in enumerate(keys))
            lse[i, h] = torch.logsumexp(s, 0)
    assert N == n_cached + T
    return o, lse


# --------------------------------------------------------------------------- #
# core
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("n_cached", [0, 5])
@pytest.mark.parametrize("sparse", [False, True])
def test_expanded_equals_absorbed_and_naive(n_cached, sparse):
    T = 6
    inputs = core_inputs(T, n_cached)
    allowed = random_mask(T, n_cached + T) if sparse else None
    kw = dict(scale=0.2, n_cached=n_cached, allowed=allowed)
    o_e, lse_e = mla_expanded(**inputs, **kw)
    o_a, lse_a = mla_absorbed(**inputs, **kw)
    torch.testing.assert_close(o_a, o_e, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_a, lse_e, atol=1e-5, rtol=1e-5)
    o_n, lse_n = naive_mla(**inputs, **kw)
    torch.testing.assert_close(o_e, o_n.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_e, lse_n.float(), atol=1e-5, rtol=1e-5)


def test_query_without_keys_gives_zero_and_minus_inf():
    inputs = core_inputs(3, 2)
    allowed = torch.ones(3, 5, dtype=torch.bool)
    allowed[1] = False
    for core in (mla_expanded, mla_absorbed):
        o, lse = core(**inputs, scale=0.3, n_cached=2, allowed=allowed)
        assert torch.all(o[1] == 0) and torch.all(lse[1] == -math.inf)
        assert torch.isfinite(o).all() and torch.isfinite(lse[[0, 2]]).all()


def test_lse_merges_cached_and_new_parts():
    n_cached, T = 7, 4
    inputs = core_inputs(T, n_cached, seed=3)
    latent = inputs.pop("latent")
    o, lse = mla_absorbed(**inputs, latent=latent, scale=0.25, n_cached=n_cached)
    o1, lse1 = mla_absorbed(**inputs, latent=latent[:n_cached], scale=0.25, n_cached=n_cached, causal=False)
    o2, lse2 = mla_expanded(**inputs, latent=latent[n_cached:], scale=0.25, n_cached=0)
    merged_lse = torch.logaddexp(lse1, lse2)
    merged = o1 * (lse1 - merged_lse).exp()[..., None] + o2 * (lse2 - merged_lse).exp()[..., None]
    torch.testing.assert_close(merged_lse, lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged, o, atol=1e-5, rtol=1e-5)


def test_bf16_close_to_fp32():
    inputs = core_inputs(5, 4, seed=5)
    own_token = torch.cat((torch.zeros(5, 4, dtype=torch.bool), torch.eye(5, dtype=torch.bool)), dim=1)
    allowed = random_mask(5, 9, seed=6) | own_token
    ref, _ = mla_expanded(**inputs, scale=0.2, n_cached=4, allowed=allowed)
    bf16 = {k: v.to(torch.bfloat16) for k, v in inputs.items()}
    for core in (mla_expanded, mla_absorbed):
        o, lse = core(**bf16, scale=0.2, n_cached=4, allowed=allowed)
        assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
        torch.testing.assert_close(o.float(), ref, atol=3e-2, rtol=3e-2)


def test_key_visibility():
    vis = key_visibility(3, 5, n_cached=2)
    assert vis.tolist() == [[True, True, True, False, False], [True] * 4 + [False], [True] * 5]
    assert key_visibility(2, 3, n_cached=3, causal=False).all()
    with pytest.raises(ValueError, match="n_cached"):
        key_visibility(3, 6, n_cached=2)


def test_core_inputs_not_mutated():
    inputs = core_inputs(4, 3)
    allowed = random_mask(4, 7)
    before = {k: v.clone() for k, v in inputs.items()}
    for core in (mla_expanded, mla_absorbed):
        core(**inputs, scale=0.2, n_cached=3, allowed=allowed)
    for k, v in inputs.items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(allowed, random_mask(4, 7))


@pytest.mark.parametrize(
    "name, bad, match",
    [
        ("q_pe", torch.zeros(4, H + 1, Dr), r"q_pe: expected shape \[4, 4, \*\], got \[4, 5, 8\]"),
        ("latent", torch.zeros(7, R), r"latent: expected shape \[\*, 40\], got \[7, 32\]"),
        ("w_uv", torch.zeros(H + 1, Dv, R), r"w_uv: expected shape \[4, \*, 32\], got \[5, 16, 32\]"),
        ("allowed", torch.ones(4, 6, dtype=torch.bool), r"allowed: expected shape \[4, 7\], got \[4, 6\]"),
    ],
)
def test_bad_shapes_raise(name, bad, match):
    inputs = core_inputs(4, 3)
    inputs[name] = bad
    with pytest.raises(ValueError, match=match):
        mla_absorbed(**inputs, scale=0.2, n_cached=3)
