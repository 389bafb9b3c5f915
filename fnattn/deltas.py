"""Deltas: explicit values for every state change a step wants.

A backend returns its outputs and one `Writes` value: the new rows of each
storage tensor its layer owns, by the tensor's name (``fnattn.writes(k=...,
v=...)``). A write carries no index: which rows it goes to is the batch's and
the State's business (every new token's cache slot; the recurrent rows the
batch hands out), so a step cannot write a row it does not own. ``None`` for a
per-request tensor says the backend already put its new rows into the spare
ring rows the batch handed out (see `State`).

The session binds each layer's `Writes` to the layer and the step; the driver
gathers them into one `StepDeltas` and hands it to `State.apply`, which checks
the whole step before it writes a byte (`fnattn.apply`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import optree
from torch import Tensor

from .batch import Batch
from .checks import fail
from .cursor import CursorAdvance
from .declare import tensor_pytree


@tensor_pytree
@dataclass(frozen=True)
class Output:
    """What most backends return: the attention output and, where asked, its LSE."""

    o: Tensor  # [T, H, Dv] in the layer dtype
    lse: Tensor | None = None  # [T, H] fp32 natural-log LSE
    replay: Any = None  # verify: the step's inputs, to replay accepted tokens


@dataclass(frozen=True)
class Writes:
    """New rows for the storage of one layer, by storage name; the batch says which rows.

    ``layer``, ``step`` and ``session`` are filled by the session that ran the
    backend; a backend leaves them unset.
    """

    values: Mapping[str, Tensor | None]  # name -> [rows, *row shape]; None: already in the spare ring rows
    layer: int | None = None
    step: int | None = None  # the Batch the rows belong to
    session: int | None = field(default=None, repr=False)  # the session that ran the backend

    def __post_init__(self):
        if not isinstance(self.values, Mapping):
            fail("Writes", "values", "a mapping storage name -> tensor or None", type(self.values).__name__)
        for name, v in self.values.items():
            if not isinstance(name, str):
                fail("Writes", "values", "storage names as keys", name)
            if v is not None and not isinstance(v, Tensor):
                fail("Writes", f"values[{name!r}]", "a torch.Tensor or None", type(v).__name__)
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))

    def __getitem__(self, name: str) -> Tensor | None:
        return self.values[name]

    def bound(self, *, layer: int, step: int, session: int) -> "Writes":
        # The values were checked when this Writes was made: a bound copy needs no second pass (a session
        # binds every layer's writes every step).
        out = object.__new__(Writes)
        out.__dict__.update(values=self.values, layer=layer, step=step, session=session)  # frozen: no setattr
        return out


def writes(**values: Tensor | None) -> Writes:
    """The new rows of one layer's storage: ``writes(k=k, v=v)``, ``writes(state=s)``."""
    return Writes(values)


optree.register_pytree_node(
    Writes,
    lambda w: (tuple(w.values.values()), (tuple(w.values), w.layer, w.step, w.session), None),
    lambda aux, ch: Writes(dict(zip(aux[0], ch)), layer=aux[1], step=aux[2], session=aux[3]),
    namespace="fnattn",
)


def check_accepted(batch, accepted, where: str) -> None:
    """``accepted`` is what `StepDeltas.accept` can give for ``batch``: a tuple of ints, one per lane; on a
    verify step each request's within 1..its new tokens (the fed token is always kept) and each pad lane's
    all of them; on any other step exactly the batch's new lengths (nothing of a prefill or decode is
    dropped). A forged count would move a cursor past rows nobody wrote, or write rows no cursor covers."""
    lens = batch.host_new_lens
    if not isinstance(accepted, tuple) or len(accepted) != len(lens) \
            or not all(type(n) is int for n in accepted):  # bool is an int subclass: not a count
        fail(where, "accepted", f"None or a tuple of {len(lens)} ints (one per lane of the batch)", accepted)
    if batch.phase != "verify":
        if accepted != lens:
            fail(where, "accepted", f"None or the batch's new lengths {lens} (only a verify step drops tokens)",
                 accepted)
        return
    for rid, n, m in zip(batch.request_ids, accepted, lens):
        if not (n == m if rid < 0 else 1 <= n <= m):
            fail(where, "accepted", f"per lane an int in 1..{m} (the fed token plus accepted drafts; a pad lane "
                 f"keeps all {m})", accepted)


