"""Fused kernels against their unfused torch bodies on a GPU, bf16: each piece of `models.fused` (with
`skinny_linear` on Qwen3.5-0.8B's projection shapes, against its fp32 reference and cuBLAS), then whole
Qwen3.5 models (the tiny config and a 4-layer slice of the 0.8B shape) fused vs `fused.unfused()` over a
prefill and decode steps. Set FNATTN_GPU_RESULTS=path.json to record every comparison."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from fnattn.kernels.skinny_linear import configured
from fnattn.models.common import rope_cos_sin, rope_inv_freq
from fnattn.models.registry import random_model
from helpers import spread_prompts

import fnattn as fa
from fnattn import kernels
from fnattn.driver import prefill, run_step
from fnattn.kernels import gdn_decode_fused
from fnattn.models import fused

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def _check(record, case, got, want, tol, reference="unfused torch", **extra):
    rel = _rel(got, want)
    ok = bool(torch.isfinite(got).all()) and rel <= tol
    record({"case": case, "backend": "fused", "reference": reference, "max_rel": rel, **extra, "ok": ok})
    assert ok, f"{case}: max rel {rel:.3e} > {tol}"


def _randn(*shape, seed=0, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(BF16)


@pytest.mark.parametrize("T", [1, 7, 4096])
def test_add_rms_norm_and_norm(T, record):
    pytest.importorskip("flashinfer")
    x, y, w = _randn(T, 1024, seed=1), _randn(T, 1024, seed=2), _randn(1024, seed=3, scale=0.1)
    with fused.unfused():
        want_sum, want_h = fused.add_rms_norm_offset_(y.clone(), x.clone(), w, 1e-6)
        want_n = fused.rms_norm_offset(x, w, 1e-6)
    got_sum, got_h = fused.add_rms_norm_offset_(y.clone(), x.clone(), w, 1e-6)
    _check(record, f"add+rmsnorm(1+w) T{T} sum", got_sum, want_sum, 1e-2)
    _check(record, f"add+rmsnorm(1+w) T{T} normed", got_h, want_h, 2e-2)
    _check(record, f"rmsnorm(1+w) T{T}", fused.rms_norm_offset(x, w, 1e-6), want_n, 2e-2)
    # q/k norms: a strided [T, H, D] view of a wider GEMM output
    qg = _randn(T, 8, 512, seed=4)[..., :256]
    wq = _randn(256, seed=5, scale=0.1)
    with fused.unfused():
        want_q = fused.rms_norm_offset(qg, wq, 1e-6)
    _check(record, f"q norm strided T{T}", fused.rms_norm_offset(qg, wq, 1e-6), want_q, 2e-2)


@pytest.mark.parametrize("T", [1, 4096])
def test_silu_and_mul(T, record):
    pytest.importorskip("flashinfer")
    gu = _randn(T, 2 * 3584, seed=6)
    _check(record, f"silu_and_mul T{T}", fused.silu_and_mul(gu), F.silu(gu[:, :3584]) * gu[:, 3584:], 2e-2)


@pytest.mark.parametrize("T, start", [(1, 0), (1, 8191), (33, 100), (8192, 0)])
def test_partial_rope(T, start, record):
    """Qwen3.5's rope: theta 1e7, the first 64 of 256 dims, rotate-half; positions up to 8k."""
    pytest.importorskip("flashinfer")
    pos = torch.arange(start, start + T, device="cuda")
    cos, sin = rope_cos_sin(pos, rope_inv_freq(64, 1e7, device="cuda"))
    q, k = _randn(T, 8, 256, seed=7), _randn(T, 2, 256, seed=8)
    with fused.unfused():
        want_q, want_k = fused.rope_(q.clone(), k.clone(), cos, sin, fused.rope_table(cos, sin))
    got_q, got_k = fused.rope_(q.clone(), k.clone(), cos, sin, fused.rope_table(cos, sin))
    _check(record, f"rope q T{T} from {start}", got_q, want_q, 2e-2)
    _check(record, f"rope k T{T} from {start}", got_k, want_k, 2e-2)
    assert torch.equal(got_q[..., 64:], q[..., 64:])  # the dims past rotary_dim pass through


