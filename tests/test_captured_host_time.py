"""benchmarks/captured_host_time.py: a captured step's host time on any machine (graphs that launch nothing)."""

import json

import pytest

from helpers import benchmark_module, run_benchmark


def test_it_counts_a_speculative_steps_host_work_against_a_decode_steps(tmp_path):
    out = tmp_path / "host.json"
    done = run_benchmark("captured_host_time", "--batch", "1", "2", "--steps", "10", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    records = json.loads(out.read_text())["records"]
    assert [r["batch"] for r in records] == [1, 2]
    for r in records:
        assert r["decode_us"] > 0 and r["speculative_us"] > 0
        # k = 3: two proposal replays, the verify and the catch-up, each more than a decode step's own work
        assert r["speculative_calls"] > 2 * r["decode_calls"] > 0
        assert r["speculative_ops"] > r["decode_ops"] > 0


def test_a_bad_count_exits_2_naming_it():
    done = run_benchmark("captured_host_time", "--draft", "0")
    assert done.returncode == 2 and "--draft" in done.stderr and "Traceback" not in done.stderr


def test_a_replayed_step_hands_out_its_buffers_only_when_asked():
    """A captured entry's outputs are overwritten by its next replay: `propose` and `verify` hand out copies,
    and with ``copy=False`` the graph's own buffers (what the speculative step reads before that replay)."""
    import torch

    from fnattn import ModelAttention
    from fnattn.bench import generate as gen
    from fnattn.bench.model import build_model

    torch.manual_seed(0)
    host = benchmark_module("captured_host_time")
    model, _, _ = build_model("qwen3_5", "tiny", "cpu")
    draft = model.family.draft(model.config, model.params, None, seed=1)
    attn = ModelAttention(draft.specs, device="cpu")
    runner = host.HostRunner(draft.step, draft.params, attn, draft.manifest(model.config), buckets=(2,),
                             max_context=64)
    st = gen._state(draft, torch.device("cpu"), 2, 64)
    for r in (0, 1):
        st = st.admit(r)
    tok = torch.tensor([3, 4])
    hid = torch.randn(2, model.config.hidden_size)
    entry = None
    for copy in (True, False):
        st = st.reserve({0: 1, 1: 1})
        st, logits, hout = runner.propose(st, [0, 1], tok, hid, copy=copy)
        entry = runner.entries()[0]
        shared = [a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                  for a, b in ((logits, entry.outputs["logits"]), (hout, entry.outputs["hidden"]))]
        assert shared == [not copy, not copy]
    with pytest.raises(ValueError, match="`copy` must be a bool, got 'no'"):
        runner.propose(st, [0, 1], tok, hid, copy="no")
    st = st.reserve({0: 4, 1: 4})
    with pytest.raises(ValueError, match="`copy` must be a bool, got 0"):
        runner.verify(st, [0, 1], torch.arange(8), num_draft=3, hidden=torch.randn(8, model.config.hidden_size),
                      copy=0)
    verified = runner.verify(st, [0, 1], torch.arange(8), num_draft=3,
                             hidden=torch.randn(8, model.config.hidden_size), copy=False)
    verify_entry = next(e for e in runner.entries() if e.bucket.phase == "verify")
    assert verified.logits.untyped_storage().data_ptr() == verify_entry.outputs["logits"].untyped_storage().data_ptr()
