"""merge_attention_states, scatter_kv and scatter_rows against their references."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels.lse_merge import merge_attention_states, merge_attention_states_ref  # noqa: E402
from fnattn.kernels.scatter import (  # noqa: E402
    scatter_kv,
    scatter_kv_ref,
    scatter_rows,
    scatter_rows_pair,
    scatter_rows_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPO = Path(__file__).resolve().parents[2]


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


# --- merge ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
@pytest.mark.parametrize("Dv", [64, 80])
def test_merge_matches_reference_with_empty_parts(dtype, tol, Dv):
    T, H = 37, 4
    o1, o2 = randn(T, H, Dv, dtype=dtype, seed=1), randn(T, H, Dv, dtype=dtype, seed=2)
    lse1, lse2 = randn(T, H, seed=3) * 4, randn(T, H, seed=4) * 4
    inf = float("-inf")
    lse1[0], lse2[1] = inf, inf  # one side empty
    lse1[2], lse2[2] = inf, inf  # both empty
    o1[0], o2[1], o1[2], o2[2] = float("nan"), float("nan"), float("nan"), float("inf")
    o, lse = merge_attention_states(o1, lse1, o2, lse2)
    ro, rlse = merge_attention_states_ref(o1, lse1, o2, lse2)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o, ro, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, rlse, rtol=1e-6, atol=1e-6)
    assert (o[2] == 0).all() and torch.isinf(lse[2]).all()
    torch.testing.assert_close(o[0], o2[0])
    torch.testing.assert_close(lse[1], lse1[1])


def test_merge_equals_attention_over_the_union():
    """Splitting keys in two and merging equals one softmax over all keys."""
    from fnattn.kernels.paged_attention import attend_ref

    q, k, v = randn(5, 4, 32, seed=1), randn(20, 2, 32, seed=2), randn(20, 2, 16, seed=3)
    q_pos, k_pos = torch.full((5,), 100, device=DEVICE), torch.arange(20, device=DEVICE)
    o, lse = attend_ref(q, k, v, q_pos, k_pos, scale=0.2)
    a = attend_ref(q, k[:7], v[:7], q_pos, k_pos[:7], scale=0.2)
    b = attend_ref(q, k[7:], v[7:], q_pos, k_pos[7:], scale=0.2)
    om, lsem = merge_attention_states(*a, *b)
    torch.testing.assert_close(om, o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lsem, lse, rtol=1e-5, atol=1e-5)


def test_merge_bad_arguments():
    o, lse = randn(3, 2, 8), randn(3, 2)
    with pytest.raises(ValueError, match="lse1"):
        merge_attention_states(o, lse.half(), o, lse)
    with pytest.raises(ValueError, match="o2"):
        merge_attention_states(o, lse, randn(3, 2, 4), lse)


# --- scatter -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scatter_kv_skips_negative_slots(dtype):
    L, P, S, H, D = 3, 5, 16, 2, 64
    cache = randn(L, P, S, H, D, dtype=dtype, seed=1)
    new = randn(L, 6, H, D, dtype=dtype, seed=2)
    slots = torch.tensor([17, -1, 0, 79, -5, 40], dtype=torch.int64, device=DEVICE)
    expect = scatter_kv_ref(cache.clone(), slots, new)
    ptr = cache.data_ptr()
    out = scatter_kv(cache, slots, new)
    assert out is cache and cache.data_ptr() == ptr
    assert torch.equal(cache, expect)
    assert torch.equal(cache[:, 1, 1], new[:, 0]) and torch.equal(cache[:, 4, 15], new[:, 3])


def test_scatter_kv_on_a_layer_slice_and_page_size_1():
    pool = randn(4, 7, 1, 1, 24, seed=1)  # MLA-like rows, page size 1
    view = pool[1:3]  # writes must land in the pool
    new = randn(2, 3, 1, 24, seed=2)
    slots = torch.tensor([6, -1, 2], device=DEVICE)
    expect = pool.clone()
    scatter_kv_ref(expect[1:3], slots, new)
    scatter_kv(view, slots, new)
    assert torch.equal(pool, expect)


def test_scatter_rows_large_rows_and_int32_index():
    L, M, N = 2, 6, 4
    dst = randn(L, M, 2, 64, 48, seed=1)  # 6144 elements a row: more than one chunk
    src = randn(L, N, 2, 64, 48, seed=2)
    index = torch.tensor([5, -1, 0, 2], dtype=torch.int32, device=DEVICE)
    expect = scatter_rows_ref(dst.clone(), index, src)
    assert scatter_rows(dst, index, src) is dst
    assert torch.equal(dst, expect)
    assert torch.equal(dst[:, 1], expect[:, 1])


def test_scatter_rows_pair_writes_both_tensors_in_one_call():
    L, M, N = 3, 10, 4
    k, v = randn(L, M, 2, 8), randn(L, M, 2, 4)  # K and V rows of different widths
    index = torch.tensor([7, -1, 0, 3], device=DEVICE)
    sk, sv = randn(L, N, 2, 8), randn(L, N, 2, 4)
    want_k, want_v = scatter_rows_ref(k.clone(), index, sk), scatter_rows_ref(v.clone(), index, sv)
    got_k, got_v = scatter_rows_pair(k, v, index, sk, sv)
    assert got_k is k and got_v is v
    torch.testing.assert_close(k, want_k, rtol=0, atol=0)
    torch.testing.assert_close(v, want_v, rtol=0, atol=0)
    with pytest.raises(ValueError, match="src_b"):
        scatter_rows_pair(k, v, index, sk, sv[:, :2])


def test_scatter_bad_arguments():
    cache = randn(2, 3, 4, 1, 8)
    with pytest.raises(ValueError, match="src"):
        scatter_kv(cache, torch.zeros(2, dtype=torch.int64, device=DEVICE), randn(2, 2, 1, 8).half())
    with pytest.raises(ValueError, match="index"):
        scatter_kv(cache, torch.zeros(2, device=DEVICE), randn(2, 2, 1, 8))
    with pytest.raises(ValueError, match="dst"):
        scatter_rows(randn(2, 8, 4).transpose(1, 2), torch.zeros(1, dtype=torch.int64, device=DEVICE),
                     randn(2, 1, 8))


def test_modules_import_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None; sys.path.insert(0, sys.argv[1])\n"
        "import torch, fnattn.kernels\n"
        "from fnattn.kernels.paged_attention import paged_decode, attend_ref\n"
        "z = torch.zeros(1, 1, 4); p = torch.zeros(1)\n"
        "attend_ref(z, z, z, p, p, scale=1.0)\n"
        "try:\n"
        "    paged_decode(z, None, None, None, None, scale=1.0)\n"
        "except ImportError as e:\n"
        "    print('ImportError', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code, str(REPO)], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert "ImportError" in res.stdout and "triton" in res.stdout


@pytest.mark.parametrize("softcap, base2", [(0.0, False), (5.0, True)])
def test_merge_new_token_equals_attention_with_the_token_cached(softcap, base2):
    from fnattn.kernels.lse_merge import merge_new_token, merge_new_token_ref
    from fnattn.kernels.paged_attention import attend_ref

    B, Hq, Hkv, D, Dv, n = 3, 8, 2, 16, 8, 5
    q, k_new, v_new = randn(B, Hq, D), randn(B, Hkv, D), randn(B, Hkv, Dv)
    kc, vc = randn(B, n, Hkv, D), randn(B, n, Hkv, Dv)
    pos = torch.arange(n + 1, device=DEVICE)
    parts, fulls = [], []
    for b in range(B):
        o, lse = attend_ref(q[b : b + 1], kc[b], vc[b], pos[n:], pos[:n], scale=0.25, softcap=softcap)
        parts.append((o, lse))
        fulls.append(attend_ref(q[b : b + 1], torch.cat([kc[b], k_new[b : b + 1]]),
                                torch.cat([vc[b], v_new[b : b + 1]]), pos[n:], pos, scale=0.25, softcap=softcap))
    o_c = torch.cat([p[0] for p in parts])
    lse_c = torch.cat([p[1] for p in parts])
    lse_c[1] = float("-inf")  # request 1: nothing cached; its cached output is garbage
    o_c[1] = float("nan")
    if base2:
        lse_c = lse_c / math.log(2.0)
    got = merge_new_token(o_c, lse_c, q, k_new, v_new, scale=0.25, softcap=softcap, lse_base2=base2)
    want = merge_new_token_ref(o_c, lse_c, q, k_new, v_new, scale=0.25, softcap=softcap, lse_base2=base2)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    for b in (0, 2):
        torch.testing.assert_close(got[0][b], fulls[b][0][0].to(got[0].dtype), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0][1], v_new[1].repeat_interleave(Hq // Hkv, dim=0), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mark", ["+inf", "nan", "cache_lens"])
def test_merge_new_token_reads_a_kernels_no_key_marks_as_an_empty_cached_part(mark):
    from fnattn.kernels.lse_merge import merge_new_token, merge_new_token_ref

    B, Hq, Hkv, D, Dv = 3, 4, 2, 16, 8
    q, k_new, v_new = randn(B, Hq, D), randn(B, Hkv, D), randn(B, Hkv, Dv)
    o_c, lse_c = randn(B, Hq, Dv), randn(B, Hq).float()
    o_c[2] = float("nan")  # an empty part's output may hold anything
    lens = torch.tensor([5, 3, 7], dtype=torch.int32, device=DEVICE)
    if mark == "cache_lens":
        lens[2] = 0
    else:
        lse_c[2] = float(mark)
    kw = dict(scale=0.25, cache_lens=lens)
    got = merge_new_token(o_c, lse_c, q, k_new, v_new, **kw)
    want = merge_new_token_ref(o_c, lse_c, q, k_new, v_new, **kw)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0][2], v_new[2].repeat_interleave(Hq // Hkv, dim=0), atol=1e-6, rtol=1e-6)
    assert torch.isfinite(got[1]).all()
    with pytest.raises(ValueError, match="cache_lens: expected \\[3\\] int32"):
        merge_new_token(o_c, lse_c, q, k_new, v_new, scale=0.25, cache_lens=lens[:2])



@pytest.mark.parametrize("base2", [False, True])
def test_merge_new_token_leaves_out_a_token_not_allowed(base2):
    """``allowed``: a query whose top-k left its own row out keeps the cached part's bits (output and natural-log
    LSE); with that part empty too it attended nothing (zero output, -inf)."""
    from fnattn.kernels.lse_merge import merge_new_token, merge_new_token_ref

    B, Hq, Hkv, D, Dv = 4, 4, 1, 16, 8
    q, k_new, v_new = randn(B, Hq, D), randn(B, Hkv, D), randn(B, Hkv, Dv)
    o_c, lse_c = randn(B, Hq, Dv), randn(B, Hq).float()
    lse_c[2:] = float("inf")  # requests 2 and 3: no cached key (FlashMLA's mark, a zero output)
    o_c[2:] = 0.0
    allowed = torch.tensor([True, False, False, True], device=DEVICE)
    kw = dict(scale=0.25, lse_base2=base2, allowed=allowed)
    got = merge_new_token(o_c, lse_c, q, k_new, v_new, **kw)
    want = merge_new_token_ref(o_c, lse_c, q, k_new, v_new, **kw)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[0][1], o_c[1]) and torch.equal(got[1][1], lse_c[1] * (math.log(2.0) if base2 else 1.0))
    assert (got[0][2] == 0).all() and torch.isneginf(got[1][2]).all()
    torch.testing.assert_close(got[0][3], v_new[3].repeat_interleave(Hq, dim=0), atol=1e-6, rtol=1e-6)
    plain = merge_new_token(o_c, lse_c, q, k_new, v_new, scale=0.25, lse_base2=base2)
    assert torch.equal(got[0][[0, 3]], plain[0][[0, 3]]) and torch.equal(got[1][[0, 3]], plain[1][[0, 3]])
    with pytest.raises(ValueError, match="allowed: expected \\[4\\] bool"):
        merge_new_token(o_c, lse_c, q, k_new, v_new, scale=0.25, allowed=allowed[:3])