@pytest.mark.parametrize("T", [1, 4096])
def test_gated_norm(T, record):
    pytest.importorskip("fla")
    o, z, w = _randn(T, 16, 128, seed=9), _randn(T, 16, 128, seed=10), 1 + _randn(128, seed=11, scale=0.1)
    with fused.unfused():
        want = fused.gated_rms_norm_silu(o, z, w, 1e-6)
    _check(record, f"gated rmsnorm silu T{T}", fused.gated_rms_norm_silu(o, z, w, 1e-6), want, 2e-2)


# Qwen3.5-0.8B's per-token projections (K, N): MLP gate_up, MLP down, GDN in_proj, out_proj / o_proj, qkv
SKINNY_SHAPES = [(1024, 7168), (3584, 1024), (1024, 8224), (2048, 1024), (1024, 5120)]


@pytest.mark.parametrize("M", [1, 7, 32, 64])
@pytest.mark.parametrize("K, N", SKINNY_SHAPES)
def test_skinny_linear(M, K, N, record):
    pytest.importorskip("triton")
    from fnattn.kernels.skinny_linear import SkinnyConfig, pick_config, skinny_linear, skinny_linear_ref

    x, w = _randn(M, K, seed=12), _randn(N, K, seed=13, scale=K ** -0.5)
    got = skinny_linear(x, w)
    cfg = pick_config(M, N, K, BF16)
    _check(record, f"skinny_linear M{M} K{K} N{N} split{cfg.split_k} vs fp32 ref", got, skinny_linear_ref(x, w), 1e-2)
    _check(record, f"skinny_linear M{M} K{K} N{N} vs F.linear", got, F.linear(x, w), 1e-2)
    if M == 1:  # the FMA form, which `benchmarks/linear_sweep.py` sweeps at a few rows
        for cfg in (SkinnyConfig(32, 128, 1, dot=False), SkinnyConfig(16, 256, 2, num_warps=8, dot=False)):
            _check(record, f"skinny_linear fma M{M} K{K} N{N} split{cfg.split_k}", skinny_linear(x, w, config=cfg),
                   skinny_linear_ref(x, w), 1e-2)
    if K == 3584:  # the MLP's down projection, with SiLU-and-mul on load
        gu = _randn(M, 2 * K, seed=14)
        got = skinny_linear(gu, w, act="silu_mul")
        _check(record, f"skinny_linear silu_mul M{M} K{K} N{N} vs fp32 ref", got,
               skinny_linear_ref(gu, w, act="silu_mul"), 1e-2)


@pytest.mark.parametrize("prefetch", [False, True])
def test_skinny_linear_with_pdl_is_the_plain_launch_bits(prefetch, record):
    """Under `kernels.pdl(True)` a GEMV loads its first weight tile before the launch before it ends (and
    with ``prefetch`` asks L2 for the rest of its slab): a chain of them (a split one with its arrival
    counters, silu_mul, the residual add with the next norm's row-local half, the GEMV that finishes that
    norm), eager and replayed, gives the bits of the chain launched without PDL."""
    pytest.importorskip("triton")
    from fnattn.kernels.skinny_folds import skinny_linear_add_
    from fnattn.kernels.skinny_linear import skinny_linear

    from fnattn.kernels import skinny_linear as skinny

    x, r = _randn(1, 1024, seed=60), _randn(1, 1024, seed=61)
    w_up, w_down, w_o = _randn(7168, 1024, seed=62, scale=1 / 32), _randn(1024, 3584, seed=63, scale=1 / 64), \
        _randn(1024, 2048, seed=64, scale=1 / 48)
    nw = _randn(1024, seed=65, scale=0.1)

    def chain():
        h = skinny_linear(skinny_linear(x, w_up), w_down, act="silu_mul")  # 1024 columns: split-K
        y, scaled, squares = skinny_linear_add_(torch.cat([h, h], dim=-1), w_o, r.clone(), nw, 1.0)
        return skinny_linear(scaled, w_up, rms=(squares, 1e-6)), y

    want = chain()
    with kernels.pdl(True), skinny.configured(prefetch=prefetch):
        eager = chain()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            replayed = chain()
    same = all(torch.equal(a, b) for a, b in zip(eager, want))
    record({"case": f"skinny chain with pdl, prefetch {prefetch}, eager", "backend": "fused", "bitwise": same,
            "ok": same})
    assert same
    for seed in (66, 67):
        x.copy_(_randn(1, 1024, seed=seed))
        want = chain()
        g.replay()
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(replayed, want))
        record({"case": f"skinny chain with pdl, prefetch {prefetch}, replay on input {seed}", "backend": "fused",
                "bitwise": same, "ok": same})
        assert same


