"""Draft models for speculative decoding: multi-token prediction (MTP) modules, depth 1.

A target family that exposes its final hidden states (``Family.step_hidden``)
can carry a small draft module trained next to it (DeepSeek-V3 "NextN",
Qwen3-Next / Qwen3.5 "MTP"). At draft position ``p`` the module reads the
target's hidden state at ``p`` (the final norm's output) and the embedding of
token ``p + 1``; its logits predict token ``p + 2``. Its ``hidden_out`` (its own
final norm's output) stands in for the target's hidden state when it drafts
further ahead than the target has verified.

The draft's attention layers are its own: ``specs`` carry layer indices after
the target's (``num_hidden_layers + j``) and live in a separate fnattn
`State`; a draft step runs through a session over that state with
``batch.positions`` equal to the target positions it drafts from.

A draft module builds on its target family's module, so the family cannot
import it: the family's ``draft`` is a `DraftHook` that the draft module fills
when imported (`models.registry` imports the draft modules after the families).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from fnattn import LayerSpec
from fnattn.checks import fail

from .loading import CheckpointError, CheckpointReader
from .registry import random_weights


@dataclass(frozen=True)
class DraftModel:
    specs: tuple[LayerSpec, ...]  # the draft's own attention layers; they live in their own fnattn State
    params: Any
    # (params, session, tokens [T] int64, hidden [T, D]) -> (logits [T, L] fp32, hidden_out [T, D], StepDeltas)
    step: Callable
    generated_lanes: tuple = ()  # what its step builds on the device (`fnattn.lanes.Lane`s), as a family's
    head: str = "lm_head"  # the field of ``params`` holding the output head [V, D] (or [L, D], below)
    vocab_ids: Tensor | None = None  # [L] int64: the token id of each logits column (`with_vocab`); None: all V

    def manifest(self, cfg):
        """The lanes of the draft's captured proposal step (`fnattn.graph.StepRunner.propose`) for the target
        config ``cfg``: the target's step lanes, the ``hidden`` it returns and the ``hidden_in`` it reads."""
        from fnattn.lanes import step_manifest

        return step_manifest(vocab=cfg.vocab_size, hidden=cfg.hidden_size, hidden_dtype=cfg.dtype,
                             generated=self.generated_lanes, hidden_in=True,
                             logits=None if self.vocab_ids is None else len(self.vocab_ids))

    def with_vocab(self, ids: Int[Tensor, " L"]) -> DraftModel:
        """This draft with an output head of ``ids``' rows only: a draft vocabulary (the frequent tokens of a
        corpus, as SGLang's speculative token map and FR-Spec keep). Its logits have one column per id, in
        ``ids``' order, and `fnattn.speculative.Speculator` (``draft_ids=draft.vocab_ids``) proposes the id of
        the column it picks. The head's rows are most of a one-layer draft's bytes a proposal (Qwen3.5-0.8B:
        248k x 1024, 508 MB in bf16); the draft reads ``len(ids) / V`` of them. Decoding stays lossless: a token
        outside ``ids`` is never proposed, and what is emitted is still the target's choice.
        ``ids``: a 1-D integer tensor of distinct token ids in ``0 .. V - 1``, at least one."""
        from fnattn.checks import fail

        W = getattr(self.params, self.head)  # [V, D]
        if self.vocab_ids is not None:
            fail("DraftModel.with_vocab", "self", "a draft with its whole head (vocab_ids None)",
                 f"one keeping {len(self.vocab_ids)} ids")
        if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.numel() < 1 or ids.is_floating_point() \
                or ids.dtype == torch.bool:
            fail("DraftModel.with_vocab", "ids", "a non-empty 1-D integer tensor of token ids",
                 tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__)
        ids = ids.to(device=W.device, dtype=torch.int64)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= W.shape[0]:
            fail("DraftModel.with_vocab", "ids", f"token ids in 0..{W.shape[0] - 1} (the head's rows)", f"{lo}..{hi}")
        if ids.unique().numel() != ids.numel():
            fail("DraftModel.with_vocab", "ids", "distinct token ids", f"{ids.numel() - ids.unique().numel()} repeated")
        head = W.index_select(0, ids)  # [L, D], a copy: the target keeps its own head
        return dataclasses.replace(self, params=dataclasses.replace(self.params, **{self.head: head}), vocab_ids=ids)


class DraftHook:
    """A target family's ``draft`` builder, registered by the draft module (``module``) when it is imported.

    Called as the builder: ``(model config, target params, weights mapping | None, *, seed) -> DraftModel``.
    """

    def __init__(self, module: str):
        self.module = module  # the draft module's path, for the error when nothing has registered
        self.build: Callable | None = None

    def register(self, build: Callable) -> None:
        if self.build is not None:
            raise ValueError(f"{self.module}: a draft builder is already registered ({self.build.__qualname__})")
        self.build = build

    def __call__(self, cfg, target_params, weights: Mapping | None = None, *, seed: int = 0) -> DraftModel:
        if self.build is None:
            raise RuntimeError(f"{self.module} has not registered its draft builder: importing it does (the "
                               "registry's family_named and random_model import it)")
        return self.build(cfg, target_params, weights, seed=seed)


def has_weights(weights: Mapping | None, marker: str) -> bool:
    """Whether ``weights`` holds the draft module (checkpoints written by transformers do not)."""
    return weights is not None and marker in weights


def draft_weights(weights: Mapping | None, shapes: dict[str, tuple[int, ...]], *, marker: str, seed: int,
                  like: Tensor, shared: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """The draft's tensors by checkpoint name, checked against ``shapes``.

    Read from ``weights`` when it holds ``marker``; otherwise random (seeded,
    scaled like `random_model`) in ``like``'s dtype and device. ``shared``
    names tensors that random drafts take from the target instead (a NextN
    head equal to the target's lm_head); a real checkpoint stores its own.
    """
    if not has_weights(weights, marker):
        shared = shared or {}
        own = {n: s for n, s in shapes.items() if n not in shared}
        return {**random_weights(own, seed=seed, dtype=like.dtype, device=like.device), **shared}
    if isinstance(weights, CheckpointReader):
        return {name: weights.expect(name, shape) for name, shape in shapes.items()}
    out = {}
    for name, shape in shapes.items():
        if name not in weights:
            raise CheckpointError(f"draft weights: tensor {name!r} is missing")
        t = weights[name]
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"draft weights: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        out[name] = t.to(device=like.device, dtype=like.dtype if t.is_floating_point() else t.dtype)
    return out


def check_step_inputs(owner: str, batch, tokens: Tensor, hidden: Tensor, hidden_size: int) -> None:
    """A draft step feeds one token and one hidden row per new position of its batch."""
    if tokens.shape[0] != batch.num_tokens:
        fail(owner, "tokens", f"{batch.num_tokens} tokens (the batch's)", tokens.shape[0])
    if tuple(hidden.shape) != (batch.num_tokens, hidden_size):
        fail(owner, "hidden", f"of shape {(batch.num_tokens, hidden_size)}", tuple(hidden.shape))

