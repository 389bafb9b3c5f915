"""The GEMV with its epilogue in the same launch (`fnattn.kernels.skinny_folds`), against the unfused ops.

On CPU under ``TRITON_INTERPRET=1`` (fp32 / fp16: bf16 dots are wrong in the interpreter).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels.skinny_folds import (  # noqa: E402
    skinny_linear_gating,
    skinny_linear_swiglu,
    skinny_linear_swiglu_ref,
)
from fnattn.kernels.skinny_linear import SkinnyConfig, skinny_linear  # noqa: E402
from fnattn.models.common import rms_norm  # noqa: E402
from skinny_helpers import close, randn  # noqa: E402

from fnattn.kernels import skinny_folds as folds  # noqa: E402

SWIGLU_CONFIGS = [None, SkinnyConfig(block_n=16, block_k=32, split_k=1),
                  SkinnyConfig(block_n=32, block_k=16, split_k=3),
                  SkinnyConfig(block_n=16, block_k=32, split_k=2, one_launch=False),
                  SkinnyConfig(block_n=16, block_k=32, split_k=1, dot=False),
                  SkinnyConfig(block_n=32, block_k=16, split_k=2, dot=False),
                  SkinnyConfig(block_n=32, block_k=16, split_k=1, early=4)]
SWIGLU_IDS = ["table", "split1", "split3", "split2 reduce kernel", "fma", "fma-split2", "early4"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("config", SWIGLU_CONFIGS, ids=SWIGLU_IDS)
def test_swiglu_is_the_gemv_then_silu_and_mul(M, dtype, config):
    """Each tile's gate and up products of the same columns: fnattn's `silu_and_mul` kernel over the plain
    GEMV's output (the same K order per column, one activation formula; through FMAs the same bits, through
    dots up to the order a dot of other rows sums in), and near the unfused torch ops; I = 45 leaves the last
    tile ragged."""
    from fnattn.kernels.norm_act import silu_and_mul

    inner, K = 45, 150
    x = randn(M, K, dtype=dtype, seed=50 + M)
    w = randn(2 * inner, K, dtype=dtype, seed=51) / K ** 0.5
    got = skinny_linear_swiglu(x, w, config=config)
    assert got.shape == (M, inner) and got.dtype == dtype
    apart = silu_and_mul(skinny_linear(x, w, config=config))
    if config is not None and not config.dot:
        assert torch.equal(got, apart)
    close(got, apart, dtype)
    close(got, skinny_linear_swiglu_ref(x, w), dtype)


def test_swiglu_beyond_the_counters_runs_the_activation_apart(monkeypatch):
    from fnattn.kernels import _counters as counters

    x, w = randn(2, 64, seed=52), randn(80, 64, seed=53)
    cfg = SkinnyConfig(block_n=16, block_k=16, split_k=2)  # 5 column tiles
    want = skinny_linear_swiglu(x, w, config=cfg)
    monkeypatch.setattr(counters, "COUNTERS", 4)
    close(skinny_linear_swiglu(x, w, config=cfg), want, torch.float32)
    empty = skinny_linear_swiglu(randn(3, 0), randn(8, 0))
    assert empty.shape == (3, 4) and not empty.any()


def test_swiglu_arguments_name_themselves():
    with pytest.raises(ValueError, match="w: expected an even number of rows \\(gate rows, then as many up rows\\), "
                                         "got 9"):
        skinny_linear_swiglu(randn(2, 16), randn(9, 16))
    with pytest.raises(ValueError, match="x: expected shape \\[M, 16\\] \\(w's K\\), got \\(2, 8\\)"):
        skinny_linear_swiglu(randn(2, 8), randn(10, 16))


@pytest.mark.parametrize("rows", [1, 4, 17])
def test_models_project_add_norm_is_the_projection_then_the_add_and_norm(rows, monkeypatch):
    """`models.fused.project_add_norm` without ``split`` (decode sizes, here with the kernel path allowed on
    this device; above 16 rows the projection on ``F.linear``): the projection, then the residual add and the
    next block's input norm (Qwen's ``1 + weight``)."""
    from fnattn.models import fused

    monkeypatch.setattr(fused, "_kernel", lambda package, *ts: package == "triton")
    D, K = 48, 96
    x, w = randn(rows, K, seed=40), randn(D, K, seed=41) / K ** 0.5
    res, nw = randn(rows, D, seed=42), randn(D, seed=43) * 0.2
    got_x, got_h = fused.project_add_norm(x, w, res.clone(), nw, 1e-6)
    torch.testing.assert_close(got_x, res + x @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_h, rms_norm(got_x, nw, 1e-6, offset=1.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", [None, SkinnyConfig(block_n=16, block_k=16, split_k=1),
                                    SkinnyConfig(block_n=32, block_k=16, split_k=4),
                                    SkinnyConfig(block_n=16, block_k=16, split_k=2, one_launch=False)],
                         ids=["table", "tiles across the gate", "split one launch", "split, reduce kernel"])
@pytest.mark.parametrize("M", [1, 3])
def test_gating_epilogue_is_the_gemv_then_gdn_gating(M, config):
    """`skinny_linear_gating`: the projection, and g / beta from its b | a columns as `gdn_gating` makes them
    (the same bits: one set of jit helpers); b and a may straddle two column tiles."""
    from fnattn.kernels.gdn_gate import gdn_gating

    H, col = 8, 108  # columns 108..115 are b, 116..123 a, of 136: b straddles two 16-column tiles
    x, w = randn(M, 64, dtype=torch.float16, seed=40), randn(136, 64, dtype=torch.float16, seed=41)
    nd, dtb = -randn(H, seed=42).exp(), randn(H, seed=43)
    y, g, beta = skinny_linear_gating(x, w, col, nd, dtb, config=config)
    want_y = skinny_linear(x, w, config=config)
    want_g, want_beta = gdn_gating(want_y[:, col + H:col + 2 * H], want_y[:, col:col + H], nd, dtb)
    assert torch.equal(y, want_y) and torch.equal(g, want_g) and torch.equal(beta, want_beta)
    assert g.dtype == torch.float32 and beta.dtype == torch.float16 and g.shape == beta.shape == (M, H)


def test_gating_epilogue_names_bad_arguments():

    x, w = randn(2, 16), randn(40, 16)
    nd, dtb = randn(4), randn(4)
    cases = [
        (dict(col=33), r"col: expected an int in 0..32 \(b and a, 4 columns each, within the 40 outputs\), got 33"),
        (dict(col=True), r"col: expected an int in 0..32"),
        (dict(neg_decay=nd.half()), r"neg_decay: expected a contiguous \[H\] float32 tensor"),
        (dict(dt_bias=dtb[:3]), r"dt_bias: expected shape \(4,\), got \(3,\)"),
    ]
    for change, message in cases:
        args = {**dict(col=8, neg_decay=nd, dt_bias=dtb), **change}
        with pytest.raises(ValueError, match=message):
            skinny_linear_gating(x, w, args["col"], args["neg_decay"], args["dt_bias"])


@pytest.mark.parametrize("rows", [1, 4, 17])
def test_models_gate_up_silu_takes_the_epilogue_only_when_asked(rows, monkeypatch):
    """`models.fused.gate_up_silu`: the GEMV then `silu_and_mul`, or under `swiglu_epilogue` (the default;
    decode sizes, here with the kernel path allowed on this device) one launch that agrees with it; above 16
    rows the unfused form either way."""
    from fnattn.models import fused

    monkeypatch.setattr(fused, "_kernel", lambda package, *ts: package == "triton")
    calls = []
    real = folds.skinny_linear_swiglu
    monkeypatch.setattr(folds, "skinny_linear_swiglu", lambda *a, **k: calls.append(1) or real(*a, **k))
    inner, D = 40, 96
    x, w = randn(rows, D, seed=60), randn(2 * inner, D, seed=61) / D ** 0.5
    with fused.swiglu_epilogue(False):
        plain = fused.gate_up_silu(x, w)
    assert not calls
    got = fused.gate_up_silu(x, w)
    assert len(calls) == (rows <= 16)
    close(got, plain, torch.float32)
    g, u = (x @ w.T).chunk(2, dim=-1)
    torch.testing.assert_close(plain, torch.nn.functional.silu(g) * u, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="swiglu_epilogue: expected True or False, got 1"):
        with fused.swiglu_epilogue(1):
            pass
