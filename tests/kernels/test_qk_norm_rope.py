"""qk_norm_rope (q / k head RMSNorm + rope, v made contiguous, one launch) against its reference and the
model's own norm and rope."""

import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_ref  # noqa: E402
from fnattn.models.common import apply_rope, rms_norm, rope_cos_sin  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gemm_slices(T, Hq, Hkv, D, dtype, seed=0, extra=24):
    """q (per head, D query dims then D gate dims), k and v as column slices of one [T, width] GEMM output,
    as Qwen3.5's gated attention cuts them: strided in both the token and the head dim."""
    g = torch.Generator().manual_seed(seed)
    width = 2 * Hq * D + 2 * Hkv * D + extra
    out = (torch.randn(T, width, generator=g) * 3).to(DEVICE, dtype)
    qg, k, v = out[:, :-extra].split([2 * Hq * D, Hkv * D, Hkv * D], dim=-1)
    q = qg.view(T, Hq, 2 * D)[..., :D]
    return q, k.view(T, Hkv, D), v.view(T, Hkv, D)


def weights(D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(D, generator=g) * 0.3).to(DEVICE, dtype)


def tables(T, Dr, seed=3):
    inv = 1.0 / 10000.0 ** (torch.arange(0, Dr, 2, dtype=torch.float32) / Dr)
    pos = torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(seed))
    cos, sin = rope_cos_sin(pos, inv)
    return cos.to(DEVICE), sin.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T, Hq, Hkv, D, Dr", [(1, 4, 2, 16, 4), (5, 4, 2, 16, 16), (3, 8, 2, 32, 8),
                                              (2, 2, 1, 24, 6)])
def test_matches_reference_and_the_models_norm_then_rope(T, Hq, Hkv, D, Dr, dtype):
    q, k, v = gemm_slices(T, Hq, Hkv, D, dtype, seed=T)
    wq, wk = weights(D, dtype, 1), weights(D, dtype, 2)
    cos, sin = tables(T, Dr)
    got = qk_norm_rope(q, k, v, wq, wk, cos, sin, eps=1e-6)
    want = qk_norm_rope_ref(q, k, v, wq, wk, cos, sin, eps=1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for a, b, name in zip(got, want, "qkv"):
        assert a.is_contiguous() and a.shape == b.shape and a.dtype == dtype, name
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * 4, msg=name)
    assert torch.equal(got[2], v)  # v is copied, not changed
    # the reference is the model's rms_norm (offset 1) then apply_rope, bit for bit
    for x, w, ref in ((q, wq, want[0]), (k, wk, want[1])):
        model = apply_rope(rms_norm(x, w, 1e-6, offset=1.0), cos, sin)
        assert torch.equal(model, ref)


def test_offset_zero_and_no_v_and_untouched_inputs():
    T, Hq, Hkv, D, Dr = 4, 2, 2, 16, 8
    q, k, v = gemm_slices(T, Hq, Hkv, D, torch.float32, seed=7)
    before = [t.clone() for t in (q, k, v)]
    wq, wk = weights(D, torch.float32, 4) + 1, weights(D, torch.float32, 5) + 1
    cos, sin = tables(T, Dr)
    qo, ko, vo = qk_norm_rope(q, k, None, wq, wk, cos, sin, eps=1e-5, offset=0.0)
    rq, rk, _ = qk_norm_rope_ref(q, k, None, wq, wk, cos, sin, eps=1e-5, offset=0.0)
    assert vo is None
    torch.testing.assert_close(qo, rq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ko, rk, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), before))


