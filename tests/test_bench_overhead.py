"""`fnattn bench overhead` on CPU: the direct way is the session's math (same logits, same stored rows),
and the command writes the records it promises. No timing is asserted."""

import json

import torch
from fnattn.models.registry import Model, family_named, random_checkpoint

from fnattn import ModelAttention
from fnattn.batch import Batch
from fnattn.bench.model import config_for, decode_state
from fnattn.bench.overhead import Direct
from fnattn.cli import main
from fnattn.driver import run_step


def test_direct_way_matches_the_session_bitwise():
    fam = family_named("qwen3_5")
    cfg = fam.adapt(config_for("qwen3_5", "tiny"))
    model = Model(fam, cfg, fam.load(cfg, random_checkpoint(fam, cfg)))
    ma = ModelAttention(model.specs)
    ids = [0, 1, 2]
    a = decode_state(model, "cpu", 3, 9, page_size=4, room=3)
    b = decode_state(model, "cpu", 3, 9, page_size=4, room=3)
    direct = Direct(model, ma, a)
    try:
        with torch.no_grad():
            for i in range(3):
                tokens = torch.tensor([5 + i, 17, 40 + 3 * i])
                a, got, _ = direct.step(a.reserve({r: 1 for r in ids}), ids, tokens)
                b = b.reserve({r: 1 for r in ids})
                b, want = run_step(model.step, model.params, ma, b, Batch.decode(b, ids), tokens)
                assert torch.equal(got, want), i
    finally:
        direct.close()
    assert [a.request(r).length for r in ids] == [b.request(r).length for r in ids] == [12] * 3
    for name, pool in a.pools.items():  # every stored row: K/V pages and recurrent slots
        for t, tensor in pool.tensors.items():
            assert torch.equal(tensor, b.pools[name].tensors[t]), (name, t)


def test_overhead_command_writes_every_record(tmp_path, capsys):
    out = tmp_path / "overhead.json"
    assert main(["bench", "overhead", "--batch", "1", "2", "--prompt", "12", "--steps", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("fnattn bench overhead --family qwen3_5 --shape tiny --batch 1 2")
    assert doc["environment"]["torch"] == torch.__version__
    by = {(r["case"], r["backend"]): r for r in doc["records"]}
    for b in (1, 2):
        case = f"qwen3_5 tiny B{b} ctx12"
        direct, session = by[(case, "direct")], by[(case, "fnattn session")]
        graph = by[(case, "fnattn graph (no capture)")]
        assert direct["time_us"] > 0 and direct["batch_build_us"] > 0 and direct["steps"] == 2
        assert session["logits_equal"] is True and session["logits_max_diff"] == 0.0
        assert set(session["breakdown_us"]) == {"batch_build", "session_entry", "step", "session_exit",
                                                "apply_validation", "apply_write", "advance"}
        assert graph["captured"] is False and graph["logits_max_diff"] == 0.0
        for r in (session, graph):
            assert r["overhead"] == r["time_us"] / direct["time_us"] and r["paired_overhead"] > 0
        assert all(r["checks"] is True for r in (direct, session, graph))  # the suite runs with FNATTN_CHECKS=1
    printed = capsys.readouterr().out
    assert "qwen3_5 tiny B2 ctx12" in printed and "FNATTN_CHECKS is on" in printed


def test_a_user_mistake_exits_2_with_one_line(tmp_path, capsys):
    for argv, word in ((["--shape", "7b"], "--shape"), (["--batch", "0"], "--batch"), (["--family", "nope"], "family")):
        assert main(["bench", "overhead", *argv, "--out", str(tmp_path / "x.json")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and word in err[0], (argv, err)
        assert not (tmp_path / "x.json").exists()
