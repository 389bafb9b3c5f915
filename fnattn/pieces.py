"""A step captured in pieces: CUDA graphs between the layers whose backends run eagerly in between.

A backend that is not capturable (it reads device values on the host, or plans from the lengths) cannot sit
inside a graph, but everything around it can. So the step is captured as consecutive graphs, each ended at such
a layer: the capture runs that layer's backend outside any graph, keeps what it returned as static tensors
(an `Island`), and begins the next piece, which reads them. A replay runs the first graph, then for each island
the layer's backend over the live batch (its plan made for the real step) with its result copied into those
static tensors, then the next graph. The last piece holds the step's apply, so the step still commits once,
inside a graph. `fnattn.prefill_graph` captures prefill so (its attention plans follow the prompts' lengths),
and `fnattn.graph.StepRunner` decode steps whose model has uncapturable decode backends.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import optree
import torch
from torch import Tensor

from .checks import fail


@dataclass
class Island:
    """One layer between two captured pieces: its inputs (the previous piece's tensors) and the tensors its
    outputs and writes are copied into, which the next piece reads."""

    layer: int
    inputs: object
    statics: list  # the (outputs, writes) leaves: a tensor to copy into, or what the capture saw (None, ...)


class Pieces:
    """Begins and ends the capture of consecutive pieces of one step on one pool."""

    def __init__(self, pool):
        self.pool, self.graphs, self.graph = pool, [], None

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        self.graph.capture_end()
        self.graphs.append(self.graph)
        self.graph = None


class CapturingSession:
    """The session a step sees while its pieces are captured: `forward` ends the current piece, runs the
    layer's backend outside the graph, keeps what came back as static tensors and begins the next piece.
    A layer the session `holds_in_graph` (``hold``) stays inside the piece. Everything else is the real
    session's."""

    def __init__(self, session, pieces: Pieces, islands: list, hold: bool):
        self._session, self._pieces, self._islands, self._hold = session, pieces, islands, hold

    def __getattr__(self, name):
        return getattr(self._session, name)

    def forward(self, layer: int, inputs):
        if self._hold and self._session.holds_in_graph(layer):  # shaped by the bucket: captured in the piece
            return self._session.forward(layer, inputs)
        self._pieces.end()
        result = self._session.forward(layer, inputs)
        leaves, spec = optree.tree_flatten(result, namespace="fnattn", none_is_leaf=True)
        owned = {id(t) for t in optree.tree_leaves(inputs, namespace="fnattn") if isinstance(t, Tensor)}
        # A backend that hands an input back (a key row to write, say) needs no copy: the next piece reads
        # the very tensor the previous one wrote.
        statics = [leaf.clone() if isinstance(leaf, Tensor) and id(leaf) not in owned else leaf
                   for leaf in leaves]
        self._islands.append(Island(layer, inputs, statics))
        self._pieces.begin()
        return optree.tree_unflatten(spec, statics)


@contextlib.contextmanager
def ending(pieces: Pieces):
    """Ends the piece being captured, also when the step raises (a capture left open breaks the stream)."""
    try:
        yield
    finally:
        if pieces.graph is not None:
            pieces.end()


def replay(graphs: list, islands: list[Island], session, where: str) -> None:
    """One replay of a step captured in pieces: the first graph, then each island's layer through ``session``
    (opened on the live batch, the captured layers' plans deferred) with its result copied back, then the
    graph after it."""
    graphs[0].replay()
    for island, graph in zip(islands, graphs[1:]):
        copy_back(island, session.forward(island.layer, island.inputs), where)
        graph.replay()


def copy_back(island: Island, result, where: str) -> None:
    """What a replay's backend returned, into the tensors the next piece reads; a backend whose return
    differs from the captured one in kind or shape is refused by name."""
    leaves = optree.tree_leaves(result, namespace="fnattn", none_is_leaf=True)
    if len(leaves) != len(island.statics):
        fail(where, f"layer {island.layer}'s backend", f"{len(island.statics)} output and write tensors "
             "(what it returned when captured)", len(leaves))
    pairs = [(static, leaf) for static, leaf in zip(island.statics, leaves) if leaf is not static]
    for static, leaf in pairs:  # all checked before any is copied
        if not isinstance(static, Tensor) or not isinstance(leaf, Tensor) or leaf.shape != static.shape:
            fail(where, f"layer {island.layer}'s backend", f"what it returned when captured ({_about(static)})",
                 _about(leaf))
    for static, leaf in pairs:
        static.copy_(leaf)


def _about(x) -> str:
    return f"tensor {tuple(x.shape)} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
