"""A decode step captured in pieces (`fnattn.pieces`, `StepRunner` on CUDA where some decode backend is not
capturable): where the pieces end, what an island keeps, and what a replay runs in between.

A CPU has no graphs, so a recorder stands in for them: it notes where each piece begins and ends and what a
replay runs, in order, while the step itself runs as it would under capture. The graphs themselves are
compared with the capture-free step on the GPU (tests/gpu/test_graph_gpu.py)."""

import optree
import pytest
import torch
from helpers import registry_scope

import fnattn as fa
from fnattn.driver import prefill
from fnattn.graph import StepRunner
from fnattn.lanes import static_shapes
from fnattn.pieces import CapturingSession, Island, copy_back, ending, replay


class _Recorder:
    """`fnattn.pieces.Pieces` on a CPU: each piece a stand-in graph whose replay notes its number in ``log``."""

    def __init__(self, log):
        self.log, self.graphs, self.graph = log, [], None

    def begin(self):
        self.log.append(f"begin {len(self.graphs)}")
        self.graph = _Graph(self.log, len(self.graphs))

    def end(self):
        self.log.append(f"end {len(self.graphs)}")
        self.graphs.append(self.graph)
        self.graph = None


class _Graph:
    def __init__(self, log, number):
        self.log, self.number = log, number

    def replay(self):
        self.log.append(f"graph {self.number}")


class _Logged:
    """A session whose forwards note their layer in ``log``."""

    def __init__(self, session, log):
        self._session, self._log = session, log

    def __getattr__(self, name):
        return getattr(self._session, name)

    def forward(self, layer, inputs):
        self._log.append(f"layer {layer}")
        return self._session.forward(layer, inputs)


def _user_copy(backend):
    """``backend``'s function as a user's (defined outside fnattn): what a notebook registers."""

    def copy(spec, views, inputs):
        return backend.source(spec, views, inputs)

    return copy


@pytest.fixture
def model():
    """Qwen3.5's tiny model (GDN layers 0-2, full attention at 3) whose GDN decode backend is a capturable copy
    of the one chosen on a CPU: only the full-attention layer is left to run between pieces."""
    from fnattn.models.registry import random_model

    m = random_model("qwen3_5", seed=0)
    with registry_scope():
        chosen = fa.ModelAttention(m.specs).backend(0, "decode")
        fa.register("gdn", "decode", "capturable_copy", plan=chosen.plan, capturable=True)(_user_copy(chosen))
        attn = fa.ModelAttention(m.specs)  # a user's backend ranks first
        assert attn.backend(0, "decode").name == "capturable_copy"
        st = fa.State(m.specs, num_pages=24, page_size=4, max_requests=3, fill=float("nan"))
        st = st.admit(0).admit(1)
        st, last = prefill(m.step, m.params, attn, st, {0: [3, 1, 4, 1, 5], 1: [9, 2]})
        yield m, attn, st.reserve({0: 1, 1: 1}), torch.tensor([int(last[r].argmax()) for r in (0, 1)])


def _captured(m, attn, st, tokens, log):
    """The decode step of requests 0 and 1 as a capture in pieces runs it: ``-> (batch, pieces, islands,
    logits, deltas)``."""
    batch = fa.Batch.decode(st, [0, 1])
    pieces, islands = _Recorder(log), []
    with static_shapes(), attn.session(st, batch, defer_capturable=True) as s, ending(pieces):
        pieces.begin()
        logits, deltas = m.step(m.params, _Logged(CapturingSession(s, pieces, islands, hold=True), log), tokens)
    return batch, pieces, islands, logits, deltas


def test_pieces_end_exactly_at_the_layers_whose_decode_backend_is_not_capturable(model):
    """The capturable GDN layers stay in their piece; the full-attention layer ends one, runs outside it, and
    the next piece reads what it returned; the step's logits are the eager step's bits."""
    m, attn, st, tokens = model
    log = []
    batch, pieces, islands, logits, deltas = _captured(m, attn, st, tokens, log)
    assert [island.layer for island in islands] == [3]
    assert len(pieces.graphs) == len(islands) + 1
    assert log == ["begin 0", "layer 0", "layer 1", "layer 2", "layer 3", "end 0", "begin 1", "end 1"]
    with static_shapes(), attn.session(st, batch) as s:
        eager, eager_deltas = m.step(m.params, s, tokens)
    assert torch.equal(logits, eager)
    # the writes the apply commits (the island's key and value rows among them, from the tensors the last piece
    # reads) are the eager step's
    got, want = (optree.tree_leaves(d, namespace="fnattn", none_is_leaf=True) for d in (deltas, eager_deltas))
    assert len(got) == len(want) and any(isinstance(t, torch.Tensor) for t in got)
    assert all(torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b for a, b in zip(got, want))


