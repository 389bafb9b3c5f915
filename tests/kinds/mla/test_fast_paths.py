"""What the fast MLA paths rest on, checked on the CPU: the config's padded heads and FP8 cache, the
references over an FP8 cache, the latent-space split-and-merge the fast backends use, the sparse
index split, capability refusals, and padded heads through whole DeepSeek-V3.2 / GLM-5 models.
The kernels themselves are compared on the GPU (tests/gpu/test_mla_backends_gpu.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from fnattn.models.registry import random_model

import fnattn as fa
from fnattn.driver import run_step
from fnattn.kinds.mla import flashinfer as mla_flashinfer
from fnattn.kinds.mla import flashmla as mla_flashmla
from fnattn.kinds.mla.latent import absorb_kernel, absorbed_query, absorbed_query_torch, merge, own_rows
from fnattn.kinds.mla.math import mla_absorbed
from fnattn.kinds.sparse_mla import flashmla as sparse_flashmla
from kinds.mla.fast_cases import compare, filled_state, mla_config, sparse_specs, step_inputs

SMALL = dict(R=16, Dr=8, Dn=8, Dv=8)


def test_config_checks_name_the_field():
    with pytest.raises(ValueError, match="padded_heads"):
        mla_config(H=8, padded=4)
    with pytest.raises(ValueError, match="cache_dtype"):
        mla_config(cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="cache_scale"):
        mla_config(cache_dtype="fp8_e4m3", cache_scale=0.0)
    c = mla_config(H=4, padded=64, cache_dtype="fp8_e4m3", cache_scale=0.5)
    assert c.heads == 64 and c.fp8_cache
    (decl,) = c.storage(torch.bfloat16)
    assert decl.dtype == torch.float8_e4m3fn and decl.shape == (576,)


def test_fp8_rows_round_trip_within_e4m3_precision():
    c = mla_config(cache_dtype="fp8_e4m3", cache_scale=0.25)
    x = torch.randn(64, 576)
    stored = c.encode_latent(x)
    assert stored.dtype == torch.float8_e4m3fn
    back = c.decode_latent(stored, torch.float32)
    assert torch.allclose(back, x, rtol=0.07, atol=0.25 * 2 ** -9)
    assert torch.equal(c.as_cached(x), back)


def _spec(**kw):
    return fa.LayerSpec(0, mla_config(**{**SMALL, **kw}), torch.float32)


@pytest.mark.parametrize("phase", ["decode", "verify"])
def test_fp8_reference_attends_the_dequantized_cache(phase):
    spec = _spec(H=2, cache_dtype="fp8_e4m3", cache_scale=0.5)
    m = spec.config
    st = filled_state([spec], [5, 0, 9], page_size=4)
    assert st.views(0).latent.dtype == torch.float8_e4m3fn
    n = 1 if phase == "decode" else 3
    b = fa.Batch.decode(st, [0, 1, 2]) if n == 1 else fa.Batch.verify(st, [0, 1, 2], num_draft=n - 1)
    inp = step_inputs(spec, b, seed=3)
    ma = fa.ModelAttention([spec], prefer=("reference",))
    with ma.session(st, b) as s:
        out, w = s.forward(0, inp)
    assert w["latent"].dtype == torch.float8_e4m3fn
    from fnattn.kinds.full.reference import cached_tokens

    for r, c in enumerate(b.host_cache_lens):
        rows = slice(r * n, (r + 1) * n)
        cached = m.decode_latent(cached_tokens(st.views(0).latent, b.block_table[r], c, 4), torch.float32)
        keys = torch.cat((cached, m.as_cached(inp.latent[rows])))
        o, lse = mla_absorbed(inp.q_nope[rows], inp.q_pe[rows], keys, inp.w_uk, inp.w_uv, scale=m.scale, n_cached=c)
        assert torch.allclose(out.o[rows], o, atol=1e-5) and torch.allclose(out.lse[rows], lse, atol=1e-5)
    st2 = st.apply(fa.StepDeltas.collect(b, [w]))
    assert st2.request(2).length == 9 + n


def test_padded_heads_leave_the_model_heads_unchanged():
    """Zero padding heads (as the model pads) change nothing in the model's own heads."""
    plain, padded = _spec(H=3), _spec(H=3, padded=8)
    st_p = filled_state([plain], [6, 2], page_size=4, seed=1)
    st_q = filled_state([padded], [6, 2], page_size=4, seed=1)
    for st in (st_p, st_q):
        assert st.views(0).latent.shape[-1] == 24
    bp, bq = fa.Batch.decode(st_p, [0, 1]), fa.Batch.decode(st_q, [0, 1])
    ip, iq = step_inputs(plain, bp, seed=2), step_inputs(padded, bq, seed=2)
    # the same model heads: copy the plain inputs into the padded ones
    iq = dataclasses.replace(iq, q_nope=torch.cat((ip.q_nope, iq.q_nope[:, 3:]), 1),
                             q_pe=torch.cat((ip.q_pe, iq.q_pe[:, 3:]), 1), latent=ip.latent,
                             w_uk=torch.cat((ip.w_uk, iq.w_uk[3:]), 0), w_uv=torch.cat((ip.w_uv, iq.w_uv[3:]), 0))
    outs = []
    for st, b, spec, inp in ((st_p, bp, plain, ip), (st_q, bq, padded, iq)):
        with fa.ModelAttention([spec], prefer=("reference",)).session(st, b) as s:
            outs.append(s.forward(0, inp)[0])
    assert torch.allclose(outs[0].o, outs[1].o[:, :3], atol=1e-6)
    assert outs[1].o[:, 3:].abs().max() == 0  # zero W_UV rows read out zero


