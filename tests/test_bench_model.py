"""`fnattn bench model --shape tiny` on CPU (the CI smoke case): every record it promises, and the byte
counts its rooflines divide."""

import json
import math

import pytest
import torch
from fnattn.models.registry import family_named, random_checkpoint

from fnattn.bench.model import config_for, step_bytes, weight_bytes
from fnattn.bench.setup import cached_state
from fnattn.cli import main


def test_tiny_model_bench_writes_every_record(tmp_path, capsys):
    out = tmp_path / "model.json"
    assert main(["bench", "model", "--family", "qwen3_5", "--shape", "tiny", "--batch", "1", "2", "--prompt", "48",
                 "--steps", "3", "--out", str(out), "--png", str(tmp_path / "model.png")]) == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("fnattn bench model")
    got = {(r["case"], r["backend"]) for r in doc["records"]}
    for b in (1, 2):
        case = f"qwen3_5 tiny B{b} ctx48"
        for backend in ("roofline step", "fnattn eager", "fnattn graph", "transformers eager"):
            assert (case, backend) in got, (case, backend)
        assert (f"qwen3_5 tiny prefill B{b} P48", "fnattn eager") in got
    by = {(r["case"], r["backend"]): r for r in doc["records"]}
    eager = by[("qwen3_5 tiny B1 ctx48", "fnattn eager")]
    assert eager["time_us"] > 0 and eager["x_roofline"] > 0 and eager["ratio_to_peer"] > 0
    roof = by[("qwen3_5 tiny B1 ctx48", "roofline step")]
    assert eager["achieved_tb_s"] == pytest.approx(sum(roof["bytes"].values()) / eager["time_us"] / 1e6)
    summary = doc["records"][-1]
    assert summary["case"] == "qwen3_5 tiny model summary"  # no graph on a CPU: the eager steps
    assert summary["decode_b1_ms"] == pytest.approx(eager["time_us"] / 1e3)
    assert summary["decode_b2_backend"] == "fnattn eager" and "launches_per_step" not in summary  # not profiled
    assert "CUDA" in by[("qwen3_5 tiny B1 ctx48", "fnattn graph")]["skipped"]
    e2e = by[("qwen3_5 tiny cpu e2e P48+3", "fnattn eager")]
    assert e2e["total_s"] == pytest.approx(e2e["prefill_s"] + e2e["decode_s"])
    assert "qwen3_5 tiny B2 ctx48" in capsys.readouterr().out


