"""Tensor parallelism on the CPU: two gloo processes on loopback give tp=1's logits for every family.

One spawn of two processes for the module: each rank builds every family's
tiny random model whole (the tp=1 reference) and sharded over the two ranks,
runs a two-request prefill and a few decode steps through both (the sharded
model's decode steps also through its `StepRunner`, padded, without host
reads: what CUDA captures per rank), and moves a
request between the degrees (tp=2 prefill -> tp=1 decode on rank 0, through
`send_request` / `gather_request`; tp=1 prefill -> tp=2 decode through
`split_request`). The ranks write what they measured to files; the tests
read them. The sharding checks run in this process.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from fnattn.models.registry import FAMILIES, Family, _load_builtin, random_model
from test_generation import bpe  # noqa: F401 (a fixture: the trained byte-level BPE tokenizer)

import fnattn as fa
from fnattn import tp
from fnattn.graph import StepRunner
from fnattn.models import tp as mtp
from fnattn.transfer import recv_request, send_request

_load_builtin()
# every family with a TP plan, and Llama with one KV head: replicated on both ranks
CASES = {name: None for name in sorted(FAMILIES) if name in mtp.FAMILY_TP}
CASES["llama_kv1"] = ("llama", {"num_key_value_heads": 1})
DEADLINE = 90.0  # the whole spawn, in seconds
PROMPTS = {0: 7, 1: 5}  # request -> prompt length
DECODE = 3
TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _family(case: str) -> tuple[str, dict | None]:
    if CASES[case] is None:
        return case, None
    name, override = CASES[case]
    fam = FAMILIES[name]
    return name, {**fam.tiny_config(), **override}


class _Runner:
    """One model's steps through a fresh State."""

    def __init__(self, model, device="cpu"):
        self.model, self.device = model, device
        self.attn = fa.ModelAttention(model.specs, device=device)

    def state(self, pages=24, requests=3, page_size=4):
        return fa.State(self.model.specs, num_pages=pages, page_size=page_size, max_requests=requests,
                        recurrent_ring=2, device=self.device)

    def run(self, state, batch, tokens):
        with self.attn.session(state, batch) as s:
            logits, deltas = self.model.step(self.model.params, s, torch.tensor(tokens, device=self.device))
        return state.apply(deltas), logits

    def prefill(self, state, prompts):
        counts = {r: len(p) for r, p in prompts.items()}
        for r in prompts:
            state = state.admit(r)
        state = state.reserve(counts)
        batch = fa.Batch.prefill(state, counts)
        return self.run(state, batch, [t for r in batch.request_ids for t in prompts[r]])

    def decode(self, state, tokens: dict[int, int]):
        state = state.reserve({r: 1 for r in tokens})
        batch = fa.Batch.decode(state, list(tokens))
        return self.run(state, batch, [tokens[r] for r in batch.request_ids])


def _prompts(vocab: int) -> dict[int, list[int]]:
    g = torch.Generator().manual_seed(5)
    return {r: torch.randint(0, vocab, (n,), generator=g).tolist() for r, n in PROMPTS.items()}


