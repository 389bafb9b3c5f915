"""FP8 index keys (`IndexerConfig.key_dtype="fp8_e4m3"`): float8 e4m3 rows with one fp32 scale per token.

The config and its refusals, the encoding, what State allocates, the reference's selection over the stored keys
(a step scores its own keys as the cache will hold them), and a request's transfer carrying the scales.
"""

from __future__ import annotations

import pytest
import torch

import fnattn as fa
from fnattn.kinds.sparse_mla.indexer import indexer_scores, topk_indices
from kinds.mla.fast_cases import filled_state, forward_all, sparse_specs, step_inputs

SMALL = dict(H=2, R=16, Dr=8, Dn=8, Dv=8)


def test_the_key_dtype_is_checked_and_dsv4_refuses_fp8_keys():
    with pytest.raises(ValueError, match=r"IndexerConfig: `key_dtype` must be one of \(None, 'fp8_e4m3'\)"):
        fa.IndexerConfig(num_heads=2, head_dim=16, topk=4, rope_head_dim=8, key_dtype="fp8")
    ix = fa.IndexerConfig(num_heads=2, head_dim=16, topk=4, rope_head_dim=8, key_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="DSV4Config: `indexer.key_dtype` must be None"):
        fa.DSV4Config(num_heads=2, head_dim=16, qk_rope_head_dim=8, sliding_window=4, compress_ratio=4,
                      compressor="csa", indexer=ix)


def test_keys_encode_to_e4m3_rows_with_a_scale_each():
    ix = fa.IndexerConfig(num_heads=2, head_dim=16, topk=4, rope_head_dim=8, key_dtype="fp8_e4m3")
    keys = torch.randn(5, 16) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 2.0])[:, None]
    stored, scale = ix.encode_keys(keys)
    assert stored.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (5, 1)
    assert scale[3, 0] == 1.0 and torch.equal(ix.decode_keys(stored, scale)[3], torch.zeros(16))  # a zero row
    back = ix.decode_keys(stored, scale)
    amax = keys.abs().amax(-1, keepdim=True)
    assert ((back - keys).abs() <= amax / 16 + 1e-12).all()  # e4m3: 3 mantissa bits, the row's largest at 448
    assert torch.allclose(stored.float().abs().amax(-1), torch.tensor([448.0, 448.0, 448.0, 0.0, 448.0]))


def test_state_holds_fp8_keys_and_their_scales():
    specs = sparse_specs(topk=4, Hi=4, Di=16, shared=True, dtype=torch.float32, key_dtype="fp8_e4m3", **SMALL)
    st = fa.State(specs, num_pages=6, page_size=4, max_requests=2)
    v0 = st.views(0)
    assert v0.index_k.dtype == torch.float8_e4m3fn and tuple(v0.index_k.shape[1:]) == (4, 16)
    assert v0.index_k_scale.dtype == torch.float32 and tuple(v0.index_k_scale.shape[1:]) == (4, 1)
    assert "index_k" not in st.views(1) and "index_k_scale" not in st.views(1)  # the shared layer owns none


def test_the_reference_selects_over_the_stored_keys_and_writes_them_encoded():
    specs = sparse_specs(topk=3, Hi=4, Di=16, dtype=torch.float32, key_dtype="fp8_e4m3", **SMALL)
    st = filled_state(specs, [6, 9], page_size=4, extra=4)
    b = fa.Batch.decode(st, [0, 1])
    ma = fa.ModelAttention(specs, prefer=("reference",), phases=("decode",))
    outs, deltas = forward_all(ma, st, b, specs, seed=3)
    (w,) = deltas.writes
    inp = step_inputs(specs[0], b, seed=3)
    ix = specs[0].config.indexer
    stored, scale = ix.encode_keys(inp.index_k)
    assert torch.equal(w["index_k"].float(), stored.float()) and torch.equal(w["index_k_scale"], scale)
    views = st.views(0)
    for r, n in enumerate(b.host_cache_lens):  # the independent math: every key as the cache holds it
        rows = views.index_k.flatten(0, 1)[[int(b.block_table[r, p // 4]) * 4 + p % 4 for p in range(n)]]
        scales = views.index_k_scale.flatten(0, 1)[[int(b.block_table[r, p // 4]) * 4 + p % 4 for p in range(n)]]
        keys = torch.cat((ix.decode_keys(rows, scales), ix.decode_keys(stored[r:r + 1], scale[r:r + 1])))
        want = topk_indices(indexer_scores(inp.index_q[r:r + 1], inp.index_w[r:r + 1], keys), n_cached=n, topk=3)
        assert torch.equal(outs[0].topk_indices[r:r + 1], want)
    after = st.apply(deltas)
    # a request's transfer to a State of another page size carries its FP8 keys and their scales
    moved, rid = fa.State(specs, num_pages=12, page_size=8, max_requests=2).import_request(after.export_request(1))
    a, m = after.views(0), moved.views(0)
    src = [int(after.requests[1].pages[p // 4]) * 4 + p % 4 for p in range(after.requests[1].length)]
    dst = [int(moved.requests[rid].pages[p // 8]) * 8 + p % 8 for p in range(moved.requests[rid].length)]
    assert torch.equal(a.index_k_scale.flatten(0, 1)[src], m.index_k_scale.flatten(0, 1)[dst])
    assert torch.equal(a.index_k.flatten(0, 1)[src].float(), m.index_k.flatten(0, 1)[dst].float())
