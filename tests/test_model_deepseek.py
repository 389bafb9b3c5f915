"""DeepSeek-V3.2, GLM-5 and DeepSeek-V3 model steps against transformers.

Each family's tiny config is built as the transformers ``...ForCausalLM`` with
random weights (norms, the router's ``e_score_correction_bias`` and the
indexer's LayerNorm bias included), saved with ``save_pretrained`` and loaded
back with ``load_model``. The indexer keeps 6 tokens of prompts of 11-19, so
the sparse selection changes the logits (checked), and the MoE layers route 3
of 8 experts (V3.2: 2 of 4 groups). Each request runs through transformers
alone with its own cache; greedy tokens are transformers' picks.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from fnattn.models.common import grouped_topk
from fnattn.models.loading import CheckpointError
from fnattn.models.registry import family_named, load_model, random_model
from safetensors.torch import load_file, save_file
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
)
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32TopkRouter

import fnattn as fa
from fnattn.cli import main as cli_main
from fnattn.driver import run_step

TOL = 1e-4
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1}
HF = {
    "deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM),
    "glm5": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
}
OVERRIDES = {
    # several expert groups, YaRN rope (scale and cos/sin factor), a small top-k
    "deepseek_v32": dict(index_topk=6, index_n_heads=8, num_experts_per_tok=3, rope_parameters=YARN,
                         max_position_embeddings=512),
    # full and shared indexer layers; GLM-5's single expert group
    "glm5": dict(index_topk=6, index_n_heads=8, num_experts_per_tok=3, n_group=1, topk_group=1,
                 indexer_types=["full", "shared", "full", "shared"]),
    # the dense-MLA path: no q_lora, attention biases, half-split rope, YaRN
    "deepseek_v3": dict(q_lora_rank=None, attention_bias=True, rope_interleave=False, num_experts_per_tok=3,
                        rope_parameters=YARN, max_position_embeddings=256),
}
NAMES = tuple(HF)


def tiny_raw(name: str) -> dict:
    return {**family_named(name).tiny_config(), **OVERRIDES[name]}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """O(1) random weights everywhere, so routing and top-k selection are far from uniform."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in n:
                continue
            if "norm" in n and n.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


