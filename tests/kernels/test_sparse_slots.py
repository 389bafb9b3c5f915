"""topk_slots (a sparse layer's top-k positions as pool slots, own-row indices and the picked mask, one
pass) against its torch form, and that form against the gathers and scatter it replaced."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels.sparse_slots import topk_slots, topk_slots_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def batch(cache_lens, new, page=4, pages=6, seed=0):
    """Requests with these cache lengths and ``new`` rows each, pages shuffled, top-k lists of visible
    positions (cached and own), shuffled, -1 padded."""
    g = torch.Generator().manual_seed(seed)
    B = len(cache_lens)
    table = torch.randperm(B * pages, generator=g).view(B, pages).int()
    lens = torch.tensor(cache_lens, dtype=torch.int32)
    cu = torch.tensor([0] + [new * (b + 1) for b in range(B)], dtype=torch.int32)
    req = torch.arange(B).repeat_interleave(new).int()
    topk = 10
    rows = []
    for b in range(B):
        for i in range(new):
            visible = torch.randperm(cache_lens[b] + i + 1, generator=g)[:topk]
            rows.append(torch.cat([visible, torch.full((topk - len(visible),), -1)]))
    idx = torch.stack(rows)
    return [t.to(DEVICE) for t in (idx, req, lens, cu, table)]


@pytest.mark.parametrize("new, pad_to, dtype", [(1, 1, torch.int64), (3, 8, torch.int32), (2, 128, torch.int64)])
def test_the_kernel_is_the_torch_form(new, pad_to, dtype):
    idx, req, lens, cu, table = batch([0, 5, 9, 17], new)
    args = (idx.to(dtype), req, lens, cu, table)
    got = topk_slots(*args, page_size=4, pad_to=pad_to, rows=True, new=new)
    want = topk_slots_ref(*args, page_size=4, pad_to=pad_to, rows=True, new=new)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert got[0].shape == (idx.shape[0], -(-10 // pad_to) * pad_to)


def test_the_torch_form_is_the_gathers_and_the_scatter_it_replaced():
    """Against the sparse backend's former torch translation (gathers and wheres per position, then the
    picked mask as a scatter of each own position's offset), padded and cast as the backend did."""
    idx, req, lens, cu, table = batch([3, 0, 12], 2, seed=1)
    r, c = req.long(), lens.long()[req.long()][:, None]
    cached, fresh = (idx >= 0) & (idx < c), (idx >= 0) & (idx >= c)
    page = table.long()[r[:, None], idx.clamp(min=0) // 4]
    slots = torch.where(cached, page * 4 + idx % 4, -1)
    rows = torch.where(fresh, cu.long()[r][:, None] + idx - c, -1)
    got_slots, got_rows, picked = topk_slots_ref(idx, req, lens, cu, table, page_size=4, rows=True, new=2)
    assert torch.equal(got_slots, slots.int()) and torch.equal(got_rows, rows.int())
    want = torch.zeros(idx.shape[0], 3, dtype=torch.bool).scatter(1, torch.where(fresh, idx - c, 2), True)[:, :2]
    assert torch.equal(picked, want)


def test_optional_outputs_and_an_empty_batch():
    idx, req, lens, cu, table = batch([4, 6], 1)
    slots, rows, picked = topk_slots(idx, req, lens, cu, table, page_size=4)
    assert rows is None and picked is None and slots.shape == idx.shape
    empty = topk_slots(idx[:0], req[:0], lens, cu, table, page_size=4, pad_to=8, rows=True, new=1)
    assert [t.shape for t in empty] == [(0, 16), (0, 16), (0, 1)]


def test_bad_arguments_name_themselves():
    idx, req, lens, cu, table = batch([4, 6], 1)
    cases = [
        (dict(indices=idx.float()), r"topk_slots: indices: expected a \[T, topk\] int32 / int64 tensor"),
        (dict(request_of_token=req[:1]), r"topk_slots: request_of_token: expected a \(2,\) int32 / int64"),
        (dict(cache_lens=lens.float()), r"topk_slots: cache_lens: expected a \(2,\) int32 / int64"),
        (dict(cu_seqlens=cu[:2]), r"topk_slots: cu_seqlens: expected a \(3,\)"),
        (dict(block_table=table[0]), r"topk_slots: block_table: expected a \[B, pages\]"),
        (dict(page_size=0), r"topk_slots: page_size: expected an int >= 1, got 0"),
        (dict(pad_to=True), r"topk_slots: pad_to: expected an int >= 1, got True"),
        (dict(new=-1), r"topk_slots: new: expected an int >= 0, got -1"),
    ]
    base = dict(indices=idx, request_of_token=req, cache_lens=lens, cu_seqlens=cu, block_table=table, page_size=4)
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            topk_slots(**{**base, **change})