@pytest.mark.parametrize("n", [1, 2, 4])
def test_cached_part_plus_own_rows_merged_is_the_whole_attention(n):
    """The fast backends' split: (cached, not causal) + (own rows, causal) merged by LSE."""
    g = torch.Generator().manual_seed(n)
    B, H, R, Dr = 3, 4, 16, 8
    cached = [0, 5, 11]
    q = torch.randn(B * n, H, R + Dr, generator=g)
    new = torch.randn(B * n, R + Dr, generator=g)
    eye = torch.eye(R).expand(H, R, R)  # W_UK = W_UV = I: absorbed q is the latent query
    o_n, lse_n = own_rows(q, new, n=n, scale=0.3, R=R)
    for b, c in enumerate(cached):
        rows = slice(b * n, (b + 1) * n)
        prefix = torch.randn(c, R + Dr, generator=g)
        keys = torch.cat((prefix, new[rows]))
        want, want_lse = mla_absorbed(q[rows, :, :R], q[rows, :, R:], keys, eye, eye, scale=0.3, n_cached=c)
        if c:
            o_c, lse_c = mla_absorbed(q[rows, :, :R], q[rows, :, R:], prefix, eye, eye, scale=0.3, n_cached=c,
                                      causal=False)
        else:
            o_c, lse_c = torch.zeros(n, H, R), torch.full((n, H), float("-inf"))
        o, lse = merge(o_c, lse_c, o_n[rows], lse_n[rows])
        assert torch.allclose(o, want, atol=1e-5) and torch.allclose(lse, want_lse, atol=1e-5)


