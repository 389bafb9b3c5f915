"""The one-launch GDN / KDA decode kernel against its reference and against the two-launch path.

Without CUDA the kernel runs under TRITON_INTERPRET=1: tiny shapes (K=16, V=32),
fp32 and fp16. Pools are NaN outside the live slots, so a read of any other row (or
of a fresh request's slot) shows in the results.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels import (  # noqa: E402
    causal_conv1d,
    gated_delta_decode_fused,
    gated_delta_decode_fused_ref,
    gated_delta_recurrent,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
K, V, W = 16, 32, 4
N = 6  # pool rows; 1 and 4 hold live states
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}
# (kda, Hk, HV): GDN with GQA-style groups of 2 and 3 value heads per key head, and one each; KDA (Hk == HV)
CASES = [(False, 2, 4), (False, 1, 3), (False, 2, 2), (True, 2, 2)]


def problem(B, Hk, HV, *, kda, dtype=torch.float32, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    C = 2 * Hk * K + HV * V

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=gen) * s

    cpool = torch.full((N, C, W - 1), float("nan"))
    spool = torch.full((N, HV, K, V), float("nan"))
    for s in (1, 4):
        cpool[s], spool[s] = rnd(C, W - 1), rnd(HV, K, V, s=0.5)
    g = -torch.rand(*((B, HV, K) if kda else (B, HV)), generator=gen)  # log decay <= 0
    args = dict(
        x=rnd(B, C).to(DEV, dtype), conv_weight=rnd(C, W, s=0.5).to(DEV, dtype),
        conv_bias=rnd(C, s=0.1).to(DEV, dtype) if bias else None, conv_state_pool=cpool.to(DEV, dtype),
        g=g.to(DEV), beta=torch.sigmoid(rnd(B, HV)).to(DEV, dtype), state_pool=spool.to(DEV),
        slots=torch.tensor([4, -1, 1][:B], dtype=torch.int64, device=DEV),  # -1: a pad lane / fresh request
        cu_seqlens=torch.arange(B + 1, dtype=torch.int32, device=DEV),
    )
    return args, dict(num_k_heads=Hk, head_k_dim=K, scale=K ** -0.5)


def two_launch(a, kw, **into):
    """The unfused decode: causal_conv1d, then gated_delta_recurrent on views of its output."""
    Hk = kw["num_k_heads"]
    y, windows = causal_conv1d(a["x"], a["conv_weight"], a["conv_bias"], a["conv_state_pool"], a["slots"],
                               a["cu_seqlens"], activation="silu")
    q = y[:, : Hk * K].unflatten(1, (Hk, K))
    k = y[:, Hk * K : 2 * Hk * K].unflatten(1, (Hk, K))
    v = y[:, 2 * Hk * K :].unflatten(1, (-1, V))
    o, states = gated_delta_recurrent(q, k, v, a["g"], a["beta"], a["state_pool"], a["slots"], a["cu_seqlens"],
                                      scale=kw["scale"], use_qk_l2norm=True, **into)
    return o, states, windows


def close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{'kda' if c[0] else 'gdn'}-{c[1]}k{c[2]}v")
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_reference(case, B, dtype):
    kda, Hk, HV = case
    a, kw = problem(B, Hk, HV, kda=kda, dtype=dtype, bias=not kda)
    o, states, windows = gated_delta_decode_fused(**a, **kw)
    ro, rstates, rwindows = gated_delta_decode_fused_ref(**a, **kw)
    close(o, ro, dtype)
    close(states, rstates, dtype)
    assert torch.equal(windows, rwindows)  # copies of inputs: exact
    assert o.dtype == dtype and states.dtype == torch.float32 and windows.dtype == dtype
    assert torch.isfinite(o).all() and torch.isfinite(states).all() and torch.isfinite(windows).all()


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("block_v", [None, 16], ids=["one-tile", "two-tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_same_bits_as_the_two_launch_path(kda, block_v, dtype):
    """The same ops on the same values: conv output rounded to x.dtype, then the recurrent kernel's math."""
    a, kw = problem(3, *((2, 2) if kda else (2, 4)), kda=kda, dtype=dtype)
    got = gated_delta_decode_fused(**a, **kw, block_v=block_v)
    want = two_launch(a, kw)
    for x, y in zip(got, want):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_states_into_spare_rows_of_the_pool_it_reads(kda):
    """Ring mode: state b goes to out_rows[b] of the pool itself (a row < 0 is skipped), every other row kept."""
    a, kw = problem(3, *((2, 2) if kda else (2, 4)), kda=kda)
    rows = torch.tensor([0, 5, -1], dtype=torch.int64, device=DEV)
    _, want_states, _ = gated_delta_decode_fused_ref(**a, **kw)
    before = a["state_pool"].clone()
    ours = dict(a, state_pool=a["state_pool"].clone())
    o, pool, windows = gated_delta_decode_fused(**ours, **kw, out_states=ours["state_pool"], out_rows=rows)
    assert pool is ours["state_pool"]
    close(pool[[0, 5]], want_states[:2], torch.float32)
    for r in (1, 2, 3, 4):
        assert torch.equal(pool[r].isnan(), before[r].isnan())
        assert torch.equal(pool[r].nan_to_num(), before[r].nan_to_num())
    # and the same rows as the two-launch path writes in the same mode
    theirs = dict(a, state_pool=a["state_pool"].clone())
    o2, pool2, windows2 = two_launch(theirs, kw, out_states=theirs["state_pool"], out_rows=rows)
    assert torch.equal(o, o2) and torch.equal(windows, windows2)
    assert torch.equal(pool.nan_to_num(), pool2.nan_to_num()) and torch.equal(pool.isnan(), pool2.isnan())


