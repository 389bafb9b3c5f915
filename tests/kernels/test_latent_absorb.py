"""absorb_query (MLA's absorbed query in one launch) against its reference and the batched product the
backends used before it."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels.latent_absorb import absorb_query, absorb_query_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(T, H, Dn, R, Dr, dtype, seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype).to(DEVICE)  # noqa: E731
    if strided:  # q_nope and q_pe as halves of one projection's output, as the models slice them
        q = r(T, H, Dn + Dr)
        return q[..., :Dn], q[..., Dn:], r(H, Dn, R) * Dn ** -0.5
    return r(T, H, Dn), r(T, H, Dr), r(H, Dn, R) * Dn ** -0.5


@pytest.mark.parametrize("T, H, Dn, R, Dr, block_r", [(1, 2, 16, 32, 8, 16), (5, 3, 16, 48, 8, 32),
                                                      (70, 2, 32, 64, 16, 64), (3, 1, 24, 40, 6, 128)])
@pytest.mark.parametrize("strided", [False, True])
def test_matches_the_reference(T, H, Dn, R, Dr, block_r, strided):
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    qn, qp, w = inputs(T, H, Dn, R, Dr, dtype, strided=strided)
    got, want = absorb_query(qn, qp, w, block_r=block_r), absorb_query_ref(qn, qp, w)
    assert got.shape == (T, H, R + Dr)
    assert torch.equal(got[..., R:], qp)  # q_pe is copied, not computed
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # the batched product the MLA backends ran before
    bmm = torch.bmm(qn.transpose(0, 1).float(), w.float()).transpose(0, 1).to(dtype)
    torch.testing.assert_close(got[..., :R], bmm, atol=tol, rtol=tol)


def test_weight_rows_of_any_stride():
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16  # a GPU's fp32 dot is TF32
    qn, qp, w = inputs(4, 2, 16, 32, 8, dtype)
    wide = torch.zeros(2, 16, 48, device=DEVICE, dtype=dtype)
    wide[..., :32] = w
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(absorb_query(qn, qp, wide[..., :32]), absorb_query_ref(qn, qp, w), atol=tol, rtol=tol)


def test_no_tokens():
    qn, qp, w = inputs(0, 2, 16, 32, 8, torch.float32)
    assert absorb_query(qn, qp, w).shape == (0, 2, 40)


@pytest.mark.parametrize("bad, match", [
    (lambda qn, qp, w: (qn, qp[:, :1], w), "q_pe: expected shape"),
    (lambda qn, qp, w: (qn, qp, w[:1]), "w_uk: expected shape"),
    (lambda qn, qp, w: (qn, qp.double(), w), "q_pe: expected dtype torch.float32 \\(q_nope's\\)"),
    (lambda qn, qp, w: (qn[0], qp, w), "q_nope: expected a 3-d tensor"),
    (lambda qn, qp, w: (qn, qp, w.transpose(1, 2).contiguous().transpose(1, 2)), "w_uk: expected a unit stride"),
])
def test_bad_arguments_name_the_argument(bad, match):
    args = bad(*inputs(2, 2, 16, 32, 8, torch.float32))
    with pytest.raises(ValueError, match=match):
        absorb_query(*args)


@pytest.mark.parametrize("T, block_t, token_split, block_k, num_stages", [
    (70, 16, 1, 16, 2), (70, 16, 3, None, 2), (40, 32, 2, 16, 3), (5, 16, 4, 16, 1), (33, 16, 8, 32, 2)])
def test_every_tiling_gives_the_reference(T, block_t, token_split, block_k, num_stages):
    """Token runs shared out over programs (the last one short) and the weight read in steps of ``block_k``
    rows: the same product."""
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    qn, qp, w = inputs(T, 3, 32, 48, 8, dtype, strided=True)
    got = absorb_query(qn, qp, w, block_r=32, block_t=block_t, token_split=token_split, block_k=block_k,
                       num_stages=num_stages)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, absorb_query_ref(qn, qp, w), atol=tol, rtol=tol)


@pytest.mark.parametrize("name, value, want", [
    ("block_r", 24, "a power of two >= 16, got 24"), ("block_t", 8, "a power of two >= 16, got 8"),
    ("block_k", 48, "a power of two >= 16, got 48"), ("token_split", 0, "an int >= 1, got 0"),
    ("num_stages", True, "an int >= 1, got True")])
def test_a_bad_tile_is_named(name, value, want):
    with pytest.raises(ValueError, match=f"absorb_query: {name}: expected {want}"):
        absorb_query(*inputs(2, 2, 16, 32, 8, torch.float32), **{name: value})


# --------------------------------------------------------------------------- merge_own_values

from fnattn.kernels.latent_absorb import merge_own_values, merge_own_values_ref  # noqa: E402


def merge_inputs(T, H, R, Dr, Dv, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    o_c, lse_c = r(T, H, R), r(T, H) * 3
    o_c[0, 0] = float("nan")  # a query FlashMLA marks as without keys: its output must not leak
    lse_c[0, 0] = float("inf")
    if T > 2:
        lse_c[2, :] = float("nan")
    q, new, w = r(T, H, R + Dr) * 0.3, r(T, R + Dr) * 0.3, r(H, Dv, R) * R ** -0.5
    return [x.to(dtype).to(DEVICE) if x is not lse_c else x.to(DEVICE) for x in (o_c, lse_c, q, new, w)]


@pytest.mark.parametrize("T, H, R, Dr, Dv, block_t, block_v", [
    (1, 2, 32, 8, 16, 16, None), (5, 3, 64, 16, 24, 16, 16), (40, 2, 96, 8, 32, 32, None),
    (70, 1, 64, 8, 16, 64, None), (40, 2, 96, 8, 48, 16, 16)])
@pytest.mark.parametrize("lse_base2", [False, True])
@pytest.mark.parametrize("masks", ["none", "cache_lens", "allowed", "both"])
def test_merge_own_values_matches_the_reference(T, H, R, Dr, Dv, block_t, block_v, lse_base2, masks):
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    o_c, lse_c, q, new, w = merge_inputs(T, H, R, Dr, Dv, dtype)
    g = torch.Generator().manual_seed(T)
    lens = (torch.randint(0, 3, (T,), generator=g).int() * 7).to(DEVICE) if masks in ("cache_lens", "both") else None
    allowed = (torch.rand(T, generator=g) > 0.4).to(DEVICE) if masks in ("allowed", "both") else None
    kw = dict(scale=0.2, lse_base2=lse_base2, cache_lens=lens, allowed=allowed)
    got_o, got_lse = merge_own_values(o_c, lse_c, q, new, w, block_t=block_t, block_v=block_v, block_r=32, **kw)
    want_o, want_lse = merge_own_values_ref(o_c, lse_c, q, new, w, **kw)
    assert got_o.shape == (T, H, Dv) and got_o.dtype == w.dtype and got_lse.dtype == torch.float32
    assert not torch.isnan(got_o).any()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got_o.float(), want_o.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-4, rtol=1e-4)


def test_merge_own_values_of_a_token_with_nothing_to_attend():
    """No cached key and its own row not picked: a zero output and -inf, as the references give."""
    o_c, lse_c, q, new, w = merge_inputs(2, 2, 32, 8, 16, torch.float32)
    lse_c[:] = float("inf")
    o, lse = merge_own_values(o_c, lse_c, q, new, w, scale=0.2,
                              allowed=torch.tensor([False, True], device=DEVICE))
    assert (o[0] == 0).all() and torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("bad, match", [
    (lambda a: {**a, "lse_c": a["lse_c"][:1]}, "lse_c: expected shape"),
    (lambda a: {**a, "new": a["new"][:, :16]}, "q: expected shape"),
    (lambda a: {**a, "w_uv": a["w_uv"][:1]}, "w_uv: expected shape"),
    (lambda a: {**a, "lse_c": a["lse_c"].double()}, "lse_c: expected dtype torch.float32"),
    (lambda a: {**a, "cache_lens": torch.zeros(3, dtype=torch.int32, device=DEVICE)}, "cache_lens: expected \\[2\\]"),
])
def test_merge_own_values_names_a_bad_argument(bad, match):
    o_c, lse_c, q, new, w = merge_inputs(2, 2, 32, 8, 16, torch.float32)
    args = bad(dict(o_c=o_c, lse_c=lse_c, q=q, new=new, w_uv=w))
    with pytest.raises(ValueError, match=match):
        merge_own_values(args["o_c"], args["lse_c"], args["q"], args["new"], args["w_uv"], scale=0.2,
                         cache_lens=args.get("cache_lens"))


@pytest.mark.parametrize("name, value", [("block_v", 12), ("block_r", 0), ("block_t", 8)])
def test_merge_own_values_names_a_bad_tile(name, value):
    o_c, lse_c, q, new, w = merge_inputs(2, 2, 32, 8, 16, torch.float32)
    with pytest.raises(ValueError, match=f"merge_own_values: {name}: expected a power of two >= 16, got {value}"):
        merge_own_values(o_c, lse_c, q, new, w, scale=0.2, **{name: value})


def test_configured_merge_tiles_give_the_reference():
    """`configured_merge`'s fields stand in for the arguments a caller leaves out; a field out of range is named."""
    from fnattn.kernels.latent_absorb import _MERGE_OVERRIDES, configured_merge

    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    o_c, lse_c, q, new, w = merge_inputs(40, 2, 96, 8, 48, dtype)
    want_o, want_lse = merge_own_values_ref(o_c, lse_c, q, new, w, scale=0.2)
    with configured_merge(block_t=32, block_v=16, num_warps=4):
        assert _MERGE_OVERRIDES[-1] == {"block_t": 32, "block_v": 16, "num_warps": 4}
        got_o, got_lse = merge_own_values(o_c, lse_c, q, new, w, scale=0.2)
        with pytest.raises(ValueError, match="merge_own_values: block_t: expected a power of two >= 16, got 8"):
            merge_own_values(o_c, lse_c, q, new, w, scale=0.2, block_t=8)  # an argument wins over the field
    assert _MERGE_OVERRIDES[-1] == {}
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got_o.float(), want_o.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="configured: block_v: expected a power of two in 16..512, got 24"):
        with configured_merge(block_v=24):
            pass
    with pytest.raises(ValueError, match="configured: tile: expected one of block_t, block_r, block_v, num_warps"):
        with configured_merge(tile=16):
            pass