def test_a_decode_session_in_pieces_holds_the_capturable_layers_and_a_mixed_one_none(model):
    """On entry a session in pieces plans only the islands' layers (a plan may copy from the host, which no
    graph may); the layers of capturable backends are held in the pieces. A mixed step holds none."""
    m, attn, st, _ = model
    with attn.session(st, fa.Batch.decode(st, [0, 1]), defer_capturable=True) as s:
        assert [layer for layer in range(4) if s.holds_in_graph(layer)] == [0, 1, 2]
    st = st.admit(2).reserve({2: 2})
    with attn.session(st, fa.Batch.mixed(st, [0, 1], {2: 2}), defer_capturable=True) as s:
        assert not any(s.holds_in_graph(layer) for layer in range(4))


def test_a_replay_runs_each_island_between_its_pieces_and_copies_its_result_into_the_next_pieces_tensors(model):
    m, attn, st, tokens = model
    batch, pieces, islands, _, _ = _captured(m, attn, st, tokens, [])
    captured = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in islands[0].statics]
    inputs = {id(t) for t in optree.tree_leaves(islands[0].inputs, namespace="fnattn")}
    # what the next piece reads, overwritten (not the inputs a backend hands back): the replay writes it again
    copied = [t for t in islands[0].statics if isinstance(t, torch.Tensor) and id(t) not in inputs]
    assert copied
    for t in copied:
        t.fill_(float("nan") if t.is_floating_point() else -1)
    log = []
    for graph in pieces.graphs:
        graph.log = log
    with static_shapes(), attn.session(st, batch, defer_capturable=True) as s:
        replay(pieces.graphs, islands, _Logged(s, log), "test")
    assert log == ["graph 0", "layer 3", "graph 1"]
    for got, want in zip(islands[0].statics, captured):
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got is want


def test_a_backend_that_returns_otherwise_than_when_captured_is_refused_by_layer():
    static = torch.zeros(2, 3)
    island = Island(layer=5, inputs=None, statics=[static, None])
    with pytest.raises(ValueError, match=r"layer 5's backend.*2 output and write tensors"):
        copy_back(island, (static,), "StepRunner")
    other = torch.zeros(3)
    island = Island(layer=5, inputs=None, statics=[other, static])
    with pytest.raises(ValueError, match=r"layer 5's backend.*tensor \(2, 3\) torch.float32.*tensor \(2, 4\)"):
        copy_back(island, (torch.ones(3), torch.ones(2, 4)), "StepRunner")
    assert (other == 0).all() and (static == 0).all()  # refused before anything was copied
    copy_back(island, (torch.ones(3), torch.ones(2, 3)), "StepRunner")
    assert (other == 1).all() and (static == 1).all()


def test_a_cpu_runner_captures_nothing_in_pieces_or_whole(model):
    m, attn, st, _ = model
    runner = StepRunner(m.step, m.params, attn, m.manifest())
    assert not runner.capture and not runner.in_pieces
    assert runner.uncapturable("decode") == [f"layer 3 decode: {attn.backend(3, 'decode').name!r} is not capturable"]
    with pytest.raises(ValueError, match="capture"):
        StepRunner(m.step, m.params, attn, m.manifest(), capture=True)


def test_bench_model_uncapturable_registers_a_notebooks_copy_of_the_kinds_decode_backend():
    """`fnattn bench model --uncapturable KIND`: KIND's layers decode through a user's copy of the chosen backend,
    not declared capturable (so a CUDA runner replays pieces around them); the other kinds keep theirs."""
    from fnattn.bench.model import notebook_kind
    from fnattn.models.registry import random_model

    m = random_model("qwen3_5", seed=0)
    with registry_scope():
        before = fa.ModelAttention(m.specs)
        attn = notebook_kind(m, before, "full")
        copy = attn.backend(3, "decode")
        assert copy.name == "notebook_copy" and not copy.builtin and not copy.capturable
        assert copy.plan is before.backend(3, "decode").plan
        assert all(attn.backend(i, "decode").name == before.backend(i, "decode").name for i in range(3))
        with pytest.raises(ValueError, match=r"--uncapturable: expected a kind of this model's layers.*'mla'"):
            notebook_kind(m, before, "mla")