@dataclass(frozen=True)
class StepDeltas:
    """All state changes of one step; applied exactly once, all or nothing.

    ``accepted`` (verify only) keeps the first ``accepted[r]`` new tokens of
    each request; ``replay`` holds the recurrent writes of the replay batch
    that re-ran them (recovery ``"replay"``). ``cursor`` is what the step
    moves; the apply checks it against the batch and the acceptance.
    """

    batch: Any  # the Batch this step ran
    writes: tuple[Writes, ...]
    cursor: CursorAdvance
    accepted: tuple[int, ...] | None = None  # [B] accepted new tokens per request (verify)
    replay: StepDeltas | None = None  # recurrent writes of the replay batch (verify, recovery "replay")

    def __post_init__(self):
        if not isinstance(self.batch, Batch):
            fail("StepDeltas", "batch", "the Batch of the step", type(self.batch).__name__)
        if isinstance(self.writes, (Tensor, str, Mapping)) or not isinstance(self.writes, Iterable):
            fail("StepDeltas", "writes", "a tuple of Writes", type(self.writes).__name__)
        object.__setattr__(self, "writes", tuple(self.writes))
        for i, w in enumerate(self.writes):
            if not isinstance(w, Writes):
                fail("StepDeltas", f"writes[{i}]", "a Writes value (what a session's forward returns)",
                     type(w).__name__)
        if not isinstance(self.cursor, CursorAdvance):
            fail("StepDeltas", "cursor", "a CursorAdvance", type(self.cursor).__name__)
        if self.replay is not None and not isinstance(self.replay, StepDeltas):
            fail("StepDeltas", "replay", "the StepDeltas of a replay batch or None", type(self.replay).__name__)
        if self.accepted is not None:
            check_accepted(self.batch, self.accepted, "StepDeltas")

    @property
    def step_id(self) -> int:
        return self.batch.step_id

    @property
    def state_version(self) -> int:
        return self.batch.state_version

    @staticmethod
    def collect(batch, layer_writes: Iterable) -> StepDeltas:
        """Gather the `Writes` each layer's forward returned (None for a layer without any)."""
        found = []
        for w in layer_writes:
            if w is None:
                continue
            if isinstance(w, (tuple, list)):  # a model that kept several layers' writes together
                found += [x for x in w if x is not None]
            else:
                found.append(w)
        counts = batch.host_new_lens
        return StepDeltas(batch=batch, writes=tuple(found), cursor=batch.cursor_after(counts))

    def accept(self, batch, accepted: Mapping[int, int], *, replay: StepDeltas | None = None) -> StepDeltas:
        """Keep the first ``accepted[r]`` new tokens of each request of a verify step.

        Rows of rejected tokens are never written; recurrent layers keep the
        state after the last accepted token (``recovery="native"``), or take
        the states of ``replay``, the deltas of the replay batch that re-ran
        the accepted tokens (``recovery="replay"``). The cursor advances by
        the accepted counts.
        """
        if batch is not self.batch and batch.step_id != self.batch.step_id:
            fail("StepDeltas.accept", "batch", f"the batch of step {self.step_id}", f"step {batch.step_id}")
        if self.accepted is not None:
            fail("StepDeltas.accept", "deltas", "deltas not yet filtered by acceptance", self.accepted)
        if batch.phase != "verify":
            fail("StepDeltas.accept", "batch", "a verify batch", batch.phase)
        live = batch.live_ids
        if not isinstance(accepted, Mapping) or set(accepted) != set(live):
            fail("StepDeltas.accept", "accepted", f"a count for each of requests {live}",
                 dict(accepted) if isinstance(accepted, Mapping) else accepted)
        counts = []
        for rid, n_new in zip(batch.request_ids, batch.host_new_lens):
            if rid < 0:  # a pad lane keeps what it wrote to the null page and slot
                counts.append(n_new)
                continue
            n = accepted[rid]
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= n_new:
                fail("StepDeltas.accept", f"accepted[{rid}]", f"an int in 1..{n_new}", n)
            counts.append(n)
        counts = tuple(counts)
        if (batch.recovery == "replay") != (replay is not None):
            fail("StepDeltas.accept", "replay",
                 "the replay batch's deltas" if batch.recovery == "replay" else "None (recovery is native)",
                 type(replay).__name__)
        if replay is not None and not isinstance(replay, StepDeltas):
            fail("StepDeltas.accept", "replay", "the StepDeltas of a replay batch or None", type(replay).__name__)
        writer = replay.batch if replay is not None else batch
        cursor = batch.cursor_after(counts, ring_of=writer)
        # Every field is checked: this value's at its construction, the counts and the replay just above, and the
        # cursor is the batch's own; `dataclasses.replace` would check them all again (a verify step's host time).
        out = object.__new__(StepDeltas)
        out.__dict__.update(self.__dict__, accepted=counts, replay=replay, cursor=cursor)
        return out


optree.register_pytree_node(
    StepDeltas,
    lambda d: ((d.writes, d.replay), (d.batch, d.cursor, d.accepted), None),
    lambda aux, ch: StepDeltas(batch=aux[0], writes=ch[0], cursor=aux[1], accepted=aux[2], replay=ch[1]),
    namespace="fnattn",
)
