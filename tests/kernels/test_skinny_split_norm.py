"""An RMSNorm split between the GEMVs on either side of it (`skinny_folds.skinny_linear_add_`, then
`skinny_linear(rms=...)` and the SwiGLU and gating GEMVs with ``rms=``), against the unfused ops.

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
from fnattn.kernels.skinny_linear import SkinnyConfig, column_tiles, rms_scaled_ref, skinny_linear  # noqa: E402
from skinny_helpers import TOL, close, lopsided, randn  # noqa: E402

ADD_CONFIGS = [None, SkinnyConfig(block_n=16, block_k=32, split_k=1), SkinnyConfig(block_n=16, block_k=16, split_k=3),
               SkinnyConfig(block_n=32, block_k=16, split_k=2, one_launch=False),
               SkinnyConfig(block_n=16, block_k=32, split_k=2, dot=False)]
ADD_IDS = ["table", "split1", "split3", "split2 reduce kernel", "fma-split2"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("config", ADD_CONFIGS, ids=ADD_IDS)
def test_add_is_the_unfused_sum_and_leaves_the_norms_row_local_half(M, dtype, config):
    """The new residual is ``residual + skinny_linear(x, w)`` bit for bit (the product rounded, then the sum);
    ``scaled`` is it times ``1 + weight``, rounded; each column tile's squares sum, over the tiles, to the
    row's sum of squares (N = 70: the last tile ragged). Without counters for the split (the reduce-kernel
    config) it runs apart, one piece a row."""
    N, K = 70, 150
    x, w = randn(M, K, dtype=dtype, seed=60 + M), randn(N, K, dtype=dtype, seed=61) / K ** 0.5
    res = lopsided(M, N, dtype, seed=62)
    nw = randn(N, dtype=dtype, seed=59) * 0.2
    want = res + skinny_linear(x, w, config=config)
    stream = res.clone()
    got, scaled, squares = skinny_linear_add_(x, w, stream, nw, 1.0, config=config)
    assert got is stream and torch.equal(got, want)
    assert torch.equal(scaled, (want.float() * (1.0 + nw.float())).to(dtype))
    pieces = 1 if config is not None and not config.one_launch else column_tiles(M, N, K, dtype, config)
    assert squares.shape == (M, pieces) and squares.dtype == torch.float32
    torch.testing.assert_close(squares.sum(-1), want.float().pow(2).sum(-1), rtol=1e-5, atol=0)


RMS_CONFIGS = [None, SkinnyConfig(block_n=16, block_k=32, split_k=3),
               SkinnyConfig(block_n=16, block_k=32, split_k=2, one_launch=False),
               SkinnyConfig(block_n=16, block_k=32, split_k=1, dot=False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("config", RMS_CONFIGS, ids=["table", "split3", "split2 reduce kernel", "fma"])
def test_rms_scales_each_row_of_the_product(M, dtype, config):
    """``rms=(squares, eps)``: each row's fp32 sums times ``1 / sqrt(squares[m].sum() / K + eps)``, rounded once
    (squares in 3 ragged pieces); a split launch without its counters gives the same from the torch form."""
    N, K = 48, 150
    x, w = lopsided(M, K, dtype, seed=63), randn(N, K, dtype=dtype, seed=64) / K ** 0.5
    sq = randn(M, 150, seed=65).pow(2)
    squares = torch.stack([sq[:, :40].sum(-1), sq[:, 40:100].sum(-1), sq[:, 100:].sum(-1)], dim=-1)
    got = skinny_linear(x, w, rms=(squares, 1e-6), config=config)
    close(got, rms_scaled_ref(x, w, (squares, 1e-6)), dtype)


@pytest.mark.parametrize("M", [1, 4])
def test_split_norm_is_the_add_norm_then_each_consumer(M):
    """The chain a decoder step runs: an output projection into the residual stream, then the next block's
    input projection finishing the norm, as the plain GEMV (also into fp32), SwiGLU's gate / up and GDN's
    gating GEMV: each near the unfused add + RMSNorm (Qwen's ``1 + weight``) then the consumer (fp16)."""
    dtype, D, K = torch.float16, 96, 130
    x, w = randn(M, K, dtype=dtype, seed=66), randn(D, K, dtype=dtype, seed=67) / K ** 0.5
    res = randn(M, D, dtype=dtype, seed=68)
    nw = randn(D, dtype=dtype, seed=69) * 0.2
    stream, h = add_rms_norm_ref(skinny_linear(x, w), res, nw, 1e-6, 1.0)
    got_stream, scaled, squares = skinny_linear_add_(x, w, res.clone(), nw, 1.0)
    assert torch.equal(got_stream, stream)
    rms = (squares, 1e-6)

    w2 = randn(80, D, dtype=dtype, seed=70) / D ** 0.5
    close(skinny_linear(scaled, w2, rms=rms), skinny_linear(h, w2), dtype)
    wide = torch.empty(M, 80, dtype=torch.float32, device=x.device)
    torch.testing.assert_close(skinny_linear(scaled, w2, rms=rms, out=wide), skinny_linear(h, w2).float(),
                               rtol=TOL[dtype], atol=TOL[dtype])
    close(skinny_linear_swiglu(scaled, w2, rms=rms), silu_and_mul_ref(skinny_linear(h, w2)), dtype)
    H = 4
    neg_decay = -torch.rand(H, generator=torch.Generator().manual_seed(71)).to(x.device) - 0.5
    dt_bias = randn(H, seed=72)
    y, g, beta = skinny_linear_gating(scaled, w2, 64, neg_decay, dt_bias, rms=rms)
    close(y, skinny_linear(h, w2), dtype)
    want_g, want_beta = gdn_gating(y[:, 64 + H:64 + 2 * H], y[:, 64:64 + H], neg_decay, dt_bias)
    torch.testing.assert_close(g, want_g, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(beta, want_beta, rtol=0, atol=0)


def test_split_norm_beyond_the_counters_runs_apart(monkeypatch):
    """A split launch with more column tiles than the counters: the add, and each consumer, run apart."""
    from fnattn.kernels import _counters as counters

    x, w, res, nw = randn(2, 64, seed=73), randn(80, 64, seed=74), randn(2, 80, seed=75), randn(80, seed=76)
    cfg = SkinnyConfig(block_n=16, block_k=16, split_k=2)  # 5 column tiles
    want, want_scaled, want_sq = skinny_linear_add_(x, w, res.clone(), nw, 1.0, config=cfg)
    w2, nd, dtb = randn(80, 80, seed=77), -randn(4, seed=78).exp(), randn(4, seed=79)
    rms = (want_sq, 1e-6)
    want_y = skinny_linear(want_scaled, w2, rms=rms, config=cfg)
    want_gating = skinny_linear_gating(want_scaled, w2, 40, nd, dtb, rms=rms, config=cfg)
    want_swiglu = skinny_linear_swiglu(want_scaled, w2, rms=rms, config=cfg)
    monkeypatch.setattr(counters, "COUNTERS", 4)
    got, scaled, sq = skinny_linear_add_(x, w, res.clone(), nw, 1.0, config=cfg)
    assert torch.equal(got, want) and torch.equal(scaled, want_scaled) and sq.shape == (2, 1)
    torch.testing.assert_close(sq[:, 0], want_sq.sum(-1), rtol=1e-5, atol=0)
    close(skinny_linear(want_scaled, w2, rms=rms, config=cfg), want_y, torch.float32)
    for a, b in zip(skinny_linear_gating(want_scaled, w2, 40, nd, dtb, rms=rms, config=cfg), want_gating):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    close(skinny_linear_swiglu(want_scaled, w2, rms=rms, config=cfg), want_swiglu, torch.float32)
    empty, scaled, sq = skinny_linear_add_(randn(3, 0), randn(8, 0), res[:1, :8].expand(3, 8).contiguous(), nw[:8])
    assert torch.equal(empty, res[:1, :8].expand(3, 8)) and sq.shape == (3, 1)
    assert torch.equal(skinny_linear(randn(3, 0), randn(8, 0), rms=(sq, 1e-6)), torch.zeros(3, 8, device=x.device))


def test_split_norm_arguments_name_themselves():
    x, w, nw = randn(2, 16), randn(8, 16), randn(8)
    ones = torch.ones(2, 1, device=x.device)
    with pytest.raises(ValueError, match="rms: expected no act or norm beside it"):
        skinny_linear(x, w, norm=(randn(16), 1e-6, 1.0), rms=(ones, 1e-6))
    with pytest.raises(ValueError, match=r"rms: expected a \(squares, eps\) pair, got Tensor"):
        skinny_linear(x, w, rms=ones)
    with pytest.raises(ValueError, match=r"rms eps: expected >= 0, got -1.0"):
        skinny_linear(x, w, rms=(ones, -1.0))
    for bad, got in ((torch.ones(2, 1, dtype=torch.float16, device=x.device), "torch.float16"),
                     (torch.ones(3, 2, device=x.device), r"\(3, 2\)"), (torch.ones(2, 0, device=x.device), r"\(2, 0\)"),
                     (torch.ones(4, 2, device=x.device).t(), r"\(2, 4\)"), ("sums", "str")):
        with pytest.raises(ValueError, match=rf"rms squares: expected a float32 \[2, P\] tensor .*got .*{got}"):
            skinny_linear(x, w, rms=(bad, 1e-6))
    with pytest.raises(ValueError, match="residual: expected an \\[M, N\\] tensor"):
        skinny_linear_add_(x, w, None, nw)
    with pytest.raises(ValueError, match="residual: expected shape \\(2, 8\\), got \\(2, 9\\)"):
        skinny_linear_add_(x, w, randn(2, 9), nw)
    with pytest.raises(ValueError, match="weight: expected shape \\(8,\\), got \\(16,\\)"):
        skinny_linear_add_(x, w, randn(2, 8), randn(16))
    with pytest.raises(ValueError, match="offset: expected a finite"):
        skinny_linear_add_(x, w, randn(2, 8), nw, float("nan"))
    both = randn(2, 24)
    with pytest.raises(ValueError, match="residual: expected a buffer apart from x's"):
        skinny_linear_add_(both[:, :16], w, both[:, 16:], nw)


@pytest.mark.parametrize("rows", [1, 4, 17])
def test_models_split_norm_only_when_asked_and_each_consumer_takes_it(rows, monkeypatch):
    """`models.fused.project_add_norm(split=True)` under `split_norm` (decode sizes, the kernel path allowed on
    this device) returns a `SplitNorm` that `linear` (also widened), `gate_up_silu` and `project_and_gate`
    finish, each near the same op on the materialized norm; without the switch, without ``split`` or above
    16 rows, the tensor. A consumer that cannot finish it (a bias) takes `tensor()`."""
    from fnattn.models import fused

    monkeypatch.setattr(fused, "_kernel", lambda package, *ts: package == "triton")
    D, K = 48, 96
    x, w = randn(rows, K, seed=80), randn(D, K, seed=81) / K ** 0.5
    res, nw = randn(rows, D, seed=82), randn(D, seed=83) * 0.2
    want_x, want_h = fused.project_add_norm(x, w, res.clone(), nw, 1e-6)
    assert isinstance(want_h, torch.Tensor)
    with fused.split_norm(True):
        assert isinstance(fused.project_add_norm(x, w, res.clone(), nw, 1e-6)[1], torch.Tensor)
        got_x, h = fused.project_add_norm(x, w, res.clone(), nw, 1e-6, split=True)
    assert isinstance(h, fused.SplitNorm) == (rows <= 16)
    close(got_x, want_x, torch.float32)
    if not isinstance(h, fused.SplitNorm):
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
    with pytest.raises(ValueError, match="split_norm: expected True or False, got 1"):
        with fused.split_norm(1):
            pass
