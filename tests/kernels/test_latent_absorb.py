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
    qn, qp, w = inputs(4, 2, 16, 32, 8, torch.float32)
    wide = torch.zeros(2, 16, 48, device=DEVICE)
    wide[..., :32] = w
    torch.testing.assert_close(absorb_query(qn, qp, wide[..., :32]), absorb_query_ref(qn, qp, w))


def test_no_tokens():
    qn, qp, w = inputs(0, 2, 16, 32, 8, torch.float32)
    assert absorb_query(qn, qp, w).shape == (0, 2, 40)


@pytest.mark.parametrize("bad, match", [
    (lambda qn, qp, w: (qn, qp[:, :1], w), "q_pe: expected shape"),
    (lambda qn, qp, w: (qn, qp, w[:1]), "w_uk: expected shape"),
    (lambda qn, qp, w: (qn, qp.double(), w), "q_pe: expected torch.float32"),
    (lambda qn, qp, w: (qn[0], qp, w), "q_nope: expected a 3-d tensor"),
    (lambda qn, qp, w: (qn, qp, w.transpose(1, 2).contiguous().transpose(1, 2)), "w_uk: expected a unit stride"),
])
def test_bad_arguments_name_the_argument(bad, match):
    args = bad(*inputs(2, 2, 16, 32, 8, torch.float32))
    with pytest.raises(ValueError, match=match):
        absorb_query(*args)


def test_block_r_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="block_r: expected a power of two >= 16, got 24"):
        absorb_query(*inputs(2, 2, 16, 32, 8, torch.float32), block_r=24)