def test_skinny_linear_replays_in_a_cuda_graph(record):
    """Captured once, a replay computes the product of whatever the input buffers hold then (split and not)."""
    pytest.importorskip("triton")
    from fnattn.kernels.skinny_linear import skinny_linear, skinny_linear_ref

    x, w_up, w_down = _randn(4, 1024, seed=15), _randn(7168, 1024, seed=16, scale=1 / 32), _randn(1024, 3584, seed=17)
    skinny_linear(skinny_linear(x, w_up), w_down, act="silu_mul")  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = skinny_linear(skinny_linear(x, w_up), w_down, act="silu_mul")
    x.copy_(_randn(4, 1024, seed=18))
    g.replay()
    want = skinny_linear_ref(skinny_linear_ref(x, w_up), w_down, act="silu_mul")
    _check(record, "skinny_linear up + silu_mul down, graph replay", out, want, 2e-2)


# A decode step's residual-add + RMSNorm folded into the projections around it: the output projections
# (K -> hidden 1024) add the residual, the input projections (hidden 1024 -> N) normalize on load.
@pytest.mark.parametrize("M", [1, 7, 16])
@pytest.mark.parametrize("N", [8224, 5120, 7168])
def test_skinny_linear_norm_prologue(M, N, record):
    pytest.importorskip("triton")
    from fnattn.kernels.skinny_linear import SkinnyConfig, pick_config, skinny_linear, skinny_linear_ref

    K = 1024
    x, w = _randn(M, K, seed=30, scale=4.0), _randn(N, K, seed=31, scale=K ** -0.5)
    norm = (_randn(K, seed=32, scale=0.1), 1e-6, 1.0)
    got = skinny_linear(x, w, norm=norm)
    split = pick_config(M, N, K, BF16).split_k
    _check(record, f"skinny_linear norm(1+w) M{M} K{K} N{N} split{split} vs fp32 ref", got,
           skinny_linear_ref(x, w, norm=norm), 1e-2)
    with fused.unfused():
        want = fused.linear(x, w, norm=norm)
    _check(record, f"fused.linear norm(1+w) M{M} K{K} N{N} vs unfused", fused.linear(x, w, norm=norm), want, 1e-2)
    if M == 1:  # split-K: every piece computes the whole row's statistics
        cfg = SkinnyConfig(32, 128, split_k=4)
        _check(record, f"skinny_linear norm(1+w) M{M} K{K} N{N} split4", skinny_linear(x, w, norm=norm, config=cfg),
               skinny_linear_ref(x, w, norm=norm), 1e-2)


@pytest.mark.parametrize("M", [1, 7, 16])
@pytest.mark.parametrize("K", [2048, 3584])
def test_skinny_linear_residual_epilogue(M, K, record):
    pytest.importorskip("triton")
    from fnattn.kernels.skinny_linear import pick_config, skinny_linear, skinny_linear_ref

    N = 1024
    x, w, res = _randn(M, K, seed=33), _randn(N, K, seed=34, scale=K ** -0.5), _randn(M, N, seed=35, scale=4.0)
    got = skinny_linear(x, w, residual=res)
    split = pick_config(M, N, K, BF16).split_k
    _check(record, f"skinny_linear residual M{M} K{K} N{N} split{split} vs fp32 ref", got,
           skinny_linear_ref(x, w, residual=res), 1e-2)
    with fused.unfused():
        want = fused.linear(x, w, residual=res)
    _check(record, f"fused.linear residual M{M} K{K} N{N} vs unfused", fused.linear(x, w, residual=res), want, 1e-2)
    both = (_randn(K, seed=36, scale=0.1), 1e-6, 0.0)
    _check(record, f"skinny_linear residual + norm(w) M{M} K{K} N{N} vs fp32 ref",
           skinny_linear(x, w, residual=res, norm=both), skinny_linear_ref(x, w, residual=res, norm=both), 1e-2)


