"""Numeric probes: run one layer through several backends and compare.

Every backend runs through the same session entry as a real step, against the
same state and batch (which no backend changes), and is compared with a
reference: the registered ``"reference"`` backend by default, or any other
backend name or function (a researcher's own ground truth). What is compared
is what a step leaves: the outputs, and the rows of the layer's storage after
the step's writes are applied (to a copy), so a backend that writes its new
states into spare ring rows compares with one that returns them as values.

NaN and Inf are differences like any other: a non-finite value where the
other side holds a finite one (either way) makes ``max_abs`` infinite, and
each row counts the non-finite values on both sides. Storage filled with NaN
(``State(..., fill=nan)``) so that stray reads show is then seen by a probe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import optree
import torch

from .checks import fail
from .deltas import StepDeltas, Writes
from .model_attention import ModelAttention
from .registry import Backend
from .rows import step_rows


@dataclass(frozen=True)
class ProbeRow:
    backend: str
    max_abs: float  # over outputs and the storage rows the step leaves; inf where only one side is finite
    max_rel: float  # max_abs / max |finite reference value|
    nonfinite: int = 0  # NaN / Inf values the backend left
    reference_nonfinite: int = 0  # NaN / Inf values the reference left
    same_nonfinite: int = 0  # places where both left the same non-finite value (NaN and NaN, +inf and +inf): equal
    unmatched: int = 0  # places where the two differ in finiteness, or hold different non-finite values


@dataclass(frozen=True)
class ProbeReport:
    layer: int
    phase: str
    reference: str
    rows: tuple[ProbeRow, ...]

    def __str__(self) -> str:
        lines = [f"probe layer {self.layer} ({self.phase}) against {self.reference}",
                 f"{'backend':<14}{'max abs':>12}{'max rel':>12}"]
        for r in self.rows:
            line = f"{r.backend:<14}{r.max_abs:>12.3e}{r.max_rel:>12.3e}"
            if r.nonfinite or r.reference_nonfinite:  # said only when there is something to say
                line += f"   non-finite: {r.nonfinite} here, {r.reference_nonfinite} in the reference"
                if r.unmatched:
                    line += f", {r.unmatched} where the other side differs"
                if r.same_nonfinite:
                    line += f", {r.same_nonfinite} the same in both (counted as equal)"
            lines.append(line)
        return "\n".join(lines)


def _leaves(tree):
    return [x for x in optree.tree_leaves(tree, namespace="fnattn") if isinstance(x, torch.Tensor)]


def _compared_outputs(out):
    """The outputs a probe compares: all but a verify's replay inputs, which are the step's own inputs handed
    back (what replaying them leaves is compared as storage rows) and which a plain function has none of."""
    if dataclasses.is_dataclass(out) and getattr(out, "replay", None) is not None:
        return dataclasses.replace(out, replay=None)
    return out


def _left_rows(state, spec, batch, attn, out, writes) -> list[torch.Tensor]:
    """The rows of the layer's storage the step leaves: each new token's, each request's current state."""
    if batch.phase == "verify":
        deltas = _every_draft_accepted(state, spec, batch, attn, out, writes)
    else:
        deltas = None if writes is None else StepDeltas.collect(batch, [writes])
    if deltas is None:
        return []
    after = state.apply(deltas, inplace=False, layers={spec.index})
    views = after.views(spec.index)
    rows = [after.recurrent_row(r) for r in batch.request_ids]  # each request's current state, after the step
    token_rows = step_rows(batch).token.index  # every new token's (a verify's: every draft accepted)
    left = []
    for name, space in state.storage_spaces[spec.index].items():
        t = views[name]
        if space == "token":
            left.append(t.flatten(0, 1).index_select(0, token_rows))
        else:
            left.append(t[rows])
    return left


def _every_draft_accepted(state, spec, batch, attn, out, writes) -> StepDeltas | None:
    """A verify step's deltas with every draft accepted, as `StepDeltas.accept` and the replay would leave them.

    A plain function of the kind (a prefill or decode reference) returns no replay inputs and one state per
    request, the one after its last token: what every draft accepted leaves, so it is applied as such.
    """
    spaces = state.storage_spaces[spec.index]
    states_given = writes is not None and any(spaces[n] == "request" for n in writes.values)
    if states_given:
        writes = _per_token(batch, spaces, writes)
    recurrent = "request" in spaces.values()
    if batch.recovery != "replay" or not recurrent:
        return None if writes is None else StepDeltas.collect(batch, [writes])
    if states_given and getattr(out, "replay", None) is None:  # a plain function: its states, natively
        native = dataclasses.replace(batch, recovery="native")
        return StepDeltas.collect(native, [writes])
    from .speculative import replay_writes  # (it imports the batch machinery probe does not otherwise need)

    every = {r: n for r, n in zip(batch.request_ids, batch.host_new_lens) if r >= 0}
    replay = replay_writes(attn, state, batch, {spec.index: out}, every)
    return StepDeltas.collect(batch, [] if writes is None else [writes]).accept(batch, every, replay=replay)


