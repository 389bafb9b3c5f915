"""paged_decode / paged_prefill against their pure-torch references.

Without CUDA the kernels run under the Triton interpreter on tiny shapes.
Pool slots that no request owns are NaN, so any stray read shows in the output.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels.lse_merge import merge_attention_states  # noqa: E402
from fnattn.kernels.paged_attention import (  # noqa: E402
    attend_ref,
    paged_decode,
    paged_decode_ref,
    paged_prefill,
    paged_prefill_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-2, atol=2e-2),
       torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}


def make_cache(cache_lens, Hkv, D, Dv, S, dtype, spare_pages=3, seed=0):
    """A NaN-filled pool holding each request's cached tokens on shuffled pages.

    Returns k_cache [P, S, Hkv, D], v_cache [P, S, Hkv, Dv], block_table
    [B, max_pages] int32 (padding entries 0), cache_lens [B] int32.
    """
    g = torch.Generator().manual_seed(seed)
    pages = [(n + S - 1) // S for n in cache_lens]
    P = sum(pages) + spare_pages
    max_pages = max(pages + [1]) + 1  # one padding column that is never read
    k_cache = torch.full((P, S, Hkv, D), float("nan"))
    v_cache = torch.full((P, S, Hkv, Dv), float("nan"))
    order = torch.randperm(P, generator=g)
    block_table = torch.zeros(len(cache_lens), max_pages, dtype=torch.int32)
    used = 0
    for b, n in enumerate(cache_lens):
        ids = order[used:used + pages[b]]
        used += pages[b]
        block_table[b, :pages[b]] = ids.int()
        t = torch.arange(n)
        k_cache[ids[t // S], t % S] = torch.randn(n, Hkv, D, generator=g)
        v_cache[ids[t // S], t % S] = torch.randn(n, Hkv, Dv, generator=g)
    return (k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype), block_table.to(DEVICE),
            torch.tensor(cache_lens, dtype=torch.int32, device=DEVICE))


def randn(*shape, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def check(out, ref, dtype):
    o, lse = out
    ro, rlse = ref
    assert o.dtype == ro.dtype and lse.dtype == torch.float32
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o.float(), ro.float(), **TOL[dtype])
    torch.testing.assert_close(lse, rlse, **TOL[dtype])


def run_decode(cache_lens, Hq, Hkv, D, S, *, Dv=None, dtype=torch.float32, new=True,
               num_splits=1, **kw):
    Dv = Dv or D
    k_cache, v_cache, block_table, lens = make_cache(cache_lens, Hkv, D, Dv, S, dtype)
    B = len(cache_lens)
    q = randn(B, Hq, D, dtype=dtype, seed=2)
    if new:
        kw.update(k_new=randn(B, Hkv, D, dtype=dtype, seed=3), v_new=randn(B, Hkv, Dv, dtype=dtype, seed=4))
    args = (q, k_cache, v_cache, block_table, lens)
    out = paged_decode(*args, scale=D ** -0.5, num_splits=num_splits, **kw)
    ref = paged_decode_ref(*args, scale=D ** -0.5, **kw)
    check(out, ref, dtype)
    return out


def run_prefill(cache_lens, new_lens, Hq, Hkv, D, S, *, Dv=None, dtype=torch.float32,
                num_splits=1, **kw):
    Dv = Dv or D
    k_cache, v_cache, block_table, lens = make_cache(cache_lens, Hkv, D, Dv, S, dtype)
    T = sum(new_lens)
    cu = torch.tensor([0] + new_lens, dtype=torch.int32).cumsum(0).int().to(DEVICE)
    q = randn(T, Hq, D, dtype=dtype, seed=2)
    k_new = randn(T, Hkv, D, dtype=dtype, seed=3)
    v_new = randn(T, Hkv, Dv, dtype=dtype, seed=4)
    args = (q, k_new, v_new, cu, k_cache, v_cache, block_table, lens)
    out = paged_prefill(*args, scale=D ** -0.5, num_splits=num_splits, **kw)
    ref = paged_prefill_ref(*args, scale=D ** -0.5, **kw)
    check(out, ref, dtype)
    return out


# --- decode ------------------------------------------------------------------


@pytest.mark.parametrize(
    "Hq, Hkv, D, S, cache_lens, num_splits",
    [
        (4, 4, 64, 16, [0, 1, 37], 1),  # GQA 1
        (8, 2, 128, 1, [5, 70], 3),  # GQA 4, page 1, split-K
        (8, 1, 64, 64, [0, 65, 130], 1),  # GQA 8, page 64
        (8, 1, 64, 64, [0, 65, 130], 2),
        (6, 2, 64, 16, [33, 2], 2),  # GQA 3: group padded to 4 rows
        (4, 2, 192, 16, [20], 1),  # head dim padded to 256
    ],
)
def test_decode_shapes(Hq, Hkv, D, S, cache_lens, num_splits):
    run_decode(cache_lens, Hq, Hkv, D, S, num_splits=num_splits)


def test_decode_head_dim_256_and_dv_differs():
    run_decode([20], 4, 2, 256, 16, num_splits=2)
    run_decode([9, 40], 4, 1, 128, 16, Dv=64)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(
    "kw",
    [dict(softcap=5.0), dict(sliding_window=20), dict(sliding_window=1),
     dict(sinks="rand"), dict(softcap=3.0, sliding_window=33, sinks="rand")],
    ids=["softcap", "window", "window1", "sinks", "all"],
)
def test_decode_features(kw, num_splits):
    kw = dict(kw)
    if kw.get("sinks") == "rand":
        kw["sinks"] = randn(8, seed=7) * 3
    run_decode([0, 50, 97], 8, 2, 64, 16, num_splits=num_splits, **kw)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_cached_part_only(num_splits):
    """Without k_new a request with an empty cache attended nothing."""
    o, lse = run_decode([0, 23, 64], 8, 2, 64, 16, new=False, num_splits=num_splits,
                        sinks=randn(8, seed=7))
    assert torch.isinf(lse[0]).all() and (lse[0] < 0).all()
    assert (o[0] == 0).all()
    o, lse = run_decode([0, 23], 8, 2, 64, 16, new=False, num_splits=num_splits, sliding_window=1)
    assert torch.isinf(lse).all() and (o == 0).all()


@pytest.mark.parametrize("fields", [dict(block_n=32, num_warps=8, num_stages=2), dict(block_m=32, block_n=16)])
def test_configured_tiles_give_the_reference(fields):
    """A sweep's tile override (`configured`) changes how the keys are walked, not what is attended."""
    from fnattn.kernels.paged_attention import configured

    with configured(**fields):
        run_decode([0, 45, 100], 8, 2, 64, 16, num_splits=2)
        run_decode([33], 8, 2, 64, 16, num_splits=1, sliding_window=20)