def test_skinny_linear_folds_replay_in_a_cuda_graph(record):
    """[down-proj + residual; gate_up with the norm on load] captured once, replayed on new buffer contents."""
    pytest.importorskip("triton")
    from fnattn.kernels.skinny_linear import skinny_linear, skinny_linear_ref

    act, res = _randn(4, 3584, seed=37), _randn(4, 1024, seed=38, scale=4.0)
    w_down, w_up = _randn(1024, 3584, seed=39, scale=3584 ** -0.5), _randn(7168, 1024, seed=40, scale=1 / 32)
    norm = (_randn(1024, seed=41, scale=0.1), 1e-6, 1.0)

    def step():
        hidden = skinny_linear(act, w_down, residual=res)
        return hidden, skinny_linear(hidden, w_up, norm=norm)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        hidden, up = step()
    act.copy_(_randn(4, 3584, seed=42))
    res.copy_(_randn(4, 1024, seed=43, scale=4.0))
    g.replay()
    want_hidden = skinny_linear_ref(act, w_down, residual=res)
    _check(record, "skinny_linear down + residual, graph replay", hidden, want_hidden, 1e-2)
    _check(record, "skinny_linear gate_up with norm(1+w), graph replay", up,
           skinny_linear_ref(want_hidden, w_up, norm=norm), 2e-2)


@pytest.mark.parametrize("rows", [1, 16, 17])
def test_fused_linear_routes_and_reshapes(rows, record):
    """3-D inputs, strided rows and the 16-row bound (17 rows: cuBLAS) all give F.linear's answer."""
    pytest.importorskip("triton")
    w = _randn(1024, 2048, seed=19, scale=2048 ** -0.5)
    x3 = _randn(1, rows, 2048, seed=20)
    got = fused.linear(x3, w)
    assert got.shape == (1, rows, 1024)
    _check(record, f"fused.linear [1, {rows}, 2048]", got, F.linear(x3, w), 1e-2)
    wide = _randn(rows, 3072, seed=21)[:, 512:2560]  # strided rows
    _check(record, f"fused.linear strided rows {rows}", fused.linear(wide, w), F.linear(wide, w), 1e-2)


@pytest.mark.parametrize("rows", [1, 8, 17])
def test_fused_linear_widened_logits_are_the_float_of_the_product(rows, record):
    """``widen=True`` (the lm_head's logits): the GEMV stores its bf16-rounded sums as fp32 itself, the bits of
    ``fused.linear(...).float()``; above 16 rows cuBLAS's product, widened."""
    pytest.importorskip("triton")
    w = _randn(248320, 1024, seed=22, scale=1024 ** -0.5)  # the Qwen3.5 vocabulary
    x = _randn(rows, 1024, seed=23)
    got, want = fused.linear(x, w, widen=True), fused.linear(x, w).float()
    ok = got.dtype == torch.float32 and torch.equal(got, want)
    record({"case": f"fused.linear widen rows {rows}", "backend": "fused", "reference": "linear().float()",
            "bitwise": ok, "ok": ok})
    assert ok


SLICE_0_8B = {  # four layers of the Qwen3.5-0.8B shape (3 GDN + 1 gated full attention), a smaller vocab
    "model_type": "qwen3_5_text", "vocab_size": 4096, "hidden_size": 1024, "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"], "intermediate_size": 3584, "hidden_act": "silu",
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": True,
}


