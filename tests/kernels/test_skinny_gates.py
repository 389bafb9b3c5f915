"""skinny_linear's ``gate=`` prologue (a token mixer's output gate applied as the projection loads it) against
the unfused gate then the product (`output_gate.gate_ref`, `skinny_linear_ref`)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels.output_gate import gated_rms_norm_silu, sigmoid_gate  # noqa: E402
from fnattn.kernels.skinny_linear import SkinnyConfig, skinny_linear, skinny_linear_ref  # noqa: E402
from skinny_helpers import close, randn  # noqa: E402

H, D, N = 4, 16, 45
K = H * D
CONFIGS = [SkinnyConfig(block_n=16, block_k=32), SkinnyConfig(block_n=32, block_k=16, split_k=2),
           SkinnyConfig(block_n=16, block_k=32, split_k=2, one_launch=False),
           SkinnyConfig(block_n=16, block_k=16, early=2), SkinnyConfig(block_n=16, block_k=32, dot=False)]
IDS = ["dot", "split2", "split2-reduce-kernel", "early2", "fma"]


def operands(M, dtype, seed):
    """x with strided rows; z as the projections leave it: GDN's z a column slice of its input projection
    (rows strided), attention's gate the second half of each head's q | gate pair (heads strided)."""
    x = randn(M, K + 8, dtype=dtype, seed=seed)[:, 4:4 + K]
    z_gdn = randn(M, 3 * K, dtype=dtype, seed=seed + 1)[:, K:2 * K].view(M, H, D)
    z_attn = randn(M, H, 2 * D, dtype=dtype, seed=seed + 2)[..., D:]
    w = randn(N, K, dtype=dtype, seed=seed + 3) / K ** 0.5
    weight = (1 + 0.1 * randn(D, dtype=torch.float32, seed=seed + 4)).to(dtype)
    return x, z_gdn, z_attn, w, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_gated_prologues_match_the_gate_then_the_product(M, dtype, config):
    x, z_gdn, z_attn, w, weight = operands(M, dtype, seed=M)
    for gate in (("silu_norm", z_gdn, weight, 1e-6), ("sigmoid", z_attn)):
        got = skinny_linear(x, w, gate=gate, config=config)
        close(got, skinny_linear_ref(x, w, gate=gate), dtype)
        # and what the two launches it replaces give (the gate kernel, then the GEMV)
        gated = (gated_rms_norm_silu(x.view(M, H, D), z_gdn, weight, 1e-6) if gate[0] == "silu_norm"
                 else sigmoid_gate(x.view(M, H, D), z_attn))
        close(got, skinny_linear(gated.reshape(M, K), w, config=config), dtype)


def test_sigmoid_gate_takes_heads_wider_than_the_k_tile():
    """Attention's 256-wide heads under a 128-wide K tile: the sigmoid gate is elementwise, the norm is not."""
    M, Hh, Dh = 2, 2, 64
    x = randn(M, Hh * Dh, seed=1)
    z = randn(M, Hh, Dh, seed=2)
    w = randn(8, Hh * Dh, seed=3)
    cfg = SkinnyConfig(block_n=16, block_k=32)
    close(skinny_linear(x, w, gate=("sigmoid", z), config=cfg), skinny_linear_ref(x, w, gate=("sigmoid", z)),
          torch.float32)
    with pytest.raises(ValueError, match="gate z: expected a head dim >= 1 .*dividing the K tile 32.*got 64"):
        skinny_linear(x, w, gate=("silu_norm", z, torch.ones(Dh, device=x.device), 1e-6), config=cfg)


def test_bad_gates_name_themselves():
    x, z, _, w, weight = operands(2, torch.float32, seed=0)
    cases = [
        (dict(gate=("relu", z)), r"gate: expected \('silu_norm', z, weight, eps\) or \('sigmoid', z\)"),
        (dict(gate=("silu_norm", z)), "gate: expected 4 items for 'silu_norm', got 2"),
        (dict(gate=("sigmoid", z[:, :2])), r"gate z: expected \[M=2, H, D\] with H \* D = 64"),
        (dict(gate=("sigmoid", z.half())), "gate z: expected dtype torch.float32"),
        (dict(gate=("silu_norm", z, weight[:8], 1e-6)), "gate weight: expected shape"),
        (dict(gate=("silu_norm", z, weight, -1.0)), "gate eps: expected >= 0"),
        (dict(gate=("sigmoid", z), norm=(torch.ones(K), 1e-6, 0.0)), "gate: expected no act or norm beside it"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            skinny_linear(x, w, **kwargs)