def _diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def _case(case: str, group: tp.TPGroup, device="cpu", dtype=torch.float32) -> dict:
    """tp=1 and tp=2 logits of one family side by side, and its request moved between the degrees."""
    name, config = _family(case)
    full = _Runner(random_model(name, seed=3, config=config, device=device, dtype=dtype), device)
    part = _Runner(mtp.random_model_tp(name, group, seed=3, config=config, device=device, dtype=dtype), device)
    prompts = _prompts(full.model.config.vocab_size)
    out = {"heads": [s.config for s in part.model.specs][:2], "family": name}

    # tp=1 and tp=2 side by side; both take the reference's greedy tokens, so the inputs never diverge
    a, want = full.prefill(full.state(), prompts)
    b, got = part.prefill(part.state(), prompts)
    diffs, out["scale"] = [_diff(got, want)], float(want.float().abs().max())
    ref_steps, ref_logits = [], []
    for _ in range(DECODE):
        ends = torch.tensor(list(PROMPTS.values())).cumsum(0) - 1 if not ref_steps else torch.arange(len(PROMPTS))
        tokens = {r: int(want[ends[i]].argmax()) for i, r in enumerate(PROMPTS)}
        ref_steps.append(tokens)
        a, want = full.decode(a, tokens)
        b, got = part.decode(b, tokens)
        ref_logits.append(want)
        diffs.append(_diff(got, want))
    out["diffs"] = diffs
    layer = full.model.specs[0].index  # what the pools of the first layer hold, per token or request
    out["pools"] = [{n: tuple(v.shape) for n, v in st.views(layer).items()} for st in (a, b)]

    # the same decode steps through the rank's StepRunner: padded to a bucket of 4 lanes (pad lanes on the
    # null page and slot), no host reads; on CUDA each rank captures its step, all-reduces included
    model = part.model
    runner = StepRunner(model.step, model.params, part.attn, model.manifest(), host_reads="error", max_context=64,
                        buckets=(4,))
    b, _ = part.prefill(part.state(pages=32, requests=4), prompts)
    runner_diffs = []
    for tokens, want in zip(ref_steps, ref_logits):
        b = b.reserve({r: 1 for r in tokens})
        b, got = runner.decode(b, list(tokens), torch.tensor(list(tokens.values()), device=device))
        runner_diffs.append(_diff(got, want))
    out["runner_diffs"], out["captured"] = runner_diffs, bool(runner.capture)

    # tp=2 prefill -> tp=1 decode: rank 1 sends its heads of request 0 to rank 0, which puts them together
    a, _ = full.prefill(full.state(), {0: prompts[0]})
    b, _ = part.prefill(part.state(), {0: prompts[0]})
    follow = {0: ref_steps[0][0]}
    whole, mine = a.export_request(0), b.export_request(0)
    _, want = full.decode(a, follow)
    if group.rank == 1:
        send_request(mine, 0)
    else:
        gathered = mtp.gather_request([mine, recv_request(1, timeout=20.0)], full.model.specs)
        # rows of tp=1's own prefill, up to the all-reduce's rounding of the residual stream
        out["gathered_vs_tp1"] = max(float((gathered.tensors[k].float() - whole.tensors[k].float()).abs().max())
                                     if whole.tensors[k].numel() else 0.0 for k in whole.tensors)
        c, _ = full.state().import_request(gathered)
        _, got = full.decode(c, follow)
        out["to_tp1"] = _diff(got, want)

    # tp=1 prefill -> tp=2 decode: each rank cuts its heads out of the whole request
    split = mtp.split_request(whole, full.model.specs, group.size, group.rank)
    out["split_vs_tp2"] = max(float((split.tensors[k].float() - mine.tensors[k].float()).abs().max())
                              if mine.tensors[k].numel() else 0.0 for k in mine.tensors)
    c, _ = part.state().import_request(split)
    _, got = part.decode(c, follow)
    out["to_tp2"] = _diff(got, want)
    return out


