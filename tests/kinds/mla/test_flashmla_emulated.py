"""The FlashMLA backends' wiring on the CPU, with sgl_kernel's three entry points emulated in torch.

What runs is the backends' own code (absorption, the plan, pool-slot translation of the top-k, the
second call over the step's rows, the own-row fold, the LSE merges, W_UV, the writes) around
stand-ins that follow the kernels' documented contracts, quirks included: LSE in base 2 for the
sparse kernel, ``+inf`` with a zero output for a query with no key, duplicate indices counted
twice. The kernels themselves are compared on the GPU (tests/gpu/test_mla_backends_gpu.py).
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from helpers import registry_scope

import fnattn as fa
from fnattn.registry import lookup
from kinds.mla.fast_cases import compare, filled_state, forward_all, mla_config, sparse_specs

SMALL = dict(R=16, Dr=8, Dn=8, Dv=8)
# 16 indexer heads: a score is exactly 0 (every head's relu 0) with odds 2^-16, so the two top-k never face
# exact ties (with 2 heads a quarter of the scores are 0, and each side breaks those ties its own way)
HI = 16


def _attend(q, keys, valid, scale, dv):
    """q [H, D] over keys [N, D] where valid [N]: (out [H, dv], natural lse [H]); +inf / 0 when empty."""
    s = (q.float() @ keys.float().T) * scale  # [H, N]
    s = s.masked_fill(~valid[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    if not valid.any():
        return torch.zeros(q.shape[0], dv), torch.full((q.shape[0],), float("inf"))
    return torch.softmax(s, dim=-1) @ keys[:, :dv].float(), lse


def get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, *rest):
    return torch.zeros(1, 8, dtype=torch.int32), torch.zeros(cache_seqlens.shape[0] + 1, dtype=torch.int32)


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, splits, softmax_scale=None,
                           causal=False):
    assert not causal and k_cache.shape[1] == 64  # the backend attends the cache non-causally, pages of 64
    B, n, H, D = q.shape
    out, lse = torch.zeros(B, n, H, head_dim_v), torch.zeros(B, H, n)
    for b in range(B):
        c = int(cache_seqlens[b])
        rows = k_cache[block_table[b].long()].flatten(0, 1)[:c, 0]  # [c, D]
        for i in range(n):
            out[b, i], lse[b, :, i] = _attend(q[b, i], rows, torch.ones(c, dtype=torch.bool), softmax_scale,
                                              head_dim_v)
    return out.to(q.dtype), lse


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    T, H, _ = q.shape
    assert indices.dtype == torch.int32 and indices.shape[1] == 1 and indices.shape[2] % 64 == 0
    out, lse, mx = torch.zeros(T, H, d_v), torch.zeros(T, H), torch.zeros(T, H)
    for t in range(T):
        idx = indices[t, 0].long()
        valid = (idx >= 0) & (idx < kv.shape[0])
        keys = kv[idx.clamp(0, kv.shape[0] - 1), 0]  # duplicates stay: the kernel counts them twice
        keys = torch.where(valid[:, None], keys, 0.0)  # an invalid index reads nothing (NaN pages stay out)
        out[t], lse_e = _attend(q[t], keys, valid, sm_scale, d_v)
        lse[t] = lse_e / math.log(2.0)  # the kernel reports log2-sum-exp2
    return out.to(q.dtype), mx, lse


@pytest.fixture
def emulated(monkeypatch):
    fm = types.ModuleType("sgl_kernel.flash_mla")
    fm.get_mla_metadata, fm.flash_mla_with_kvcache, fm.flash_mla_sparse_fwd = (
        get_mla_metadata, flash_mla_with_kvcache, flash_mla_sparse_fwd)
    pkg = types.ModuleType("sgl_kernel")
    pkg.flash_mla = fm
    monkeypatch.setitem(sys.modules, "sgl_kernel", pkg)
    monkeypatch.setitem(sys.modules, "sgl_kernel.flash_mla", fm)
    with registry_scope():
        for kind, phases in (("mla", ("decode", "verify")), ("sparse_mla", ("prefill", "decode", "verify"))):
            for phase in phases:
                b = lookup(kind, phase, "flashmla")
                fa.register(kind, phase, "emulated", plan=b.plan, page_size=b.page_size, replace=True)(b.source)
        yield "emulated"


TOL = 1e-4  # fp32 end to end


def _ok(rows):
    for r in rows:
        assert r["finite"] and r["o_rel"] <= TOL and r["lse_abs"] <= 1e-3 and r["writes_equal"], r
        assert r.get("topk_mismatch", 0.0) == 0.0, r


@pytest.mark.parametrize("phase, k", [("decode", 0), ("verify", 1), ("verify", 3)])
def test_dense_flashmla_wiring(emulated, phase, k):
    spec = fa.LayerSpec(0, mla_config(H=3, padded=4, **SMALL), torch.float32)
    st = filled_state([spec], [0, 1, 63, 64, 130], page_size=64)
    ids = list(range(5))
    b = fa.Batch.decode(st, ids) if phase == "decode" else fa.Batch.verify(st, ids, num_draft=k)
    _ok(compare([spec], st, b, emulated, seed=k))


def test_dense_flashmla_refuses_other_page_sizes(emulated):
    spec = fa.LayerSpec(0, mla_config(H=2, **SMALL), torch.float32)
    st = filled_state([spec], [3], page_size=16)
    with pytest.raises(ValueError, match="page_size"):
        compare([spec], st, fa.Batch.decode(st, [0]), emulated)


@pytest.mark.parametrize("one_pass", [False, True], ids=["", "one-pass slots"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("phase, k", [("prefill", 0), ("decode", 0), ("verify", 2)])
def test_sparse_flashmla_wiring(emulated, shared, phase, k, one_pass):
    """``one_pass``: the top-k translated by `fnattn.kernels.topk_slots` (the Triton interpreter here)."""
    if one_pass:
        pytest.importorskip("triton")
    from fnattn.kinds.sparse_mla.flashmla import one_pass_slots

    with one_pass_slots(one_pass):
        _sparse_wiring(emulated, shared, phase, k)


@pytest.mark.parametrize("phase, k", [("prefill", 0), ("decode", 0), ("verify", 2)])
def test_sparse_flashmla_wiring_with_fp8_index_keys(emulated, phase, k):
    """FP8 index keys: the Triton indexer (the interpreter here) reads the stored keys and their scales and
    picks what the reference picks from the dequantized keys; both write the same FP8 rows and scales."""
    pytest.importorskip("triton")
    _sparse_wiring(emulated, True, phase, k, key_dtype="fp8_e4m3")


def _sparse_wiring(emulated, shared, phase, k, key_dtype=None):
    specs = sparse_specs(topk=5, Hi=HI, Di=16, shared=shared, H=2, padded=4, dtype=torch.float32, key_dtype=key_dtype,
                         **SMALL)
    st = filled_state(specs, [0, 1, 9, 17], page_size=4, extra=12)
    ids = list(range(4))
    if phase == "prefill":
        b = fa.Batch.prefill(st, {0: 6, 1: 1, 2: 3, 3: 2})
    elif phase == "decode":
        b = fa.Batch.decode(st, ids)
    else:
        b = fa.Batch.verify(st, ids, num_draft=k)
    _ok(compare(specs, st, b, emulated, seed=k))


def test_sparse_multi_step_decode_wiring(emulated):
    specs = sparse_specs(topk=4, Hi=HI, Di=16, shared=True, H=2, padded=4, dtype=torch.float32, **SMALL)
    fast, ref = (filled_state(specs, [2, 7, 11], page_size=4, extra=8) for _ in range(2))
    fm = fa.ModelAttention(specs, prefer=(emulated,), phases=("decode",))
    rm = fa.ModelAttention(specs, prefer=("reference",), phases=("decode",))
    for step in range(5):
        of, df = forward_all(fm, fast, fa.Batch.decode(fast, range(3)), specs, seed=50 + step)
        orf, dr = forward_all(rm, ref, fa.Batch.decode(ref, range(3)), specs, seed=50 + step)
        fast, ref = fast.apply(df), ref.apply(dr)
        for layer in (0, 1):
            assert torch.allclose(of[layer].o, orf[layer].o, atol=1e-5), (step, layer)
