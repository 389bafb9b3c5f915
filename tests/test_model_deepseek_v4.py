"""DeepSeek-V4 model steps against transformers' DeepseekV4ForCausalLM.

The family's tiny config (a sliding layer, CSA every 4 tokens with a top-3
indexer, HCA every 8, CSA again; a window of 6; two mHC streams; a hash-routed
MoE layer, then learned routing) is built in transformers with O(1) random
weights (routing tables drawn at random), written with ``save_pretrained``
(DeepSeek's own tensor names) and loaded back with ``load_model``. Prompts and
16 decode steps cross window, CSA and HCA boundaries both inside the prefill
and inside the decode. Each request runs through transformers alone.
"""

from __future__ import annotations

import json

import pytest
import torch
from fnattn.models.loading import CheckpointError
from fnattn.models.registry import family_named, load_model, random_model
from helpers import same_bits
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache

import fnattn as fa
from fnattn.driver import run_step
from fnattn.speculative import replay_writes

TOL = 1e-4


def tiny_raw(**overrides) -> dict:
    return {**family_named("deepseek_v4").tiny_config(), **overrides}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    E = model.config.n_routed_experts
    with torch.no_grad():
        for n, p in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in n:
                continue
            if "tid2eid" in n:
                p.copy_(torch.randint(0, E, p.shape, generator=g))
            elif "norm" in n and n.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def hf_model(raw: dict, seed: int = 0) -> DeepseekV4ForCausalLM:
    kwargs = {k: v for k, v in raw.items() if k != "model_type"}
    config = DeepseekV4Config(**kwargs, attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).eval()
    randomize_(model, seed)
    return model