def test_own_rows_with_nothing_selected_is_empty_not_nan():
    q, new = torch.randn(2, 2, 24), torch.randn(2, 24)
    o, lse = own_rows(q, new, n=2, scale=1.0, R=16, allowed=torch.zeros(2, 2, dtype=torch.bool))
    assert torch.isneginf(lse).all() and (o == 0).all()
    o2, lse2 = merge(o, lse, o, lse)
    assert torch.isneginf(lse2).all() and not torch.isnan(o2).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_query_is_the_product_beside_the_rope_part(dtype):
    """Written in place (the product into its columns, q_pe beside it): the concatenation's values (a BLAS
    may block a strided output differently: to fp32 rounding), contiguous."""
    g = torch.Generator().manual_seed(0)
    T, H, Dn, R, Dr = 5, 4, 16, 32, 8
    q_nope, q_pe = torch.randn(T, H, Dn, generator=g).to(dtype), torch.randn(T, H, Dr, generator=g).to(dtype)
    w_uk = torch.randn(H, Dn, R, generator=g).to(dtype)
    got = absorbed_query(dataclasses.make_dataclass("Q", ["q_nope", "q_pe", "w_uk"])(q_nope, q_pe, w_uk))
    want = torch.cat((torch.einsum("thd,hdr->thr", q_nope.float(), w_uk.float()).to(dtype), q_pe), dim=-1)
    assert got.is_contiguous() and got.shape == (T, H, R + Dr) and got.dtype == dtype
    assert torch.equal(got[..., R:], q_pe)
    torch.testing.assert_close(got, want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)


def test_absorb_kernel_switch():
    """On by default; a CPU query keeps the torch product (the kernel serves CUDA tensors); a non-bool is
    refused by name. The merge with W_UV in one launch is on by default too (dense MLA; sparse MLA's is off)."""
    from fnattn.kinds.mla import latent

    assert latent._ABSORB_KERNEL[-1] is True and latent._MERGE_VALUES[-1] is True
    g = torch.Generator().manual_seed(1)
    Q = dataclasses.make_dataclass("Q", ["q_nope", "q_pe", "w_uk"])
    q = Q(torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 8, generator=g), torch.randn(2, 16, 32, generator=g))
    with absorb_kernel(True):
        assert latent._ABSORB_KERNEL[-1] is True
        assert torch.equal(absorbed_query(q), absorbed_query_torch(q))
    assert latent._ABSORB_KERNEL[-1] is True
    with latent.merge_values_kernel(False):
        assert latent._MERGE_VALUES[-1] is False
    assert latent._MERGE_VALUES[-1] is True
    from fnattn.kinds.sparse_mla import flashmla as sparse  # sparse MLA's own: off by default

    assert sparse._MERGE_VALUES[-1] is False
    with sparse.merge_values_kernel(True):
        assert sparse._MERGE_VALUES[-1] is True and latent._MERGE_VALUES[-1] is True
    assert sparse._MERGE_VALUES[-1] is False
    with pytest.raises(ValueError, match="absorb_kernel: expected True or False, got 'yes'"):
        with absorb_kernel("yes"):
            pass


def test_sparse_indices_split_into_pool_slots_and_step_rows():
    specs = sparse_specs(topk=4, Hi=2, Di=8, **SMALL, H=2, dtype=torch.float32)
    st = filled_state(specs, [5, 0], page_size=4)
    b = fa.Batch.prefill(st, {0: 2, 1: 3})
    meta = fa.SparseQueryMetadata.build(b, topk=4)
    idx = torch.tensor([[0, 4, 5, -1], [6, 3, -1, -1], [0, -1, -1, -1], [1, 0, -1, -1], [2, 1, 0, -1]])
    from fnattn.kernels.sparse_slots import topk_slots_ref

    slots, rows, _ = topk_slots_ref(idx, meta.request_of_token, b.cache_lens, b.cu_seqlens, b.block_table,
                                    page_size=4, rows=True)
    fresh = rows >= 0  # the step's own positions
    S, bt = 4, b.block_table.long()
    assert slots[0].tolist() == [bt[0, 0] * S, bt[0, 1] * S, -1, -1]
    assert rows[0].tolist() == [-1, -1, 0, -1] and rows[1].tolist() == [1, -1, -1, -1]
    assert rows[4].tolist() == [4, 3, 2, -1] and (slots[2:] == -1).all()
    # every valid position lands in exactly one part
    assert torch.equal((slots >= 0) | (rows >= 0), idx >= 0) and not ((slots >= 0) & fresh).any()


