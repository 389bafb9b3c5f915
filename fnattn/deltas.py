"""Deltas: explicit values for every state change a step wants.

Backends never write live storage; they return deltas (a `RecurrentWrite` with
``state=None`` says its states already sit in spare ring rows no request reads). The driver gathers a step's
deltas into one `StepDeltas` and hands it to `State.apply`, which validates all
of them before writing any byte, then applies each exactly once.

Every write delta addresses rows of one layer's storage through an index
tensor: token-addressed writes (K/V, latents, index keys) use flat cache slots
``page * page_size + offset``; request-addressed writes (recurrent and conv
state) use recurrent slot ids. A negative index means "skip this row" (padding,
or a token that was rejected during verification).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import optree
import torch
from jaxtyping import Float, Int
from torch import Tensor

from .checks import fail


def _tensor_pytree(cls):
    """Tensors are children, everything else is static aux data."""
    fields = dataclasses.fields(cls)
    tensors = tuple(f.name for f in fields if f.metadata.get("tensor"))
    static = tuple(f.name for f in fields if not f.metadata.get("tensor"))

    def flatten(obj):
        return (
            tuple(getattr(obj, n) for n in tensors),
            tuple(getattr(obj, n) for n in static),
            tensors,
        )

    def unflatten(aux, children):
        return cls(**dict(zip(static, aux)), **dict(zip(tensors, children)))

    optree.register_pytree_node(cls, flatten, unflatten, namespace="fnattn")
    return cls


def _t():
    return dataclasses.field(metadata={"tensor": True})


@dataclass(frozen=True)
class _Write:
    """Base of every storage write. Subclasses name their (storage, field) pairs."""

    #: (name of the storage tensor in the layer's pool, name of the value field)
    targets: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: "token": index is a flat cache slot; "request": index is a recurrent slot
    index_space: ClassVar[str] = "token"

    def rows(self) -> int:
        return self.index.shape[0]

    @property
    def index(self) -> Tensor:
        return self.slots


@_tensor_pytree
@dataclass(frozen=True)
class KVWrite(_Write):
    """New K/V rows of a full-attention layer."""

    targets: ClassVar = (("k", "k"), ("v", "v"))
    layer: int
    slots: Int[Tensor, " T"] = _t()  # [T] flat cache slot per token, < 0 skipped
    k: Float[Tensor, "T Hkv D"] = _t()  # [T, Hkv, D]
    v: Float[Tensor, "T Hkv Dv"] = _t()  # [T, Hkv, Dv]


@_tensor_pytree
@dataclass(frozen=True)
class LatentWrite(_Write):
    """New MLA cache rows: latent then rope key, ``[T, R + Dr]``."""

    targets: ClassVar = (("latent", "latent"),)
    layer: int
    slots: Int[Tensor, " T"] = _t()  # [T] flat cache slot per token
    latent: Float[Tensor, "T RDr"] = _t()  # [T, R + Dr]


@_tensor_pytree
@dataclass(frozen=True)
class IndexKeyWrite(_Write):
    """New DSA indexer keys of a sparse layer."""

    targets: ClassVar = (("index_k", "keys"),)
    layer: int
    slots: Int[Tensor, " T"] = _t()  # [T] flat cache slot per token
    keys: Float[Tensor, "T Di"] = _t()  # [T, Di]


@_tensor_pytree
@dataclass(frozen=True)
class RecurrentWrite(_Write):
    """New recurrent and conv-window state of a GDN/KDA layer.

    One row per request (prefill, decode), or one row per token (verify: the
    state after every draft position). Rows go to `Batch.recurrent_write_rows`:
    spare ring rows when the batch has a ring (the apply then moves each
    request's ring position, see `State`), else the current rows, where all
    verify rows but each request's last accepted one are marked -1 (see
    `StepDeltas.accept`).

    ``state=None``: the backend already wrote the states into the spare ring
    rows ``slots`` while the step ran (fresh storage handed out by `State`,
    never a live row), so the apply copies nothing; ``ring_step`` names the
    batch that was handed those rows.
    """

    targets: ClassVar = (("ssm", "state"), ("conv", "conv"))
    index_space: ClassVar = "request"
    layer: int
    slots: Int[Tensor, " R"] = _t()  # [R] recurrent storage row per state (R = B or T), < 0 skipped
    state: Float[Tensor, "R H K V"] | None = _t()  # [R, H, K, V]; None: written in place
    conv: Float[Tensor, "R C W1"] = _t()  # [R, C, W - 1]
    ring_step: int | None = None  # the batch whose spare ring rows `slots` are; None: current rows

    @property
    def in_place(self) -> bool:
        return self.state is None


WRITE_TYPES = (KVWrite, LatentWrite, IndexKeyWrite, RecurrentWrite)


@dataclass(frozen=True)
class CursorAdvance:
    """How many tokens each request's cursor moves, once per step, after all layers."""

    request_ids: tuple[int, ...]
    counts: tuple[int, ...]
    ring: tuple[int, ...] | None = None  # new ring position of each request's recurrent state; None: unmoved

    def __post_init__(self):
        object.__setattr__(self, "request_ids", tuple(self.request_ids))
        object.__setattr__(self, "counts", tuple(self.counts))
        if len(self.request_ids) != len(self.counts):
            fail("CursorAdvance", "counts", f"{len(self.request_ids)} entries (one per request)", len(self.counts))
        if self.ring is not None:
            object.__setattr__(self, "ring", tuple(self.ring))
            if len(self.ring) != len(self.request_ids) or not all(
                    isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in self.ring):
                fail("CursorAdvance", "ring", f"{len(self.request_ids)} non-negative ints (one per request)",
                     self.ring)
        if len(set(self.request_ids)) != len(self.request_ids):
            fail("CursorAdvance", "request_ids", "unique ids", self.request_ids)
        for c in self.counts:
            if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                fail("CursorAdvance", "counts", "non-negative ints", self.counts)


