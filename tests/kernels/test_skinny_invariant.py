"""skinny_linear in the invariant mode: a row's bits do not change with the rows beside it.

In the mode the GEMV's launch is fixed by the weight's shape (the table's config at 16 rows), rows go in
16-row tiles over a grid axis, and where the tiles alone fill the device each program sums K's pieces itself
(``PIECES``) instead of as programs of their own: the same additions, so the same bits. The folds (residual,
SwiGLU, GDN's gating, the split RMSNorm's squares and row scale) ride on the same sums."""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fnattn.kernels.invariant import invariant  # noqa: E402
from fnattn.kernels.skinny_folds import (  # noqa: E402
    skinny_linear_add_,
    skinny_linear_gating,
    skinny_linear_swiglu,
)
from fnattn.kernels.skinny_linear import (  # noqa: E402
    launch_config,
    pick_config,
    skinny_linear,
    skinny_linear_ref,  # noqa: E402
)
from skinny_helpers import close, randn  # noqa: E402

from fnattn.kernels import skinny_linear as module  # noqa: E402

N, K = 70, 1024  # three 32-column tiles; K in 4 pieces of two 128-tiles (fp16) at 132 SMs
ROWS = (1, 5, 17, 40)  # one row tile, and two / three of them (the grid's row axis)


def _sms(monkeypatch, sms) -> list[bool]:
    """The SM count the launch sees: 132 keeps K's pieces as programs at every row count here; a few make the
    calls of more than one row tile sum them in one program (``PIECES``). ``-> [PIECES of each launch]``."""
    monkeypatch.setattr(module, "num_sms", lambda index=None: sms)
    seen, plan = [], module._plan

    def recording(*args):
        p = plan(*args)
        seen.append(p.constexprs["PIECES"] and p.grid[1] == 1)
        # more than one row tile: the row tiles of a weight slab side by side on axis 0
        assert p.constexprs["ROWS_FIRST"] == (p.row_tiles > 1)
        assert p.grid == ((p.row_tiles, p.grid[1], p.col_tiles) if p.row_tiles > 1 else (p.col_tiles, p.grid[1], 1))
        return p

    monkeypatch.setattr(module, "_plan", recording)
    return seen


