"""add_rms_norm_ (residual add + RMSNorm in place) and silu_and_mul against the unfused torch ops."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels.norm_act import add_rms_norm_, add_rms_norm_ref, silu_and_mul, silu_and_mul_ref  # noqa: E402
from fnattn.models.common import rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("T, D", [(1, 1024), (5, 96), (3, 33)])
def test_add_rms_norm_writes_the_sum_and_its_norm_in_place(T, D, offset, dtype):
    y, r = randn(T, D, dtype=dtype, seed=D), randn(T, D, dtype=dtype, seed=D + 1)
    w = randn(D, dtype=dtype, seed=3, scale=0.3)
    want_sum, want = add_rms_norm_ref(y, r, w, 1e-6, offset)
    torch.testing.assert_close(want, rms_norm(want_sum, w, 1e-6, offset=offset))  # the model's own norm
    got_sum, got = add_rms_norm_(y, r, w, 1e-6, offset)
    assert got_sum is r and got is y
    torch.testing.assert_close(got_sum, want_sum, rtol=0, atol=0)  # one rounding of the same fp32 sum
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])


def test_add_rms_norm_takes_strided_rows():
    wide_y, wide_r = randn(4, 80, seed=5), randn(4, 80, seed=6)
    y, r = wide_y[:, 8:72], wide_r[:, 16:80]
    w = randn(64, seed=7)
    want_sum, want = add_rms_norm_ref(y.clone(), r.clone(), w, 1e-5, 1.0)
    add_rms_norm_(y, r, w, 1e-5, 1.0)
    torch.testing.assert_close(r, want_sum, rtol=0, atol=0)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, inner", [(1, 3584), (6, 40), (2, 1500)])
def test_silu_and_mul_is_the_unfused_ops(T, inner, dtype):
    gu = randn(T, 2 * inner, dtype=dtype, seed=inner, scale=3.0)
    got = silu_and_mul(gu)
    assert got.is_contiguous() and got.shape == (T, inner) and got.dtype == dtype
    torch.testing.assert_close(got, silu_and_mul_ref(gu), rtol=TOL[dtype], atol=TOL[dtype])


def test_bad_arguments_name_themselves_and_write_nothing():
    y, r, w = randn(2, 32, seed=1), randn(2, 32, seed=2), randn(32, seed=3)
    before = (y.clone(), r.clone())
    cases = [
        (lambda: add_rms_norm_(y[0], r, w, 1e-6), r"add_rms_norm_: y: expected a \[T, D\] tensor"),
        (lambda: add_rms_norm_(y, r[:1], w, 1e-6), r"add_rms_norm_: residual: expected shape \(2, 32\)"),
        (lambda: add_rms_norm_(y, r.half(), w, 1e-6), r"residual: expected dtype torch.float32 \(y's\)"),
        (lambda: add_rms_norm_(y, r, w[:8], 1e-6), r"weight: expected shape \(32,\), got \(8,\)"),
        (lambda: add_rms_norm_(y, r, w, -1e-6), r"eps: expected >= 0"),
        (lambda: add_rms_norm_(y, r, w, 1e-6, float("inf")), r"offset: expected a finite Python float"),
        (lambda: add_rms_norm_(y, y, w, 1e-6), r"residual: expected a buffer apart from y's"),
        (lambda: add_rms_norm_(y, r.t().contiguous().t(), w, 1e-6), r"residual: expected unit stride"),
        (lambda: silu_and_mul(randn(2, 7)), r"silu_and_mul: gate_up: expected an even last dim"),
        (lambda: silu_and_mul(randn(3)), r"silu_and_mul: gate_up: expected a \[T, D\] tensor"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert torch.equal(y, before[0]) and torch.equal(r, before[1])


def test_models_take_the_kernels_only_under_own_norm_act(monkeypatch):
    """`models.fused.add_rms_norm_offset_` / `silu_and_mul`: the kernels by default (here with only the Triton
    kernel path allowed), the torch bodies under `own_norm_act(False)`, with the kernels' results."""
    from fnattn.kernels import norm_act as module
    from fnattn.models import fused

    monkeypatch.setattr(fused, "_kernel", lambda package, *ts: package == "triton")
    calls = []
    for name in ("add_rms_norm_", "silu_and_mul"):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    y, r, w, gu = randn(3, 64, seed=1), randn(3, 64, seed=2), randn(64, seed=3), randn(3, 80, seed=4)
    with fused.own_norm_act(False):
        plain = (*fused.add_rms_norm_offset_(y.clone(), r.clone(), w, 1e-6), fused.silu_and_mul(gu))
    assert not calls
    got = (*fused.add_rms_norm_offset_(y.clone(), r.clone(), w, 1e-6), fused.silu_and_mul(gu))
    assert calls == ["add_rms_norm_", "silu_and_mul"]
    for a, b in zip(got, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="own_norm_act: expected True or False, got 'yes'"):
        with fused.own_norm_act("yes"):
            pass


def test_operands_the_kernels_do_not_take_run_the_torch_bodies(monkeypatch):
    """Under the switch, rows without a unit inner stride or a residual in y's buffer go to the torch body,
    not to a refusal."""
    from fnattn.kernels import norm_act as module
    from fnattn.models import fused

    monkeypatch.setattr(fused, "_kernel", lambda package, *ts: package == "triton")
    monkeypatch.setattr(module, "add_rms_norm_", lambda *a, **k: pytest.fail("the kernel was called"))
    monkeypatch.setattr(module, "silu_and_mul", lambda *a, **k: pytest.fail("the kernel was called"))
    w = randn(32, seed=3)
    both = randn(2, 64, seed=4)
    y, r = both[:, :32], both[:, 32:]  # one buffer
    strided = randn(32, 2, seed=5).t()  # [2, 32], inner stride 2
    with fused.own_norm_act(True):
        for yy, rr in ((y, r), (strided, randn(2, 32, seed=6))):
            got_sum, got = fused.add_rms_norm_offset_(yy, rr, w, 1e-6)
            want_sum, want = add_rms_norm_ref(yy, rr, w, 1e-6, 1.0)
            torch.testing.assert_close(got_sum, want_sum)
            torch.testing.assert_close(got, want)
        transposed = randn(2, 2 * 16, seed=7).t()  # [32, 2], inner stride 32
        torch.testing.assert_close(fused.silu_and_mul(transposed), silu_and_mul_ref(transposed))