def test_a_wrong_shape_exits_2_with_one_line(tmp_path, capsys):
    assert main(["bench", "model", "--shape", "7b", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--shape" in err[0] and "0.8b" in err[0]


def test_prefer_picks_the_backends_and_an_unknown_name_exits_2(tmp_path, capsys):
    out = tmp_path / "x.json"
    assert main(["bench", "model", "--shape", "tiny", "--batch", "1", "--prompt", "8", "--steps", "1",
                 "--no-transformers", "--prefer", "nope", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "`prefer`" in err[0] and "'nope'" in err[0] and not out.exists()
    assert main(["bench", "model", "--shape", "tiny", "--batch", "1", "--prompt", "8", "--steps", "1",
                 "--no-transformers", "--prefer", "reference", "--out", str(out)]) == 0
    assert "--prefer reference" in json.loads(out.read_text())["command"]


def test_weight_and_step_bytes():
    fam = family_named("qwen3_5")
    cfg = fam.adapt(config_for("qwen3_5", "tiny"))
    weights = random_checkpoint(fam, cfg)
    ckpt = sum(t.numel() * t.element_size() for t in weights.values())
    got = weight_bytes(fam.load(cfg, weights))
    assert ckpt <= got <= ckpt * 1.01  # fused copies replace their parts; only small fp32 extras are added
    st = cached_state(cfg.specs, batch=3, ctx=10, page_size=4, device="cpu")
    moved = step_bytes(st, 3, 10)
    kv_row = 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # k and v, fp32, one full-attention layer
    assert moved["kv_read"] == 3 * 10 * kv_row and moved["kv_written"] == 3 * kv_row
    assert moved["state_read"] == moved["state_written"] > 0


def test_the_real_shape_is_the_qwen3_5_0_8b_text_decoder():
    c = config_for("qwen3_5", "0.8b")
    assert c["layer_types"].count("linear_attention") == 18 and c["layer_types"].count("full_attention") == 6
    assert (c["hidden_size"], c["vocab_size"], c["intermediate_size"]) == (1024, 248320, 3584)
    cfg = family_named("qwen3_5").adapt(c)
    assert cfg.tie_word_embeddings and cfg.rotary_dim == 64 and torch.float32 == cfg.dtype


def test_decode_room_fits_the_runner_block_table():
    """The decode state's reserved pages fit the StepRunner's block-table width the bench gives it (run
    uncaptured on CPU: the same lanes and checks as a captured step)."""
    from fnattn.models.registry import random_model

    from fnattn.bench.model import decode_state, time_decode
    from fnattn.graph import StepRunner
    from fnattn.model_attention import ModelAttention

    model = random_model("qwen3_5")
    ma = ModelAttention(model.specs)
    steps, ctx, room = 3, 43, 2 * (3 + 8)  # ctx + room = 65: one token past a page boundary
    st = decode_state(model, torch.device("cpu"), 2, ctx, page_size=16, room=room)
    times, st = time_decode(model, ma, st, 2, steps)
    runner = StepRunner(model.step, model.params, ma, model.manifest(), buckets=(2,), max_context=ctx + room,
                        capture=False)
    times, st = time_decode(model, ma, st, 2, steps, runner=runner)
    assert len(times) == steps and st.request(0).length == ctx + 2 * (steps + 3)


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_peer_runs_our_weights(tied):
    """The peer really holds the bench's tensors: its prefill logits are ours (tiny config, fp32, CPU), with
    untied and tied embeddings (the 0.8B shape ties them)."""
    pytest.importorskip("transformers")
    from fnattn.models.registry import Model

    import fnattn as fa
    from fnattn.bench.model import transformers_model
    from fnattn.driver import prefill

    fam = family_named("qwen3_5")
    config = {**config_for("qwen3_5", "tiny"), "tie_word_embeddings": tied}
    cfg = fam.adapt(config)
    weights = random_checkpoint(fam, cfg, seed=3)
    hf, why = transformers_model("qwen3_5", config, weights, torch.device("cpu"), torch.float32)
    assert why is None
    model = Model(fam, cfg, fam.load(cfg, weights))
    prompt = [5, 9, 17, 33, 2, 71, 8, 100, 3]
    st = fa.State(model.specs, num_pages=8, page_size=4, max_requests=1).admit(0)
    _, last = prefill(model.step, model.params, fa.ModelAttention(model.specs), st, {0: prompt})
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt]), logits_to_keep=1).logits[0, -1]
    torch.testing.assert_close(last[0], theirs.float(), atol=1e-4, rtol=1e-4)


def test_profile_on_a_cpu_splits_a_step_into_torch_ops(tmp_path):
    out = tmp_path / "p.json"
    assert main(["bench", "model", "--shape", "tiny", "--batch", "2", "--prompt", "16", "--steps", "2",
                 "--no-transformers", "--profile", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert "--profile 2" in doc["command"]
    (rec,) = [r for r in doc["records"] if r["backend"] == "fnattn eager profile" and r["phase"] == "decode"]
    (pre,) = [r for r in doc["records"] if r["backend"] == "fnattn eager profile" and r["phase"] == "prefill"]
    assert pre["case"].endswith("prefill B2 P16") and pre["profile"]["steps"] == 1
    for p, steps in ((rec["profile"], 2), (pre["profile"], 1)):
        assert p["device"] == "cpu" and p["steps"] == steps and 0 < p["busy_us"] <= p["span_us"] and p["kernels"] > 0
        names = {t["name"] for t in p["top"]}
        assert any(n in names for n in ("aten::mm", "aten::addmm", "aten::bmm")) and p["by_kind"]["gemm"] > 0
        assert all(t["us_per_step"] >= 0 and t["per_step"] > 0 for t in p["top"])
    # times on a shared CPU are noise: compare no two of them, only that each op class is named and counted
    assert set(pre["profile"]["by_kind"]) == set(rec["profile"]["by_kind"])
    timed = next(r for r in doc["records"] if r["case"] == rec["case"] and r["backend"] == "fnattn eager")
    assert timed["launches_per_step"] == rec["profile"]["kernels"]


@pytest.mark.parametrize("argv", [["--family", "nope"], ["--batch", "0"], ["--prompt", "-1"], ["--steps", "0"],
                                  ["--profile", "-1"], ["--family", "kimi_linear", "--shape", "0.8b"]])
def test_user_mistakes_exit_2_with_one_line(argv, tmp_path, capsys):
    assert main(["bench", "model", *argv, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fnattn bench:")


@pytest.mark.parametrize("family, shape, low, high", [("deepseek_v32", "2-layer", 25e9, 30e9),
                                                      ("kimi_linear", "4-layer", 11e9, 14e9)])
def test_released_layer_shapes_adapt_and_hold_their_released_widths(family, shape, low, high):
    """The real-width shapes adapt as the family's config and their weights (counted from the family's
    shapes, nothing allocated) are what the released layers hold: 2 DeepSeek-V3.2 layers (one of 256 experts
    of 2048) ~27 GB, 4 Kimi-Linear-48B layers ~12 GB in bf16."""
    from fnattn.models.registry import family_named

    from fnattn.bench.model import config_for

    fam = family_named(family)
    cfg = fam.adapt(config_for(family, shape))
    numel = sum(math.prod(s) for s in fam.weight_shapes(cfg).values())
    assert low < 2 * numel < high
    assert len(cfg.specs) == {"deepseek_v32": 2, "kimi_linear": 4}[family]


def test_moe_weight_bytes_count_the_experts_a_step_touches():
    from fnattn.models.registry import family_named, random_checkpoint

    from fnattn.bench.model import experts_per_token, weight_bytes

    fam = family_named("deepseek_v32")
    cfg = fam.adapt(fam.tiny_config())  # 3 layers, 2 of them MoE over 8 experts, 2 a token
    params = fam.load(cfg, random_checkpoint(fam, cfg))
    k, E = experts_per_token(cfg), 8
    assert k == 2
    every = weight_bytes(params)
    moe_layers = [layer.mlp for layer in params.layers if hasattr(layer.mlp, "experts")]
    assert len(moe_layers) == 2
    per_expert = sum(t.numel() * t.element_size() for t in vars(moe_layers[0].experts[0]).values()
                     if isinstance(t, torch.Tensor))
    one_token = weight_bytes(params, tokens=1, experts_per_token=k)
    assert one_token == every - 2 * (E - k) * per_expert  # one token reads its k experts of each layer
    many = weight_bytes(params, tokens=10_000, experts_per_token=k)
    assert many == every  # enough tokens touch every expert
    two = weight_bytes(params, tokens=2, experts_per_token=k)
    assert one_token < two < every  # 8 * (1 - (6/8)^2) = 3.5 experts a layer
    assert abs(two - (every - 2 * (E - 3.5) * per_expert)) <= 2  # each layer's count rounded to a byte
    dense = family_named("qwen3_5")
    dcfg = dense.adapt(dense.tiny_config())
    dparams = dense.load(dcfg, random_checkpoint(dense, dcfg))
    assert weight_bytes(dparams, tokens=1, experts_per_token=experts_per_token(dcfg)) == weight_bytes(dparams)


def test_a_model_too_big_for_the_device_is_refused_before_allocating(tmp_path, capsys, monkeypatch):
    import os

    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 1 << 18}[name])  # 1 GiB
    assert main(["bench", "model", "--family", "kimi_linear", "--shape", "4-layer", "--device", "cpu",
                 "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fnattn bench: --family kimi_linear --shape 4-layer: needs 25.7 GB of float32 weights on cpu, "
                   "this host has 1.1 GB"]


def test_every_record_names_the_switches_in_force():
    from fnattn.kernels.skinny_linear import configured

    from fnattn.bench import environment
    from fnattn.models import fused

    plain = environment()["switches"]
    assert plain["fused"] is True and plain["gemv_config"] == {} and set(plain) >= {"pdl", "qk_one_launch",
                                                                                   "own_norm_act", "output_gates"}
    with fused.output_gates(False), configured(prefetch=True):
        assert environment()["switches"] == {**plain, "output_gates": False, "gemv_config": {"prefetch": True}}


def test_tiny_24_repeats_the_tiny_schedule_to_24_layers():
    from fnattn.bench.model import config_for

    tiny, deep = config_for("qwen3_5", "tiny"), config_for("qwen3_5", "tiny-24")
    assert deep["num_hidden_layers"] == 24 and deep["hidden_size"] == tiny["hidden_size"]
    pattern = tiny["layer_types"]
    assert deep["layer_types"] == [pattern[i % len(pattern)] for i in range(24)]
    with pytest.raises(ValueError, match=r"--shape: must be one of \['0.8b', 'tiny', 'tiny-24'\] for family "
                                         r"'qwen3_5', got 'huge'"):
        config_for("qwen3_5", "huge")


def test_a_moe_step_roofline_counts_the_experts_its_tokens_picked():
    """The roofline step of a MoE case reads the routed experts one real step picked (counted per layer), not
    the uniform estimate: the record names the counts, and its weight bytes follow them."""
    from fnattn.models.common import StackedExperts, counting_routed_experts, moe_sum

    from fnattn.bench.model import config_for, run_model_bench

    torch.set_num_threads(1)
    records = run_model_bench(family="deepseek_v32", shape="tiny", batches=[1, 4], prompts=[16], steps=2,
                              device="cpu", transformers=False, graph=False, log=lambda *a: None)
    roofs = [r for r in records if r["backend"] == "roofline step"]
    assert len(roofs) == 2
    k = config_for("deepseek_v32", "tiny")["num_experts_per_tok"]
    for r, b in zip(roofs, [1, 4]):
        touched = r["experts_touched"]
        assert len(touched) == 2  # the tiny model's two MoE layers
        assert all(k <= n <= min(8, b * k) for n in touched)  # each token picks k distinct experts of 8
    assert roofs[0]["experts_touched"] == [k, k]  # one token: exactly its k experts a layer
    # bytes follow the counts: more experts picked at batch 4 read more weights, and as many per expert
    extra = sum(roofs[1]["experts_touched"]) - 2 * k
    w1, w4 = roofs[0]["bytes"]["weights"], roofs[1]["bytes"]["weights"]
    assert (w4 > w1) == (extra > 0) and (extra == 0 or (w4 - w1) % extra <= 2)
    # the counter sees each call's distinct experts, and nothing outside its block
    stacked = StackedExperts.stack([tuple(torch.randn(*s) for s in ((4, 8), (4, 8), (8, 4))) for _ in range(6)])
    ids = torch.tensor([[0, 3], [3, 5], [0, 5]])
    with counting_routed_experts() as counts:
        moe_sum(torch.randn(3, 8), ids, torch.rand(3, 2), 6, lambda e, xs: stacked[e](xs), lambda y, w: y * w)
    moe_sum(torch.randn(3, 8), ids, torch.rand(3, 2), 6, lambda e, xs: stacked[e](xs), lambda y, w: y * w)
    assert counts == [3]
    # `experts` counts each call once, on the grouped path (a static step) and through the loop alike
    from fnattn.models.common import experts

    from fnattn.lanes import static_shapes

    with counting_routed_experts() as counts:
        experts(torch.randn(3, 8), ids, torch.rand(3, 2), stacked.gate_up, stacked.down)
        with static_shapes():
            experts(torch.randn(3, 8), ids[:1], torch.rand(1, 2), stacked.gate_up, stacked.down)
    assert counts == [3, 2]


def test_deepseek_v4_experts_are_counted_as_every_moe_family_s():
    """DeepSeek-V4's routed experts are a `StackedExperts` too, so its roofline counts the picked ones (hash-routed
    layers included: a token's fixed experts)."""
    from fnattn.bench.model import config_for, run_model_bench

    torch.set_num_threads(1)
    records = run_model_bench(family="deepseek_v4", shape="tiny", batches=[1], prompts=[16], steps=2,
                              device="cpu", transformers=False, graph=False, log=lambda *a: None)
    (roof,) = [r for r in records if r["backend"] == "roofline step"]
    raw = config_for("deepseek_v4", "tiny")
    assert len(roof["experts_touched"]) == raw["num_hidden_layers"]  # every V4 block is a MoE
    assert all(1 <= n <= raw["num_experts_per_tok"] for n in roof["experts_touched"])


def test_commit_names_a_tree_whose_files_differ_from_its_head(tmp_path, monkeypatch):
    """A record's commit: FNATTN_COMMIT when set; else git's HEAD, marked ``+changes`` when tracked files differ
    from it (a copied tree with older git metadata must not name code that did not run)."""
    import shutil
    import subprocess

    import fnattn.bench as bench

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(git + ["add", "-A"], cwd=tmp_path, check=True)
    subprocess.run(git + ["commit", "-qm", "one"], cwd=tmp_path, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    monkeypatch.delenv("FNATTN_COMMIT", raising=False)
    monkeypatch.setattr(bench, "__file__", str(pkg / "__init__.py"))
    assert bench.commit() == head
    (pkg / "__init__.py").write_text("x = 2\n")
    assert bench.commit() == head + "+changes"
    monkeypatch.setenv("FNATTN_COMMIT", "abc")
    assert bench.commit() == "abc"


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v32"])
def test_the_profile_sets_each_layer_s_time_against_its_bytes(family):
    """With ``--profile``, an eager case's ``layers`` record holds one row per layer: its ops' time, and bytes
    that add up, with the rest of the step's, to the case's roofline (a MoE layer's picked experts included)."""
    from fnattn.bench.model import run_model_bench

    torch.set_num_threads(1)
    logged = []
    records = run_model_bench(family=family, shape="tiny", batches=[2], prompts=[16], steps=2, device="cpu",
                              transformers=False, graph=False, profile=2, log=logged.append)
    (rec,) = [r for r in records if r["backend"] == "fnattn eager layers"]
    (roof,) = [r for r in records if r["backend"] == "roofline step"]
    (prof,) = [r for r in records if r["backend"] == "fnattn eager profile" and r["phase"] == "decode"]
    model_specs = [r["layer"] for r in rec["layers"]]
    assert model_specs == list(range(len(model_specs))) and len(model_specs) >= 2
    for r in rec["layers"]:
        assert r["time_us"] > 0 and r["bytes"]["weights"] > 0 and r["floor_us"] > 0
        assert r["x_floor"] == pytest.approx(r["time_us"] / r["floor_us"])
    assert {r["kind"] for r in rec["layers"]} >= ({"gdn", "full"} if family == "qwen3_5" else {"sparse_mla"})
    for key in ("kv_read", "kv_written", "state_read", "state_written"):
        assert sum(r["bytes"][key] for r in rec["layers"]) == roof["bytes"][key]
    weights = sum(r["bytes"]["weights"] for r in rec["layers"])
    assert weights + rec["outside_weight_bytes"] == roof["bytes"]["weights"] and rec["outside_weight_bytes"] > 0
    assert rec["busy_us"] == prof["profile"]["busy_us"] and 0 < rec["layers_us"] < rec["busy_us"]
    assert any("layers" in line and "floor" in line for line in logged)


def test_a_range_s_device_time_is_the_kernels_inside_its_span():
    """On CUDA a layer's time is the kernels that ran within its range's device-side span, not the span itself
    (which holds the host's gaps between launches in an eager step)."""
    from types import SimpleNamespace

    from fnattn.bench.profile import range_kernel_times

    def event(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    annotations = [event("fnattn layer 0", 0, 100), event("fnattn layer 1", 100, 300), event("other", 0, 300),
                   event("fnattn layer 0", 300, 400)]  # a second step
    kernels = [event("k", 10, 20), event("k", 50, 55), event("k", 120, 150), event("k", 290, 310),
               event("k", 320, 330)]
    times = range_kernel_times(annotations, kernels, "fnattn layer ", steps=2)
    # the kernel straddling two spans (290-310) is charged to neither
    assert times == {"fnattn layer 0": (15 + 10) / 2, "fnattn layer 1": 30 / 2}


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32", "deepseek_v4", "glm5", "kimi_linear", "llama",
                                    "qwen2", "qwen3", "qwen3_5", "qwen3_next"])
def test_every_family_walks_its_layers_in_profiler_ranges(family):
    """Each family's step runs each layer inside `layer_ranges`' range ``fnattn layer {i}``, once a step, and
    nothing of the kind outside the block: what the per-layer profile charges kernels by."""
    from fnattn.models.common import layer_ranges
    from fnattn.models.registry import random_model
    from torch.profiler import ProfilerActivity, profile

    import fnattn as fa
    from fnattn.driver import prefill

    torch.set_num_threads(1)
    model = random_model(family)
    attn = fa.ModelAttention(model.specs)
    page = attn.page_size or 4
    st = fa.State(model.specs, num_pages=64, page_size=page, max_requests=2).admit(0).admit(1)
    with profile(activities=[ProfilerActivity.CPU]) as prof, layer_ranges():
        st, _ = prefill(model.step, model.params, attn, st, {0: [3, 5, 7]})
    names = [e.name for e in prof.events() if e.name.startswith("fnattn layer ")]
    assert sorted(names) == sorted(f"fnattn layer {i}" for i in range(len(model.specs)))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        prefill(model.step, model.params, attn, st, {1: [2, 4]})
    assert not [e for e in prof.events() if e.name.startswith("fnattn layer ")]