def _worker(rank: int, port: int, result_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    results: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=30))
        group = tp.TPGroup.of()
        for case in CASES:
            try:
                results[case] = _case(case, group)
            except Exception as e:  # one family's failure is reported, the others still run
                results[case] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
                break  # the peer may now wait on a collective this rank will not join
        dist.destroy_process_group()
    except Exception as e:
        results["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    os._exit(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """``-> [rank 0's results, rank 1's results]``, each ``{case: measurements}``."""
    result_dir = tmp_path_factory.mktemp("tp")
    ctx = mp.start_processes(_worker, args=(_free_port(), str(result_dir)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + DEADLINE
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"the two tp ranks did not finish within {DEADLINE} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    out = []
    for rank in (0, 1):
        with open(result_dir / f"rank{rank}.pkl", "rb") as f:
            out.append(pickle.load(f))
    for r in out:
        assert "error" not in r, r["error"]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_logits_equal_tp1_eager_and_through_the_step_runner(ranks, case):
    for rank, results in enumerate(ranks):
        got = results.get(case)
        assert got is not None, f"rank {rank} did not reach {case}"
        assert "error" not in got, got["error"]
        assert len(got["diffs"]) == 1 + DECODE
        assert max(got["diffs"]) <= TOL, (rank, got["diffs"])
        assert len(got["runner_diffs"]) == DECODE and max(got["runner_diffs"]) <= TOL, (rank, got["runner_diffs"])


@pytest.mark.parametrize("case", list(CASES))
def test_a_request_moves_between_tp2_and_tp1(ranks, case):
    first, second = ranks[0][case], ranks[1][case]
    assert "error" not in first and "error" not in second
    assert first["gathered_vs_tp1"] <= TOL, "the gathered heads differ from tp=1's own state"
    assert first["to_tp1"] <= TOL
    for got in (first, second):
        assert got["split_vs_tp2"] <= TOL, "the split request differs from the rank's own state"
        assert got["to_tp2"] <= TOL


def test_rank_specs_hold_the_ranks_heads(ranks):
    heads = ranks[0]["llama"]["heads"][0]
    assert (heads.num_q_heads, heads.num_kv_heads) == (2, 1)
    kv1 = ranks[1]["llama_kv1"]["heads"][0]
    assert (kv1.num_q_heads, kv1.num_kv_heads) == (2, 1)  # the one KV head, on both ranks
    gdn = ranks[0]["qwen3_5"]["heads"][0]
    assert (gdn.num_k_heads, gdn.num_v_heads) == (1, 2)
    assert ranks[0]["deepseek_v3"]["heads"][0].num_heads == 2
    assert ranks[0]["kimi_linear"]["heads"][0].num_heads == 1  # KDA: 2 heads over 2 ranks
    assert ranks[0]["deepseek_v4"]["heads"][0].num_heads == 2
    # the rank's State holds its heads only: [pages, page size, heads, dim] and [slots, heads, K, V]
    whole, mine = ranks[1]["llama"]["pools"]
    assert mine["k"][:2] == whole["k"][:2] and (whole["k"][2], mine["k"][2]) == (2, 1)
    whole, mine = ranks[1]["qwen3_5"]["pools"]
    assert (whole["ssm"][1], mine["ssm"][1]) == (4, 2) and 2 * mine["conv"][1] == whole["conv"][1]
    whole, mine = ranks[1]["deepseek_v3"]["pools"]
    assert whole == mine  # MLA's latent is every head's: each rank keeps it whole


# --------------------------------------------------------------------------- in this process


def _group(size: int, rank: int = 0) -> tp.TPGroup:
    return tp.TPGroup(size, rank, backend="gloo")  # no collective runs before the sharding fails


@pytest.mark.parametrize("name, config, size, field", [
    ("llama", {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16}, 4, "num_attention_heads"),
    ("llama", {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16}, 3, "num_key_value_heads"),
    ("qwen3", {"intermediate_size": 130}, 4, "intermediate_size"),
    ("qwen3_5", {}, 4, "linear_num_key_heads"),
    ("deepseek_v32", {}, 8, "num_heads"),
    ("kimi_linear", {}, 4, "kda_heads"),
    ("deepseek_v4", {}, 4, "o_groups"),  # 4 heads split, their 2 output groups do not
])
def test_heads_that_do_not_split_are_refused_naming_the_field(name, config, size, field):
    cfg = {**FAMILIES[name].tiny_config(), **config}
    with pytest.raises(ValueError, match=rf"tp={size}: `{field}` must be a multiple of tp={size}"):
        mtp.random_model_tp(name, _group(size), config=cfg)


def test_kv_heads_fewer_than_ranks_are_replicated():
    cfg = {**FAMILIES["llama"].tiny_config(), "num_attention_heads": 8, "num_key_value_heads": 2}
    parts = [mtp.random_model_tp("llama", _group(4, r), seed=1, config=cfg) for r in range(4)]
    full = random_model("llama", seed=1, config=cfg)
    assert [p.specs[0].config.num_kv_heads for p in parts] == [1] * 4
    k = full.params.layers[0].k[0]  # [2 * Dh, D]
    Dh = full.config.head_dim
    for r, p in enumerate(parts):  # ranks 0, 1 share KV head 0; ranks 2, 3 KV head 1
        torch.testing.assert_close(p.params.layers[0].k[0], k[(r // 2) * Dh:(r // 2 + 1) * Dh], rtol=0, atol=0)


def test_shard_then_unshard_is_the_identity_and_refuses_unequal_replicas():
    segs = (tp.Segment(2, 3, "a"), tp.Segment(1, 2, "b", replicate=True), tp.Segment(4, 1, "c"))
    x = torch.arange(2 * 3 + 2 + 4).float()[:, None].expand(-1, 5).clone()
    parts = [tp.shard(x, 0, segs, 2, r) for r in range(2)]
    assert [p.shape[0] for p in parts] == [3 + 2 + 2] * 2
    torch.testing.assert_close(tp.unshard(parts, 0, segs), x, rtol=0, atol=0)
    parts[1][3] += 1  # rank 1's copy of the replicated block
    with pytest.raises(ValueError, match=r"`parts\[1\]` must be the same replicated b block as rank 0"):
        tp.unshard(parts, 0, segs)


def test_all_reduce_is_the_identity_outside_a_group_of_several():
    x = torch.randn(3, 4)
    assert tp.all_reduce(x) is x
    with tp.active(tp.TPGroup.single()):
        assert tp.all_reduce(x) is x
    assert tp.current() is None


def test_gather_refuses_payloads_of_other_specs():
    model = random_model("llama", seed=0)
    r = _Runner(model)
    st, _ = r.prefill(r.state(), {0: [1, 2, 3]})
    whole = st.export_request(0)
    with pytest.raises(ValueError, match=r"`parts\[0\]` must be a payload of the tp=2 rank specs"):
        mtp.gather_request([whole, whole], model.specs)
    halves = [mtp.split_request(whole, model.specs, 2, rank) for rank in range(2)]
    again = mtp.gather_request(halves, model.specs)
    assert again.checksum == whole.checksum
    with pytest.raises(ValueError, match=r"`payload` must be a payload of the whole model's specs"):
        mtp.split_request(halves[0], model.specs, 2, 0)


@pytest.mark.parametrize("name", sorted(set(FAMILIES) - set(mtp.FAMILY_TP)) or ["none"])
def test_a_family_without_a_tp_plan_is_refused_by_name(name):
    if name == "none":
        assert set(FAMILIES) <= set(mtp.FAMILY_TP)
        return
    with pytest.raises(ValueError, match=rf"`family` must be one with a TP plan .*got '{name}'"):
        mtp.random_model_tp(name, _group(2))


def test_a_tp_model_refuses_a_family_without_a_plan():
    with pytest.raises(ValueError, match=r"`family` must be one with a TP plan"):
        mtp.shard_weights(Family("x", (), None, None, None, None, None), None, {}, 2, 0)


# --------------------------------------------------------------------------- fnattn generate --tp


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, bpe):  # noqa: F811
    """A tiny random Llama checkpoint directory (config.json, model.safetensors, tokenizer.json)."""
    import json

    from fnattn.models.registry import family_named, random_weights
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("tp_ckpt")
    fam = family_named("llama")
    raw = {**fam.tiny_config(), "vocab_size": bpe.get_vocab_size(), "eos_token_id": 0}
    (path / "config.json").write_text(json.dumps(raw))
    save_file(random_weights(fam.weight_shapes(fam.adapt(raw)), seed=4), str(path / "model.safetensors"))
    bpe.save(str(path / "tokenizer.json"))
    return path


def _generate_args(path) -> list[str]:
    return ["generate", "--model", str(path), "--prompt", "the cat sat", "--max-new-tokens", "5", "--json"]


def test_generate_tp2_under_torchrun_gives_tp1s_tokens(checkpoint, capsys):
    import json
    import subprocess
    import sys

    from fnattn.cli import main

    assert main(_generate_args(checkpoint)) == 0
    want = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["completions"][0]["ids"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "fnattn", *_generate_args(checkpoint), "--tp", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, run.stdout  # rank 0 alone prints
    assert json.loads(lines[0])["completions"][0]["ids"] == want
    assert "tp=2]" in run.stderr


@pytest.mark.parametrize("env, message", [
    ({}, "--tp 2: needs a torchrun launch (torchrun --nproc-per-node 2 -m fnattn ...): RANK, WORLD_SIZE, "
         "MASTER_ADDR, MASTER_PORT not set"),
    ({"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
     "--tp 2: torchrun started WORLD_SIZE=3 processes, not 2"),
])
def test_generate_tp_outside_its_torchrun_launch_exits_2_with_one_line(checkpoint, capsys, monkeypatch, env,
                                                                        message):
    from fnattn.cli import main

    for k in tp.TORCHRUN_ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        main([*_generate_args(checkpoint), "--tp", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == f"fnattn generate: error: {message}\n"


# --------------------------------------------------------------------------- fnattn bench model --tp


def test_bench_model_tp2_under_torchrun_times_the_ranks_share(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "fnattn", "bench", "model", "--family", "qwen3_5", "--tp", "2",
           "--device", "cpu", "--no-transformers", "--steps", "3", "--batch", "2", "--prompt", "8", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["command"].endswith(f"--tp 2 --out {out}")
    rows = {(r["case"], r["backend"]): r for r in doc["records"]}
    eager = rows[("qwen3_5 tiny tp2 B2 ctx8", "fnattn eager")]
    assert eager["phase"] == "decode" and eager["time_us"] > 0
    assert rows[("qwen3_5 tiny tp2", "transformers")]["skipped"].startswith("--tp 2")
    assert run.stdout.count("qwen3_5 tiny tp2 B2 ctx8") == 3  # rank 0's table alone (roofline, eager, graph)


def test_bench_model_tp_outside_torchrun_exits_2_with_one_line(capsys, monkeypatch):
    from fnattn.cli import main

    for k in tp.TORCHRUN_ENV:
        monkeypatch.delenv(k, raising=False)
    assert main(["bench", "model", "--family", "llama", "--tp", "2", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == ("fnattn bench: --tp 2: needs a torchrun launch (torchrun --nproc-per-node 2 "
                                       "-m fnattn ...): RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set\n")