optree.register_pytree_node(
    CursorAdvance,
    lambda c: ((), (c.request_ids, c.counts, c.ring), None),
    lambda aux, _: CursorAdvance(*aux),
    namespace="fnattn",
)


@dataclass(frozen=True)
class StepDeltas:
    """All state changes of one step; applied exactly once, all or nothing."""

    step_id: int  # the Batch this step ran
    state_version: int  # the State version the step read
    writes: tuple  # tuple of KVWrite | LatentWrite | IndexKeyWrite | RecurrentWrite
    cursor: CursorAdvance | None = None

    def __post_init__(self):
        object.__setattr__(self, "writes", tuple(self.writes))
        for i, w in enumerate(self.writes):
            if not isinstance(w, WRITE_TYPES):
                fail("StepDeltas", f"writes[{i}]", "a write delta (KVWrite, ...)", type(w).__name__)
        if self.cursor is not None and not isinstance(self.cursor, CursorAdvance):
            fail("StepDeltas", "cursor", "a CursorAdvance or None", type(self.cursor).__name__)

    @staticmethod
    def collect(batch, layer_deltas, *, advance: bool = True) -> "StepDeltas":
        """Gather per-layer delta tuples of a step and the batch's cursor advance."""
        writes = [w for group in layer_deltas for w in group]
        cursor = batch.cursor_advance() if advance else None
        return StepDeltas(step_id=batch.step_id, state_version=batch.state_version, writes=tuple(writes), cursor=cursor)

    def accept(self, batch, accepted: Mapping[int, int]) -> "StepDeltas":
        """Keep the first ``accepted[r]`` new tokens of each request of a verify step.

        Token-addressed writes of rejected tokens get slot -1 (skipped by apply);
        per-token recurrent states keep only the row of the last accepted token
        (with a ring, every row is a spare one and the ring position moves to
        the last accepted token's row instead); the cursor advances by the
        accepted counts. Nothing else changes.
        """
        if batch.step_id != self.step_id:
            fail("StepDeltas.accept", "batch", f"the batch of step {self.step_id}", f"step {batch.step_id}")
        if set(accepted) != set(batch.request_ids):
            fail("StepDeltas.accept", "accepted", f"a count for each of requests {batch.request_ids}", dict(accepted))
        cu = batch.host_cu_seqlens
        keep, last = [], []
        for b, (rid, n_new) in enumerate(zip(batch.request_ids, batch.host_new_lens)):
            n = accepted[rid]
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= n_new:
                fail("StepDeltas.accept", f"accepted[{rid}]", f"an int in 1..{n_new}", n)
            keep += [i < n for i in range(n_new)]
            last.append(cu[b] + n - 1)
        device = batch.slot_mapping.device
        keep_t = torch.tensor(keep, dtype=torch.bool, device=device)
        last_t = torch.tensor(last, dtype=torch.long, device=device)
        writes = []
        for w in self.writes:
            if w.index_space == "token":
                w = dataclasses.replace(w, slots=torch.where(keep_t, w.slots, torch.full_like(w.slots, -1)))
            elif w.rows() == len(keep) and w.ring_step is None:  # one state per token: keep the last accepted
                index = torch.full((len(keep),), -1, dtype=torch.long, device=device)
                w = dataclasses.replace(w, slots=index.index_copy(0, last_t, batch.recurrent_slots.long()))
            writes.append(w)
        counts = tuple(accepted[r] for r in batch.request_ids)
        ring = None if batch.recovery == "replay" else batch.ring_after(counts)
        cursor = CursorAdvance(batch.request_ids, counts, ring=ring)
        return StepDeltas(step_id=self.step_id, state_version=self.state_version, writes=tuple(writes), cursor=cursor)



optree.register_pytree_node(
    StepDeltas,
    lambda d: ((d.writes,), (d.step_id, d.state_version, d.cursor), None),
    lambda aux, ch: StepDeltas(step_id=aux[0], state_version=aux[1], writes=ch[0], cursor=aux[2]),
    namespace="fnattn",
)

