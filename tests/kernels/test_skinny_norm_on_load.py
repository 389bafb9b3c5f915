"""A residual add whose GEMV leaves the next RMSNorm's statistics, and GEMVs that normalize on load from them
(`skinny_folds.skinny_linear_add_`, `skinny_linear(norm=, squares=)`), against the unfused ops.

On CPU under ``TRITON_INTERPRET=1`` (fp32 / fp16: bf16 dots are wrong in the interpreter).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels.gdn_gate import gdn_gating  # noqa: E402
from fnattn.kernels.norm_act import add_rms_norm_ref, silu_and_mul_ref  # noqa: E402
from fnattn.kernels.skinny_folds import skinny_linear_add_, skinny_linear_gating, skinny_linear_swiglu  # noqa: E402
from fnattn.kernels.skinny_linear import SkinnyConfig, column_tiles, skinny_linear  # noqa: E402
from skinny_helpers import TOL, close, lopsided, randn  # noqa: E402

ADD_CONFIGS = [None, SkinnyConfig(block_n=16, block_k=32, split_k=1), SkinnyConfig(block_n=16, block_k=16, split_k=3),
               SkinnyConfig(block_n=32, block_k=16, split_k=2, one_launch=False),
               SkinnyConfig(block_n=16, block_k=32, split_k=2, dot=False)]
ADD_IDS = ["table", "split1", "split3", "split2 reduce kernel", "fma-split2"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("config", ADD_CONFIGS, ids=ADD_IDS)
def test_add_is_the_unfused_sum_and_leaves_its_squares(M, dtype, config):
    """The new residual is ``residual + skinny_linear(x, w)`` bit for bit (the product rounded, then the sum);
    each column tile's squares sum, over the tiles, to the row's sum of squares (N = 70: the last tile
    ragged). Without counters for the split (the reduce-kernel config) it runs apart, one piece a row."""
    N, K = 70, 150
    x, w = randn(M, K, dtype=dtype, seed=60 + M), randn(N, K, dtype=dtype, seed=61) / K ** 0.5
    res = lopsided(M, N, dtype, seed=62)
    want = res + skinny_linear(x, w, config=config)
    stream = res.clone()
    got, squares = skinny_linear_add_(x, w, stream, config=config)
    assert got is stream and torch.equal(got, want)
    pieces = 1 if config is not None and not config.one_launch else column_tiles(M, N, K, dtype, config)
    assert squares.shape == (M, pieces) and squares.dtype == torch.float32
    torch.testing.assert_close(squares.sum(-1), want.float().pow(2).sum(-1), rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_norm_from_squares_is_the_norm_on_load(M, dtype, offset):
    """The statistics read from ``squares`` (in 3 ragged pieces) in place of a pass over x: the pass's product
    to fp32 rounding of the statistics, and near the unfused norm then linear."""
    from fnattn.kernels.skinny_linear import skinny_linear_ref

    N, K = 48, 150
    x, w = lopsided(M, K, dtype, seed=63), randn(N, K, dtype=dtype, seed=64) / K ** 0.5
    nw = randn(K, dtype=dtype, seed=65) * 0.2 + (0.0 if offset else 1.0)
    xf = x.float().pow(2)
    squares = torch.stack([xf[:, :40].sum(-1), xf[:, 40:100].sum(-1), xf[:, 100:].sum(-1)], dim=-1)
    norm = (nw, 1e-6, offset)
    got = skinny_linear(x, w, norm=norm, squares=squares)
    close(got, skinny_linear(x, w, norm=norm), dtype)
    close(got, skinny_linear_ref(x, w, norm=norm), dtype)


@pytest.mark.parametrize("M", [1, 4])
def test_add_then_normalize_on_load_is_the_add_norm_then_each_consumer(M):
    """The chain a decoder step runs: an output projection into the residual stream, then the next block's
    input projection normalizing on load, as the plain GEMV, SwiGLU's gate / up and GDN's gating GEMV: each
    near the unfused add + RMSNorm (Qwen's ``1 + weight``) then the consumer (fp16)."""
    dtype, D, K = torch.float16, 96, 130
    x, w = randn(M, K, dtype=dtype, seed=66), randn(D, K, dtype=dtype, seed=67) / K ** 0.5
    res = randn(M, D, dtype=dtype, seed=68)
    nw = randn(D, dtype=dtype, seed=69) * 0.2
    stream, h = add_rms_norm_ref(skinny_linear(x, w), res, nw, 1e-6, 1.0)
    got_stream, squares = skinny_linear_add_(x, w, res.clone())
    assert torch.equal(got_stream, stream)
    norm = (nw, 1e-6, 1.0)

    w2 = randn(80, D, dtype=dtype, seed=70) / D ** 0.5
    close(skinny_linear(got_stream, w2, norm=norm, squares=squares), skinny_linear(h, w2), dtype)
    close(skinny_linear_swiglu(got_stream, w2, norm=norm, squares=squares),
          silu_and_mul_ref(skinny_linear(h, w2)), dtype)
    H = 4
    neg_decay = -torch.rand(H, generator=torch.Generator().manual_seed(71)).to(x.device) - 0.5
    dt_bias = randn(H, seed=72)
    y, g, beta = skinny_linear_gating(got_stream, w2, 64, neg_decay, dt_bias, norm=norm, squares=squares)
    want_y = skinny_linear(h, w2)
    close(y, want_y, dtype)
    want_g, want_beta = gdn_gating(y[:, 64 + H:64 + 2 * H], y[:, 64:64 + H], neg_decay, dt_bias)
    torch.testing.assert_close(g, want_g, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(beta, want_beta, rtol=0, atol=0)


def test_add_beyond_the_counters_runs_apart(monkeypatch):
    from fnattn.kernels import _counters as counters

    x, w, res = randn(2, 64, seed=73), randn(80, 64, seed=74), randn(2, 80, seed=75)
    cfg = SkinnyConfig(block_n=16, block_k=16, split_k=2)  # 5 column tiles
    want, want_sq = skinny_linear_add_(x, w, res.clone(), config=cfg)
    monkeypatch.setattr(counters, "COUNTERS", 4)
    got, sq = skinny_linear_add_(x, w, res.clone(), config=cfg)
    assert torch.equal(got, want) and sq.shape == (2, 1)
    torch.testing.assert_close(sq[:, 0], want_sq.sum(-1), rtol=1e-5, atol=0)
    empty, sq = skinny_linear_add_(randn(3, 0), randn(8, 0), res[:1].expand(3, 80)[:, :8].contiguous())
    assert torch.equal(empty, res[:1, :8].expand(3, 8)) and sq.shape == (3, 1)


def test_squares_and_the_add_name_their_arguments():
    x, w, nw = randn(2, 16), randn(8, 16), randn(16)
    with pytest.raises(ValueError, match="squares: expected norm= beside it"):
        skinny_linear(x, w, squares=torch.ones(2, 1, device=x.device))
    for bad, got in ((torch.ones(2, 1, dtype=torch.float16, device=x.device), "torch.float16"),
                     (torch.ones(3, 2, device=x.device), r"\(3, 2\)"), (torch.ones(2, 0, device=x.device), r"\(2, 0\)"),
                     (torch.ones(4, 2, device=x.device).t(), r"\(2, 4\)"), ("sums", "str")):
        with pytest.raises(ValueError, match=rf"squares: expected a float32 \[2, P\] tensor .*got .*{got}"):
            skinny_linear(x, w, norm=(nw, 1e-6, 1.0), squares=bad)
    with pytest.raises(ValueError, match="residual: expected an \\[M, N\\] tensor"):
        skinny_linear_add_(x, w, None)
    with pytest.raises(ValueError, match="residual: expected shape \\(2, 8\\), got \\(2, 9\\)"):
        skinny_linear_add_(x, w, randn(2, 9))
    both = randn(2, 24)
    with pytest.raises(ValueError, match="residual: expected a buffer apart from x's"):
        skinny_linear_add_(both[:, :16], w, both[:, 16:])


@pytest.mark.parametrize("rows", [1, 4, 17])
def test_models_norm_on_load_only_when_asked_and_each_consumer_takes_it(rows, monkeypatch):
    """`models.fused.project_add_norm(on_load=True)` under `norm_on_load` (decode sizes, the kernel path allowed
    on this device) returns a `NormOnLoad` that `linear` (also widened), `gate_up_silu` and `project_and_gate`
    normalize on load, each near the same op on the materialized norm; without the switch, without
    ``on_load`` or above 16 rows, the tensor. A consumer that cannot fold (a bias) takes `tensor()`."""
    from fnattn.models import fused

    monkeypatch.setattr(fused, "_kernel", lambda package, *ts: package == "triton")
    D, K = 48, 96
    x, w = randn(rows, K, seed=80), randn(D, K, seed=81) / K ** 0.5
    res, nw = randn(rows, D, seed=82), randn(D, seed=83) * 0.2
    want_x, want_h = fused.project_add_norm(x, w, res.clone(), nw, 1e-6)
    assert isinstance(want_h, torch.Tensor)
    with fused.norm_on_load(True):
        assert isinstance(fused.project_add_norm(x, w, res.clone(), nw, 1e-6)[1], torch.Tensor)
        got_x, h = fused.project_add_norm(x, w, res.clone(), nw, 1e-6, on_load=True)
    assert isinstance(h, fused.NormOnLoad) == (rows <= 16)
    close(got_x, want_x, torch.float32)
    if not isinstance(h, fused.NormOnLoad):
        return
    assert h.shape == (rows, D) and h.dtype == torch.float32 and h.x is got_x
    close(h.tensor(), want_h, torch.float32)
    w2 = randn(64, D, seed=84) / D ** 0.5
    close(fused.linear(h, w2), fused.linear(want_h, w2), torch.float32)
    close(fused.linear(h, w2, widen=True), fused.linear(want_h, w2, widen=True), torch.float32)
    bias = randn(64, seed=85)
    close(fused.linear(h, w2, bias), fused.linear(want_h, w2, bias), torch.float32)
    close(fused.gate_up_silu(h, w2), fused.gate_up_silu(want_h, w2), torch.float32)
    nd, dtb = -randn(4, seed=86).exp(), randn(4, seed=87)
    for a, b in zip(fused.project_and_gate(h, w2, 40, nd, dtb), fused.project_and_gate(want_h, w2, 40, nd, dtb)):
        close(a, b, torch.float32)
    with pytest.raises(ValueError, match="norm_on_load: expected True or False, got 1"):
        with fused.norm_on_load(1):
            pass
