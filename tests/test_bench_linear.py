"""`fnattn bench linear` on CPU: it refuses cleanly (no CUDA, rows out of the kernel's range) and its sweep grid
holds only configs the kernel takes. The timings themselves run on a GPU."""

import pytest
import torch

from fnattn.bench.linear import GRID, SHAPES, sweep_configs
from fnattn.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_linear_without_cuda_exits_2_with_one_line(tmp_path, capsys):
    out = tmp_path / "linear.json"
    assert main(["bench", "linear", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA device" in err
    assert not out.exists()


@pytest.mark.parametrize("rows", ["0", "65"])
def test_linear_rows_outside_the_kernel_range_exit_2(rows, tmp_path, capsys):
    assert main(["bench", "linear", "--batch", "1", rows, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--batch values must be 1..64 rows, got [{rows}]" in err


@pytest.mark.parametrize("K", sorted({K for _, K, _, _ in SHAPES}))
def test_sweep_grid_splits_only_where_each_piece_holds_two_tiles(K):
    configs = sweep_configs(K)
    assert len(set(configs)) == len(configs)
    unsplit = [c for c in configs if c.split_k == 1]
    assert len(unsplit) == len(GRID["block_n"]) * len(GRID["block_k"]) * len(GRID["num_warps"]) \
        * len(GRID["num_stages"])
    assert all(K // c.split_k >= 2 * c.block_k for c in configs if c.split_k > 1)
    assert any(c.split_k > 1 for c in configs)
