"""`fnattn bench linear` on CPU: it refuses cleanly (no CUDA, rows out of the kernel's range), the sweep grid of
``benchmarks/linear_sweep.py`` holds only configs the kernel takes, and a case's records with the sweep's best and
a fold case's (with a stand-in timer over the interpreted kernel) say what they promise. The timings themselves run
on a GPU."""

import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fnattn.kernels.skinny_linear import pick_config  # noqa: E402
from helpers import benchmark_module  # noqa: E402

from fnattn.bench import with_ratios  # noqa: E402
from fnattn.bench.linear import (  # noqa: E402
    CALLS,
    FOLD_EPS,
    SHAPES,
    fold_case,
    print_linear_table,
)
from fnattn.cli import main  # noqa: E402

linear_sweep = benchmark_module("linear_sweep")
FMA_PRODUCTS, FMA_ROWS, GRID = linear_sweep.FMA_PRODUCTS, linear_sweep.FMA_ROWS, linear_sweep.GRID
sweep_configs = linear_sweep.sweep_configs


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


@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("K", sorted({K for _, K, _, _ in SHAPES}))
def test_sweep_grid_splits_only_where_each_piece_holds_two_tiles(K, rows):
    configs = sweep_configs(K, rows)
    assert len(set(configs)) == len(configs)
    unsplit = [c for c in configs if c.split_k == 1 and c.dot]
    assert len(unsplit) == len(GRID["block_n"]) * len(GRID["block_k"]) * len(GRID["num_warps"]) \
        * len(GRID["num_stages"])
    assert all(K // c.split_k >= 2 * c.block_k for c in configs if c.split_k > 1)
    assert any(c.split_k > 1 for c in configs)
    fma = [c for c in configs if not c.dot]
    assert bool(fma) == (rows <= FMA_ROWS)
    assert all(rows * c.block_n * c.block_k <= FMA_PRODUCTS * c.num_warps // 4 for c in fma)


@pytest.mark.parametrize("act", [None, "silu_mul"])
def test_case_records_cublas_table_and_the_best_of_the_sweep(act):
    pytest.importorskip("triton")
    times = itertools.cycle([9.0, 4.0, 6.0, 2.5, 8.0, 3.0, 7.0])
    calls = []

    def timer(call, copies, **options):
        for i in (0, copies - 1):  # the first and the last weight copy run (the interpreted kernel on CPU)
            call(i)
        calls.append(copies)
        if len(calls) == 5:
            raise RuntimeError("out of resource: shared memory")  # one sweep config the device refuses
        return next(times)

    K, N, rows = 96, 40, 3
    records = with_ratios(linear_sweep.sweep_case(rows=rows, name="tiny", K=K, N=N, act=act, dtype=torch.float32,
                                                  device="cpu", timer=timer))
    peer, table, best = records
    assert [r["backend"] for r in records] == [peer["peer"], "skinny table", "skinny best"]
    assert all(r["weight_bytes"] == N * K * 4 and r["weight_copies"] == CALLS and r["act"] == act for r in records)
    assert table["config"] == vars(pick_config(rows, N, K, torch.float32))
    sweep = best["sweep"]
    assert len(sweep) == len(sweep_configs(K, rows)) and sum("error" in t for t in sweep) == 1
    fastest = min((t for t in sweep if "time_us" in t), key=lambda t: t["time_us"])
    assert best["time_us"] == fastest["time_us"] and best["config"] == {k: v for k, v in fastest.items()
                                                                         if k != "time_us"}
    assert best["table_vs_best"] == table["time_us"] / best["time_us"]
    for r in (table, best):
        assert r["ratio_to_peer"] == peer["time_us"] / r["time_us"]
        assert r["tb_s"] == N * K * 4 / (r["time_us"] * 1e-6) / 1e12


def test_fold_case_records_the_unfused_and_the_folded_pair(capsys):
    """Both timed calls compute the pair's answer (the folded one against the unfused torch math), and the
    records say which is which."""
    pytest.importorskip("triton")
    from fnattn.kernels.skinny_linear import skinny_linear_ref
    from fnattn.models.common import rms_norm

    outputs, times = [], iter([7.0, 5.0])

    def timer(call, copies, **options):
        outputs.append([call(i) for i in range(copies)])
        return next(times)

    rows, K, N, hidden = 3, 96, 40, 32
    records = with_ratios(fold_case(rows=rows, name="tiny", K=K, N=N, hidden=hidden, dtype=torch.float32,
                                    device="cpu", timer=timer))
    unfused, folded = records
    assert [r["backend"] for r in records] == ["down + add_rmsnorm + up", "skinny fold (residual=, norm=)"]
    assert all(r["peer"] == unfused["backend"] and r["norm_kernel"] == "torch" for r in records)
    wbytes = (hidden * K + N * hidden) * 4
    assert all(r["weight_bytes"] == wbytes and r["weight_copies"] == CALLS and r["case"] == unfused["case"]
               for r in records)
    assert folded["ratio_to_peer"] == 7.0 / 5.0 and "ratio_to_peer" not in unfused
    assert folded["tb_s"] == wbytes / (5.0 * 1e-6) / 1e12
    assert folded["configs"]["down"]["block_n"] >= 16 and folded["configs"]["up"]["block_k"] == 64
    # Rebuild the case's tensors (same seed and order) to check the folded answers.
    g = torch.Generator().manual_seed(0)
    downs = [torch.randn(hidden, K, generator=g) * K ** -0.5 for _ in range(CALLS)]
    ups = [torch.randn(N, hidden, generator=g) * hidden ** -0.5 for _ in range(CALLS)]
    x, residual = torch.randn(rows, K, generator=g), torch.randn(rows, hidden, generator=g)
    weight = torch.randn(hidden, generator=g) * 0.1
    # Off CUDA `add_rms_norm_offset_` is its torch body, which leaves the residual as it was.
    for i in range(CALLS):
        h = skinny_linear_ref(x, downs[i], residual=residual)
        want = skinny_linear_ref(h, ups[i], norm=(weight, FOLD_EPS, 1.0))
        torch.testing.assert_close(outputs[1][i], want, rtol=1e-4, atol=1e-4)
        unfused_want = rms_norm(residual + x @ downs[i].T, weight, FOLD_EPS, offset=1.0) @ ups[i].T
        torch.testing.assert_close(outputs[0][i], unfused_want, rtol=1e-4, atol=1e-4)
    print_linear_table(records)
    assert "skinny fold (residual=, norm=)" in capsys.readouterr().out


def test_the_table_prints_rows_without_a_time_of_their_own(capsys):
    """A floor row whose kernel half could not be timed (no time_us, a why) prints as such, not as a KeyError that
    ends the bench before its record is written."""
    from fnattn.bench import print_table

    print_table([{"case": "c", "backend": "timed", "time_us": 12.5},
                 {"case": "c", "backend": "floor", "keys_us": 3.0, "why": "this build has no such op"},
                 {"case": "c", "backend": "broken", "error": "no kernel"}])
    out = capsys.readouterr().out.splitlines()
    assert "12.5" in out[1] and "this build has no such op" in out[2] and "ERROR no kernel" in out[3]
