"""skinny_linear (decode-sized x @ w.T, optionally with SiLU-and-mul or RMSNorm on load and a residual added
before the rounding) against its reference."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels.skinny_linear import (  # noqa: E402
    SkinnyConfig,
    pick_config,
    rms_norm_ref,
    skinny_linear,
    skinny_linear_ref,
)
from fnattn.models.common import rms_norm  # noqa: E402
from skinny_helpers import DEVICE, close, lopsided, randn  # noqa: E402

CONFIGS = [SkinnyConfig(block_n=16, block_k=32, split_k=1, num_warps=2, num_stages=2),
           SkinnyConfig(block_n=32, block_k=64, split_k=2, num_warps=4, num_stages=3),
           SkinnyConfig(block_n=16, block_k=32, split_k=1, dot=False),
           SkinnyConfig(block_n=32, block_k=16, split_k=2, dot=False),
           SkinnyConfig(block_n=16, block_k=32, split_k=2, early=4),
           SkinnyConfig(block_n=32, block_k=16, split_k=1, early=2, dot=False)]
IDS = ["dot", "dot-split2", "fma", "fma-split2", "dot-split2-early4", "fma-early2"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act", [None, "silu_mul"])
@pytest.mark.parametrize("M", [1, 3, 16, 33])
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_matches_reference(M, act, dtype, config):
    N, K = 45, 150  # neither a multiple of any block; K = 150 splits into uneven pieces of 64-tiles
    x = randn(M, 2 * K if act else K, dtype=dtype, seed=M)
    w = randn(N, K, dtype=dtype, seed=100 + M) / K ** 0.5
    close(skinny_linear(x, w, act=act, config=config), skinny_linear_ref(x, w, act=act), dtype)


@pytest.mark.parametrize("act", [None, "silu_mul"])
def test_table_config_and_strided_rows(act):
    M, N, K = 5, 70, 96
    width = 2 * K if act else K
    big = randn(M, width + 24, seed=1)
    x = big[:, 8:8 + width]  # rows strided by width + 24, unit inner stride
    w = randn(N, K, seed=2)
    assert not x.is_contiguous()
    close(skinny_linear(x, w, act=act), skinny_linear_ref(x.contiguous(), w, act=act), torch.float32)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_out_is_written_and_returned(config):
    M, N, K = 3, 40, 130
    x, w = randn(M, K, seed=3), randn(N, K, seed=4)
    holder = torch.full((M, N + 10), 7.0, device=DEVICE)
    out = holder[:, 5:5 + N]  # strided rows
    y = skinny_linear(x, w, out=out, config=config)
    assert y.data_ptr() == out.data_ptr()
    close(out, skinny_linear_ref(x, w), torch.float32)
    assert (holder[:, :5] == 7).all() and (holder[:, 5 + N:] == 7).all()  # nothing outside out written


@pytest.mark.parametrize("config", CONFIGS + [SkinnyConfig(block_n=16, block_k=32, split_k=2, one_launch=False)],
                         ids=IDS + ["dot-split2-reduce-kernel"])
@pytest.mark.parametrize("residual", [False, True])
def test_fp32_out_holds_the_rounded_product_widened(config, residual):
    """Logits: an fp32 ``out`` of a half-precision product gets ``skinny_linear(...).float()``'s bits, from
    the GEMV's own launch (and from the split-K reduce kernel's)."""
    M, N, K = 3, 45, 150
    x, w = randn(M, K, dtype=torch.float16, seed=7), randn(N, K, dtype=torch.float16, seed=8) / K ** 0.5
    r = randn(M, N, dtype=torch.float16, seed=9) if residual else None
    out = torch.full((M, N), float("nan"), device=DEVICE)
    y = skinny_linear(x, w, out=out, residual=r, config=config)
    assert y is out and y.dtype == torch.float32
    assert torch.equal(y, skinny_linear(x, w, residual=r, config=config).float())


def test_more_splits_than_k_tiles():
    """split_k beyond the K tiles: each piece still streams at least one tile, none is empty."""
    x, w = randn(2, 40, seed=5), randn(20, 40, seed=6)
    close(skinny_linear(x, w, config=SkinnyConfig(16, 16, split_k=8)), skinny_linear_ref(x, w), torch.float32)


def test_empty_shapes():
    w = randn(8, 16)
    assert skinny_linear(randn(0, 16), w).shape == (0, 8)
    out = torch.full((3, 8), 5.0, device=DEVICE)
    assert (skinny_linear(randn(3, 0), randn(8, 0), out=out) == 0).all()


def test_reference_is_silu_and_mul_then_linear():
    x, w = randn(4, 64, dtype=torch.float16, seed=7), randn(9, 32, dtype=torch.float16, seed=8)
    g, u = x.float().chunk(2, dim=-1)
    a = (F.silu(g) * u).to(torch.float16)
    torch.testing.assert_close(skinny_linear_ref(x, w, act="silu_mul"), (a.float() @ w.float().T).half())
    torch.testing.assert_close(skinny_linear_ref(x[:, :32], w), F.linear(x[:, :32].float(), w.float()).half())


@pytest.mark.parametrize("M, N, K", [(1, 7168, 1024), (1, 1024, 3584), (8, 8224, 1024), (32, 1024, 2048),
                                     (64, 5120, 1024), (1, 248320, 1024), (3, 30, 40)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pick_config_fills_the_device(M, N, K, dtype):
    cfg = pick_config(M, N, K, dtype, sms=132)
    programs = -(-N // cfg.block_n) * cfg.split_k
    k_tiles = -(-K // cfg.block_k)
    assert cfg.split_k <= max(1, K // 256)  # no piece shorter than the table's minimum
    assert cfg.split_k <= k_tiles
    if K >= 256 * 8:  # room to split: the table reaches one program per SM
        assert programs >= 132
    assert cfg.block_n >= (32 if M <= 16 else 16)
    assert cfg.block_k == (64 if dtype == torch.float32 else 128)


def test_skinny_config_checks_fields():
    for kwargs, field in [(dict(block_n=24, block_k=32), "block_n"), (dict(block_n=16, block_k=8), "block_k"),
                          (dict(block_n=16, block_k=32, split_k=0), "split_k"),
                          (dict(block_n=16, block_k=32, num_warps=3), "num_warps"),
                          (dict(block_n=16, block_k=32, num_stages=0), "num_stages"),
                          (dict(block_n=16, block_k=32, dot=1), "dot"),
                          (dict(block_n=16, block_k=32, one_launch=None), "one_launch"),
                          (dict(block_n=16, block_k=32, prefetch="yes"), "prefetch"),
                          (dict(block_n=16, block_k=32, early=3), "early"),
                          (dict(block_n=16, block_k=32, early=True), "early")]:
        with pytest.raises(ValueError, match=f"SkinnyConfig.{field}: expected"):
            SkinnyConfig(**kwargs)


def test_configured_replaces_fields_of_the_table_within_its_block():
    from fnattn.kernels import skinny_linear as module

    plain = pick_config(1, 7168, 1024, torch.bfloat16, sms=132)
    with module.configured(num_warps=8):
        with module.configured(one_launch=False):
            inner = pick_config(1, 7168, 1024, torch.bfloat16, sms=132)
        outer = pick_config(1, 7168, 1024, torch.bfloat16, sms=132)
    assert (inner.num_warps, inner.one_launch) == (8, False) and (outer.num_warps, outer.one_launch) == (8, True)
    assert pick_config(1, 7168, 1024, torch.bfloat16, sms=132) == plain
    with pytest.raises(ValueError, match="configured: expected SkinnyConfig fields, got one_lunch"):
        module.configured(one_lunch=True).__enter__()
    with pytest.raises(ValueError, match="SkinnyConfig.one_launch: expected a bool, got 1"):
        module.configured(one_launch=1).__enter__()
    assert module._OVERRIDES == [{}]  # a refused block leaves nothing behind


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's case: on CUDA PDL is asked for")
def test_pdl_is_asked_for_only_where_the_device_has_it():
    """The interpreter (and a CPU tensor) has no grid dependency control: under pdl(True) the kernels launch
    as they do without it."""
    from fnattn.kernels._triton import pdl_launch, pdl_supported

    from fnattn import kernels

    assert not pdl_supported(torch.device("cpu"))
    x, w = randn(3, 64), randn(48, 64)
    with kernels.pdl(True):
        assert not pdl_launch(x.device)
        got = skinny_linear(x, w, config=SkinnyConfig(block_n=16, block_k=16, split_k=2, prefetch=True))
    close(got, skinny_linear_ref(x, w), torch.float32)
    with pytest.raises(ValueError, match="pdl: expected True or False, got 1"):
        kernels.pdl(1).__enter__()


def test_bad_arguments_name_themselves():
    x, w = randn(2, 16), randn(8, 16)
    cases = [
        (dict(x=randn(65, 16), w=w), r"x: expected at most 64 rows \(any number in the invariant mode\), got 65"),
        (dict(x=x, w=w, act="gelu"), "act: expected None or 'silu_mul', got 'gelu'"),
        (dict(x=randn(16), w=w), r"x: expected a 2-D tensor, got \(16,\)"),
        (dict(x=x, w=randn(8, 16, dtype=torch.float16)), "w: expected dtype torch.float32"),
        (dict(x=x.to(torch.int32), w=w.to(torch.int32)), "x: expected dtype bfloat16, float16 or float32"),
        (dict(x=randn(2, 12), w=w), r"x: expected shape \[M, 16\]"),
        (dict(x=x, w=w, act="silu_mul"), r"x: expected shape \[M, 2 \* 16\]"),
        (dict(x=randn(16, 2).T, w=w), "x: expected unit stride"),
        (dict(x=x, w=randn(16, 8).T), "w: expected a contiguous tensor"),
        (dict(x=x, w=w, out=randn(2, 9)), r"out: expected shape \(2, 8\)"),
        (dict(x=x, w=w, out=randn(2, 8, dtype=torch.float16)), r"out: expected shape .* dtype torch.float32, got"),
        (dict(x=x.half(), w=w.half(), out=randn(2, 8, dtype=torch.bfloat16)),
         r"dtype torch.float16 or torch.float32 \(widened\), got"),
        (dict(x=x, w=w, out=randn(8, 2).T), "out: expected unit stride"),
        (dict(x=x, w=w, config=(16, 16, 1, 4, 2)), "config: expected a SkinnyConfig or None, got tuple"),
    ]
    if DEVICE == "cpu":
        cases.append((dict(x=x, w=torch.randn(8, 16, device="meta")), "w: expected device cpu"))
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            skinny_linear(kwargs.pop("x"), kwargs.pop("w"), **kwargs)
    with pytest.raises(ValueError, match="act: expected None or 'silu_mul'"):
        skinny_linear_ref(x, w, act="relu")


# The residual epilogue and the RMSNorm prologue (K = 150: no multiple of any block_k; split 8 of 16-wide tiles
# leaves pieces of unequal length).
FOLD_CONFIGS = [SkinnyConfig(block_n=16, block_k=32, split_k=1), SkinnyConfig(block_n=32, block_k=32, split_k=2),
                SkinnyConfig(block_n=16, block_k=16, split_k=8), SkinnyConfig(block_n=16, block_k=32, split_k=2,
                                                                              dot=False)]
FOLD_IDS = ["split1", "split2", "split8", "fma-split2"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("config", FOLD_CONFIGS, ids=FOLD_IDS)
def test_residual_matches_reference(M, dtype, config):
    N, K = 45, 150
    x, w = randn(M, K, dtype=dtype, seed=M), randn(N, K, dtype=dtype, seed=50 + M) / K ** 0.5
    res = randn(M, N, dtype=dtype, seed=60 + M) * 4
    y = skinny_linear(x, w, residual=res, config=config)
    close(y, skinny_linear_ref(x, w, residual=res), dtype)
    close(y, (res.float() + x.float() @ w.float().T).to(dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("config", FOLD_CONFIGS[:2] + FOLD_CONFIGS[3:], ids=FOLD_IDS[:2] + FOLD_IDS[3:])
def test_norm_matches_reference(M, offset, dtype, config):
    N, K = 45, 150
    x, w = lopsided(M, K, dtype, seed=M), randn(N, K, dtype=dtype, seed=70 + M) / K ** 0.5
    nw = randn(K, dtype=dtype, seed=80) * 0.2 + (0.0 if offset else 1.0)
    norm = (nw, 1e-6, offset)
    y = skinny_linear(x, w, norm=norm, config=config)
    close(y, skinny_linear_ref(x, w, norm=norm), dtype)
    close(y, skinny_linear_ref(rms_norm(x, nw, 1e-6, offset=offset), w), dtype)
    if config.split_k > 1:  # each piece normalized by its own columns' statistics would be far off
        half = K // 2
        wrong = torch.cat([rms_norm(x[:, :half], nw[:half], 1e-6, offset=offset),
                           rms_norm(x[:, half:], nw[half:], 1e-6, offset=offset)], dim=1)
        assert (y.float() - skinny_linear_ref(wrong, w).float()).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", FOLD_CONFIGS, ids=FOLD_IDS)
def test_norm_and_residual_together_strided_rows_and_out(dtype, config):
    M, N, K = 3, 40, 150
    big = lopsided(M, K + 30, dtype, seed=9)
    x = big[:, 10:10 + K]  # rows strided by K + 30
    res_big = randn(M, N + 8, dtype=dtype, seed=10)
    res = res_big[:, 3:3 + N]  # strided residual rows
    w, nw = randn(N, K, dtype=dtype, seed=11) / K ** 0.5, randn(K, dtype=dtype, seed=12) * 0.1
    norm = (nw, 1e-5, 1.0)
    want = skinny_linear_ref(x.contiguous(), w, residual=res.contiguous(), norm=norm)
    close(skinny_linear(x, w, residual=res, norm=norm, config=config), want, dtype)
    holder = torch.full((M, N + 6), 7.0, device=DEVICE, dtype=dtype)
    out = holder[:, 2:2 + N]
    y = skinny_linear(x, w, residual=res, norm=norm, out=out, config=config)
    assert y.data_ptr() == out.data_ptr()
    close(out, want, dtype)
    assert (holder[:, :2] == 7).all() and (holder[:, 2 + N:] == 7).all()
    assert torch.equal(res, res_big[:, 3:3 + N]) and torch.equal(x, big[:, 10:10 + K])  # operands untouched


def test_table_config_with_both_folds():
    M, N, K = 2, 70, 96
    x, w, res = randn(M, K, seed=13), randn(N, K, seed=14), randn(M, N, seed=15)
    nw = randn(K, seed=16)
    close(skinny_linear(x, w, residual=res, norm=(nw, 1e-6, 0.0)),
          skinny_linear_ref(x, w, residual=res, norm=(nw, 1e-6, 0.0)), torch.float32)


def test_empty_k_with_residual_is_the_residual():
    res = randn(3, 8, seed=17)
    assert torch.equal(skinny_linear(randn(3, 0), randn(8, 0), residual=res), res)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_reference_norm_is_models_rms_norm_then_linear(dtype, offset):
    """The kernel package imports nothing from fnattn: its copy of `rms_norm` must round exactly as the model's."""
    x, w = lopsided(4, 64, dtype, seed=18), randn(9, 64, dtype=dtype, seed=19)
    nw, res = randn(64, dtype=dtype, seed=20) * 0.3, randn(4, 9, dtype=dtype, seed=21)
    assert torch.equal(rms_norm_ref(x, nw, 1e-6, offset), rms_norm(x, nw, 1e-6, offset=offset))
    h = rms_norm(x, nw, 1e-6, offset=offset)
    want = (res.float() + h.float() @ w.float().T).to(dtype)
    torch.testing.assert_close(skinny_linear_ref(x, w, residual=res, norm=(nw, 1e-6, offset)), want, rtol=0, atol=0)