class Case:
    """One family: the transformers model, its checkpoint directory and our loaded model."""

    def __init__(self, name, tmp_path_factory, seed=0):
        raw = tiny_raw(name)
        config_cls, model_cls = HF[name]
        kwargs = {k: v for k, v in raw.items() if k != "model_type"}
        config = config_cls(**kwargs, attn_implementation="eager", experts_implementation="eager")
        torch.manual_seed(seed)
        self.hf = model_cls(config).eval()
        randomize_(self.hf, seed)
        self.dir = tmp_path_factory.mktemp(name)
        self.hf.save_pretrained(self.dir)
        self.name, self.raw = name, raw
        self.model = load_model(self.dir)
        self.ma = fa.ModelAttention(self.model.specs)
        self._hf_runs = {}

    def prompt(self, n: int, seed: int) -> list[int]:
        g = torch.Generator().manual_seed(1000 + seed)
        return torch.randint(0, self.raw["vocab_size"], (n,), generator=g).tolist()

    def hf_greedy(self, prompt: list[int], steps: int = 16):
        """transformers alone: prompt logits then ``steps`` greedy decode logits; ``-> (logits list, tokens)``."""
        key = (tuple(prompt), steps)
        if key not in self._hf_runs:
            cache = DynamicCache(config=self.hf.config)
            with torch.no_grad():
                out = self.hf(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits[0]
                logits, tokens = [out], [int(out[-1].argmax())]
                for _ in range(steps):
                    out = self.hf(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True).logits[0]
                    logits.append(out)
                    tokens.append(int(out[-1].argmax()))
            self._hf_runs[key] = (logits, tokens)
        return self._hf_runs[key]

    def state(self, requests=1):
        st = fa.State(self.model.specs, num_pages=48, page_size=4, max_requests=requests)
        for r in range(requests):
            st = st.admit(r)
        return st

    def run(self, st, batch, tokens):
        return run_step(self.model.step, self.model.params, self.ma, st, batch,
                                  torch.tensor(tokens, dtype=torch.long))

    def prefill(self, st, prompts: dict[int, list[int]]):
        st = st.reserve({r: len(p) for r, p in prompts.items()})
        batch = fa.Batch.prefill(st, {r: len(p) for r, p in prompts.items()})
        return self.run(st, batch, [t for r in batch.request_ids for t in prompts[r]])


@pytest.fixture(scope="module", params=NAMES)
def case(request, tmp_path_factory):
    return Case(request.param, tmp_path_factory)


def close(ours, theirs, what):
    err = (ours - theirs).abs().max().item()
    assert err <= TOL, f"{what}: max abs error {err:.2e}"


# --------------------------------------------------------------------------- #
# parity with transformers
# --------------------------------------------------------------------------- #


def test_prefill_then_16_greedy_decode_steps_match_hf(case):
    prompt = case.prompt(16, 0)
    hf_logits, tokens = case.hf_greedy(prompt)
    st, logits = case.prefill(case.state(), {0: prompt})
    close(logits, hf_logits[0], "prefill")
    for i in range(16):
        st = st.reserve({0: 1})
        st, logits = case.run(st, fa.Batch.decode(st, [0]), [tokens[i]])
        close(logits, hf_logits[i + 1][-1:], f"decode step {i}")
        assert int(logits[0].argmax()) == tokens[i + 1]


def test_batch_of_three_requests_matches_each_hf_run(case):
    prompts = {0: case.prompt(19, 1), 1: case.prompt(11, 2), 2: case.prompt(14, 3)}
    runs = {r: case.hf_greedy(p, steps=4) for r, p in prompts.items()}
    st, logits = case.prefill(case.state(3), prompts)
    row = 0
    for r, p in prompts.items():
        close(logits[row:row + len(p)], runs[r][0][0], f"request {r} prefill")
        row += len(p)
    for i in range(4):
        st = st.reserve({r: 1 for r in prompts})
        batch = fa.Batch.decode(st, list(prompts))
        st, logits = case.run(st, batch, [runs[r][1][i] for r in batch.request_ids])
        for b, r in enumerate(batch.request_ids):
            close(logits[b], runs[r][0][i + 1][-1], f"request {r} decode step {i}")


def test_chunked_prefill_equals_one_shot(case):
    prompt = case.prompt(17, 4)
    _, one_shot = case.prefill(case.state(), {0: prompt})
    st, chunks, done = case.state(), [], 0
    for n in (7, 5, 5):  # later chunks attend (and select from) a cached prefix
        st, logits = case.prefill(st, {0: prompt[done:done + n]})
        chunks.append(logits)
        done += n
    close(torch.cat(chunks), one_shot, "chunked prefill")


def test_verify_then_accept_matches_hf(case):
    """Verify 1 + 3 drafts, keep 2: the dropped tokens never reach the cache."""
    prompt = case.prompt(13, 5)
    hf_logits, tokens = case.hf_greedy(prompt)
    st, _ = case.prefill(case.state(), {0: prompt})
    st = st.reserve({0: 4})
    batch = fa.Batch.verify(st, [0], num_draft=3)
    with case.ma.session(st, batch) as s:
        logits, deltas = case.model.step(case.model.params, s, torch.tensor(tokens[:4]))
    close(logits, torch.cat([hf_logits[i + 1][-1:] for i in range(4)]), "verify")
    st = st.apply(deltas.accept(batch, {0: 2}))
    st = st.reserve({0: 1})
    st, logits = case.run(st, fa.Batch.decode(st, [0]), [tokens[2]])
    close(logits, hf_logits[3][-1:], "decode after accepting 2 of 4")


def test_sparse_selection_changes_the_result(case):
    if case.name == "deepseek_v3":
        pytest.skip("dense MLA has no indexer")
    cfg = case.model.config
    assert cfg.indexer.topk == 6
    wide = dataclasses.replace(cfg, indexer=dataclasses.replace(cfg.indexer, topk=64))
    params = dataclasses.replace(case.model.params, config=wide)
    prompt = case.prompt(16, 0)
    st = fa.State(wide.specs, num_pages=8, page_size=4, max_requests=1).admit(0).reserve({0: 16})
    st, dense = run_step(case.model.step, params, fa.ModelAttention(wide.specs), st,
                                   fa.Batch.prefill(st, {0: 16}), torch.tensor(prompt))
    hf_sparse = case.hf_greedy(prompt)[0][0]
    assert (dense[6:] - hf_sparse[6:]).abs().max() > 1e-2  # tokens 6.. see more keys than the top-k
    close(dense[:6], hf_sparse[:6], "tokens that see at most top-k keys")


@pytest.mark.parametrize("name", ["deepseek_v32", "glm5"])
def test_fp8_index_keys_run_the_whole_model(name):
    """`IndexerConfig(key_dtype="fp8_e4m3")` through a whole model: prefill in two chunks, then decode steps.
    With a top-k that covers every key the selection cannot differ, so the logits equal the plain keys' run
    bit for bit (the keys only choose); with the usual top-k the FP8 run stays finite and its cache holds the
    keys as e4m3 rows with a scale each."""
    from fnattn.driver import prefill

    base = random_model(name)
    cfg = base.config

    def run(key_dtype, topk):
        ix = dataclasses.replace(cfg.indexer, key_dtype=key_dtype, topk=topk)
        c = dataclasses.replace(cfg, indexer=ix)
        params = dataclasses.replace(base.params, config=c)
        ma = fa.ModelAttention(c.specs)
        st = fa.State(c.specs, num_pages=16, page_size=4, max_requests=2)
        for r in (0, 1):
            st = st.admit(r)
        st, last = prefill(base.family.step, params, ma, st, {0: list(range(3, 22)), 1: [5, 9, 2]}, chunk=8)
        seen = [torch.stack([last[0], last[1]])]
        for i in range(3):
            st = st.reserve({0: 1, 1: 1})
            st, logits = run_step(base.family.step, params, ma, st, fa.Batch.decode(st, [0, 1]),
                                  torch.tensor([7 + i, 11 + i]))
            seen.append(logits)
        return st, seen

    _, plain = run(None, 64)
    st, fp8 = run("fp8_e4m3", 64)
    assert all(torch.equal(a, b) for a, b in zip(plain, fp8))
    owner = next(s.index for s in cfg.specs if s.config.index_source_layer is None)
    assert st.views(owner).index_k.dtype == torch.float8_e4m3fn and st.views(owner).index_k_scale.dtype == torch.float32
    _, usual = run("fp8_e4m3", cfg.indexer.topk)
    assert all(bool(torch.isfinite(x).all()) for x in usual)


# --------------------------------------------------------------------------- #
# layout, routing and config reading
# --------------------------------------------------------------------------- #


def test_glm_shared_layers_own_no_indexer_and_reuse_the_full_layer():
    cfg = family_named("glm5").adapt(tiny_raw("glm5"))
    assert [s.config.index_source_layer for s in cfg.specs] == [None, 0, None, 2]
    names = family_named("glm5").weight_shapes(cfg)
    assert any(n.startswith("model.layers.2.self_attn.indexer.") for n in names)
    assert not any(n.startswith(("model.layers.1.self_attn.indexer.", "model.layers.3.self_attn.indexer."))
                   for n in names)
    st = fa.State(cfg.specs, num_pages=4, page_size=4, max_requests=1)
    assert "index_k" not in st.views(1) and "index_k" in st.views(2)


def test_grouped_topk_matches_hf_router():
    """Negative biases make kept experts score below zero: they must still win over dropped groups."""
    raw = tiny_raw("deepseek_v32")
    config = DeepseekV32Config(**{k: v for k, v in raw.items() if k != "model_type"})
    router = DeepseekV32TopkRouter(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.3)
        router.e_score_correction_bias.copy_(-0.6 - 0.3 * torch.rand(8, generator=g))
    x = torch.randn(32, raw["hidden_size"], generator=g)
    _, hf_w, hf_ids = router(x)
    scores = torch.nn.functional.linear(x, router.weight).sigmoid()
    ids, w = grouped_topk(scores, router.e_score_correction_bias, 3, n_group=4, topk_group=2, normalize=True,
                          scaling=raw["routed_scaling_factor"])
    assert (scores + router.e_score_correction_bias < 0).any()
    order, hf_order = ids.sort(-1), hf_ids.sort(-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), hf_w.gather(1, hf_order.indices))


