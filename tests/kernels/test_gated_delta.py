"""GDN / KDA kernels against their pure-torch references (and fla's naive recurrence).

Without CUDA the Triton kernels run under TRITON_INTERPRET=1, so shapes are tiny
(K=16, V=32, chunk 16) and dtypes are fp32 / fp16 only.
"""

import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels.gated_delta import (  # noqa: E402
    causal_conv1d,
    causal_conv1d_ref,
    chunk_indices,
    gated_delta_chunked,
    gated_delta_chunked_ref,
    gated_delta_recurrent,
    gated_delta_recurrent_ref,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
K, V = 16, 32
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
}


def cu_of(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)


def make_inputs(lens, Hk, HV, *, kda, dtype=torch.float32, seed=0, g_max=1.0, normalize=True):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = rnd(T, Hk, K), rnd(T, Hk, K)
    if normalize:
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    v = rnd(T, HV, V)
    g = -torch.rand(*((T, HV, K) if kda else (T, HV)), generator=gen) * g_max  # log decay <= 0
    beta = torch.sigmoid(rnd(T, HV))
    return (q.to(DEV, dtype), k.to(DEV, dtype), v.to(DEV, dtype), g.to(DEV), beta.to(DEV))


def make_pool(n, shape, live, *, dtype=torch.float32, seed=1):
    """Pool of n slots, NaN everywhere except the `live` slots, so stray reads show."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.full((n, *shape), float("nan"))
    for s in live:
        pool[s] = torch.randn(*shape, generator=gen) * 0.5
    return pool.to(DEV, dtype)


def slots_of(values):
    return torch.tensor(values, dtype=torch.int64, device=DEV)


def close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


def same_pool(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


# ---------------------------------------------------------------- recurrent


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("per_pos", [False, True], ids=["final", "per_pos"])
def test_recurrent_matches_ref(kda, dtype, per_pos):
    lens = [1, 3, 6]
    q, k, v, g, beta = make_inputs(lens, 1, 2, kda=kda, dtype=dtype)
    pool = make_pool(4, (2, K, V), live=[0, 2])
    slots, cu = slots_of([2, -1, 0]), cu_of(lens)
    before = pool.clone()
    args = (q, k, v, g, beta, pool, slots, cu)
    o, s = gated_delta_recurrent(*args, scale=K**-0.5, per_position_states=per_pos)
    o_ref, s_ref = gated_delta_recurrent_ref(*args, scale=K**-0.5, per_position_states=per_pos)
    assert o.dtype == dtype and s.dtype == pool.dtype
    assert s.shape == ((sum(lens) if per_pos else len(lens)), 2, K, V)
    close(o, o_ref, dtype)
    close(s, s_ref, torch.float32)
    assert same_pool(pool, before)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_recurrent_bf16_state_pool(kda):
    lens = [2, 5]
    q, k, v, g, beta = make_inputs(lens, 2, 4, kda=kda, seed=3)
    pool = make_pool(3, (4, K, V), live=[1, 2], dtype=torch.bfloat16)
    slots, cu = slots_of([1, 2]), cu_of(lens)
    o, s = gated_delta_recurrent(q, k, v, g, beta, pool, slots, cu, scale=0.3)
    o_ref, s_ref = gated_delta_recurrent_ref(q, k, v, g, beta, pool, slots, cu, scale=0.3)
    assert s.dtype == torch.bfloat16
    close(o, o_ref, torch.float32)
    torch.testing.assert_close(s.float(), s_ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_verify_native_equals_replay(kda):
    # verify 1 + 3 drafts per request; request 0 accepts 2 tokens, request 1 all 4
    lens, accepted = [4, 4], [2, 4]
    q, k, v, g, beta = make_inputs(lens, 1, 2, kda=kda, seed=5)
    pool = make_pool(3, (2, K, V), live=[0, 1])
    slots = slots_of([1, 0])
    o, per_pos = gated_delta_recurrent(q, k, v, g, beta, pool, slots, cu_of(lens), scale=0.25, per_position_states=True)
    rows = torch.cat([torch.arange(4 * b, 4 * b + a) for b, a in enumerate(accepted)]).to(DEV)
    o_re, final = gated_delta_recurrent(
        q[rows], k[rows], v[rows], g[rows], beta[rows], pool, slots, cu_of(accepted), scale=0.25
    )
    assert torch.equal(o_re, o[rows])
    for b, a in enumerate(accepted):
        assert torch.equal(final[b], per_pos[4 * b + a - 1])


def test_recurrent_into_caller_buffers():
    # a ring of 2 buffers per request; write into ring entry 1 (a strided view)
    lens = [1, 1, 1]
    q, k, v, g, beta = make_inputs(lens, 2, 2, kda=False, seed=7)
    pool = make_pool(5, (2, K, V), live=[0, 3, 4])
    slots, cu = slots_of([4, 0, 3]), cu_of(lens)
    ring = torch.zeros(3, 2, 2, K, V, device=DEV)
    out = ring[:, 1]
    _, s = gated_delta_recurrent(q, k, v, g, beta, pool, slots, cu, scale=0.25, out_states=out)
    _, s_ref = gated_delta_recurrent_ref(q, k, v, g, beta, pool, slots, cu, scale=0.25)
    assert s.data_ptr() == out.data_ptr()
    close(ring[:, 1], s_ref, torch.float32)
    assert torch.count_nonzero(ring[:, 0]) == 0
    with pytest.raises(ValueError, match="out_states"):
        gated_delta_recurrent(q, k, v, g, beta, pool, slots, cu, scale=0.25, out_states=ring[:2, 1])


@pytest.mark.parametrize("per_pos", [False, True], ids=["final", "per_pos"])
def test_recurrent_into_rows_of_the_pool_it_reads(per_pos):
    # rows 0-2 are current states, 3-5 their spare ring rows: states land in the spare rows
    # named by out_rows (-1: not written), and the rows being read stay untouched
    lens = [1, 2]
    q, k, v, g, beta = make_inputs(lens, 1, 2, kda=True, seed=8)
    pool = make_pool(6, (2, K, V), live=[0, 2])
    slots, cu = slots_of([2, 0]), cu_of(lens)
    out_rows = slots_of([5, -1, 3] if per_pos else [5, 3])
    before = pool.clone()
    args = (q, k, v, g, beta, pool, slots, cu)
    o, s = gated_delta_recurrent(*args, scale=0.25, per_position_states=per_pos, out_states=pool, out_rows=out_rows)
    o_ref, s_ref = gated_delta_recurrent_ref(*args, scale=0.25, per_position_states=per_pos)
    assert s is pool
    close(o, o_ref, torch.float32)
    for r, row in enumerate(out_rows.tolist()):
        if row >= 0:
            close(pool[row], s_ref[r], torch.float32)
    untouched = [i for i in range(6) if i not in out_rows.tolist()]
    assert same_pool(pool[untouched], before[untouched])
    with pytest.raises(ValueError, match="out_rows"):
        gated_delta_recurrent(*args, scale=0.25, per_position_states=per_pos, out_states=pool, out_rows=slots_of([1]))
    with pytest.raises(ValueError, match="out_rows"):
        gated_delta_recurrent(*args, scale=0.25, out_rows=slots_of([5, 3]))


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_recurrent_qk_l2norm(kda):
    lens = [3, 2]
    q, k, v, g, beta = make_inputs(lens, 1, 2, kda=kda, seed=9, normalize=False)
    pool = make_pool(2, (2, K, V), live=[1])
    slots, cu = slots_of([1, -1]), cu_of(lens)
    o, s = gated_delta_recurrent(q, k, v, g, beta, pool, slots, cu, scale=0.25, use_qk_l2norm=True)
    o_ref, s_ref = gated_delta_recurrent_ref(q, k, v, g, beta, pool, slots, cu, scale=0.25, use_qk_l2norm=True)
    close(o, o_ref, torch.float32)
    close(s, s_ref, torch.float32)


# ---------------------------------------------------------------- chunked

# lengths: 1, a non-multiple of the chunk, an exact chunk, several chunks with a tail
CHUNK_LENS = [1, 23, 16, 37]


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_chunked_ref_matches_recurrent_ref(kda):
    lens = [1, 23, 16, 37, 64]
    q, k, v, g, beta = make_inputs(lens, 2, 4, kda=kda, seed=11)
    pool = make_pool(6, (4, K, V), live=[0, 2, 5])
    slots, cu = slots_of([5, -1, 0, 2, -1]), cu_of(lens)
    o_ref, s_ref = gated_delta_recurrent_ref(q, k, v, g, beta, pool, slots, cu, scale=0.25)
    for chunk in (8, 16, 64):
        o, s = gated_delta_chunked_ref(q, k, v, g, beta, pool, slots, cu, scale=0.25, chunk_size=chunk)
        torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_chunked_matches_recurrent(kda, dtype):
    q, k, v, g, beta = make_inputs(CHUNK_LENS, 1, 2, kda=kda, dtype=dtype, seed=13)
    pool = make_pool(5, (2, K, V), live=[1, 3, 4])
    slots, cu = slots_of([3, -1, 1, 4]), cu_of(CHUNK_LENS)
    before = pool.clone()
    o, s = gated_delta_chunked(q, k, v, g, beta, pool, slots, cu, scale=K**-0.5, chunk_size=16)
    o_ref, s_ref = gated_delta_recurrent_ref(q, k, v, g, beta, pool, slots, cu, scale=K**-0.5)
    assert o.dtype == dtype and s.dtype == pool.dtype and s.shape == (4, 2, K, V)
    close(o, o_ref, dtype)
    close(s, s_ref, dtype)
    assert same_pool(pool, before)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_chunked_strong_decay(kda):
    # per-token log decays down to -16: a 16-token chunk spans about exp(-128), past the
    # fp32 range if a decay were ever formed as exp(+G)
    lens = [20, 16]
    q, k, v, g, beta = make_inputs(lens, 2, 2, kda=kda, seed=17, g_max=16.0)
    pool = make_pool(2, (2, K, V), live=[0, 1])
    slots, cu = slots_of([0, 1]), cu_of(lens)
    o, s = gated_delta_chunked(q, k, v, g, beta, pool, slots, cu, scale=0.25, chunk_size=16)
    o_ref, s_ref = gated_delta_recurrent_ref(q, k, v, g, beta, pool, slots, cu, scale=0.25)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    close(o, o_ref, torch.float32)
    close(s, s_ref, torch.float32)


def test_chunked_l2norm_chunk32_caller_buffer_shared_chunks():
    lens = [40, 5]
    q, k, v, g, beta = make_inputs(lens, 2, 4, kda=False, seed=19, normalize=False)
    pool = make_pool(3, (4, K, V), live=[2])
    slots, cu = slots_of([2, -1]), cu_of(lens)
    ring = torch.zeros(2, 2, 4, K, V, device=DEV)
    seq, idx = chunk_indices(cu, 32)
    assert seq.tolist() == [0, 0, 1] and idx.tolist() == [0, 1, 0]
    o, s = gated_delta_chunked(
        q, k, v, g, beta, pool, slots, cu, scale=0.25, chunk_size=32, use_qk_l2norm=True,
        out_states=ring[:, 0], chunks=(seq, idx),
    )
    o_ref, s_ref = gated_delta_recurrent_ref(q, k, v, g, beta, pool, slots, cu, scale=0.25, use_qk_l2norm=True)
    close(o, o_ref, torch.float32)
    close(ring[:, 0], s_ref, torch.float32)
    assert torch.count_nonzero(ring[:, 1]) == 0


# ---------------------------------------------------------------- fla as a second oracle


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_against_fla_naive(kda):
    pytest.importorskip("fla")
    pytest.importorskip("einops")
    if kda:
        from fla.ops.kda.naive import naive_recurrent_kda
    else:
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    lens = [5, 9]
    Hk, HV = 1, 2
    q, k, v, g, beta = make_inputs(lens, Hk, HV, kda=kda, seed=23)
    pool = make_pool(2, (HV, K, V), live=[0, 1])
    slots, cu = slots_of([1, 0]), cu_of(lens)
    o, s = gated_delta_recurrent(q, k, v, g, beta, pool, slots, cu, scale=0.25)
    o_c, s_c = gated_delta_chunked_ref(q, k, v, g, beta, pool, slots, cu, scale=0.25, chunk_size=4)
    for b, slot in enumerate(slots.tolist()):
        r = slice(int(cu[b]), int(cu[b + 1]))
        s0 = pool[slot][None].clone()
        if kda:
            # fla KDA layout [B, T, H, D], value heads shared over key heads like ours
            o_f, s_f = naive_recurrent_kda(
                q[r][None], k[r][None], v[r][None], g[r][None], beta[r][None],
                scale=0.25, initial_state=s0, output_final_state=True,
            )
        else:
            # fla's naive GDN has one head count: repeat key heads onto value heads
            qe = q[r].repeat_interleave(HV // Hk, dim=1)[None]
            ke = k[r].repeat_interleave(HV // Hk, dim=1)[None]
            o_f, s_f = naive_recurrent_gated_delta_rule(
                qe, ke, v[r][None], beta[r][None], g[r][None],
                scale=0.25, initial_state=s0, output_final_state=True,
            )
        for o_x, s_x in ((o, s), (o_c, s_c)):
            torch.testing.assert_close(o_x[r], o_f[0].to(o_x.dtype), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(s_x[b], s_f[0].float(), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- causal conv1d

CONV_LENS = [1, 2, 0, 7, 12]  # shorter than the window, empty, longer
CONV_C, CONV_W = 48, 4


def conv_inputs(dtype, seed=29):
    gen = torch.Generator().manual_seed(seed)
    T = sum(CONV_LENS)
    x = torch.randn(T, CONV_C, generator=gen).to(DEV, dtype)
    w = (torch.randn(CONV_C, CONV_W, generator=gen) * 0.5).to(DEV, dtype)
    bias = torch.randn(CONV_C, generator=gen).to(DEV, dtype)
    pool = make_pool(6, (CONV_C, CONV_W - 1), live=[0, 2, 5], dtype=dtype)
    return x, w, bias, pool, slots_of([5, -1, 0, 2, 2]), cu_of(CONV_LENS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("per_pos", [False, True], ids=["final", "per_pos"])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_conv_matches_ref(dtype, per_pos, activation, with_bias):
    x, w, bias, pool, slots, cu = conv_inputs(dtype)
    bias = bias if with_bias else None
    before = pool.clone()
    y, s = causal_conv1d(x, w, bias, pool, slots, cu, activation=activation, per_position_states=per_pos)
    y_ref, s_ref = causal_conv1d_ref(x, w, bias, pool, slots, cu, activation=activation, per_position_states=per_pos)
    assert y.dtype == dtype and s.dtype == pool.dtype
    assert s.shape == ((x.shape[0] if per_pos else len(CONV_LENS)), CONV_C, CONV_W - 1)
    close(y, y_ref, dtype)
    assert torch.equal(s, s_ref)  # windows are copies of inputs: exact
    assert same_pool(pool, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("per_pos", [False, True], ids=["final", "per_pos"])
def test_conv_interior_tiles_give_the_general_paths_bits(dtype, per_pos):
    """`gdn_conv.interior_tiles` (on by default): tiles of 32 tokens inside one request past its first taps read x
    alone; the ones at a request's start or across two requests (and a pad-free short request) take the general
    path. The same bits either way, and the reference's values (per-position windows keep the general path)."""
    from fnattn.kernels import gdn_conv

    gen = torch.Generator().manual_seed(31)
    lens = [70, 5, 130, 33]
    x = torch.randn(sum(lens), CONV_C, generator=gen).to(DEV, dtype)
    w = (torch.randn(CONV_C, CONV_W, generator=gen) * 0.5).to(DEV, dtype)
    bias = torch.randn(CONV_C, generator=gen).to(DEV, dtype)
    pool = make_pool(6, (CONV_C, CONV_W - 1), live=[0, 2, 5], dtype=dtype)
    args = (x, w, bias, pool, slots_of([5, -1, 0, 2]), cu_of(lens))
    with gdn_conv.interior_tiles(False):
        plain = causal_conv1d(*args, per_position_states=per_pos)
    with gdn_conv.interior_tiles(True):
        inner = causal_conv1d(*args, per_position_states=per_pos)
    for a, b in zip(inner, plain):
        assert torch.equal(a, b)
    y_ref, s_ref = causal_conv1d_ref(*args, per_position_states=per_pos)
    close(inner[0], y_ref, dtype)
    assert torch.equal(inner[1], s_ref)


