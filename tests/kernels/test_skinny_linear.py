"""skinny_linear (decode-sized x @ w.T, optionally with SiLU-and-mul on load) against its reference."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels.skinny_linear import SkinnyConfig, pick_config, skinny_linear, skinny_linear_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
CONFIGS = [SkinnyConfig(block_n=16, block_k=32, split_k=1, num_warps=2, num_stages=2),
           SkinnyConfig(block_n=32, block_k=64, split_k=2, num_warps=4, num_stages=3),
           SkinnyConfig(block_n=16, block_k=32, split_k=1, dot=False),
           SkinnyConfig(block_n=32, block_k=16, split_k=2, dot=False)]
IDS = ["dot", "dot-split2", "fma", "fma-split2"]


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def close(y, ref, dtype):
    assert y.dtype == ref.dtype == dtype and y.shape == ref.shape
    tol = TOL[dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


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
                          (dict(block_n=16, block_k=32, dot=1), "dot")]:
        with pytest.raises(ValueError, match=f"SkinnyConfig.{field}: expected"):
            SkinnyConfig(**kwargs)


def test_bad_arguments_name_themselves():
    x, w = randn(2, 16), randn(8, 16)
    cases = [
        (dict(x=randn(65, 16), w=w), "x: expected at most 64 rows, got 65"),
        (dict(x=x, w=w, act="gelu"), "act: expected None or 'silu_mul', got 'gelu'"),
        (dict(x=randn(16), w=w), r"x: expected a 2-D tensor, got \(16,\)"),
        (dict(x=x, w=randn(8, 16, dtype=torch.float16)), "w: expected dtype torch.float32"),
        (dict(x=x.to(torch.int32), w=w.to(torch.int32)), "x: expected dtype bfloat16, float16 or float32"),
        (dict(x=randn(2, 12), w=w), r"x: expected shape \[M, 16\]"),
        (dict(x=x, w=w, act="silu_mul"), r"x: expected shape \[M, 2 \* 16\]"),
        (dict(x=randn(16, 2).T, w=w), "x: expected unit stride"),
        (dict(x=x, w=randn(16, 8).T), "w: expected a contiguous tensor"),
        (dict(x=x, w=w, out=randn(2, 9)), r"out: expected shape \(2, 8\)"),
        (dict(x=x, w=w, out=randn(2, 8, dtype=torch.float16)), "out: expected shape .* dtype torch.float32"),
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