@pytest.mark.parametrize("name, change, field", [
    ("deepseek_v32", {"hidden_act": "gelu"}, "hidden_act"),
    ("deepseek_v32", {"num_key_value_heads": 2}, "num_key_value_heads"),
    ("deepseek_v32", {"q_lora_rank": None}, "q_lora_rank"),
    ("deepseek_v32", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
    ("deepseek_v32", {"n_group": 3}, "n_group"),
    ("deepseek_v32", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ("deepseek_v32", {"index_topk": 0}, "index_topk"),
    ("deepseek_v32", {"index_head_dim": 4}, "index_head_dim"),
    ("deepseek_v32", {"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
    ("deepseek_v32", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ("deepseek_v32", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v32", {"rope_interleave": False}, "rope_interleave"),
    ("glm5", {"indexer_types": ["shared", "full", "full", "full"]}, "indexer_types"),
    ("glm5", {"indexer_types": ["full", "shared"]}, "indexer_types"),
    ("glm5", {"indexer_rope_interleave": False}, "indexer_rope_interleave"),
    ("deepseek_v3", {"model_type": "deepseek_v32"}, "model_type"),
])
def test_adapt_refuses_bad_fields(name, change, field):
    with pytest.raises(ValueError, match=field):
        family_named(name).adapt({**tiny_raw(name), **change})


# --------------------------------------------------------------------------- #
# loading
# --------------------------------------------------------------------------- #


def tensors(obj):
    """Every tensor of a params tree, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in tensors(x)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors(getattr(obj, f.name))]
    return []


def test_sharded_and_unsharded_checkpoints_load_the_same(case, tmp_path):
    case.hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(tmp_path.glob("model-*.safetensors"))) >= 3
    a, b = tensors(load_model(tmp_path).params), tensors(case.model.params)
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_missing_or_misshaped_tensor_is_named(case, tmp_path):
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    file = tmp_path / "model.safetensors"
    for edit in ("missing", "misshaped"):
        shutil.copytree(case.dir, tmp_path, dirs_exist_ok=True)
        sd = load_file(file)
        if edit == "missing":
            del sd[name]
        else:
            sd[name] = sd[name][:-1].clone()
        save_file(sd, file, metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
            load_model(tmp_path)


@pytest.mark.parametrize("name", NAMES)
def test_random_model_and_demo_run(name, capsys):
    model = random_model(name)
    assert len(model.specs) == model.config.num_layers
    assert cli_main(["demo", "--model", name, "--tokens", "3"]) == 0
    assert "generated token ids" in capsys.readouterr().out
