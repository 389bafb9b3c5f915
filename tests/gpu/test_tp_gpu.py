"""Tensor parallelism on two GPUs over NCCL: tp=2 logits equal tp=1's, requests move between the degrees
over NCCL, and decode throughput at tp=2 against tp=1.

One spawn of two processes (rank r on ``cuda:r``, NVLink multicast off), the
same measurements as tests/test_tp.py's gloo run (`_case` there) for every
family in fp32 and bf16, with the fast backends of each GPU (decode steps
also through each rank's `StepRunner`, which captures them in a CUDA graph,
NCCL all-reduces included, where every backend is capturable), plus a decode
timing of a larger Llama-shaped model. Skipped without two CUDA devices.
Record: ``FNATTN_GPU_RESULTS=tests/gpu_results/tp_gpu.json pytest tests/gpu/test_tp_gpu.py``.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

from fnattn.models.registry import random_model  # noqa: E402
from test_generation import bpe  # noqa: E402, F401 (a fixture: the trained byte-level BPE tokenizer)
from test_tp import CASES, DECODE, _case, _free_port, _generate_args, _Runner, checkpoint  # noqa: E402, F401

from fnattn import tp  # noqa: E402
from fnattn.models import tp as mtp  # noqa: E402

DEADLINE = 540.0
# fp32: absolute (other kernels' and head counts' rounding); bf16: relative to the largest logit
TOL = {"float32": 1e-3, "bfloat16": 5e-2}  # bf16 on gloo (CPU): up to 2.5% (Qwen3-Next, MoE routing)
BENCH = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 4,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
         "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
         "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
BATCH, CONTEXT, STEPS = 16, 512, 40


def _decode_rate(runner: _Runner, group_barrier) -> float:
    """Decode tokens/s of ``BATCH`` requests at ``CONTEXT`` tokens (median of ``STEPS`` steps)."""
    st = runner.state(pages=BATCH * ((CONTEXT + STEPS) // 16 + 2), requests=BATCH, page_size=16)
    g = torch.Generator().manual_seed(0)
    prompts = {r: torch.randint(0, BENCH["vocab_size"], (CONTEXT,), generator=g).tolist() for r in range(BATCH)}
    st, _ = runner.prefill(st, prompts)
    times = []
    for _ in range(STEPS):
        group_barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        st, _ = runner.decode(st, {r: 1 for r in range(BATCH)})
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return BATCH / times[len(times) // 2]


def _worker(rank: int, port: int, result_dir: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    results: dict = {}
    try:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
        group = tp.TPGroup.of()
        device = f"cuda:{rank}"
        for dtype in (torch.float32, torch.bfloat16):
            for case in CASES:
                key = f"{case}-{str(dtype).removeprefix('torch.')}"
                try:
                    results[key] = _case(case, group, device, dtype)
                except Exception as e:
                    results[key] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
                    raise
        barrier = dist.barrier
        one = _Runner(random_model("llama", seed=0, config=BENCH, dtype=torch.bfloat16, device=device), device)
        results["tp1_tok_s"] = _decode_rate(one, lambda: None) if rank == 0 else None
        del one
        torch.cuda.empty_cache()
        barrier()
        two = _Runner(mtp.random_model_tp("llama", group, seed=0, config=BENCH, dtype=torch.bfloat16,
                                          device=device), device)
        results["tp2_tok_s"] = _decode_rate(two, barrier)
        dist.destroy_process_group()
    except Exception as e:
        results.setdefault("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    os._exit(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off (not every machine's driver has it)
    result_dir = tmp_path_factory.mktemp("tp_gpu")
    ctx = mp.start_processes(_worker, args=(_free_port(), str(result_dir)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + DEADLINE
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"the two GPU ranks did not finish within {DEADLINE} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    out = []
    for rank in (0, 1):
        with open(result_dir / f"rank{rank}.pkl", "rb") as f:
            out.append(pickle.load(f))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_tp2_over_nccl_matches_tp1_and_moves_requests(ranks, case, dtype, record):
    key = f"{case}-{dtype}"
    rows = [r.get(key) for r in ranks]
    for r in rows:
        assert r is not None, (ranks[0].get("error"), ranks[1].get("error"))
        assert "error" not in r, r["error"]
    first, second = rows
    tol = TOL[dtype] * (1.0 if dtype == "float32" else max(1.0, first["scale"]))
    worst = max(max(r["diffs"] + r["runner_diffs"]) for r in rows)
    moved = max(first["to_tp1"], first["to_tp2"], second["to_tp2"])
    ok = worst <= tol and moved <= tol and len(first["diffs"]) == 1 + DECODE
    record({"test": "tp2_nccl_parity", "case": case, "family": first["family"], "dtype": dtype,
            "max_abs_logit_diff": worst, "transfer_max_abs_logit_diff": moved, "tol": tol,
            "decode_captured": [r["captured"] for r in rows], "ok": ok})
    assert worst <= tol, [r["diffs"] for r in rows]
    assert moved <= tol, (first["to_tp1"], first["to_tp2"], second["to_tp2"])


def test_decode_throughput_tp2_against_tp1(ranks, record):
    for r in ranks:
        assert "error" not in r, r["error"]
    one, two = ranks[0]["tp1_tok_s"], ranks[0]["tp2_tok_s"]
    record({"test": "tp_decode_throughput", "model": {k: BENCH[k] for k in ("hidden_size", "num_hidden_layers",
                                                                              "num_attention_heads",
                                                                              "num_key_value_heads")},
            "dtype": "bfloat16", "batch": BATCH, "context": CONTEXT, "tp1_tokens_per_s": one,
            "tp2_tokens_per_s": two, "speedup": two / one, "ok": two > 0 and one > 0})
    assert one > 0 and two > 0



def test_generate_tp2_on_two_gpus_gives_tp1s_tokens(checkpoint, capsys, record):  # noqa: F811
    import json
    import subprocess
    import sys

    from fnattn.cli import main

    assert main([*_generate_args(checkpoint), "--device", "cuda:0"]) == 0
    want = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["completions"][0]["ids"]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "fnattn", *_generate_args(checkpoint), "--tp", "2",
           "--device", "cuda"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    got = json.loads(lines[0])["completions"][0]["ids"] if run.returncode == 0 and len(lines) == 1 else None
    record({"test": "generate_tp2_cuda", "command": " ".join(cmd[2:]), "tp1_ids": want, "tp2_ids": got,
            "ok": got == want})
    assert run.returncode == 0, run.stderr[-3000:]
    assert got == want