def test_capability_refusals_say_why():
    cuda = torch.device("cuda")
    tiny = fa.LayerSpec(0, mla_config(H=4, **SMALL), torch.bfloat16)
    fp8 = fa.LayerSpec(0, mla_config(H=4, cache_dtype="fp8_e4m3"), torch.bfloat16)
    assert any("512 + 64" in r for r in mla_flashmla.supports(tiny, cuda))
    assert any("flashinfer" in r for r in mla_flashmla.supports(fp8, cuda))
    assert not any("FP8" in r for r in mla_flashinfer.supports(fp8, cuda))
    (sp,) = sparse_specs(topk=8, H=16)
    assert any("padded_heads" in r for r in sparse_flashmla.supports(sp, cuda))
    (sp64,) = sparse_specs(topk=8, H=16, padded=64)
    assert not any("heads" in r for r in sparse_flashmla.supports(sp64, cuda))
    text = fa.ModelAttention([tiny], device="cpu").explain()
    assert "flashmla" in text and "needs a CUDA device" in text


@pytest.mark.parametrize("backend", ["reference"])
def test_compare_harness_finds_no_difference_with_itself(backend):
    specs = sparse_specs(topk=4, Hi=2, Di=8, shared=True, H=2, padded=4, dtype=torch.float32, **SMALL)
    st = filled_state(specs, [7, 1], page_size=4)
    rows = compare(specs, st, fa.Batch.decode(st, [0, 1]), backend)
    assert all(r["o_rel"] == 0 and r["writes_equal"] and r["topk_mismatch"] == 0 for r in rows)


@pytest.mark.parametrize("name", ["deepseek_v32", "glm5"])
def test_padded_heads_through_the_model_give_the_same_logits(name):
    """The model pads to `padded_heads` and drops the padding again: logits are unchanged."""
    model = random_model(name)
    padded = dataclasses.replace(model.params, config=dataclasses.replace(model.config, padded_heads=16))
    assert padded.config.specs[0].config.mla.heads == 16
    logits = []
    for params in (model.params, padded):
        ma = fa.ModelAttention(params.config.specs)
        st = fa.State(params.config.specs, num_pages=16, page_size=4, max_requests=2, fill=float("nan"))
        st = st.admit(0).admit(1).reserve({0: 12, 1: 12})
        b = fa.Batch.prefill(st, {0: 9, 1: 3})
        st, lp = run_step(model.step, params, ma, st, b, torch.arange(12) % 150)
        b = fa.Batch.decode(st, [0, 1])
        st, ld = run_step(model.step, params, ma, st, b, torch.tensor([5, 7]))
        logits.append(torch.cat((lp, ld)))
    assert torch.allclose(logits[0], logits[1], atol=1e-5)


@pytest.mark.parametrize("n", [1, 2])
def test_fold_own_rows_reads_a_kernels_no_key_marks(n):
    """The cached part as FlashMLA leaves it: base-2 LSE, +inf (a zero output) for a query with no cached key.
    The fold reads the mark as an empty part, in the torch form (verify, and any CPU step) as in the kernel."""
    from fnattn.kinds.mla.latent import fold_own_rows

    g = torch.Generator().manual_seed(7)
    B, H, R, Dr = 2, 3, 16, 8
    q = torch.randn(B * n, H, R + Dr, generator=g)
    new = torch.randn(B * n, R + Dr, generator=g)
    o_c = torch.randn(B * n, H, R, generator=g)
    lse_nat = torch.randn(B * n, H, generator=g)
    lse_c = lse_nat / math.log(2.0)
    o_c[:n], lse_c[:n] = 0.0, float("inf")  # request 0: no cached key
    o, lse = fold_own_rows(q, o_c, lse_c, new, n=n, scale=0.3, lse_base2=True)
    o_n, lse_n = own_rows(q, new, n=n, scale=0.3, R=R)
    assert torch.allclose(o[:n], o_n[:n].to(o.dtype), atol=1e-6) and torch.allclose(lse[:n], lse_n[:n], atol=1e-6)
    want, want_lse = merge(o_c[n:], lse_nat[n:], o_n[n:], lse_n[n:])
    assert torch.allclose(o[n:], want.to(o.dtype), atol=1e-5) and torch.allclose(lse[n:], want_lse, atol=1e-5)
