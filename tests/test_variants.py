"""docs/variants.md: a new attention kind in one file, then probe, checkpoints, MTP recovery and a model.

The kind is docs/variants/gated_linear.py itself, run as a module; the code of
each test is the code the page shows.
"""

import importlib.util
import pathlib
import re
import sys

import pytest
import torch
import torch.nn.functional as F

import fnattn as fa
from fnattn import driver, speculative
from fnattn.declare import select_tokens

ROOT = pathlib.Path(__file__).resolve().parents[1]
KIND_FILE = ROOT / "docs" / "variants" / "gated_linear.py"
PAGES = (ROOT / "docs" / "variants.md", ROOT / "docs" / "variants.zh.md")

def load():
    """Run the kind's file as module ``gated_linear``; running it again re-registers (a re-run notebook cell)."""
    spec = importlib.util.spec_from_file_location("gated_linear", KIND_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gated_linear"] = module  # its annotations resolve against the module's globals
    spec.loader.exec_module(module)
    return module


def gated_spec(gl, index=0):
    return fa.LayerSpec(index, gl.GatedLinearConfig(num_heads=2, head_k_dim=4, head_v_dim=3), torch.float32)


def random_inputs(gl, spec, T, seed=0):
    c, gen = spec.config, torch.Generator().manual_seed(seed)
    H, K, V = c.num_heads, c.head_k_dim, c.head_v_dim
    return gl.GatedLinearInputs(q=torch.randn(T, H, K, generator=gen), k=torch.randn(T, H, K, generator=gen),
                                v=torch.randn(T, H, V, generator=gen),
                                g=F.logsigmoid(torch.randn(T, H, generator=gen)))  # [T, H] log decay <= 0


def run_layer(attn, state, batch, inputs):
    """One step of a one-layer model: ``-> (output, StepDeltas)``."""
    with attn.session(state, batch) as s:
        out, w = s.forward(0, inputs)
    return out, fa.StepDeltas.collect(batch, [w])


def state_of(state, rid):
    """The request's current [H, K, V] state."""
    return state.views(0).state[state.recurrent_row(rid)]


def page_code(page):
    """The page's Python blocks other than the quoted kind file, in order."""
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)
    return [b for b in blocks if b != KIND_FILE.read_text()]


def test_the_kind_is_one_short_file_quoted_by_both_pages():
    source = KIND_FILE.read_text()
    assert len(source.splitlines()) <= 150
    for page in PAGES:
        assert source in page.read_text(), f"{page.name} must quote {KIND_FILE.name} as it is"
    english, chinese = (page_code(page) for page in PAGES)
    assert english and english == chinese  # the twin pages show the same code


def test_the_page_runs_as_a_script_from_any_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # not the repository root: the page finds the kind's file by itself
    monkeypatch.setattr(sys, "path", list(sys.path))  # the page puts docs/variants on it
    monkeypatch.delitem(sys.modules, "gated_linear", raising=False)  # its `import gated_linear` runs the file
    namespace = {"__name__": "variants_page"}
    for block in page_code(PAGES[0]):
        exec(compile(block, str(PAGES[0]), "exec"), namespace)


def test_the_file_runs_again_like_a_notebook_cell():
    load()
    gl = load()  # every registration replaces the previous one
    assert "gated_linear" in fa.known_kinds()
    assert fa.kind_info("gated_linear").config is gl.GatedLinearConfig
    spec = gated_spec(gl)
    assert spec.config.storage(torch.bfloat16)[0].shape == (2, 4, 3)
    with pytest.raises(ValueError, match="num_heads"):
        gl.GatedLinearConfig(num_heads=0, head_k_dim=4, head_v_dim=3)
    with pytest.raises(fa.OutsideSessionError):  # backends run only through a session
        gl.decode(spec, None, None)