def test_fold_arguments_name_themselves():
    M, N, K = 2, 8, 16
    x, w, res, nw = randn(M, K), randn(N, K), randn(M, N), randn(K)
    buf = randn(M, K + N)
    gu = randn(M, 2 * K)
    cases = [
        (dict(x=buf[:, :K], w=w, out=buf[:, K:]), "out: expected a buffer apart from x's"),
        (dict(x=x, w=w, residual=res, out=res), "out: expected a buffer apart from residual's"),
        (dict(x=x, w=w, residual=res, out=res[:, :N]), "out: expected a buffer apart from residual's"),
        (dict(x=x, w=w, residual=randn(M, N + 1)), r"residual: expected shape \(2, 8\), got \(2, 9\)"),
        (dict(x=x, w=w, residual=randn(N)), r"residual: expected shape \(2, 8\), got \(8,\)"),
        (dict(x=x, w=w, residual=[1.0]), r"residual: expected shape \(2, 8\), got list"),
        (dict(x=x, w=w, residual=res.half()), "residual: expected dtype torch.float32 .x's., got torch.float16"),
        (dict(x=x, w=w, residual=randn(N, M).T), "residual: expected unit stride along its last dim"),
        (dict(x=x, w=w, norm=(randn(K + 1), 1e-6, 1.0)), r"norm weight: expected shape \(16,\), got \(17,\)"),
        (dict(x=x, w=w, norm=(nw.half(), 1e-6, 1.0)), "norm weight: expected dtype torch.float32"),
        (dict(x=x, w=w, norm=(randn(K, 2)[:, 0], 1e-6, 1.0)), "norm weight: expected a contiguous tensor"),
        (dict(x=x, w=w, norm=(nw, 1e-6)), "norm: expected a .weight, eps, offset. triple, got tuple of 2"),
        (dict(x=x, w=w, norm=nw), "norm: expected a .weight, eps, offset. triple, got Tensor"),
        (dict(x=x, w=w, norm=(nw, torch.tensor(1e-6), 1.0)), "norm eps: expected a finite Python float"),
        (dict(x=x, w=w, norm=(nw, -1.0, 1.0)), "norm eps: expected >= 0, got -1.0"),
        (dict(x=x, w=w, norm=(nw, 1e-6, float("nan"))), "norm offset: expected a finite Python float, got nan"),
        (dict(x=gu, w=w, act="silu_mul", norm=(nw, 1e-6, 1.0)), "norm and act: expected at most one of them"),
    ]
    if DEVICE == "cpu":
        cases += [(dict(x=x, w=w, residual=torch.randn(M, N, device="meta")), "residual: expected device cpu"),
                  (dict(x=x, w=w, norm=(torch.randn(K, device="meta"), 1e-6, 1.0)), "norm weight: expected device")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            skinny_linear(kwargs.pop("x"), kwargs.pop("w"), **kwargs)
    with pytest.raises(ValueError, match="norm and act: expected at most one of them"):
        skinny_linear_ref(gu, w, act="silu_mul", norm=(nw, 1e-6, 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_fused_linear_torch_body_with_residual_and_norm(dtype, offset):
    """Off CUDA `fused.linear` is the unfused truth: rms_norm, F.linear (rounded), then the residual added."""
    from fnattn.models import fused

    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(22)).to(dtype)
    w = (torch.randn(24, 64, generator=torch.Generator().manual_seed(23)) / 8).to(dtype)
    res = torch.randn(2, 3, 24, generator=torch.Generator().manual_seed(24)).to(dtype)
    nw = (torch.randn(64, generator=torch.Generator().manual_seed(25)) * 0.2).to(dtype)
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    h = (h * (1.0 + nw.float())).to(dtype) if offset else h.to(dtype) * nw
    want_lin = F.linear(h, w)
    assert torch.equal(fused.linear(x, w, norm=(nw, 1e-6, offset)), want_lin)
    assert torch.equal(fused.linear(x, w, residual=res), F.linear(x, w) + res)
    got = fused.linear(x, w, residual=res, norm=(nw, 1e-6, offset))
    assert got.dtype == dtype and got.shape == (2, 3, 24)
    assert torch.equal(got, want_lin + res)
    bias = torch.randn(24, generator=torch.Generator().manual_seed(26)).to(dtype)
    assert torch.equal(fused.linear(x, w, bias, residual=res), F.linear(x, w, bias) + res)


# Every split with every fold, the dtypes alternating so that each split and each fold meets both
# (all 24 interpreted cases took 86 s).
@pytest.mark.parametrize("split, fold, dtype", [
    pytest.param(split, fold, dtype, id=f"{split}-{fold}-{str(dtype)[6:]}")
    for i, split in enumerate([2, 3, 8]) for j, fold in enumerate(["none", "residual", "norm", "both"])
    for dtype in [(torch.float32, torch.float16)[(i + j) % 2]]])
def test_one_launch_split_is_the_two_launch_bits(split, fold, dtype):
    """The last piece of a column tile sums the partials in split order, as the second kernel does: the same
    bits; and every counter is zero again after the launch (the next launch counts from zero)."""
    from fnattn.kernels import skinny_linear as module

    M, N, K = 3, 70, 200
    x, w = lopsided(M, K, dtype, seed=22), randn(N, K, dtype=dtype, seed=23) / K ** 0.5
    res = randn(M, N, dtype=dtype, seed=24) if fold in ("residual", "both") else None
    norm = (randn(K, dtype=dtype, seed=25) * 0.2, 1e-6, 1.0) if fold in ("norm", "both") else None
    one = SkinnyConfig(block_n=16, block_k=16, split_k=split)
    two = SkinnyConfig(block_n=16, block_k=16, split_k=split, one_launch=False)
    got = skinny_linear(x, w, residual=res, norm=norm, config=one)
    # a second launch reuses the counters the first left at zero
    assert torch.equal(skinny_linear(x, w, residual=res, norm=norm, config=one), got)
    assert torch.equal(got, skinny_linear(x, w, residual=res, norm=norm, config=two))
    close(got, skinny_linear_ref(x, w, residual=res, norm=norm), dtype)
    assert not module.tile_counters(x.device, 1).any()


def test_split_launch_beyond_the_counters_uses_the_reduce_kernel(monkeypatch):
    from fnattn.kernels import _counters as counters
    from fnattn.kernels import skinny_linear as module

    x, w = randn(2, 64, seed=26), randn(80, 64, seed=27)
    cfg = SkinnyConfig(block_n=16, block_k=16, split_k=2)  # 5 column tiles
    want = skinny_linear(x, w, config=cfg)
    monkeypatch.setattr(counters, "COUNTERS", 4)
    assert module.tile_counters(x.device, 5) is None
    assert torch.equal(skinny_linear(x, w, config=cfg), want)