VARIANTS = {"default": None, "qk norms and rope apart": lambda on: fused.qk_one_launch(not on), "pdl": kernels.pdl,
            "output gates": fused.output_gates, "gemv l2 prefetch": lambda on: configured(prefetch=on),
            "own norm and act": fused.own_norm_act, "gating epilogue": fused.gating_epilogue,
            "swiglu epilogue": fused.swiglu_epilogue, "gemv early4": lambda on: configured(early=4 if on else 1),
            "gdn state first": gdn_decode_fused.state_first,
            "split norm": fused.split_norm}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name, config", [("tiny", None), ("0.8b slice", SLICE_0_8B)])
def test_whole_model_fused_matches_unfused(name, config, variant, record):
    """Also with each switch the other way: `fused.qk_one_launch` off (FlashInfer's q / k
    norms and rope, v copied apart), `kernels.pdl` on (the kernels launched with PDL), `fused.output_gates`
    on (GDN's gated norm and the attention gate as fnattn's own launches), the GEMVs' L2 prefetch on,
    `fused.own_norm_act` on (fnattn's add + RMSNorm and SiLU-and-mul), `fused.gating_epilogue` on (GDN's
    gating in its input projection's GEMV), `fused.swiglu_epilogue` on (SiLU-and-mul in the gate / up
    GEMV's launch), the GEMVs' first load four K tiles wide (`SkinnyConfig.early`), the fused GDN decode's state
    read before its PDL wait (`kernels.gdn_decode_fused.state_first`), the residual adds in the
    output projections and the norms after them finished by the next GEMVs (`fused.split_norm`)."""
    pytest.importorskip("flashinfer")
    model = random_model("qwen3_5", dtype=BF16, device="cuda", config=config, seed=2)
    ma = fa.ModelAttention(model.specs, device="cuda")
    prompts = spread_prompts(model.config.vocab_size)

    def run():
        st = fa.State(model.specs, num_pages=64, page_size=16, max_requests=2, device="cuda")
        st = st.admit(0).admit(1)
        with torch.no_grad():
            st, last = prefill(model.step, model.params, ma, st, prompts)
            out = [torch.stack([last[0], last[1]])]
            for t in range(8):
                st = st.reserve({0: 1, 1: 1})
                tokens = torch.tensor([t + 1, t + 2], device="cuda")
                st, logits = run_step(model.step, model.params, ma, st, fa.Batch.decode(st, [0, 1]), tokens)
                out.append(logits)
        return torch.cat(out)

    with fused.unfused():
        want = run()
    switch = VARIANTS[variant]
    with switch(True) if switch else contextlib.nullcontext():
        got = run()
    name += "" if switch is None else f", {variant}"
    _check(record, f"qwen3_5 {name}: logits, prefill + 8 decode steps", got, want, 3e-2)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    record({"case": f"qwen3_5 {name}: top-1 agreement", "backend": "fused", "agreement": agree, "ok": agree >= 0.75})
    assert agree >= 0.75, f"top-1 agreement {agree:.2f}"


@pytest.mark.parametrize("T", [1, 8, 16, 512])
def test_qk_norm_rope_against_the_unfused_norms_and_rope(T, record):
    """`fnattn.kernels.qk_norm_rope` on Qwen3.5-0.8B's attention (8 q / 2 kv heads of 256, rope on 64 dims,
    theta 1e7): q / k / v cut from one qkv GEMM output, as the model cuts them; against the model's
    rms_norm + apply_rope (the torch bodies), in eager and in a CUDA-graph replay."""
    from fnattn.kernels.qk_norm_rope import qk_norm_rope
    from fnattn.models.common import apply_rope, rms_norm

    qkv = _randn(T, 2 * 8 * 256 + 2 * 2 * 256, seed=50, scale=3.0)
    qg, k, v = qkv.split([4096, 512, 512], dim=-1)
    q = qg.view(T, 8, 512)[..., :256]
    k, v = k.view(T, 2, 256), v.view(T, 2, 256)
    wq, wk = _randn(256, seed=51, scale=0.2), _randn(256, seed=52, scale=0.2)
    pos = torch.arange(8000 - T, 8000, device="cuda")
    cos, sin = rope_cos_sin(pos, rope_inv_freq(64, 1e7, device="cuda"))
    want_q = apply_rope(rms_norm(q, wq, 1e-6, offset=1.0), cos, sin)
    want_k = apply_rope(rms_norm(k, wk, 1e-6, offset=1.0), cos, sin)
    qo, ko, vo = qk_norm_rope(q, k, v, wq, wk, cos, sin, eps=1e-6)
    _check(record, f"qk_norm_rope q T{T}", qo, want_q, 1e-2)
    _check(record, f"qk_norm_rope k T{T}", ko, want_k, 1e-2)
    assert torch.equal(vo, v) and vo.is_contiguous()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gq, gk, gv = qk_norm_rope(q, k, v, wq, wk, cos, sin, eps=1e-6)
    qkv.copy_(_randn(*qkv.shape, seed=53, scale=3.0))
    graph.replay()
    torch.cuda.synchronize()
    _check(record, f"qk_norm_rope q T{T}, graph replay on new inputs", gq,
           apply_rope(rms_norm(q, wq, 1e-6, offset=1.0), cos, sin), 1e-2)
    assert torch.equal(gv, v)