def _per_token(batch, spaces, writes: Writes) -> Writes:
    """Per-request states given once per request (``B`` rows) as a verify's state after every token
    (``T`` rows: each request's repeated over its tokens, so the last of them is its own)."""
    B, T = len(batch.request_ids), batch.num_tokens
    lens = torch.tensor(batch.host_new_lens)
    values = {}
    for name, v in writes.values.items():
        if spaces[name] == "request" and v is not None and v.shape[0] == B != T:
            v = v.repeat_interleave(lens.to(v.device), dim=0)
        values[name] = v
    return Writes(values).bound(layer=writes.layer, step=writes.step, session=writes.session)


def _compare(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, int, int, int, int]:
    """``a`` (a backend's) against ``b`` (the reference's): ``-> (max abs over places both hold finite
    values, max |finite b|, non-finite in a, in b, the same non-finite in both, places that differ in
    finiteness or hold different non-finite values)``."""
    if a.shape != b.shape:
        return float("inf"), 0.0, 0, 0, 0, max(a.numel(), b.numel(), 1)
    if not a.is_floating_point() or not a.numel():
        return (0.0 if torch.equal(a, b) else float("inf")), 0.0, 0, 0, 0, 0
    a, b = a.float(), b.float()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    both = fa & fb
    err = (a - b).abs()[both].max().item() if both.any() else 0.0
    scale = b.abs()[fb].max().item() if fb.any() else 0.0
    neither = ~fa & ~fb
    same = neither & ((a == b) | (torch.isnan(a) & torch.isnan(b)))
    unmatched = int((fa != fb).sum()) + int((neither & ~same).sum())
    return err, scale, int((~fa).sum()), int((~fb).sum()), int(same.sum()), unmatched


def probe(spec, *, state, batch, inputs, backends: Sequence[str] = ("reference",),
          reference: str | Callable = "reference") -> ProbeReport:
    """Compare ``backends`` with ``reference`` on one layer of one step.

    ``reference``: a registered backend name, or a function
    ``(spec, views, inputs) -> (outputs, writes)`` of the layer's kind.

    A verify batch compares the outputs (not the replay inputs a verify hands back) and the rows the step
    leaves with every draft accepted: the token rows of all its tokens and each request's state after its
    last token, which recovery ``"native"`` takes from the states the backend returned and recovery
    ``"replay"`` from replaying the tokens through the same backend (so the replay inputs are checked by
    what they lead to). A plain function of the kind serves as the reference of a verify too: the one state
    per request it returns is the one every draft accepted leaves. Which draft a step accepts is the
    model's business; the states at earlier positions are not compared.

    Any place where one side is finite and the other is not makes ``max_abs`` (and ``max_rel``) infinite;
    each row counts the non-finite values on both sides, and the places where both hold the same one.
    """
    if isinstance(backends, str) or not all(isinstance(b, str) for b in backends):
        fail("probe", "backends", "a sequence of backend names", backends)
    if callable(reference):
        ref = Backend(spec.kind, batch.phase, getattr(reference, "__name__", "reference"), reference,
                      builtin=False, source=reference)
        ref_name = f"{ref.name} (given)"
    elif isinstance(reference, str):
        ref, ref_name = reference, reference
    else:
        fail("probe", "reference", "a backend name or a function (spec, views, inputs) -> (outputs, writes)",
             reference)
    results = {}
    for label, choice in ((ref_name, ref), *((name, name) for name in backends)):
        ma = ModelAttention([spec], prefer=(choice,), device=state.device, phases=(batch.phase,))
        with ma.session(state, batch) as s:
            out, writes = s.forward(spec.index, inputs)
        if not _leaves(out):  # an unregistered output type would flatten to nothing and compare nothing
            raise TypeError(f"probe: backend {label!r} returned {type(out).__name__}, which is not a pytree of "
                            "tensors (register it with optree, namespace 'fnattn'); its outputs cannot be compared")
        results[label] = _leaves(_compared_outputs(out)) + _left_rows(state, spec, batch, ma, out, writes)
    want = results[ref_name]
    rows = []
    for name in backends:
        got = results[name]
        if len(got) != len(want):
            raise ValueError(f"probe: backend {name!r} left {len(got)} tensors (outputs and storage rows), "
                             f"the reference {len(want)}")
        abs_err, scale, counts = 0.0, 0.0, [0, 0, 0, 0]
        for a, b in zip(got, want):
            err, top, *found = _compare(a, b)
            abs_err, scale = max(abs_err, err), max(scale, top)
            counts = [c + f for c, f in zip(counts, found)]
        if counts[3]:  # a NaN or Inf where the other side differs is a difference, never hidden by a max
            abs_err = float("inf")
        rows.append(ProbeRow(name, abs_err, abs_err / scale if scale else abs_err, *counts))
    return ProbeReport(spec.index, batch.phase, ref_name, tuple(rows))