@pytest.mark.parametrize("per_pos", [False, True], ids=["final", "per_pos"])
def test_short_conv_tiles_give_the_same_bits(monkeypatch, per_pos):
    """`gdn_conv.short_conv_tiles`: a verify-sized call (8 requests of 4 tokens) on a device of many SMs halves
    its token tile down to 4; each output is its own taps' sum, so outputs and windows are the same bits."""
    from fnattn.kernels import gdn_conv

    monkeypatch.setattr(gdn_conv, "num_sms", lambda index=None: 132)
    tiles, launch = [], gdn_conv.token_tile
    monkeypatch.setattr(gdn_conv, "token_tile", lambda *a: tiles.append(launch(*a)) or tiles[-1])
    gen = torch.Generator().manual_seed(33)
    lens = [4] * 8
    x = torch.randn(sum(lens), CONV_C, generator=gen).to(DEV, torch.float16)
    w = (torch.randn(CONV_C, CONV_W, generator=gen) * 0.5).to(DEV, torch.float16)
    pool = make_pool(10, (CONV_C, CONV_W - 1), live=list(range(8)), dtype=torch.float16)
    args = (x, w, None, pool, slots_of(list(range(8))), cu_of(lens))
    with gdn_conv.short_conv_tiles(False):
        plain = causal_conv1d(*args, per_position_states=per_pos)
    with gdn_conv.short_conv_tiles(True):
        short = causal_conv1d(*args, per_position_states=per_pos)
    assert tiles == [32, 4]
    for a, b in zip(short, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("interior", [False, True], ids=["general", "interior"])
@pytest.mark.parametrize("split", [(16, 32), (5, 41), (1, 47)], ids=["even", "uneven", "edges"])
def test_conv_split_outputs_are_the_column_slices_contiguous(split, interior):
    """``split=(c1, c2)``: the conv's output as three contiguous tensors (GDN's q, k, v for fla-core's chunk),
    bit for bit y's column slices, on the general path and the interior tiles; the windows unchanged; tiles
    of channels that straddle c1 or c2 store each column into its own part."""
    from fnattn.kernels import gdn_conv

    gen = torch.Generator().manual_seed(32)
    lens = [70, 5, 1, 33]
    x = torch.randn(sum(lens), CONV_C, generator=gen).to(DEV, torch.float32)
    w = (torch.randn(CONV_C, CONV_W, generator=gen) * 0.5).to(DEV)
    pool = make_pool(6, (CONV_C, CONV_W - 1), live=[0, 2, 5])
    args = (x, w, None, pool, slots_of([5, -1, 0, 2]), cu_of(lens))
    with gdn_conv.interior_tiles(interior):
        y, windows = causal_conv1d(*args)
        parts, windows_split = causal_conv1d(*args, split=split)
    c1, c2 = split
    for part, want in zip(parts, (y[:, :c1], y[:, c1:c2], y[:, c2:])):
        assert part.is_contiguous() and torch.equal(part, want)
    assert parts[1].untyped_storage().data_ptr() == parts[0].untyped_storage().data_ptr()  # one buffer
    assert torch.equal(windows_split, windows)


@pytest.mark.parametrize("split", [(0, 8), (8, 8), (8, 48), [8, 16], (8.0, 16)])
def test_conv_split_refuses_channels_out_of_order(split):
    x, w, bias, pool, _, _ = conv_inputs(torch.float32)
    with pytest.raises(ValueError, match=r"split: expected \(c1, c2\) with 0 < c1 < c2 < 48"):
        causal_conv1d(x[:9], w, bias, pool, slots_of([-1]), cu_of([9]), split=split)


def test_conv_ref_matches_torch_conv1d():
    x, w, bias, pool, _, _ = conv_inputs(torch.float32)
    x = x[:9]
    y_ref, _ = causal_conv1d_ref(x, w, bias, pool, slots_of([-1]), cu_of([9]), activation="silu")
    y_t = torch.nn.functional.conv1d(x.T[None], w[:, None, :], bias, padding=CONV_W - 1, groups=CONV_C)
    y_t = torch.nn.functional.silu(y_t[0, :, :9].T)
    torch.testing.assert_close(y_ref, y_t, atol=1e-5, rtol=1e-5)


def test_conv_window_carries_across_steps():
    # one 10-token request run as 3 + 1 + 6 tokens, feeding each step's window to the next
    x, w, bias, pool, _, _ = conv_inputs(torch.float32)
    x = x[:10]
    y_all, win_all = causal_conv1d(x, w, bias, pool, slots_of([0]), cu_of([10]))
    ys, state, start = [], pool[:1], 0
    for n in (3, 1, 6):
        y, state = causal_conv1d(x[start:start + n], w, bias, state, slots_of([0]), cu_of([n]))
        ys.append(y)
        start += n
    torch.testing.assert_close(torch.cat(ys), y_all, atol=1e-6, rtol=1e-6)
    assert torch.equal(state, win_all)


# ---------------------------------------------------------------- argument checks


def test_bad_shapes_raise():
    lens = [2, 3]
    q, k, v, g, beta = make_inputs(lens, 1, 2, kda=False)
    pool = make_pool(2, (2, K, V), live=[0, 1])
    slots, cu = slots_of([0, 1]), cu_of(lens)
    ok = dict(scale=0.25)
    cases = [
        ("v", (q, k, v[:-1], g, beta, pool, slots, cu)),
        ("g", (q, k, v, g[:, :, None].expand(-1, -1, K + 1), beta, pool, slots, cu)),
        ("beta", (q, k, v, g, beta[:, :1], pool, slots, cu)),
        ("state_pool", (q, k, v, g, beta, pool[:, :, :, :8], slots, cu)),
        ("slots", (q, k, v, g, beta, pool, slots[:1], cu)),
        ("cu_seqlens", (q, k, v, g, beta, pool, slots, cu.long())),
        ("HV", (q.expand(-1, 3, -1), k.expand(-1, 3, -1), v, g, beta, pool, slots, cu)),
    ]
    for name, args in cases:
        for fn in (gated_delta_recurrent, gated_delta_chunked):
            with pytest.raises(ValueError, match=name):
                fn(*args, **ok)
    with pytest.raises(ValueError, match="chunk_size"):
        gated_delta_chunked(q, k, v, g, beta, pool, slots, cu, scale=0.25, chunk_size=24)
    x, w, bias, cpool, cslots, ccu = conv_inputs(torch.float32)
    with pytest.raises(ValueError, match="conv_state_pool"):
        causal_conv1d(x, w, bias, cpool[:, :, :2], cslots, ccu)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, w, bias, cpool, cslots, ccu, activation="relu")


