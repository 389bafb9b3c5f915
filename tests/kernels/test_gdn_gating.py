"""GDN's one-launch gating (g, beta) against its torch reference, and the reference against gdn_project.

Without CUDA the kernel runs under TRITON_INTERPRET=1, fp32 and fp16 (the interpreter
truncates fp32 -> bf16 instead of rounding; bf16 is checked on the GPU). a and b are
column slices of one [T, P] tensor, as the in_proj GEMM output hands them over.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels import gdn_gating, gdn_gating_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# exp overflows to inf in the sigmoid of b < -88 (as torch's does); numpy says so under the interpreter
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
FP32 = dict(rtol=1e-6, atol=1e-38, equal_nan=True)  # atol: a denormal flushed to zero


def gemm_out(T, H, dtype=torch.float32, *, scale=4.0, seed=0):
    """(a, b) [T, H] as column slices of one [T, P] GEMM output (row stride P != H), and neg_decay, dt_bias [H]."""
    gen = torch.Generator().manual_seed(seed)
    P = 3 * H + 7
    y = (torch.randn(T, P, generator=gen) * scale).to(DEV, dtype)
    b, a = y[:, H + 3 : 2 * H + 3], y[:, 2 * H + 5 : 3 * H + 5]
    A_log = torch.empty(H).uniform_(1.0, 16.0, generator=gen).log()
    neg_decay = (-A_log.exp()).to(DEV)
    dt_bias = torch.randn(H, generator=gen).to(DEV)
    return a, b, neg_decay, dt_bias


def check(got, want):
    (g, beta), (rg, rbeta) = got, want
    assert g.dtype == torch.float32 and g.shape == rg.shape and g.is_contiguous()
    assert beta.dtype == rbeta.dtype and beta.shape == rbeta.shape and beta.is_contiguous()
    torch.testing.assert_close(g, rg, **FP32)
    if beta.dtype == torch.float32:
        torch.testing.assert_close(beta, rbeta, **FP32)
    else:  # the same fp32 sigmoid rounded once: at most a half-ulp tie apart
        torch.testing.assert_close(beta.float(), rbeta.float(), rtol=2**-10, atol=0, equal_nan=True)


@pytest.mark.parametrize("T", [1, 5, 130])
@pytest.mark.parametrize("H", [1, 16, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_reference(T, H, dtype):
    a, b, nd, dt = gemm_out(T, H, dtype, seed=T * 100 + H)
    assert a.stride(0) != H and b.stride(0) != H  # strided rows, as in the model
    check(gdn_gating(a, b, nd, dt), gdn_gating_ref(a, b, nd, dt))


def test_reference_is_torch():
    a, b, nd, dt = gemm_out(5, 16)
    g, beta = gdn_gating_ref(a, b, nd, dt)
    assert torch.equal(g, nd * F.softplus(a + dt))
    assert torch.equal(beta, torch.sigmoid(b))


@pytest.mark.parametrize("sp", [dict(), dict(softplus_threshold=100.0), dict(softplus_beta=0.5, softplus_threshold=5.0),
                                dict(softplus_beta=-2.0), dict(softplus_beta=3.0, softplus_threshold=-1.0)],
                         ids=["default", "thr100", "beta0.5", "beta-2", "thr-1"])
def test_softplus_threshold_and_extremes(sp):
    """Large |a + dt_bias| on both sides of the threshold (and past exp's fp32 range), infinities and NaN."""
    thr, beta = sp.get("softplus_threshold", 20.0), sp.get("softplus_beta", 1.0)
    edge = thr / beta
    vals = [edge - 1e-3, edge, edge + 1e-3, edge + 2.0, -edge, 19.99, 20.0, 20.01, 87.0, 88.8, 89.0, 95.0,
            -87.0, -89.0, -100.0, -150.0, 1e-8, -1e-8, 0.0, float("inf"), float("-inf"), float("nan")]
    H = 8
    vals += [float("nan")] * (-len(vals) % H)
    rows = len(vals) // H
    a, b, nd, _ = gemm_out(rows + 2, H, scale=60.0, seed=3)  # the last two rows stay random (|a| ~ 60)
    dt = torch.zeros(H, device=DEV)
    a[:rows] = b[:rows] = torch.tensor(vals, device=DEV).view(rows, H)
    assert a.stride(0) != H and a[0, 1].item() == torch.tensor(vals[1]).item()
    check(gdn_gating(a, b, nd, dt, **sp), gdn_gating_ref(a, b, nd, dt, **sp))


def test_layouts_and_dtypes():
    """Mixed a / b dtypes, a transposed view (inner stride != 1), broadcast rows, strided neg_decay / dt_bias,
    beta_dtype, and T = 0."""
    a, b, nd, dt = gemm_out(6, 16)
    check(gdn_gating(a, b.half(), nd, dt), gdn_gating_ref(a, b.half(), nd, dt))
    at = a.t().contiguous().t()  # [T, H] with strides (1, T)
    assert at.stride(1) != 1
    check(gdn_gating(at, b, nd, dt), gdn_gating_ref(at, b, nd, dt))
    row = a[:1].expand(6, 16)  # stride 0 over rows
    check(gdn_gating(row, b, nd, dt), gdn_gating_ref(row, b, nd, dt))
    nd2, dt2 = torch.stack([nd, nd], 1)[:, 0], torch.stack([dt, -dt], 1)[:, 1]
    assert nd2.stride(0) == 2
    check(gdn_gating(a, b, nd2, dt2), gdn_gating_ref(a, b, nd2, dt2))
    bh = b.half()
    got = gdn_gating(a, bh, nd, dt, beta_dtype=torch.float32)
    assert got[1].dtype == torch.float32
    check(got, gdn_gating_ref(a, bh, nd, dt, beta_dtype=torch.float32))
    torch.testing.assert_close(got[1], torch.sigmoid(bh.float()), **FP32)
    g0, beta0 = gdn_gating(a[:0], b[:0], nd, dt)
    assert g0.shape == (0, 16) and beta0.shape == (0, 16) and beta0.dtype == b.dtype


def test_matches_gdn_project():
    """The reference is gdn_project's own g / beta, fed the slices of its one in_proj GEMM."""
    from fnattn.models.gdn_layer import GDNWeights, gdn_project

    gen = torch.Generator().manual_seed(7)
    D, Hk, H, K, V, W = 32, 2, 4, 8, 8, 4
    C = 2 * Hk * K + H * V

    def r(*shape, s=0.3):
        return s * torch.randn(*shape, generator=gen)

    qkv, z, wb, wa = r(C, D), r(H * V, D), r(H, D), r(H, D, s=3.0)
    A_log = torch.empty(H).uniform_(1.0, 16.0, generator=gen).log()
    w = GDNWeights(in_proj_qkv=qkv, in_proj_z=z, in_proj_b=wb, in_proj_a=wa, conv_weight=r(C, W), conv_bias=r(C),
                   A_log=A_log, dt_bias=r(H, s=1.0), norm_weight=1 + r(V), out_proj=r(D, H * V),
                   num_k_heads=Hk, num_v_heads=H, head_k_dim=K, head_v_dim=V,
                   in_proj=torch.cat([qkv, z, wb, wa]), neg_decay=-A_log.exp())
    x = r(9, D, s=1.0)
    _, _, g, beta = gdn_project(w, x)
    y = F.linear(x, w.in_proj)  # [T, C + HV + 2H]: ... | b | a
    b, a = y[:, C + H * V : C + H * V + H], y[:, C + H * V + H :]
    rg, rbeta = gdn_gating_ref(a, b, w.neg_decay, w.dt_bias.float())
    assert torch.equal(rg, g) and torch.equal(rbeta, beta)
    check(gdn_gating(a.to(DEV), b.to(DEV), w.neg_decay.to(DEV), w.dt_bias.to(DEV)),
          (rg.to(DEV), rbeta.to(DEV)))


def _bad_cases():
    a, b, nd, dt = gemm_out(3, 4)
    ok = dict(a=a, b=b, neg_decay=nd, dt_bias=dt)
    return [
        ("a", dict(ok, a=a[0]), "[T, H]"),
        ("a", dict(ok, a=a[:, :0], b=b[:, :0], neg_decay=nd[:0], dt_bias=dt[:0]), "H >= 1"),
        ("a", dict(ok, a=a.double()), "dtype"),
        ("a", dict(ok, a=a.to_sparse()), "dense"),
        ("a", dict(ok, a=[[1.0]]), "torch.Tensor"),
        ("b", dict(ok, b=b[:2]), "like a"),
        ("b", dict(ok, b=b.int()), "dtype"),
        ("b", dict(ok, b=b.to("meta")), "device"),
        ("neg_decay", dict(ok, neg_decay=nd[:3]), r"\[H\] = \[4\]"),
        ("neg_decay", dict(ok, neg_decay=nd.half()), "float32"),
        ("dt_bias", dict(ok, dt_bias=dt[None]), r"\[H\]"),
        ("dt_bias", dict(ok, dt_bias=dt.bfloat16()), "float32"),
        ("dt_bias", dict(ok, dt_bias=dt.to("meta")), "device"),
        ("beta_dtype", dict(ok, beta_dtype=torch.int8), "got torch.int8"),
        ("softplus_beta", dict(ok, softplus_beta=0.0), "non-zero"),
        ("softplus_beta", dict(ok, softplus_beta=True), "non-zero"),
        ("softplus_threshold", dict(ok, softplus_threshold=float("nan")), "real number"),
        ("softplus_threshold", dict(ok, softplus_threshold="20"), "real number"),
    ]


@pytest.mark.parametrize("fn", [gdn_gating, gdn_gating_ref], ids=["kernel", "ref"])
@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_arguments(fn, case):
    name, kw, text = _bad_cases()[case]
    args = [kw.pop(k) for k in ("a", "b", "neg_decay", "dt_bias")]
    with pytest.raises(ValueError, match=rf"^{name}: .*{text}"):
        fn(*args, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors are only refused outside the interpreter")
def test_cpu_tensors_run_only_under_the_interpreter(monkeypatch):
    import fnattn.kernels.gdn_gate as mod

    class Compiled:  # what triton.jit returns when TRITON_INTERPRET is off
        def __getitem__(self, grid):
            raise AssertionError("launched")

    monkeypatch.setattr(mod, "_gating_kernel", Compiled())
    a, b, nd, dt = gemm_out(2, 4)
    with pytest.raises(ValueError, match=r"^a: expected a CUDA tensor"):
        mod.gdn_gating(a, b, nd, dt)