class Case:
    def __init__(self, tmp_path_factory, seed=0):
        self.raw = tiny_raw()
        self.hf = hf_model(self.raw, seed)
        self.dir = tmp_path_factory.mktemp("deepseek_v4")
        self.hf.save_pretrained(self.dir)
        self.model = load_model(self.dir)
        self.ma = fa.ModelAttention(self.model.specs)
        self._runs = {}

    def prompt(self, n: int, seed: int) -> list[int]:
        g = torch.Generator().manual_seed(1000 + seed)
        return torch.randint(0, self.raw["vocab_size"], (n,), generator=g).tolist()

    def hf_greedy(self, prompt: list[int], steps: int = 16):
        key = (tuple(prompt), steps)
        if key not in self._runs:
            cache = DynamicCache(config=self.hf.config)
            with torch.no_grad():
                out = self.hf(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits[0]
                logits, tokens = [out], [int(out[-1].argmax())]
                for _ in range(steps):
                    out = self.hf(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True).logits[0]
                    logits.append(out)
                    tokens.append(int(out[-1].argmax()))
            self._runs[key] = (logits, tokens)
        return self._runs[key]

    def state(self, requests=1, **kw):
        st = fa.State(self.model.specs, **{"num_pages": 64, "page_size": 4, "max_requests": requests, **kw})
        for r in range(requests):
            st = st.admit(r)
        return st

    def run(self, st, batch, tokens):
        return run_step(self.model.step, self.model.params, self.ma, st, batch, torch.tensor(tokens))

    def prefill(self, st, prompts: dict[int, list[int]]):
        st = st.reserve({r: len(p) for r, p in prompts.items()})
        batch = fa.Batch.prefill(st, {r: len(p) for r, p in prompts.items()})
        return self.run(st, batch, [t for r in batch.request_ids for t in prompts[r]])


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return Case(tmp_path_factory)


def close(ours, theirs, what):
    err = (ours - theirs).abs().max().item()
    assert err <= TOL, f"{what}: max abs error {err:.2e}"


def test_checkpoint_names_are_transformers_own(case):
    names = set(json.loads((case.dir / "model.safetensors.index.json").read_text())["weight_map"]) \
        if (case.dir / "model.safetensors.index.json").exists() else None
    from safetensors import safe_open

    if names is None:
        with safe_open(str(case.dir / "model.safetensors"), framework="pt") as f:
            names = set(f.keys())
    fam = family_named("deepseek_v4")
    wanted = set(fam.weight_shapes(case.model.config)) | set(fam.index_shapes(case.model.config))
    assert wanted == names  # every tensor read, none left over


def test_prefill_then_16_greedy_decode_steps_match_hf(case):
    prompt = case.prompt(13, 0)  # positions 0..28: windows of 4 and 8 close in the prefill and the decode
    hf_logits, tokens = case.hf_greedy(prompt)
    st, logits = case.prefill(case.state(), {0: prompt})
    close(logits, hf_logits[0], "prefill")
    for i in range(16):
        st = st.reserve({0: 1})
        st, logits = case.run(st, fa.Batch.decode(st, [0]), [tokens[i]])
        close(logits, hf_logits[i + 1][-1:], f"decode step {i}")
        assert int(logits[0].argmax()) == tokens[i + 1]


def test_batch_of_mixed_lengths_matches_each_hf_run(case):
    prompts = {0: case.prompt(19, 1), 1: case.prompt(3, 2), 2: case.prompt(8, 3), 3: case.prompt(11, 4)}
    runs = {r: case.hf_greedy(p, steps=6) for r, p in prompts.items()}
    st, logits = case.prefill(case.state(4), prompts)
    row = 0
    for r, p in prompts.items():
        close(logits[row:row + len(p)], runs[r][0][0], f"request {r} prefill")
        row += len(p)
    for i in range(6):
        st = st.reserve({r: 1 for r in prompts})
        batch = fa.Batch.decode(st, list(prompts))
        st, logits = case.run(st, batch, [runs[r][1][i] for r in batch.request_ids])
        for b, r in enumerate(batch.request_ids):
            close(logits[b], runs[r][0][i + 1][-1], f"request {r} decode step {i}")


@pytest.mark.parametrize("chunks", [(7, 5, 6), (1, 3, 4, 9, 1), (8, 8, 2)])
def test_chunked_prefill_matches_hf(case, chunks):
    prompt = case.prompt(18, 5)
    hf_logits, tokens = case.hf_greedy(prompt, steps=4)
    st, outs, done = case.state(), [], 0
    for n in chunks:  # later chunks read the window, the entries and the compressor state of a prefix
        st, logits = case.prefill(st, {0: prompt[done:done + n]})
        outs.append(logits)
        done += n
    close(torch.cat(outs), hf_logits[0], f"chunked prefill {chunks}")
    for i in range(4):
        st = st.reserve({0: 1})
        st, logits = case.run(st, fa.Batch.decode(st, [0]), [tokens[i]])
        close(logits, hf_logits[i + 1][-1:], f"decode {i} after chunks {chunks}")


@pytest.mark.parametrize("recovery", ["native", "replay"])
def test_verify_then_accept_matches_hf(case, recovery):
    """Verify 1 + 4 drafts across an entry boundary, keep 2: rejected tokens leave no entry and no state."""
    prompt = case.prompt(14, 6)
    hf_logits, tokens = case.hf_greedy(prompt)
    st, _ = case.prefill(case.state(), {0: prompt})
    st = st.reserve({0: 5})
    batch = fa.Batch.verify(st, [0], num_draft=4, recovery=recovery)
    with case.ma.session(st, batch) as s:
        logits, deltas = case.model.step(case.model.params, s, torch.tensor(tokens[:5]))
    close(logits, torch.cat([hf_logits[i + 1][-1:] for i in range(5)]), "verify")
    replay = replay_writes(case.ma, st, batch, s.replay_outputs, {0: 2}) if recovery == "replay" else None
    st = st.apply(deltas.accept(batch, {0: 2}, replay=replay))
    for i in range(2, 8):
        st = st.reserve({0: 1})
        st, logits = case.run(st, fa.Batch.decode(st, [0]), [tokens[i]])
        close(logits, hf_logits[i + 1][-1:], f"decode {i} after accepting 2 of 5")


def test_native_and_replay_recovery_leave_bitwise_equal_state(case):
    prompt = case.prompt(10, 7)
    _, tokens = case.hf_greedy(prompt, steps=8)
    states = {}
    for recovery in ("native", "replay"):
        st, _ = case.prefill(case.state(recurrent_ring=2), {0: prompt})
        for accepted in (3, 1, 4):
            st = st.reserve({0: 4})
            batch = fa.Batch.verify(st, [0], num_draft=3, recovery=recovery)
            with case.ma.session(st, batch) as s:
                _, deltas = case.model.step(case.model.params, s, torch.tensor(tokens[:4]))
            replay = replay_writes(case.ma, st, batch, s.replay_outputs, {0: accepted}) \
                if recovery == "replay" else None
            st = st.apply(deltas.accept(batch, {0: accepted}, replay=replay))
        states[recovery] = st
    a, b = states["native"], states["replay"]
    for spec in case.model.specs:
        va, vb = a.views(spec.index), b.views(spec.index)
        for name in va:
            if a.storage_spaces[spec.index][name] == "request":
                row_a = a.request(0).ring_pos * a.slots_per_ring + a.request(0).slot
                row_b = b.request(0).ring_pos * b.slots_per_ring + b.request(0).slot
                ra = va[name].index_select(0, torch.tensor([row_a]))
                rb = vb[name].index_select(0, torch.tensor([row_b]))
                assert same_bits(ra, rb), (spec.index, name)


def test_the_indexer_top_k_decides_the_logits():
    """With more entries than the top-k, a larger top-k attends more entries and changes the logits."""
    prompt = list(range(1, 30))
    out = {}
    for k in (3, 64):
        m = random_model("deepseek_v4", seed=2, config=tiny_raw(index_topk=k))
        ma = fa.ModelAttention(m.specs)
        st = fa.State(m.specs, num_pages=16, page_size=4, max_requests=1).admit(0).reserve({0: len(prompt)})
        _, out[k] = run_step(m.step, m.params, ma, st, fa.Batch.prefill(st, {0: len(prompt)}), torch.tensor(prompt))
    assert torch.equal(out[3][:12], out[64][:12])  # up to 3 entries are visible: the same selection
    assert (out[3][-1] - out[64][-1]).abs().max() > 1e-3


@pytest.mark.parametrize("field, value", [("o_groups", 3), ("num_key_value_heads", 2), ("scoring_func", "relu"),
                                          ("layer_types", ["sliding_attention"]), ("index_head_dim", 4),
                                          ("n_shared_experts", 2), ("partial_rotary_factor", 0.3)])
def test_bad_config_fields_are_named(field, value):
    with pytest.raises(ValueError, match=f"`{field}"):
        family_named("deepseek_v4").adapt(tiny_raw(**{field: value}))


def test_routing_table_out_of_range_is_refused(case, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    for f in case.dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.ffn.gate.tid2eid"
    tensors[name] = tensors[name].clone()
    tensors[name][5, 1] = case.raw["n_routed_experts"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tid2eid"):
        load_model(tmp_path)


def test_transfer_moves_the_window_entries_and_compressor_state():
    """Export after a prefill that leaves half-filled windows, import into another page size and ring, decode."""
    import test_transfer as tt

    from fnattn.transfer import RequestState

    model = tt.Model("deepseek_v4")
    a, last = tt.sender(model, n=11)  # 11 tokens: CSA holds 3 pending rows, HCA 3, the window is full
    follow = [int(last[-1].argmax())] + tt.prompt(model, 9, seed=1)  # crosses 12 and 16 after the hand-off
    _, want = model.decode(a, 7, follow)
    a, _ = tt.sender(model, n=11)
    payload = RequestState.from_bytes(a.export_request(7).to_bytes())
    b, rid = tt.receiver(model).import_request(payload)
    assert rid == 7
    b, got = model.decode(b, 7, follow)
    assert torch.equal(got, want)


def test_csa_layers_declare_and_fill_their_generated_top_k():
    from fnattn.graph import StepRunner

    model = random_model("deepseek_v4", seed=4)
    attn = fa.ModelAttention(model.specs)
    manifest = model.manifest()
    names = sorted(lane.name for lane in manifest.role("generated"))
    assert names == [f"indexer_topk_{i}" for i, s in enumerate(model.specs) if s.config.compressor == "csa"]
    runner = StepRunner(model.step, model.params, attn, manifest, max_context=64, buckets=(2,))
    st = fa.State(model.specs, num_pages=32, page_size=8, max_requests=2, fill=float("nan")).admit(0).admit(1)
    prompts = {0: list(range(1, 14)), 1: [5, 6, 7]}
    st = st.reserve({r: len(p) for r, p in prompts.items()})
    st, logits = run_step(model.step, model.params, attn, st, fa.Batch.prefill(st, {0: 13, 1: 3}),
                          torch.tensor(prompts[0] + prompts[1]))
    tok = torch.tensor([int(logits[12].argmax()), int(logits[15].argmax())])
    st = st.reserve({0: 1, 1: 1})
    st, got = runner.decode(st, [0, 1], tok)
    (entry,) = runner._entries.values()
    assert sorted(entry.generated) == names
    assert torch.isfinite(got).all()


def test_a_prefix_hit_equals_a_cold_run():
    """A request admitted on another's 9-token prefix (window rows, entries and compressor state copied at the
    holder's cursor) decodes what a cold run of it does, and the holder keeps decoding as if alone."""
    import test_prefix_sharing

    test_prefix_sharing.test_prefix_hit_equals_cold_run("deepseek_v4", 9)
