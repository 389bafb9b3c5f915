"""gated_rms_norm_silu and sigmoid_gate (the gates on a token mixer's output, strided gates read in place)
against the unfused torch ops."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels.output_gate import (  # noqa: E402
    gated_rms_norm_silu,
    gated_rms_norm_silu_ref,
    sigmoid_gate,
    sigmoid_gate_ref,
)
from fnattn.models.common import rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def projection_slices(T, H, D, dtype, seed):
    """x contiguous [T, H, D] and z / gate cut from a wider projection output, as the models cut them."""
    x = randn(T, H, D, dtype=dtype, seed=seed, scale=2.0)
    wide = randn(T, 3 * H * D + 5, dtype=dtype, seed=seed + 1, scale=2.0)
    z = wide[:, H * D + 3:2 * H * D + 3].view(T, H, D)  # strided rows, unit inner stride
    return x, z


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, H, D", [(1, 16, 128), (5, 3, 48), (2, 2, 256)])
def test_gated_norm_is_the_unfused_ops(T, H, D, dtype):
    x, z = projection_slices(T, H, D, dtype, seed=T + H)
    w = randn(D, dtype=dtype, seed=7, scale=0.5)
    got = gated_rms_norm_silu(x, z, w, 1e-6)
    want = gated_rms_norm_silu_ref(x, z, w, 1e-6)
    assert got.is_contiguous() and got.shape == (T, H, D) and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    # the reference is the model's own body: rms_norm, then silu(z) in fp32
    torch.testing.assert_close(want, (rms_norm(x, w, 1e-6) * torch.nn.functional.silu(z.float())).to(dtype))
    # a strided x too (a view into a wider buffer)
    wide = torch.cat([x, x], dim=-1)[..., :D]
    torch.testing.assert_close(gated_rms_norm_silu(wide, z, w, 1e-6), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, H, D", [(1, 8, 256), (7, 2, 40)])
def test_sigmoid_gate_is_the_unfused_ops(T, H, D, dtype):
    x, gate = projection_slices(T, H, D, dtype, seed=3 * T + H)
    got = sigmoid_gate(x, gate)
    assert got.is_contiguous() and got.shape == (T, H, D) and got.dtype == dtype
    torch.testing.assert_close(got, sigmoid_gate_ref(x, gate), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("T, H, D", [(5, 3, 48), (9, 3, 128)])
def test_many_rows_a_program_agree(T, H, D, monkeypatch):
    """The prefill-sized form (ROWS_MANY head rows a program, the last program part empty) gives what one
    row a program gives."""
    from fnattn.kernels import output_gate

    x, z = projection_slices(T, H, D, torch.float32, seed=T * H)
    w = randn(D, seed=5, scale=0.5)
    one = gated_rms_norm_silu(x, z, w, 1e-6), sigmoid_gate(x, z)
    monkeypatch.setattr(output_gate, "MANY_ROWS", 2)
    monkeypatch.setattr(output_gate, "ROWS_MANY", 4)
    assert (T * H) % 4  # a part-empty last program
    many = gated_rms_norm_silu(x, z, w, 1e-6), sigmoid_gate(x, z)
    torch.testing.assert_close(many[0], one[0], rtol=0, atol=0)
    torch.testing.assert_close(many[1], one[1], rtol=0, atol=0)
    torch.testing.assert_close(many[0], gated_rms_norm_silu_ref(x, z, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_empty_inputs_give_empty_outputs():
    x, z = projection_slices(0, 4, 32, torch.float32, seed=1)
    assert gated_rms_norm_silu(x, z, randn(32), 1e-6).shape == (0, 4, 32)
    assert sigmoid_gate(x, z).shape == (0, 4, 32)


def test_bad_arguments_name_themselves():
    x, z = projection_slices(2, 4, 32, torch.float32, seed=2)
    w = randn(32)
    cases = [
        (lambda: gated_rms_norm_silu(x[0], z, w, 1e-6), r"gated_rms_norm_silu: x: expected a \[T, H, D\] tensor"),
        (lambda: gated_rms_norm_silu(x, z[:1], w, 1e-6), r"gated_rms_norm_silu: z: expected shape \(2, 4, 32\)"),
        (lambda: gated_rms_norm_silu(x, z.half(), w, 1e-6), r"z: expected dtype torch.float32 \(x's\)"),
        (lambda: gated_rms_norm_silu(x, z, w[:16], 1e-6), r"weight: expected shape \(32,\), got \(16,\)"),
        (lambda: gated_rms_norm_silu(x, z, w, -1.0), r"eps: expected >= 0, got -1.0"),
        (lambda: gated_rms_norm_silu(x, z, w, float("nan")), r"eps: expected a finite Python float"),
        (lambda: gated_rms_norm_silu(x, z.transpose(1, 2).contiguous().transpose(1, 2), w, 1e-6),
         r"z: expected unit stride along its last dim"),
        (lambda: sigmoid_gate(x, z[..., :16]), r"sigmoid_gate: gate: expected shape \(2, 4, 32\)"),
        (lambda: sigmoid_gate(x.int(), z.int()), r"sigmoid_gate: x: expected dtype bfloat16, float16 or float32"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_models_take_the_kernels_only_under_output_gates(monkeypatch):
    """`models.fused.gated_rms_norm_silu` / `sigmoid_gate`: the kernels by default (here with the kernel path
    allowed on this device), the torch bodies under `output_gates(False)`; the two agree."""
    from fnattn.kernels import output_gate as module
    from fnattn.models import fused

    monkeypatch.setattr(fused, "_kernel", lambda package, *ts: package == "triton")
    calls = []
    for name in ("gated_rms_norm_silu", "sigmoid_gate"):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    x, z = projection_slices(3, 4, 64, torch.float32, seed=11)
    w = randn(64, seed=12)
    with fused.output_gates(False):
        plain = fused.gated_rms_norm_silu(x, z, w, 1e-6), fused.sigmoid_gate(x, z)
    assert not calls
    got = fused.gated_rms_norm_silu(x, z, w, 1e-6), fused.sigmoid_gate(x, z)
    assert calls == ["gated_rms_norm_silu", "sigmoid_gate"]
    for a, b in zip(got, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="output_gates: expected True or False, got 1"):
        with fused.output_gates(1):
            pass
