"""The CPU SDPA backend reads its inputs by their strides: a valid non-contiguous ``q``, ``k`` or ``v`` (a slice of
a wider head dim, a column slice of a fused projection, a head-major layout, a broadcast) gives the reference's
output. torch's fused CPU kernel takes the head dim as
contiguous whatever its stride says, so a slice along it read the neighbouring values (NaN here)."""

import pytest
import torch
from helpers import full_inputs, full_spec, full_state_with, phase_batch, run

import fnattn as fa
from fnattn.kinds.cpu_sdpa import flash


def _strided(x: torch.Tensor, how: str) -> torch.Tensor:
    """A view with the values of ``x`` ``[T, H, D]`` and other strides; whatever lies between its rows is NaN."""
    T, H, D = x.shape
    if how == "every_other_in_head_dim":
        wide = torch.full((T, H, 2 * D), float("nan"), dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    if how == "column_of_a_projection":
        wide = torch.full((T, H * D + 5), float("nan"), dtype=x.dtype)
        wide[:, 3 : 3 + H * D] = x.reshape(T, H * D)
        return wide[:, 3 : 3 + H * D].view(T, H, D)
    if how == "heads_major":
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    assert how == "broadcast_head"
    return x[:, :1].expand(T, H, D)


HOWS = ["every_other_in_head_dim", "column_of_a_projection", "heads_major", "broadcast_head"]


@pytest.mark.parametrize("phase, cached, new", [("prefill", [0, 6], 5), ("decode", [0, 5], 1),
                                                ("verify", [4, 6], 3)])
@pytest.mark.parametrize("hq, hkv, window", [(4, 2, 0), (4, 4, 3)])
@pytest.mark.parametrize("how", HOWS)
def test_non_contiguous_q_k_v_give_the_reference_output(phase, cached, new, hq, hkv, window, how):
    spec = full_spec(0, hq=hq, hkv=hkv, d=8, sliding_window=window)
    st = full_state_with(spec, cached)
    counts = {r: new for r in range(len(cached))}
    st = st.reserve(counts)
    b = phase_batch(st, phase, counts)
    dense = full_inputs(spec, b.num_tokens, gen=torch.Generator().manual_seed(5))
    if how == "broadcast_head":  # the same values in every head, so that the dense copy is the broadcast's
        dense = fa.FullAttentionInputs(*(x[:, :1].expand_as(x).contiguous() for x in (dense.q, dense.k, dense.v)))
    ref, _ = run(fa.ModelAttention([spec], prefer=("reference",)), st, b, {0: dense})
    for name in ("q", "k", "v"):
        views = {n: getattr(dense, n) for n in ("q", "k", "v")}
        views[name] = _strided(views[name], how)
        assert torch.equal(views[name], getattr(dense, name))
        got, _ = run(fa.ModelAttention([spec], prefer=("sdpa",)), st, b, {0: fa.FullAttentionInputs(**views)})
        torch.testing.assert_close(got[0].o, ref[0].o, atol=1e-5, rtol=1e-5, msg=f"{name} {how}")
        torch.testing.assert_close(got[0].lse, ref[0].lse, atol=1e-5, rtol=1e-5, msg=f"{name} {how}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shared_cpu_kernel_wrapper_reads_a_strided_head_dim_as_its_values(dtype):
    # Every CPU sdpa backend (full, MLA, DeepSeek-V4) calls the kernel through this one wrapper.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g).to(dtype) for _ in range(3))
    want_o, want_lse = flash(q, k, v, scale=0.3)[:2]
    for i in range(3):
        args = [q, k, v]
        wide = torch.full((1, 2, 5, 16), float("nan"), dtype=dtype)
        wide[..., 1::2] = args[i]
        args[i] = wide[..., 1::2]
        o, lse = flash(*args, scale=0.3)[:2]
        assert torch.equal(o, want_o) and torch.equal(lse, want_lse), i