@pytest.mark.parametrize("sms", [132, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + [torch.bfloat16] * torch.cuda.is_available())
def test_a_row_is_the_same_bits_in_a_call_of_any_size(monkeypatch, sms, dtype):
    pieces = _sms(monkeypatch, sms)
    x = randn(max(ROWS), K, dtype=dtype, seed=1)
    w = randn(N, K, dtype=dtype, seed=2) / K ** 0.5
    with invariant(True):
        cfg = launch_config(1, N, K, dtype, sms=sms)
        assert cfg == launch_config(max(ROWS), N, K, dtype, sms=sms)  # fixed by the weight's shape
        assert cfg.split_k > 1  # K's pieces are in play
        alone = torch.cat([skinny_linear(x[i:i + 1], w) for i in range(max(ROWS))])
        for M in ROWS:
            assert torch.equal(skinny_linear(x[:M], w), alone[:M]), M
    assert any(pieces) == (sms < 132) and not all(pieces)
    close(alone, skinny_linear_ref(x, w), dtype)


def test_the_mode_takes_more_rows_than_the_table_and_the_table_is_its_own_outside():
    x = randn(80, 64, dtype=torch.float16, seed=3)
    w = randn(32, 64, dtype=torch.float16, seed=4)
    with pytest.raises(ValueError, match="x: expected at most 64 rows .*got 80"):
        skinny_linear(x, w)
    with invariant(True):
        close(skinny_linear(x, w), skinny_linear_ref(x, w), torch.float16)
    assert launch_config(3, N, K, torch.float16, sms=132) == pick_config(3, N, K, torch.float16, sms=132)
    with invariant(True):
        assert launch_config(40, N, K, torch.float16, sms=132) == \
            pick_config(16, N, K, torch.float16, sms=132)


@pytest.mark.parametrize("sms", [132, 8])
def test_the_folds_keep_a_row_to_itself(monkeypatch, sms):
    """SwiGLU, the residual add with the next norm's squares, the row scale and GDN's gating: each row of
    a 20-row call (two row tiles) is the one-row call's bits."""
    pieces = _sms(monkeypatch, sms)
    dtype, M, H = torch.float16, 20, 8  # two row tiles, the second partial
    x = randn(M, K, dtype=dtype, seed=5)
    w = randn(2 * N, K, dtype=dtype, seed=6) / K ** 0.5
    res = randn(M, 2 * N, dtype=dtype, seed=7)
    weight = randn(2 * N, dtype=dtype, seed=8) * 0.1
    nd, dtb = -randn(H, seed=9).abs(), randn(H, seed=10)
    with invariant(True):
        def each(f):
            return [f(slice(i, i + 1)) for i in range(M)], f(slice(0, M))

        ones, whole = each(lambda r: skinny_linear_swiglu(x[r], w))
        assert torch.equal(torch.cat(ones), whole)
        ones, whole = each(lambda r: skinny_linear_add_(x[r], w, res[r].clone(), weight, 1.0))
        for j in range(3):  # the sum, the scaled rows and the squares in pieces
            assert torch.equal(torch.cat([o[j] for o in ones]), whole[j]), j
        squares = whole[2]
        ones, whole = each(lambda r: skinny_linear(x[r], w, rms=(squares[r], 1e-6)))
        assert torch.equal(torch.cat(ones), whole)
        ones, whole = each(lambda r: skinny_linear_gating(x[r], w, 16, nd, dtb))
        for j in range(3):
            assert torch.equal(torch.cat([o[j] for o in ones]), whole[j]), j
    assert any(pieces) == (sms < 132) and not all(pieces)


def test_a_config_of_its_own_keeps_its_bits_in_the_mode(monkeypatch):
    """A caller's config (a first load of two tiles, two K pieces) at 40 rows, the tiles filling the device: the
    pieces stay programs of their own, and each row is the one-row call's bits."""
    from fnattn.kernels.skinny_linear import SkinnyConfig

    pieces = _sms(monkeypatch, 4)
    cfg = SkinnyConfig(block_n=32, block_k=32, split_k=2, early=2)
    x, w = randn(40, 256, dtype=torch.float16, seed=11), randn(N, 256, dtype=torch.float16, seed=12) / 16
    with invariant(True):
        whole = skinny_linear(x, w, config=cfg)
        assert torch.equal(torch.cat([skinny_linear(x[i:i + 1], w, config=cfg) for i in range(40)]), whole)
    assert not any(pieces)
    close(whole, skinny_linear_ref(x, w), torch.float16)


@pytest.mark.parametrize("sms, rows, swiglu_rows", [(2, 64, 64), (4, 32, 64), (132, 16, 16)])
def test_wider_row_tiles_where_they_fill_the_device_but_not_for_the_squares(monkeypatch, sms, rows, swiglu_rows):
    """`wide_invariant_rows`: past 16 rows a plain product, SwiGLU, gating, the norm on load and the row scale
    take 64- or 32-row tiles where those still give every SM a program (three column tiles here, five for
    SwiGLU's), each row the one-row call's bits; the residual add with its squares (whose bits moved with the
    tile's height on the H100) and the switch off keep 16 (column tiles as the 16-row table gives them:
    `invariant_tiles` off). (Under the interpreter the bits are numpy's; the GPU run of this file checks the
    MMA's.)"""
    from fnattn.kernels.skinny_linear import invariant_tiles, wide_invariant_rows

    monkeypatch.setattr(module, "_INVARIANT_TILES", [False])  # the table's column tiles, whatever the default
    assert invariant_tiles  # the switch this pins

    monkeypatch.setattr(module, "num_sms", lambda index=None: sms)
    heights, plan = [], module._plan

    def recording(*args):
        p = plan(*args)
        heights.append(p.constexprs["BLOCK_M"])
        return p

    monkeypatch.setattr(module, "_plan", recording)
    dtype, M, k = torch.float16, 40, 256
    x, w = randn(M, k, dtype=dtype, seed=13), randn(N, k, dtype=dtype, seed=14) / 16
    w2 = randn(2 * N, k, dtype=dtype, seed=15) / 16
    with invariant(True):
        alone = torch.cat([skinny_linear(x[i:i + 1], w) for i in range(M)])
        heights.clear()
        assert torch.equal(skinny_linear(x, w), alone)
        assert torch.equal(skinny_linear_swiglu(x, w2), torch.cat([skinny_linear_swiglu(x[i:i + 1], w2)
                                                                   for i in range(M)]))
        assert heights[:2] == [rows, swiglu_rows]  # the two whole calls
        heights.clear()
        res, weight = randn(M, 2 * N, dtype=dtype, seed=16), randn(2 * N, dtype=dtype, seed=17) * 0.1
        _, _, squares = skinny_linear_add_(x, w2, res, weight, 1.0)
        skinny_linear(x, w2, rms=(squares, 1e-6))
        skinny_linear(x, w2, norm=(randn(k, dtype=dtype, seed=18), 1e-6, 1.0))
        assert heights == [16, swiglu_rows, swiglu_rows], heights
        heights.clear()
        with wide_invariant_rows(False):
            assert torch.equal(skinny_linear(x, w), alone)
        assert heights == [16]
    close(alone, skinny_linear_ref(x, w), dtype)


@pytest.mark.parametrize("N, sms, block_n, stages", [(80, 4, 64, 4), (48, 132, 32, 4), (4000, 4, 128, 3)])
def test_invariant_tiles_widen_the_column_tile_the_table_narrowed(monkeypatch, N, sms, block_n, stages):
    """`invariant_tiles`: in the mode a projection whose 16-row table tile narrowed to 32 columns takes 64 (4
    stages), one of at least 8 x SMs 64-column tiles takes 128 (3 stages), a split one keeps the table's; one
    config at every row count, so each row is the one-row call's bits. Off: the table's 16-row config."""
    from fnattn.kernels.skinny_linear import invariant_tiles, launch_config

    monkeypatch.setattr(module, "num_sms", lambda index=None: sms)
    K = 128 if N < 4000 else 64
    with invariant(True):
        cfg = [launch_config(m, N, K, torch.float16, sms=sms) for m in (1, 16, 40)]
        assert cfg[0] == cfg[1] == cfg[2] and (cfg[0].block_n, cfg[0].num_stages) == (block_n, stages)
        with invariant_tiles(False):
            table = launch_config(40, N, K, torch.float16, sms=sms)
        assert table == dataclasses.replace(module._table(16, N, K, torch.float16, sms), dot=True, early=1)
        if N < 4000:
            x, w = randn(40, K, dtype=torch.float16, seed=21), randn(N, K, dtype=torch.float16, seed=22) / 8
            whole = skinny_linear(x, w)
            assert torch.equal(whole[:16], skinny_linear(x[:16], w))  # the same config at 16 and 40 rows
            close(whole, skinny_linear_ref(x, w), torch.float16)
    split = module._table(16, 1024, 2048, torch.float16, 132)
    assert split.split_k > 1 and module._invariant_tiles(split, 1024, 132) == split