@pytest.mark.parametrize("fields, match", [(dict(block_k=16), "block_k: expected one of block_m"),
                                           (dict(block_n=48), "block_n: expected a power of two in 1..256, got 48"),
                                           (dict(num_stages=0), "num_stages: expected an int in 1..8, got 0"),
                                           (dict(num_warps=True), "num_warps: expected a power of two")])
def test_configured_refuses_bad_fields(fields, match):
    from fnattn.kernels.paged_attention import configured

    with pytest.raises(ValueError, match=match):
        with configured(**fields):
            pass


def test_decode_default_splits_and_fp16():
    run_decode([3, 70], 8, 2, 64, 16, num_splits=None)
    run_decode([0, 45, 100], 8, 2, 128, 16, dtype=torch.float16, num_splits=2, softcap=10.0)


def test_decode_equals_cached_part_merged_with_new_token():
    """The folded new token equals attending the cache and merging the new token by LSE."""
    cache_lens, Hq, Hkv, D = [0, 17, 80], 8, 2, 64
    k_cache, v_cache, block_table, lens = make_cache(cache_lens, Hkv, D, D, 16, torch.float32)
    q = randn(3, Hq, D, seed=2)
    k_new, v_new = randn(3, Hkv, D, seed=3), randn(3, Hkv, D, seed=4)
    args = (q, k_cache, v_cache, block_table, lens)
    o, lse = paged_decode(*args, k_new=k_new, v_new=v_new, scale=0.1)
    o_c, lse_c = paged_decode(*args, scale=0.1, num_splits=2)
    pos = torch.zeros(1, dtype=torch.long, device=DEVICE)
    parts = [attend_ref(q[b:b + 1], k_new[b:b + 1], v_new[b:b + 1], pos, pos, scale=0.1) for b in range(3)]
    o_n = torch.cat([p[0] for p in parts])
    lse_n = torch.cat([p[1] for p in parts])
    o_m, lse_m = merge_attention_states(o_c, lse_c, o_n, lse_n)
    torch.testing.assert_close(o_m, o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_m, lse, rtol=1e-5, atol=1e-5)


# --- prefill / verify ---------------------------------------------------------


@pytest.mark.parametrize(
    "Hq, Hkv, D, S, cache_lens, new_lens, num_splits",
    [
        (8, 2, 64, 16, [0, 0, 0], [1, 17, 70], 1),  # plain prefill, ragged
        (8, 1, 128, 64, [5, 64, 0], [3, 33, 1], 1),  # chunked prefill, GQA 8
        (4, 4, 64, 1, [10, 0, 40, 129], [2, 3, 4, 5], 1),  # verify, GQA 1, page 1
        (4, 4, 64, 1, [10, 0, 40, 129], [2, 3, 4, 5], 3),  # verify, split-K
        (8, 2, 128, 16, [7, 30], [0, 4], 1),  # a request with no new tokens
    ],
)
def test_prefill_shapes(Hq, Hkv, D, S, cache_lens, new_lens, num_splits):
    run_prefill(cache_lens, new_lens, Hq, Hkv, D, S, num_splits=num_splits)