_FP32, _BF16, _EVEN, _UNEVEN = torch.float32, torch.bfloat16, (16, 32), (5, 41)


# Every pair of two choices' values in at least one case (the whole product, 48 interpreted cases, took 85 s)
@pytest.mark.parametrize("dtype, chunk_size, split, with_bias, block_c", [
    pytest.param(_FP32, 16, None, False, 128, id="fp32-16-one output-no bias-wide"),
    pytest.param(_FP32, 64, _EVEN, True, 16, id="fp32-64-split even-bias-even channels"),
    pytest.param(_BF16, 16, _UNEVEN, False, 16, id="bf16-16-split uneven-no bias-even channels"),
    pytest.param(_BF16, 64, None, True, 128, id="bf16-64-one output-bias-wide"),
    pytest.param(_FP32, 16, _UNEVEN, True, 128, id="fp32-16-split uneven-bias-wide"),
    pytest.param(_BF16, 16, _EVEN, False, 128, id="bf16-16-split even-no bias-wide"),
    pytest.param(_FP32, 64, None, False, 16, id="fp32-64-one output-no bias-even channels"),
    pytest.param(_FP32, 64, _UNEVEN, False, 128, id="fp32-64-split uneven-no bias-wide"),
])
def test_conv_chunk_tiles_give_the_packed_tiles_bits(chunk_size, split, with_bias, dtype, block_c, monkeypatch):
    """``chunks=`` under `chunk_tiles`: each program one chunk of one request (its bounds and slot read once),
    the same output bits as the packed tiles and the same windows: requests of 1, 15 / 16 / 17, 63 / 64 / 65
    and 130 tokens, with saved windows, without (a fresh request) and NaN in every pool row not read. A
    16-channel tile divides the channels (and the even split): no channel masks, scalar output blocks."""
    from fnattn.kernels import gdn_conv

    monkeypatch.setitem(gdn_conv.CHUNK_LAUNCH, "block_c", block_c)
    monkeypatch.setitem(gdn_conv.CHUNK_LAUNCH, "min_tokens", 0)  # these 371 tokens tiled by chunks too

    gen = torch.Generator().manual_seed(33)
    lens = [1, 17, 64, 130, 15, 63, 16, 65]
    x = torch.randn(sum(lens), CONV_C, generator=gen).to(DEV, dtype)
    w = (torch.randn(CONV_C, CONV_W, generator=gen) * 0.5).to(DEV, dtype)
    bias = torch.randn(CONV_C, generator=gen).to(DEV, dtype) if with_bias else None
    pool = make_pool(9, (CONV_C, CONV_W - 1), live=[0, 2, 3, 5, 7, 8], dtype=dtype)
    pool[[1, 4, 6]] = float("nan")  # rows no request reads
    args = (x, w, bias, pool, slots_of([5, -1, 0, 2, 7, 3, -1, 8]), cu_of(lens))
    chunks = chunk_indices(cu_of(lens), chunk_size)
    with gdn_conv.chunk_tiles(False):
        want = causal_conv1d(*args, split=split, chunks=chunks, chunk_size=chunk_size)
    with gdn_conv.chunk_tiles(True):
        got = causal_conv1d(*args, split=split, chunks=chunks, chunk_size=chunk_size)
    for a, b in zip(got[0] if split else got[:1], want[0] if split else want[:1]):
        assert not a.isnan().any() and torch.equal(a, b)
    assert torch.equal(got[1], want[1])
    y_ref, _ = causal_conv1d_ref(*args)
    y = torch.cat(got[0], 1) if split else got[0]  # the parts side by side: channel order
    if dtype == torch.float32:
        close(y, y_ref, dtype)