def test_probe_the_vectorized_prefill_against_the_reference():
    gl = load()
    spec = gated_spec(gl)
    # NaN storage: a fresh request that read its slot would show it.
    state = fa.State([spec], num_pages=8, page_size=4, max_requests=4, fill=float("nan"))
    state = state.admit(0).admit(1).reserve({0: 9, 1: 6})
    fresh = fa.Batch.prefill(state, {0: 5, 1: 2})
    report = fa.probe(spec, state=state, batch=fresh, inputs=random_inputs(gl, spec, 7),
                      backends=["reference", "vectorized"], reference=gl.reference)
    print(report)
    errors = {r.backend: r.max_rel for r in report.rows}
    assert errors["reference"] == 0.0 and errors["vectorized"] < 1e-5

    # A second chunk starts from the state the first one left.
    attn = fa.ModelAttention([spec], prefer=("reference",))
    _, deltas = run_layer(attn, state, fresh, random_inputs(gl, spec, 7))
    state = state.apply(deltas)
    chunk = fa.Batch.prefill(state, {0: 4, 1: 4})
    report = fa.probe(spec, state=state, batch=chunk, inputs=random_inputs(gl, spec, 8, seed=1),
                      backends=["vectorized"], reference=gl.reference)
    assert report.rows[0].max_rel < 1e-5


def test_in_the_invariant_mode_the_vectorized_prefill_steps_aside_for_the_reference():
    """The page's reference says it honours the mode; the vectorized prefill does not, so a ModelAttention built
    in the mode takes the reference, and explains why."""
    import fnattn.switches

    gl = load()
    spec = gated_spec(gl)
    prefer = ("vectorized", "reference")
    assert fa.ModelAttention([spec], prefer=prefer).backend(0, "prefill").name == "vectorized"
    with fnattn.switches.set(invariant=True):
        attn = fa.ModelAttention([spec], prefer=prefer)
    assert {attn.backend(0, p).name for p in ("prefill", "decode", "verify")} == {"reference"}
    assert "vectorized (does not honour the invariant mode" in attn.explain()


def test_checkpoint_then_restore_gives_the_same_step():
    gl = load()
    spec = gated_spec(gl)
    attn = fa.ModelAttention([spec], prefer=("reference",))
    state = fa.State([spec], num_pages=8, page_size=4, max_requests=4).admit(0).reserve({0: 8})
    _, deltas = run_layer(attn, state, fa.Batch.prefill(state, {0: 4}), random_inputs(gl, spec, 4))
    state = state.apply(deltas)

    ckpt = state.checkpoint([0])
    tokens = [random_inputs(gl, spec, 1, seed=10 + i) for i in range(3)]
    outs, states = [], []
    for inputs in tokens:
        batch = fa.Batch.decode(state, [0])
        out, deltas = run_layer(attn, state, batch, inputs)
        state = state.apply(deltas)
        outs.append(out.o)
        states.append(state_of(state, 0).clone())

    state = state.restore(ckpt)
    assert state.request(0).length == 4
    out, deltas = run_layer(attn, state, fa.Batch.decode(state, [0]), tokens[0])
    state = state.apply(deltas)
    assert torch.equal(out.o, outs[0]) and torch.equal(state_of(state, 0), states[0])


@pytest.mark.parametrize("ring", [2, 5])  # 5 = 1 + 3 drafts + 1: verify keeps every state in place
def test_native_and_replay_recovery_agree_bit_for_bit(ring):
    gl = load()
    spec = gated_spec(gl)
    attn = fa.ModelAttention([spec], prefer=("reference",))
    state = fa.State([spec], num_pages=16, page_size=4, max_requests=4, recurrent_ring=ring)
    state = state.admit(0).admit(1).reserve({0: 3, 1: 5})
    _, deltas = run_layer(attn, state, fa.Batch.prefill(state, {0: 3, 1: 5}), random_inputs(gl, spec, 8))
    state = state.apply(deltas).reserve({0: 4, 1: 4})

    drafts = random_inputs(gl, spec, 8, seed=1)  # the last token and 3 drafts per request
    accepted = {0: 2, 1: 4}  # what the target agreed with, picked by hand

    batch = fa.Batch.verify(state, [0, 1], num_draft=3)  # recovery="native"
    out, deltas = run_layer(attn, state, batch, drafts)
    native = state.apply(deltas.accept(batch, accepted), inplace=False)  # a copy: `state` stays usable

    batch = fa.Batch.verify(state, [0, 1], num_draft=3, recovery="replay")
    with attn.session(state, batch) as s:
        out_r, w = s.forward(0, drafts)
    assert w is None  # no state leaves a replay-mode verify
    replay = speculative.replay_writes(attn, state, batch, {0: out_r}, accepted)
    deltas = fa.StepDeltas.collect(batch, [w]).accept(batch, accepted, replay=replay)
    replayed = state.apply(deltas, inplace=False)

    keep = torch.tensor([0, 1, 4, 5, 6, 7])  # rows of the accepted tokens: 2 of request 0, 4 of request 1
    batch = fa.Batch.prefill(state, accepted)
    out_f, deltas = run_layer(attn, state, batch, select_tokens(drafts, keep))
    fed = state.apply(deltas, inplace=False)

    assert torch.equal(out.o, out_r.o) and torch.equal(out.o[keep], out_f.o)
    for rid in (0, 1):
        assert torch.equal(state_of(native, rid), state_of(replayed, rid))
        assert torch.equal(state_of(native, rid), state_of(fed, rid))
        assert native.request(rid).length == replayed.request(rid).length == {0: 5, 1: 9}[rid]