def test_no_rope_dims_is_the_norm_alone():
    q, k, v = gemm_slices(2, 2, 1, 16, torch.float32, seed=8)
    wq, wk = weights(16, torch.float32, 6), weights(16, torch.float32, 7)
    empty = torch.zeros(2, 0, device=DEVICE)
    qo, ko, _ = qk_norm_rope(q, k, v, wq, wk, empty, empty, eps=1e-6)
    torch.testing.assert_close(qo, rms_norm(q, wq, 1e-6, offset=1.0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ko, rms_norm(k, wk, 1e-6, offset=1.0), rtol=1e-5, atol=1e-5)


def test_zero_tokens():
    q, k, v = (torch.zeros(0, h, 16, device=DEVICE) for h in (2, 1, 1))
    w = torch.zeros(16, device=DEVICE)
    cos = torch.zeros(0, 8, device=DEVICE)
    qo, ko, vo = qk_norm_rope(q, k, v, w, w, cos, cos, eps=1e-6)
    assert qo.shape == (0, 2, 16) and ko.shape == (0, 1, 16) and vo.shape == (0, 1, 16)


def test_bad_arguments_name_themselves():
    q, k, v = gemm_slices(3, 2, 1, 16, torch.float32)
    w = weights(16, torch.float32, 1)
    cos, sin = tables(3, 8)
    cases = [
        (dict(q=q[0]), "q: expected a [T, H, D] tensor, got (2, 16)"),
        (dict(k=k[:2]), "k: expected shape [3, Hkv, 16]"),
        (dict(v=v[:, :, :0].expand(3, 2, 0)), "v: expected shape [3, 1, Dv]"),
        (dict(q_weight=w[:8]), "q_weight: expected shape (16,), got (8,)"),
        (dict(k_weight=w.half()), "k_weight: expected dtype torch.float32 (q's), got torch.float16"),
        (dict(cos=cos[:2]), "cos: expected a [3, Dr] tensor (q's tokens), got (2, 8)"),
        (dict(cos=torch.zeros(3, 5, device=DEVICE), sin=torch.zeros(3, 5, device=DEVICE)),
         "cos: expected an even number of rope dims <= the head dim 16, got 5"),
        (dict(sin=sin[:, :4]), "sin: expected cos's shape (3, 8), got (3, 4)"),
        (dict(q=q.transpose(1, 2).contiguous().transpose(1, 2)), "q: expected unit stride along its last dim"),
        (dict(eps=-1.0), "eps: expected >= 0, got -1.0"),
        (dict(offset=float("nan")), "offset: expected a finite Python float, got nan"),
    ]
    base = dict(q=q, k=k, v=v, q_weight=w, k_weight=w, cos=cos, sin=sin, eps=1e-6)
    for change, message in cases:
        for fn in (qk_norm_rope, qk_norm_rope_ref):
            with pytest.raises(ValueError, match=re.escape(message)):
                fn(**{**base, **change})


def test_models_qk_norm_rope_takes_the_kernel_unless_switched_off(monkeypatch):
    """`models.fused.qk_norm_rope`: by default (here with the kernel path allowed on this device) the one
    launch, or under `qk_one_launch(False)` the model's norms, rope and v copy, which agree with it."""
    from fnattn.kernels import qk_norm_rope as module
    from fnattn.models import fused

    monkeypatch.setattr(fused, "_kernel", lambda package, *ts: package == "triton")
    calls = []
    real = module.qk_norm_rope
    monkeypatch.setattr(module, "qk_norm_rope", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k, v = gemm_slices(3, 4, 2, 16, torch.float32, seed=9)
    wq, wk = weights(16, torch.float32, 10), weights(16, torch.float32, 11)
    cos, sin = tables(3, 8)
    with fused.qk_one_launch(False):
        plain = fused.qk_norm_rope(q, k, v, wq, wk, 1e-6, cos, sin)
    assert not calls
    got = fused.qk_norm_rope(q, k, v, wq, wk, 1e-6, cos, sin)
    assert calls == [1]
    for a, b in zip(got, plain):
        assert a.is_contiguous() and b.is_contiguous()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="qk_one_launch: expected True or False, got None"):
        with fused.qk_one_launch(None):
            pass