@pytest.mark.parametrize("T", [1, 8, 512])
def test_output_gates_against_the_unfused_ops(T, record):
    """`fnattn.kernels.output_gate` on Qwen3.5-0.8B's shapes, bf16: GDN's gated norm (16 heads of 128, z a
    column slice of the input projection) and the attention gate (8 heads of 256, the gate a slice of the
    q GEMM), against the model's torch bodies, eager and in a CUDA-graph replay on new inputs."""
    from fnattn.kernels.output_gate import gated_rms_norm_silu, sigmoid_gate
    from fnattn.models.common import rms_norm

    proj = _randn(T, 8224, seed=70, scale=2.0)
    z = proj[:, 6144:8192].view(T, 16, 128)
    o = _randn(T, 16, 128, seed=71, scale=2.0)
    w = _randn(128, seed=72, scale=0.5)
    qg = _randn(T, 8 * 512, seed=73, scale=2.0).view(T, 8, 512)
    gate, attn = qg[..., 256:], _randn(T, 8, 256, seed=74)

    def want():
        return ((rms_norm(o, w, 1e-6) * F.silu(z.float())).to(BF16), attn * torch.sigmoid(gate))

    got = (gated_rms_norm_silu(o, z, w, 1e-6), sigmoid_gate(attn, gate))
    for name, a, b in zip(("gated norm", "sigmoid gate"), got, want()):
        _check(record, f"output_gate {name} T{T}", a, b, 1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = (gated_rms_norm_silu(o, z, w, 1e-6), sigmoid_gate(attn, gate))
    proj.copy_(_randn(T, 8224, seed=75, scale=2.0))
    qg.copy_(_randn(T, 8, 512, seed=76, scale=2.0))
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(("gated norm", "sigmoid gate"), replayed, want()):
        _check(record, f"output_gate {name} T{T}, graph replay on new inputs", a, b, 1e-2)


@pytest.mark.parametrize("T", [1, 8, 512])
def test_own_norm_act_against_the_unfused_ops(T, record):
    """`fnattn.kernels.norm_act` on Qwen3.5-0.8B's shapes, bf16: the residual add + RMSNorm (1 + weight) in
    place and SiLU-and-mul (3584 wide), against the model's torch bodies, eager and in a CUDA-graph replay."""
    from fnattn.kernels.norm_act import add_rms_norm_, silu_and_mul
    from fnattn.models.common import rms_norm

    y, r = _randn(T, 1024, seed=80, scale=2.0), _randn(T, 1024, seed=81, scale=4.0)
    w, gu = _randn(1024, seed=82, scale=0.2), _randn(T, 2 * 3584, seed=83, scale=3.0)

    def want(y, r):
        x = r + y
        g, u = gu.chunk(2, dim=-1)
        return x, rms_norm(x, w, 1e-6, offset=1.0), F.silu(g) * u

    expected = want(y, r)
    got = (*add_rms_norm_(y.clone(), r.clone(), w, 1e-6, 1.0), silu_and_mul(gu))
    for name, a, b in zip(("residual sum", "add + norm", "silu_and_mul"), got, expected):
        _check(record, f"norm_act {name} T{T}", a, b, 1e-2)
    yb, rb = y.clone(), r.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = (*add_rms_norm_(yb, rb, w, 1e-6, 1.0), silu_and_mul(gu))
    y2, r2 = _randn(T, 1024, seed=84, scale=2.0), _randn(T, 1024, seed=85, scale=4.0)
    yb.copy_(y2)
    rb.copy_(r2)
    gu.copy_(_randn(T, 2 * 3584, seed=86, scale=3.0))
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(("residual sum", "add + norm", "silu_and_mul"), replayed, want(y2, r2)):
        _check(record, f"norm_act {name} T{T}, graph replay on new inputs", a, b, 1e-2)


@pytest.mark.parametrize("M", [1, 8])
def test_gating_epilogue_is_the_gemv_then_gdn_gating(M, record):
    """`skinny_linear_gating` on Qwen3.5-0.8B's GDN input projection (1024 -> 8224, b and a the last 32
    columns), bf16: the product, g and beta bitwise those of `skinny_linear` then `gdn_gating`, eager and in
    a CUDA-graph replay on new inputs."""
    from fnattn.kernels.gdn_gate import gdn_gating
    from fnattn.kernels.skinny_folds import skinny_linear_gating
    from fnattn.kernels.skinny_linear import skinny_linear

    x, w = _randn(M, 1024, seed=90), _randn(8224, 1024, seed=91, scale=1 / 32)
    nd = -torch.rand(16, device="cuda", generator=torch.Generator(device="cuda").manual_seed(92)).exp() * 4
    dtb = _randn(16, seed=93).float()

    def want():
        y = skinny_linear(x, w)
        return (y, *gdn_gating(y[:, 8208:8224], y[:, 8192:8208], nd, dtb))

    def same(got, expected):
        return all(torch.equal(a, b) for a, b in zip(got, expected))

    ok = same(skinny_linear_gating(x, w, 8192, nd, dtb), want())
    record({"case": f"skinny_linear_gating M{M}, eager", "backend": "fused", "bitwise": ok, "ok": ok})
    assert ok
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = skinny_linear_gating(x, w, 8192, nd, dtb)
    x.copy_(_randn(M, 1024, seed=94))
    graph.replay()
    torch.cuda.synchronize()
    ok = same(replayed, want())
    record({"case": f"skinny_linear_gating M{M}, graph replay on new inputs", "backend": "fused", "bitwise": ok,
            "ok": ok})
    assert ok


@pytest.mark.parametrize("M", [1, 8, 16])
def test_swiglu_epilogue_is_the_gemv_then_silu_and_mul(M, record):
    """`skinny_linear_swiglu` on Qwen3.5-0.8B's MLP (1024 -> 2 x 3584), bf16: fnattn's `silu_and_mul` over
    `skinny_linear`'s product (recorded whether bitwise; the tiles hold other rows, so a dot may sum in
    another order), eager and in a CUDA-graph replay on new inputs."""
    from fnattn.kernels.norm_act import silu_and_mul
    from fnattn.kernels.skinny_folds import skinny_linear_swiglu
    from fnattn.kernels.skinny_linear import skinny_linear

    x, w = _randn(M, 1024, seed=95), _randn(7168, 1024, seed=96, scale=1 / 32)
    got = skinny_linear_swiglu(x, w)
    want = silu_and_mul(skinny_linear(x, w))
    record({"case": f"skinny_linear_swiglu M{M}, eager: bitwise", "backend": "fused",
            "bitwise": torch.equal(got, want), "ok": True})
    _check(record, f"skinny_linear_swiglu M{M}, eager", got, want, 1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = skinny_linear_swiglu(x, w)
    x.copy_(_randn(M, 1024, seed=97))
    graph.replay()
    torch.cuda.synchronize()
    _check(record, f"skinny_linear_swiglu M{M}, graph replay on new inputs", replayed,
           silu_and_mul(skinny_linear(x, w)), 1e-2)