def test_prefill_head_dim_256():
    run_prefill([20], [3], 4, 2, 256, 16, num_splits=2)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize(
    "kw",
    [dict(softcap=5.0), dict(sliding_window=9), dict(sinks="rand"),
     dict(softcap=3.0, sliding_window=40, sinks="rand")],
    ids=["softcap", "window", "sinks", "all"],
)
def test_prefill_features(kw, num_splits):
    kw = dict(kw)
    if kw.get("sinks") == "rand":
        kw["sinks"] = randn(8, seed=7) * 3
    run_prefill([0, 37, 70], [20, 1, 5], 8, 2, 64, 16, num_splits=num_splits, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [2, 7])
def test_prefill_split_k_several_m_tiles(dtype, num_splits):
    """Every (m-tile, request, kv head) has its own splits to merge; an empty cache and a window included."""
    Hq, Hkv = (4, 2) if dtype == torch.float32 else (8, 1)  # fp32: 32 tokens a tile, fp16: 16
    run_prefill([0, 150, 40], [37, 3, 18], Hq, Hkv, 64, 16, dtype=dtype, num_splits=num_splits,
                sliding_window=30, sinks=randn(Hq, seed=7))


def test_decode_many_splits_mostly_empty():
    """More splits than key blocks: the empty splits weigh nothing in the merge."""
    run_decode([0, 5, 40], 8, 2, 64, 16, num_splits=12, sinks=randn(8, seed=7))
    o, lse = run_decode([0, 5, 40], 8, 2, 64, 16, new=False, num_splits=12, sliding_window=1)
    assert torch.isinf(lse).all() and (o == 0).all()


def test_prefill_fp16_and_explicit_max_len():
    run_prefill([0, 45], [33, 4], 8, 2, 128, 16, dtype=torch.float16, max_new_len=33)


def test_decode_matches_prefill_with_one_new_token():
    cache_lens, Hq, Hkv, D = [0, 31, 66], 8, 2, 64
    k_cache, v_cache, block_table, lens = make_cache(cache_lens, Hkv, D, D, 16, torch.float32)
    q = randn(3, Hq, D, seed=2)
    k_new, v_new = randn(3, Hkv, D, seed=3), randn(3, Hkv, D, seed=4)
    cu = torch.arange(4, dtype=torch.int32, device=DEVICE)
    o_d, lse_d = paged_decode(q, k_cache, v_cache, block_table, lens, k_new=k_new, v_new=v_new,
                              scale=0.1, sliding_window=40)
    o_p, lse_p = paged_prefill(q, k_new, v_new, cu, k_cache, v_cache, block_table, lens,
                               scale=0.1, sliding_window=40)
    torch.testing.assert_close(o_d, o_p, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_d, lse_p, rtol=1e-6, atol=1e-6)


# --- argument checks ----------------------------------------------------------


def test_bad_arguments_raise_naming_the_argument():
    k_cache, v_cache, block_table, lens = make_cache([4], 2, 64, 64, 16, torch.float32)
    q = randn(1, 8, 64)
    with pytest.raises(ValueError, match="block_table"):
        paged_decode(q, k_cache, v_cache, block_table.long(), lens, scale=0.1)
    with pytest.raises(ValueError, match="k_cache"):
        paged_decode(randn(1, 8, 32), k_cache, v_cache, block_table, lens, scale=0.1)
    with pytest.raises(ValueError, match="Hq"):
        paged_decode(randn(1, 3, 64), k_cache, v_cache, block_table, lens, scale=0.1)
    with pytest.raises(ValueError, match="k_new"):
        paged_decode(q, k_cache, v_cache, block_table, lens, k_new=randn(1, 2, 64).half(),
                     v_new=randn(1, 2, 64).half(), scale=0.1)
    with pytest.raises(ValueError, match="cu_seqlens"):
        paged_prefill(q, randn(1, 2, 64), randn(1, 2, 64), torch.zeros(2, device=DEVICE),
                      k_cache, v_cache, block_table, lens, scale=0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bf16 tl.dot is wrong in the interpreter)")
def test_bf16_on_gpu():
    run_decode([0, 300, 1000], 32, 8, 128, 16, dtype=torch.bfloat16, num_splits=None)
    run_prefill([0, 300], [200, 5], 32, 8, 128, 16, dtype=torch.bfloat16)


def test_decode_tiles_take_two_stages_only_when_the_grid_fills_the_device():
    """The sweep's finding (decode_sweep.py on the H200): a grid with a program per SM reads faster with two
    stages; a split grid, prefill tiles and head dims not swept keep three; an override wins either way."""
    from fnattn.kernels.paged_attention import _config, configured

    bf16 = torch.bfloat16
    assert _config(128, 128, 4, 1, bf16, wide=True)[3] == 2 and _config(128, 128, 4, 1, bf16)[3] == 3
    assert _config(256, 256, 4, 1, bf16, wide=True)[3] == 3  # d256: not measured
    assert _config(128, 128, 4, 64, bf16, wide=True)[3] == 3  # a prefill tile
    with configured(num_stages=4):
        assert _config(128, 128, 4, 1, bf16, wide=True)[3] == 4

