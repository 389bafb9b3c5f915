"""GDN's one-launch gating (g, beta) against torch (`gdn_gating_ref`, what gdn_project runs) on CUDA.

a and b are bf16 column slices of one in_proj output at the Qwen3.5-0.8B shape
(P = 6144 + 2048 + 2 * 16 columns, H = 16) and at H = 32 / 48. g is fp32 and is held
to 1e-6 relative (libdevice's expf / log1pf are what torch's kernels call, the divisions
are IEEE-rounded); beta is the fp32 sigmoid rounded once to bf16, so it should match
bit for bit (the count of differing elements is recorded). The launch is also captured
in a CUDA graph, which fails on any host read. Set FNATTN_GPU_RESULTS=path.json to record.
"""

import pytest
import torch

from fnattn.kernels import gdn_gating, gdn_gating_ref

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16
G_RTOL = 1e-6
G_ATOL = 1e-38  # a denormal g (x < -87) flushed to zero would still pass


def _gemm_out(T, H, dtype=BF16, *, scale=3.0, seed=0, qkvz=6144 + 2048):
    """(a, b) [T, H] as the last two column blocks of a [T, qkvz + 2H] GEMM output, neg_decay and dt_bias [H]."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    y = (torch.randn(T, qkvz + 2 * H, device=DEV, generator=gen) * scale).to(dtype)
    b, a = y[:, qkvz : qkvz + H], y[:, qkvz + H :]
    A_log = torch.empty(H, device=DEV).uniform_(1.0, 16.0, generator=gen).log()
    return a, b, -A_log.exp(), torch.randn(H, device=DEV, generator=gen)


def _errors(got, want):
    """(max abs, max rel) over the elements where want is finite; the others must agree exactly (inf / nan)."""
    fin = torch.isfinite(want)
    assert torch.equal(got[~fin].nan_to_num(), want[~fin].nan_to_num()), "non-finite values differ"
    if not fin.any():
        return 0.0, 0.0
    d = (got[fin].double() - want[fin].double()).abs()
    rel = d / want[fin].double().abs().clamp_min(1e-30)
    return d.max().item(), rel[d > G_ATOL].max().item() if (d > G_ATOL).any() else 0.0


def _compare(record, case, got, want):
    (g, beta), (rg, rbeta) = got, want
    assert g.dtype == torch.float32 and beta.dtype == rbeta.dtype and g.shape == rg.shape == beta.shape
    g_abs, g_rel = _errors(g, rg)
    b_abs, b_rel = _errors(beta.float(), rbeta.float())
    beta_diff = int((beta != rbeta).logical_and(~(beta.isnan() & rbeta.isnan())).sum())
    beta_tol = 1e-6 if beta.dtype == torch.float32 else 2.0 ** -8  # one bf16 ulp of slack, recorded
    ok = g_rel <= G_RTOL and b_rel <= beta_tol
    record({"case": case, "backend": "gdn_gating (triton)", "reference": "gdn_gating_ref (torch)",
            "g_max_abs": g_abs, "g_max_rel": g_rel, "beta_max_abs": b_abs, "beta_max_rel": b_rel,
            "beta_elements_differing": beta_diff, "ok": ok})
    assert ok, f"{case}: g max rel {g_rel:.3e} (tol {G_RTOL}), beta max rel {b_rel:.3e} (tol {beta_tol})"


@pytest.mark.parametrize("H", [16, 32, 48])
@pytest.mark.parametrize("T", [1, 32, 4096])
def test_bf16_gemm_slices(T, H, record):
    a, b, nd, dt = _gemm_out(T, H, seed=T + H)
    _compare(record, f"bf16 T{T} H{H}", gdn_gating(a, b, nd, dt), gdn_gating_ref(a, b, nd, dt))


@pytest.mark.parametrize("T, H, dtype", [(65536, 16, BF16), (100, 128, BF16), (77, 16, torch.float16),
                                         (77, 48, torch.float32)], ids=["bf16-T65536", "bf16-H128", "fp16", "fp32"])
def test_sizes_and_dtypes(T, H, dtype, record):
    a, b, nd, dt = _gemm_out(T, H, dtype, scale=8.0, seed=7)
    _compare(record, f"{str(dtype)[6:]} T{T} H{H}", gdn_gating(a, b, nd, dt), gdn_gating_ref(a, b, nd, dt))


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("sp", [dict(), dict(softplus_threshold=100.0),
                                dict(softplus_beta=0.5, softplus_threshold=5.0)], ids=["default", "thr100", "beta0.5"])
def test_extremes(dtype, sp, record):
    """|a + dt_bias| on both sides of the threshold, past exp's fp32 range, and inf / nan."""
    vals = [19.99, 20.0, 20.01, 9.99, 10.0, 10.01, 87.0, 88.8, 89.0, 95.0, 150.0, -87.0, -89.0, -100.0, -150.0,
            1e-8, -1e-8, 0.0, float("inf"), float("-inf"), float("nan"), 0.5, -0.5, 3.0]
    H = 8
    rows = len(vals) // H
    a, b, nd, _ = _gemm_out(rows + 64, H, dtype, scale=40.0, seed=11)
    dt = torch.zeros(H, device=DEV)
    a[:rows] = b[:rows] = torch.tensor(vals, device=DEV).view(rows, H).to(dtype)
    _compare(record, f"extremes {str(dtype)[6:]} {sp}", gdn_gating(a, b, nd, dt, **sp),
             gdn_gating_ref(a, b, nd, dt, **sp))


def test_cuda_graph_capture(record):
    """Captured once, replayed on new a / b values: the same results as eager torch."""
    a_src, b_src, nd, dt = _gemm_out(32, 16, seed=21)
    y = torch.empty(32, 6144 + 2048 + 32, device=DEV, dtype=BF16)
    a, b = y[:, -16:], y[:, -32:-16]
    a.copy_(a_src), b.copy_(b_src)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gdn_gating(a, b, nd, dt)  # compile and load outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g, beta = gdn_gating(a, b, nd, dt)
    for seed in (22, 23):
        a_new, b_new, _, _ = _gemm_out(32, 16, seed=seed)
        a.copy_(a_new), b.copy_(b_new)
        graph.replay()
        torch.cuda.synchronize()
        _compare(record, f"cuda graph replay seed {seed}", (g.clone(), beta.clone()), gdn_gating_ref(a, b, nd, dt))