def test_caller_buffers_and_an_fp16_state_pool():
    a, kw = problem(3, 2, 4, kda=False)
    a["state_pool"] = a["state_pool"].half()
    out_s = torch.empty(3, 4, K, V, dtype=torch.float32, device=DEV)
    out_w = torch.empty(3, a["x"].shape[1], W - 1, dtype=torch.float32, device=DEV)
    o, states, windows = gated_delta_decode_fused(**a, **kw, out_states=out_s, out_windows=out_w)
    assert states is out_s and windows is out_w
    ro, rstates, rwindows = gated_delta_decode_fused_ref(**a, **kw)
    close(o, ro, torch.float16)
    torch.testing.assert_close(states, rstates.float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(windows, rwindows)


def test_no_activation_and_no_l2norm_match_reference():
    a, kw = problem(2, 1, 3, kda=False)
    for extra in (dict(activation=None), dict(use_qk_l2norm=False)):
        got = gated_delta_decode_fused(**a, **kw, **extra)
        want = gated_delta_decode_fused_ref(**a, **kw, **extra)
        for x, y in zip(got, want):
            close(x, y, torch.float32)


def test_steps_chain_from_the_rows_they_wrote():
    """Steps that each start from the window and state the previous one left: the reference's outputs, and
    after W - 1 steps the window holds exactly the last W - 1 inputs."""
    a, kw = problem(1, 2, 4, kda=False)
    xs = torch.randn(W - 1, a["x"].shape[1], generator=torch.Generator().manual_seed(7)).to(DEV)
    pools = {n: (a["conv_state_pool"].clone(), a["state_pool"].clone()) for n in ("kernel", "ref")}
    for i in range(W - 1):
        for name, fn in (("kernel", gated_delta_decode_fused), ("ref", gated_delta_decode_fused_ref)):
            cpool, spool = pools[name]
            o, states, windows = fn(**dict(a, x=xs[i : i + 1], conv_state_pool=cpool, state_pool=spool), **kw)
            cpool[4], spool[4] = windows[0], states[0]
            pools[name + " o"] = o
        close(pools["kernel o"], pools["ref o"], torch.float32)
        close(pools["kernel"][1][4], pools["ref"][1][4], torch.float32)
    assert torch.equal(pools["kernel"][0][4], xs.T)


@pytest.mark.parametrize("fn", [gated_delta_decode_fused, gated_delta_decode_fused_ref], ids=["kernel", "ref"])
def test_bad_arguments_are_refused_naming_them(fn):
    a, kw = problem(3, 2, 4, kda=False)
    with pytest.raises(ValueError, match="cu_seqlens: expected one new token per request"):
        fn(**dict(a, cu_seqlens=torch.tensor([0, 3], dtype=torch.int32, device=DEV),
                  slots=a["slots"][:1]), **kw)
    with pytest.raises(ValueError, match="x: expected C = 2"):
        fn(**dict(a, x=torch.cat([a["x"], a["x"][:, :1]], dim=1)), **kw)
    with pytest.raises(ValueError, match="conv_state_pool"):
        fn(**dict(a, conv_state_pool=a["conv_state_pool"][:, :, :2]), **kw)
    with pytest.raises(ValueError, match="activation"):
        fn(**a, **kw, activation="relu")
    with pytest.raises(ValueError, match="g: expected"):
        fn(**dict(a, g=a["g"][:, :3]), **kw)
    with pytest.raises(ValueError, match="state_pool"):
        fn(**dict(a, state_pool=a["state_pool"][:, :, :, :8]), **kw)
    with pytest.raises(ValueError, match="num_k_heads"):
        fn(**a, **dict(kw, num_k_heads=3))
    if fn is gated_delta_decode_fused:
        with pytest.raises(ValueError, match="out_rows: given without out_states"):
            fn(**a, **kw, out_rows=a["slots"])
        with pytest.raises(ValueError, match="out_windows"):
            fn(**a, **kw, out_windows=torch.empty(3, 5, W - 1, device=DEV))


def test_fill_device_narrows_the_default_tile_until_the_grid_fills_the_sms():
    """At batch 1 with 16 value heads of 128 the usual 64 columns make 32 programs: under `fill_device`
    (the default) 16 columns make 128 (no narrower); batch 8 already fills 132 SMs."""
    from fnattn.kernels import gdn_decode_fused as module

    with module.fill_device(False):
        assert module.default_block_v(1, 16, 128, 128, 132) == 64
        a, kw = problem(1, 2, 4, kda=False)
        plain = gated_delta_decode_fused(**a, **kw)
    with module.fill_device(True):
        assert module.default_block_v(1, 16, 128, 128, 132) == 16
        assert module.default_block_v(4, 16, 128, 128, 132) == 32
        assert module.default_block_v(8, 16, 128, 128, 132) == 64
        assert module.default_block_v(1, 16, 128, 256, 132) == 16
        narrowed = gated_delta_decode_fused(**a, **kw)  # 32 columns: 4 programs, narrowed to 16
    for x, y in zip(narrowed, plain):
        assert torch.equal(x, y)
    from fnattn.kernels.invariant import invariant

    with module.fill_device(True), invariant(True):  # a request's tile must not follow its batch's size
        assert [module.default_block_v(b, 16, 128, 128, 132) for b in (1, 4, 8)] == [64, 64, 64]
    with pytest.raises(ValueError, match="fill_device: expected True or False, got 'yes'"):
        with module.fill_device("yes"):
            pass


def test_state_first_is_on_by_default_and_takes_only_a_bool():
    """`state_first` moves the fused decode's reads of its state, window and batch rows before its PDL wait,
    which the interpreter has not (tests/kernels/hopper_compile.py compiles that form for sm_90; its bits on the
    H200 are tests/gpu/test_gdn_decode_fused_gpu.py's). Here: on unless asked, and the same results either way."""
    from fnattn.kernels import gdn_decode_fused as module

    assert module._STATE_FIRST[-1] is True
    a, kw = problem(2, 2, 4, kda=False)
    first = gated_delta_decode_fused(**a, **kw)
    with module.state_first(False):
        assert module._STATE_FIRST[-1] is False
        plain = gated_delta_decode_fused(**a, **kw)
    for x, y in zip(first, plain):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="state_first: expected True or False, got 1"):
        with module.state_first(1):
            pass


def test_state_first_applies_to_grids_of_at_most_two_programs_an_sm(monkeypatch):
    """The flag each launch passes: on while the grid has at most two programs an SM (Qwen3.5's batches 1
    and 8 on 132 SMs), off above (batch 32 and up), whatever the results (the same either way)."""
    from fnattn.kernels import gdn_decode_fused as module

    real, seen = module._fused_decode_kernel, []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((grid[0] * grid[1] * grid[2], kw["STATE_FIRST"]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(module, "_fused_decode_kernel", Spy())
    for sms in (1, 2, 4, 64):
        monkeypatch.setattr(module, "num_sms", lambda index=None, sms=sms: sms)
        for B in (1, 3):
            a, kw = problem(B, 2, 4, kda=False)
            with module.fill_device(False):
                gated_delta_decode_fused(**a, **kw, block_v=V)  # one V tile: B * 4 programs
            assert seen[-1] == (B * 4, B * 4 <= 2 * sms)
    assert {first for _, first in seen} == {True, False}
