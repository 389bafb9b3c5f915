"""Speculative decoding support: acceptance, and recovery of recurrent state.

A verify step runs 1 + k tokens per request (the last accepted token and k
drafts). Greedy acceptance keeps the longest prefix of drafts that matches the
target's own choices, plus the target's next token (the bonus). Only the
accepted part of the step reaches the state:

* K/V, latent and index-key rows of rejected tokens are never written
  (`StepDeltas.accept` marks them skipped);
* recurrent layers recover in one of two ways, chosen per run with
  ``Batch.verify(..., recovery=...)``:
    - ``"native"``: verify returned the state after every token; the apply
      keeps the row of the last accepted token;
    - ``"replay"``: verify returned only its per-token inputs; `replay_writes`
      re-runs the accepted tokens from the state the step read (which the
      step did not change, so it is the step's checkpoint) and the result joins
      the same single apply.
Both run the same token-by-token recurrence on the same inputs, so they leave
bitwise-identical state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from .batch import Batch
from .checks import fail
from .deltas import CursorAdvance, StepDeltas
from .inputs import RecurrentInputs, RecurrentOutput


def greedy_accept(logits: torch.Tensor, batch: Batch, drafts: Mapping[int, list[int]]):
    """``-> ({rid: accepted tokens incl. the last one}, {rid: next token})``.

    ``logits`` [T, vocab] of a verify step whose request r fed
    ``[last, *drafts[r]]``; row i predicts the token after input i.
    """
    cu = batch.host_cu_seqlens
    choice = logits.argmax(-1).tolist()
    accepted, bonus = {}, {}
    for b, rid in enumerate(batch.request_ids):
        d = drafts[rid]
        if len(d) != batch.host_new_lens[b] - 1:
            fail("greedy_accept", f"drafts[{rid}]", f"{batch.host_new_lens[b] - 1} tokens", len(d))
        n = 0
        while n < len(d) and choice[cu[b] + n] == d[n]:
            n += 1
        accepted[rid] = n + 1  # the fed last token plus n matching drafts
        bonus[rid] = choice[cu[b] + n]
    return accepted, bonus


def replay_writes(model_attention, state, verify_batch: Batch, outputs: Mapping[int, RecurrentOutput],
                  accepted: Mapping[int, int]) -> tuple:
    """Recurrent writes for the accepted tokens of a replay-mode verify step.

    ``outputs`` maps each recurrent layer to its verify output (which carries
    the step's inputs). The replay runs through a session of its own over the
    state the verify step read; only recurrent layers take part.
    """
    if verify_batch.recovery != "replay":
        fail("replay_writes", "verify_batch", 'a verify batch with recovery="replay"', verify_batch.recovery)
    batch = Batch.replay(state, dict(accepted))
    if batch.request_ids != verify_batch.request_ids:
        fail("replay_writes", "accepted", f"counts for requests {verify_batch.request_ids} in order",
             batch.request_ids)
    cu = verify_batch.host_cu_seqlens
    keep = torch.tensor([cu[b] + i for b, rid in enumerate(batch.request_ids) for i in range(accepted[rid])],
                        dtype=torch.long, device=state.device)  # rows of the accepted tokens
    writes = []
    with model_attention.session(state, batch) as s:
        for layer, out in outputs.items():
            if out.replay is None:
                fail("replay_writes", f"outputs[{layer}]", "a verify output with replay inputs", None)
            r: RecurrentInputs = out.replay
            sliced = replace(r, x=r.x.index_select(0, keep), g=r.g.index_select(0, keep),
                             beta=r.beta.index_select(0, keep))
            _, deltas = s.forward(layer, sliced)
            writes += deltas
    return tuple(writes)


def accept_step(deltas: StepDeltas, verify_batch: Batch, accepted: Mapping[int, int], *,
                extra_writes: tuple = ()) -> StepDeltas:
    """The verify step's deltas filtered by acceptance, plus replayed recurrent writes."""
    kept = deltas.accept(verify_batch, accepted)
    return StepDeltas(step_id=kept.step_id, state_version=kept.state_version, writes=kept.writes + tuple(extra_writes),
                      cursor=CursorAdvance(verify_batch.request_ids,
                                           tuple(accepted[r] for r in verify_batch.request_ids)))