# --------------------------------------------------------------------------- a tiny hybrid model

VOCAB, DIM = 48, 16


def init_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"embed": (VOCAB, DIM), "wq0": (DIM, 8), "wk0": (DIM, 8), "wv0": (DIM, 8), "wg0": (DIM, 2),
              "wo0": (8, DIM), "wq1": (DIM, 16), "wk1": (DIM, 8), "wv1": (DIM, 8), "wo1": (16, DIM),
              "head": (DIM, VOCAB)}
    return {n: torch.randn(s, generator=gen) / s[0] ** 0.5 for n, s in shapes.items()}


def model_specs(gl):
    return (fa.LayerSpec(0, gl.GatedLinearConfig(num_heads=2, head_k_dim=4, head_v_dim=4), torch.float32),
            fa.LayerSpec(1, fa.FullAttentionConfig(num_q_heads=4, num_kv_heads=2, head_dim=4), torch.float32))


def make_step(gl):
    def step(params, session, tokens):
        p = params
        x = p["embed"][tokens]  # [T, DIM]
        T = x.shape[0]
        # Layer 0, gated linear: 2 heads of K = V = 4; the decay gate is a logsigmoid, so <= 0.
        q, k, v = ((x @ p[w]).view(T, 2, 4) for w in ("wq0", "wk0", "wv0"))  # [T, 2, 4]
        g = F.logsigmoid(x @ p["wg0"])  # [T, 2]
        out0, w0 = session.forward(0, gl.GatedLinearInputs(q=q, k=F.normalize(k, dim=-1), v=v, g=g))
        x = x + out0.o.flatten(1) @ p["wo0"]
        # Layer 1, full attention: 4 query heads over 2 kv heads. No rope: layer 0 already carries position.
        q = (x @ p["wq1"]).view(T, 4, 4)  # [T, Hq, D]
        k, v = ((x @ p[w]).view(T, 2, 4) for w in ("wk1", "wv1"))  # [T, Hkv, D]
        out1, w1 = session.forward(1, fa.FullAttentionInputs(q=q, k=k, v=v))
        x = x + out1.o.flatten(1) @ p["wo1"]
        return x @ p["head"], fa.StepDeltas.collect(session.batch, [w0, w1])  # [T, VOCAB]

    return step


def test_a_hybrid_model_generates_what_it_computes_without_a_cache():
    gl = load()
    specs, params, step = model_specs(gl), init_params(), make_step(gl)
    attn = fa.ModelAttention(specs, prefer=("vectorized", "reference"))
    assert attn.backend(0, "prefill").name == "vectorized" and attn.backend(0, "decode").name == "reference"

    def new_state():
        return fa.State(specs, num_pages=32, page_size=4, max_requests=4)

    prompts = {0: [3, 14, 15, 9, 2, 6], 1: [27, 1, 8]}
    _, out = driver.generate(step, params, attn, new_state(), prompts, max_new_tokens=8)
    _, chunked = driver.generate(step, params, attn, new_state(), prompts, max_new_tokens=8, chunk=4)

    def without_cache(prompt, n):  # the whole sequence through one prefill, for every new token
        seq = list(prompt)
        for _ in range(n):
            _, last = driver.prefill(step, params, attn, new_state().admit(0), {0: seq})
            seq.append(int(last[0].argmax()))
        return seq[len(prompt):]

    for rid, prompt in prompts.items():
        assert out[rid] == chunked[rid] == without_cache(prompt, 8)
    assert len(set(out[0] + out[1])) > 1  # not one token repeated: the check would be blind