@pytest.mark.parametrize("key, value, expected", [
    ("block_c", 48, "a power of two >= 16"), ("block_c", 8, "a power of two >= 16"),
    ("num_warps", 3, "one of 1, 2, 4, 8, 16, 32"), ("channels_first", 1, "True or False"),
    ("min_tokens", -1, "an int >= 0"), ("min_tokens", True, "an int >= 0"),
])
def test_conv_refuses_a_bad_chunk_launch(key, value, expected, monkeypatch):
    """`CHUNK_LAUNCH` is what the sweeps set: a field no kernel launch can take is refused by name, and nothing
    is written."""
    from fnattn.kernels import gdn_conv

    x, w, bias, pool, _, _ = conv_inputs(torch.float32)
    x = x[:20]
    before = pool.clone()
    monkeypatch.setitem(gdn_conv.CHUNK_LAUNCH, key, value)
    with pytest.raises(ValueError, match=re.escape(f"CHUNK_LAUNCH[{key!r}]: expected {expected}, got {value!r}")):
        causal_conv1d(x, w, bias, pool, slots_of([0]), cu_of([20]), chunks=chunk_indices(cu_of([20]), 16),
                      chunk_size=16)
    assert torch.allclose(pool, before, rtol=0, atol=0, equal_nan=True)  # rows no request reads hold NaN


@pytest.mark.parametrize("bad, match", [
    (dict(chunk_size=24), r"chunk_size: expected a power of two >= 16"),
    (dict(chunk_size=8), r"chunk_size: expected a power of two >= 16"),
    (dict(chunks=[0, 0]), r"chunks: expected a \(request, chunk of request\) pair of tensors, got list"),
    (dict(chunks="int64"), r"chunks\[0\] \(requests\): expected a 1-D int32 tensor"),
    (dict(chunks="short"), r"chunks: expected two lists of one length, at least 2 \(20 tokens in chunks of 16\)"),
])
def test_conv_refuses_bad_chunks(bad, match):
    x, w, bias, pool, _, _ = conv_inputs(torch.float32)
    seq, idx = chunk_indices(cu_of([20]), 16)
    chunks = bad.get("chunks")
    chunks = {"int64": (seq.long(), idx), "short": (seq[:1], idx[:1])}[chunks] if isinstance(chunks, str) else chunks
    kw = dict(chunks=(seq, idx) if chunks is None else chunks, chunk_size=bad.get("chunk_size", 16))
    with pytest.raises(ValueError, match=match):
        causal_conv1d(x[:20], w, bias, pool, slots_of([-1]), cu_of([20]), **kw)
