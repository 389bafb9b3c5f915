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
      step did not change, so it is the step's checkpoint) and its deltas join
      the same single apply (`StepDeltas.accept(..., replay=...)`).
Both run the same token-by-token recurrence on the same inputs, so they leave
bitwise-identical state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .batch import Batch
from .checks import fail
from .declare import select_tokens
from .deltas import StepDeltas
from .staging import to_device


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


def greedy_accept_rows(logits: Float[Tensor, "T V"], drafts: Int[Tensor, "n k"]) -> Int[Tensor, "n k2"]:
    """`greedy_accept` on the device: ``logits`` [n * (1 + k), vocab] of a verify whose request b fed its last
    token then ``drafts[b]`` ([n, k]); ``-> [n, 2 + k]`` int64 rows ``(accepted, *choices)``: the last token plus
    the leading drafts the target's choices agree with, then the target's token after each input (the emitted
    tokens are the first ``accepted`` choices: the kept drafts, then the bonus)."""
    if drafts.dim() != 2 or logits.dim() != 2 or logits.shape[0] != drafts.shape[0] * (drafts.shape[1] + 1):
        fail("greedy_accept_rows", "logits", "[n * (1 + k), vocab] rows for drafts [n, k] = "
             f"{tuple(drafts.shape)}", tuple(logits.shape))
    n, k = drafts.shape
    choice = logits.argmax(-1).view(n, k + 1)  # [n, 1 + k]
    kept = (choice[:, :k] == drafts).long().cumprod(dim=1).sum(dim=1)  # [n] leading drafts it agrees with
    return torch.cat([kept[:, None] + 1, choice], dim=1)


def forced_accept_rows(logits: Float[Tensor, "T V"], drafts: Int[Tensor, "n k"], count: int) -> Int[Tensor, "n k2"]:
    """`greedy_accept_rows`' format with every request keeping ``count`` tokens (1 .. k + 1: the last one and
    ``count - 1`` drafts) whatever the target chose: the kept drafts, then the target's choice after the last
    of them (its bonus), then its choices after the others. Benchmarks time the machinery at either end of
    acceptance with it, on the device as greedy acceptance is."""
    n, k = drafts.shape
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= k + 1:
        fail("forced_accept_rows", "count", f"an int in 1..{k + 1}", count)
    if logits.dim() != 2 or logits.shape[0] != n * (k + 1):
        fail("forced_accept_rows", "logits", f"[n * (1 + k), vocab] rows for drafts [n, k] = {(n, k)}",
             tuple(logits.shape))
    choice = logits.argmax(-1).view(n, k + 1)  # [n, 1 + k]
    emitted = torch.cat([drafts[:, :count - 1], choice[:, count - 1:]], dim=1)
    return torch.cat([torch.full((n, 1), count, dtype=emitted.dtype, device=emitted.device), emitted], dim=1)


def sampled_accept_rows(logits: Float[Tensor, "T V"], drafts: Int[Tensor, "n k"], draft_probs: Float[Tensor, "n k V"],
                        sampler, generator) -> Int[Tensor, "n k2"]:
    """Speculative sampling's acceptance on the device, in `greedy_accept_rows`' row format ``(accepted,
    *emitted)``: draft ``j`` of request b is kept while ``u < p(x) / q(x)`` (``p`` the target's warped
    distribution at that position, ``q`` the draft's one it was drawn from, ``u`` uniform from ``generator``);
    at the first refusal a token is drawn from ``max(0, p - q)`` renormalised, and after ``k`` kept drafts from
    ``p`` at the last position. The emitted tokens are then distributed as the target's own sampling
    (``sampler``'s temperature and filters) would draw them, whatever the draft proposes."""
    n, k = drafts.shape
    if logits.dim() != 2 or logits.shape[0] != n * (k + 1):
        fail("sampled_accept_rows", "logits", f"[n * (1 + k), vocab] rows for drafts [n, k] = {(n, k)}",
             tuple(logits.shape))
    if tuple(draft_probs.shape) != (n, k, logits.shape[1]):
        fail("sampled_accept_rows", "draft_probs", f"[n, k, vocab] = {(n, k, logits.shape[1])}",
             tuple(draft_probs.shape))
    p = sampler.warp(logits).softmax(dim=-1).view(n, k + 1, -1)  # [n, 1 + k, V] fp32
    px = p[:, :k].gather(2, drafts[..., None]).squeeze(2)  # [n, k]
    qx = draft_probs.float().gather(2, drafts[..., None]).squeeze(2)
    u = torch.rand((n, k), generator=generator, device=logits.device)
    kept = (u * qx < px).long().cumprod(dim=1).sum(dim=1)  # [n]: u < p / q, without dividing by q
    lanes = torch.arange(n, device=logits.device)
    p_at = p[lanes, kept]  # [n, V]
    q_at = draft_probs.float()[lanes, kept.clamp(max=k - 1)] * (kept < k)[:, None]
    residual = (p_at - q_at).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)  # p == q there: draw from p
    token = torch.multinomial(residual, 1, generator=generator)  # [n, 1]
    emitted = torch.cat([drafts, token], dim=1).scatter(1, kept[:, None], token)
    return torch.cat([kept[:, None] + 1, emitted], dim=1)


def replay_writes(model_attention, state, verify_batch: Batch, outputs: Mapping[int, object],
                  accepted: Mapping[int, int]) -> StepDeltas:
    """The recurrent writes of the accepted tokens of a replay-mode verify step, as the replay batch's deltas.

    ``outputs`` maps each recurrent layer to its verify output (which carries
    the step's inputs). The replay runs through a session of its own over the
    state the verify step read; only recurrent layers take part.
    """
    if verify_batch.recovery != "replay":
        fail("replay_writes", "verify_batch", 'a verify batch with recovery="replay"', verify_batch.recovery)
    padded = verify_batch.num_pad > 0
    batch = Batch.replay(state, dict(accepted), pad_to=verify_batch.num_requests if padded else None,
                         columns=verify_batch.block_table.shape[1] if padded else None,
                         pad_tokens=1 + verify_batch.num_draft)
    if batch.request_ids != verify_batch.request_ids:
        fail("replay_writes", "accepted", f"counts for requests {verify_batch.live_ids} in order",
             batch.live_ids)
    _check_replay_outputs(model_attention, state, outputs)
    cu = verify_batch.host_cu_seqlens
    keep = torch.tensor([cu[b] + i for b, n in enumerate(batch.host_new_lens) for i in range(n)],
                        dtype=torch.long, device=state.device)  # rows of the accepted tokens (pad lanes: all)
    writes = []
    with model_attention.session(state, batch) as s:
        for layer, out in outputs.items():
            _, w = s.forward(layer, select_tokens(out.replay, keep))
            if w is None:  # the replay batch is a native verify: it must return the state after each token
                fail(f"replay_writes: layer {layer}, backend {_backend_name(model_attention, layer)!r}", "writes",
                     "the recurrent states of the replayed tokens (the replay batch is a verify with recovery "
                     "'native': return the state after every token)", None)
            # Only per-request storage is replayed; a layer's token rows come from the verify step itself.
            spaces = state.storage_spaces[layer]
            writes.append(replace(w, values={n: v for n, v in w.values.items() if spaces[n] == "request"}))
    return StepDeltas.collect(batch, writes)


def _backend_name(model_attention, layer: int) -> str:
    return model_attention.backend(layer, "verify").name


def _check_replay_outputs(model_attention, state, outputs) -> None:
    """Every recurrent layer of the step left replay inputs: the replay re-runs them, and a layer without
    them would leave its state unwritten (the apply then refuses the step, naming the writes, not why)."""
    if not isinstance(outputs, Mapping):
        fail("replay_writes", "outputs", "a mapping layer -> its verify output (a session's replay_outputs)",
             type(outputs).__name__)
    spaces = state.storage_spaces
    recurrent = [layer for layer in model_attention.spec_by_layer if "request" in spaces.get(layer, {}).values()]
    for layer in sorted(set(recurrent) | set(outputs)):
        out = outputs.get(layer)
        if getattr(out, "replay", None) is None:
            fail("replay_writes", f"outputs[{layer}]",
                 f"the verify output of layer {layer} carrying its replay inputs: in a verify with recovery "
                 f"'replay', backend {_backend_name(model_attention, layer)!r} must return Output(replay=inputs) "
                 "(its inputs without meta) and no state",
                 "missing" if out is None else f"{type(out).__name__} with replay=None")


def accept_step(deltas: StepDeltas, verify_batch: Batch, accepted: Mapping[int, int], *,
                replay: StepDeltas | None = None) -> StepDeltas:
    """The verify step's deltas filtered by acceptance (with the replayed recurrent writes, if any)."""
    return deltas.accept(verify_batch, accepted, replay=replay)


class Speculator:
    """Greedy speculative decoding with a draft model that reads the target's hidden states.

    ``target_step(params, session, tokens) -> (logits, hidden, StepDeltas)`` and
    ``draft_step(params, session, tokens, hidden) -> (logits, hidden_out, StepDeltas)``
    (multi-token prediction: the draft at position p reads the target's hidden
    state at p and token p + 1, and predicts token p + 2). Each owns a State.

    Per step: the draft proposes ``num_draft`` tokens (its speculative entries
    are rolled back with a checkpoint), the target verifies ``1 + num_draft``
    tokens per request, greedy acceptance keeps the matching prefix plus the
    target's bonus token, the target's deltas are filtered and applied once,
    and the draft catches up on the accepted positions with the target's true
    hidden states.

    ``target_runner``: a `fnattn.graph.StepRunner` over ``target_step`` with a ``hidden`` output lane, which
    runs every verify step (the captured verify graph on a GPU). ``draft_runner``: one over ``draft_step`` with
    the ``hidden_in`` and ``hidden`` lanes (``step_manifest(..., hidden_in=True)``), which runs the draft's own
    proposal steps (`StepRunner.propose`: captured per bucket on a GPU) and its catch-up on each step's tokens, as
    a fixed-shape verify of the ``1 + num_draft`` positions (the emitted tokens, padded) whose acceptance keeps the
    accepted ones. With both runners and no ``propose_hook`` the drafts stay on the device and greedy acceptance is
    computed there: one host read a step (`_step_on_device`; an ``accept_hook`` is given the counts it read).
    Prefill and the catch-up on the prompts stay eager. On that path a step's acceptance by the target is applied
    when ``tstate`` is next read: the next step reads it after launching the draft's proposals, so the host applies
    it while the device runs them (every read of ``tstate`` sees it applied).
    ``accept_hook(step, accepted) -> accepted``: replaces greedy acceptance's counts (each 1 .. k + 1: the
    last token plus the drafts kept); the bonus token is then the target's choice after the last one kept.
    For benchmarks that force every draft in (or none) whatever the logits say. ``force_accept``: every request
    keeps this many tokens a step (1 .. k + 1), decided on the device, so the one-read path keeps its order (the
    catch-up launched before the read); what benchmarks time at either end of acceptance. ``trace``: keep every logits
    tensor computed in ``self.trace`` (for comparisons).
    ``draft_ids``: the token id of each column of the draft's logits, for a draft whose head keeps only those rows
    (`models.mtp.DraftModel.with_vocab`: ``draft_ids=draft.vocab_ids``); the draft proposes the id of the column
    it picks, and when sampling its distribution over the vocabulary is zero elsewhere. None: the columns are the
    vocabulary.
    """

    def __init__(self, *, target_step, target_params, target_attn, target_state, draft_step, draft_params,
                 draft_attn, draft_state, num_draft: int, recovery: str = "native", propose_hook=None,
                 target_runner=None, accept_hook=None, draft_runner=None, trace: bool = False, sampler=None,
                 force_accept: int | None = None, draft_ids: Int[torch.Tensor, " L"] | None = None):
        if isinstance(num_draft, bool) or not isinstance(num_draft, int) or num_draft < 1:
            fail("Speculator", "num_draft", "an int >= 1", num_draft)
        if recovery not in ("native", "replay"):
            fail("Speculator", "recovery", "'native' or 'replay'", recovery)
        if target_runner is not None and (not getattr(target_runner, "hidden", False)
                                          or target_runner.attn is not target_attn):
            fail("Speculator", "target_runner", "None or a StepRunner over target_attn with a 'hidden' output lane",
                 type(target_runner).__name__)
        if draft_runner is not None and (not getattr(draft_runner, "hidden_in", False)
                                         or draft_runner.attn is not draft_attn):
            fail("Speculator", "draft_runner", "None or a StepRunner over draft_attn with 'hidden_in' and 'hidden' "
                 "lanes", type(draft_runner).__name__)
        if force_accept is not None and (isinstance(force_accept, bool) or not isinstance(force_accept, int)
                                         or not 1 <= force_accept <= num_draft + 1):
            fail("Speculator", "force_accept", f"None or an int in 1..{num_draft + 1}", force_accept)
        if force_accept is not None and accept_hook is not None:
            fail("Speculator", "force_accept", "None with an accept_hook (both force the counts)", force_accept)
        if not isinstance(trace, bool):
            fail("Speculator", "trace", "a bool", trace)
        if draft_ids is not None and (not isinstance(draft_ids, torch.Tensor) or draft_ids.dim() != 1
                                      or draft_ids.numel() < 1 or draft_ids.dtype != torch.int64
                                      or draft_ids.device != target_state.device):
            fail("Speculator", "draft_ids", f"None or a non-empty 1-D int64 tensor on {target_state.device}",
                 (tuple(draft_ids.shape), draft_ids.dtype, str(draft_ids.device))
                 if isinstance(draft_ids, torch.Tensor) else type(draft_ids).__name__)
        if draft_ids is not None and (int(draft_ids.min()) < 0 or draft_ids.unique().numel() != draft_ids.numel()):
            fail("Speculator", "draft_ids", "distinct token ids >= 0", draft_ids.tolist()[:16])
        from .generation import Sampler

        if sampler is not None and not isinstance(sampler, Sampler):
            fail("Speculator", "sampler", "None (greedy) or a fnattn.generation.Sampler", type(sampler).__name__)
        sampling = sampler is not None and not sampler.greedy
        if sampling and (propose_hook is not None or accept_hook is not None or force_accept is not None):
            fail("Speculator", "sampler", "greedy (None or temperature 0) with a propose_hook, accept_hook or "
                 "force_accept", sampler)
        if sampling and sampler._flashinfer(torch.empty(0, device=target_state.device)):
            fail("Speculator", "sampler", "kernel 'torch' (acceptance draws from the torch generator)", sampler.kernel)
        self.sampler = sampler if sampling else None
        self.generator = sampler.generator(target_state.device) if sampling else None
        self.k, self.recovery, self.propose_hook, self.accept_hook = num_draft, recovery, propose_hook, accept_hook
        self.force_accept = force_accept
        self.draft_ids, self._vocab = draft_ids, None  # the vocabulary: the target's logits' width, seen at start
        if draft_runner is not None:
            self._check_draft_columns(None, draft_runner.manifest.dims["L"], draft_runner.manifest.dims["V"])
        self.runner, self.draft_runner = target_runner, draft_runner
        self.target = (target_step, target_params, target_attn)
        self.draft = (draft_step, draft_params, draft_attn)
        self._tstate, self.dstate = target_state, draft_state
        self._device = target_state.device
        # a step's target acceptance not yet applied (Verified, counts): `tstate` applies it when first read, which
        # the next step does after launching the draft's proposals, so that host work runs beside them
        self._pending: tuple | None = None
        self.last: dict[int, int] = {}  # newest token of each request, not yet fed to the target
        # draft's next token (0-d), its hidden_out and, when sampling, the distribution it was drawn from [V]
        self.proposal: dict[int, tuple] = {}
        # the same proposals as the rows they were chosen in: (ids, tokens [n], hidden [n, D], probs or None),
        # which the next chain of the same requests takes whole (no per-request gather on the device)
        self._proposed: tuple | None = None
        self.steps = 0
        #: with ``trace=True``, every logits tensor computed, in order (target verify/prefill, draft), for
        #: comparisons; off by default (a long generation would keep every step's logits alive)
        self.trace: list[torch.Tensor] = []
        self._tracing = trace

    @property
    def tstate(self):
        """The target's State, every step's acceptance applied."""
        if self._pending is not None:
            verified, accepted = self._pending
            self._pending = None
            self._tstate = verified.accept(accepted)
        return self._tstate

    @tstate.setter
    def tstate(self, state) -> None:
        if self._pending is not None:
            fail("Speculator", "tstate", "set after the last step's acceptance was applied (read it first)", state)
        self._tstate = state

    # ------------------------------------------------------------------ helpers
    def _trace(self, logits: torch.Tensor) -> None:
        if self._tracing:
            self.trace.append(logits)

    def _choose(self, logits: torch.Tensor):
        """One token per row of ``logits`` [m, V]: ``-> (tokens [m], the distributions drawn from [m, V] or
        None)``: the argmax, or with a sampler a draw from its warped distribution."""
        if self.sampler is None:
            return logits.argmax(-1), None
        probs = self.sampler.warp(logits).softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1), probs

    def _choose_draft(self, logits: torch.Tensor):
        """`_choose` over the draft's logits [m, L]: ``-> (token ids [m], the distributions drawn from over the
        vocabulary [m, V] or None)``, each column the id ``draft_ids`` gives it (the columns checked where the
        logits came from: `_run_draft`, or a draft runner's manifest at construction)."""
        if self.draft_ids is None:
            return self._choose(logits)
        columns, probs = self._choose(logits)
        tokens = self.draft_ids.index_select(0, columns)
        if probs is not None:
            probs = probs.new_zeros(probs.shape[0], self._vocab).index_copy_(1, self.draft_ids, probs)
        return tokens, probs

    def _check_draft_columns(self, logits: torch.Tensor | None, columns: int | None = None,
                             vocab: int | None = None) -> None:
        """The draft's logits have a column per id of ``draft_ids``, or without it one per token id."""
        columns = logits.shape[-1] if columns is None else columns
        vocab = self._vocab if vocab is None else vocab
        if self.draft_ids is not None and columns != self.draft_ids.numel():
            fail("Speculator", "draft_ids", f"one id per column of the draft's logits ({columns})",
                 self.draft_ids.numel())
        if self.draft_ids is None and vocab is not None and columns != vocab:
            fail("Speculator", "draft_ids", f"the token id of each of the draft's {columns} logits columns (the "
                 f"vocabulary has {vocab}: a draft with a smaller head, DraftModel.with_vocab)", None)

    def _run_target(self, batch, tokens):
        step, params, attn = self.target
        with attn.session(self.tstate, batch) as s:
            logits, hidden, deltas = step(params, s, tokens)
        self._trace(logits)
        return logits, hidden, deltas, s.replay_outputs

    def _run_draft(self, batch, tokens, hidden):
        step, params, attn = self.draft
        with attn.session(self.dstate, batch) as s:
            logits, hout, deltas = step(params, s, tokens, hidden)
        self._check_draft_columns(logits)  # before its deltas apply
        self._trace(logits)
        self.dstate = self.dstate.apply(deltas)
        return logits, hout

    def _draft_chain(self, ids):
        """The draft's ``k`` proposals for every request, ``[n, k]`` on the device, rows in ``ids`` order: its
        pending proposal, then ``k - 1`` proposal steps on speculative entries, rolled back afterwards;
        ``-> (drafts, the distributions they were drawn from [n, k, V] or None)``."""
        if self._proposed is not None and self._proposed[0] == tuple(ids):
            _, tok, hid, first = self._proposed  # [n], [n, D], [n, V] or None
        else:
            tok = torch.stack([self.proposal[r][0] for r in ids])  # [n]
            hid = torch.stack([self.proposal[r][1] for r in ids])  # [n, D]
            first = torch.stack([self.proposal[r][2] for r in ids]) if self.sampler else None
        drafts, probs = [tok], [first] if self.sampler else None
        if self.k > 1:
            ckpt = self.dstate.checkpoint(ids)
            for _ in range(self.k - 1):
                self.dstate = self.dstate.reserve({r: 1 for r in ids})
                logits, hid = self._propose(ids, tok, hid)
                tok, q = self._choose_draft(logits)
                drafts.append(tok)
                if probs is not None:
                    probs.append(q)
            self.dstate = self.dstate.restore(ckpt)
        return torch.stack(drafts, dim=1), None if probs is None else torch.stack(probs, dim=1)

    def _propose(self, ids, tok, hid):
        """One proposal step (``tok`` [n], ``hid`` [n, D] in ``ids`` order): ``-> (logits, hidden_out)``."""
        if self.draft_runner is None:
            return self._run_draft(Batch.decode(self.dstate, ids), tok, hid)
        # Read before the bucket's next replay (the choice, the next proposal's hidden lane): no copies unless kept
        self.dstate, logits, hout = self.draft_runner.propose(self.dstate, ids, tok, hid, copy=self._tracing)
        self._trace(logits)
        return logits, hout

    def _tokens(self, rows) -> torch.Tensor:
        return to_device(rows, torch.long, self._device)

    def _catch_up(self, counts, tokens, hidden):
        """Draft entries for accepted positions; its last row gives the next proposal."""
        self.dstate = self.dstate.reserve(counts)
        batch = Batch.prefill(self.dstate, counts)
        logits, hout = self._run_draft(batch, self._tokens(tokens), hidden)
        rows = self._tokens([end - 1 for end in batch.host_cu_seqlens[1:]])
        self._keep_proposals(batch.request_ids, logits.index_select(0, rows), hout.index_select(0, rows))

    def _keep_proposals(self, ids, logits, hidden) -> None:
        """Each request's next proposal from its last kept row (``logits`` [n, V], ``hidden`` [n, D] in ``ids``
        order): on the device, 0-d views of one choice over every row."""
        choices, probs = self._choose_draft(logits)
        for b, r in enumerate(ids):
            self.proposal[r] = (choices[b], hidden[b], None if probs is None else probs[b])
        self._proposed = (tuple(ids), choices, hidden, probs)

    # ------------------------------------------------------------------ public
    def start(self, prompts: Mapping[int, list[int]]) -> dict[int, int]:
        """Admit requests and prefill them; ``-> {rid: first generated token}``."""
        counts = {r: len(p) for r, p in prompts.items()}
        for r, n in counts.items():
            if n < 1:
                fail("Speculator.start", f"prompts[{r}]", "at least one token", prompts[r])
            self.tstate, self.dstate = self.tstate.admit(r), self.dstate.admit(r)
        self.tstate = self.tstate.reserve(counts)
        batch = Batch.prefill(self.tstate, counts)
        tokens = [t for r in batch.request_ids for t in prompts[r]]
        logits, hidden, deltas, _ = self._run_target(batch, self._tokens(tokens))
        if self._vocab is None and self.draft_ids is not None and int(self.draft_ids.max()) >= logits.shape[-1]:
            self._leave(counts)
            fail("Speculator", "draft_ids", f"token ids below {logits.shape[-1]} (the target's vocabulary)",
                 int(self.draft_ids.max()))
        self._vocab = logits.shape[-1]
        self.tstate = self.tstate.apply(deltas)
        cu, shifted = batch.host_cu_seqlens, []
        chosen, _ = self._choose(logits.index_select(0, self._tokens([end - 1 for end in cu[1:]])))
        first = dict(zip(batch.request_ids, chosen.tolist()))
        for r in batch.request_ids:
            shifted += list(prompts[r][1:]) + [first[r]]
        self.last.update(first)
        try:
            self._catch_up(counts, shifted, hidden)
        except ValueError:  # the draft refused its part (its logits and draft_ids disagree): none of it stays
            self._leave(counts)
            raise
        return first

    def _leave(self, requests) -> None:
        """Requests that `start` admitted leave both states again, as if never started."""
        for r in requests:
            self.tstate, self.dstate = self.tstate.release(r), self.dstate.release(r)
            self.last.pop(r, None)
            self.proposal.pop(r, None)

    def step(self) -> dict[int, list[int]]:
        """One speculative step for every active request; ``-> {rid: emitted tokens}``."""
        ids = list(self.last)
        if not ids:
            fail("Speculator.step", "requests", "at least one active request", ids)
        if self.runner is not None and self.draft_runner is not None and self.propose_hook is None:
            return self._step_on_device(ids)
        proposed, probs = self._draft_chain(ids)
        drafts = dict(zip(ids, proposed.tolist()))
        if self.propose_hook is not None:
            drafts = {r: list(d) for r, d in self.propose_hook(self.steps, drafts).items()}
        self.tstate = self.tstate.reserve({r: self.k + 1 for r in ids})
        if self.runner is not None:
            tokens = [t for r in ids for t in [self.last[r], *drafts[r]]]
            verified = self.runner.verify(self.tstate, ids, self._tokens(tokens), num_draft=self.k,
                                          recovery=self.recovery)
            batch, logits, hidden = verified.live_batch, verified.logits, verified.hidden
            self._trace(logits)
            accepted, bonus = self._accept(logits, batch, drafts, proposed, probs)
            self.tstate = verified.accept(accepted)
        else:
            batch = Batch.verify(self.tstate, ids, num_draft=self.k, recovery=self.recovery)
            tokens = [t for r in batch.request_ids for t in [self.last[r], *drafts[r]]]
            logits, hidden, deltas, replay_outputs = self._run_target(batch, self._tokens(tokens))
            accepted, bonus = self._accept(logits, batch, drafts, proposed, probs)
            replay = None
            if self.recovery == "replay":
                replay = replay_writes(self.target[2], self.tstate, batch, replay_outputs, accepted)
            self.tstate = self.tstate.apply(accept_step(deltas, batch, accepted, replay=replay))
        emitted, shifted, rows = {}, [], []
        cu = batch.host_cu_seqlens
        for b, r in enumerate(batch.request_ids):
            n = accepted[r]
            emitted[r] = drafts[r][: n - 1] + [bonus[r]]
            shifted += emitted[r]
            rows += range(cu[b], cu[b] + n)
            self.last[r] = bonus[r]
        if self.draft_runner is None:
            self._catch_up(accepted, shifted, hidden[self._tokens(rows)])
        else:
            self._catch_up_verify(batch.request_ids, emitted, accepted, hidden)
        self.steps += 1
        return emitted

    def _step_on_device(self, ids) -> dict[int, list[int]]:
        """`step` with both runners: the drafts stay on the device from proposal to verify, acceptance (greedy,
        forced, or with a sampler speculative sampling's) is computed there, and so are the draft's catch-up on
        the emitted tokens and its next proposals, all launched before the step's one host read (each request's
        accepted count with its emitted tokens): the device runs the whole step while the host waits once.
        With an ``accept_hook`` (host counts) the catch-up follows the read."""
        k = self.k
        proposed, probs = self._draft_chain(ids)  # [n, k], [n, k, V] when sampling
        last = to_device([self.last[r] for r in ids], torch.long, proposed.device)
        self.tstate = self.tstate.reserve({r: k + 1 for r in ids})
        tokens = torch.cat([last[:, None], proposed], dim=1).reshape(-1)  # [n * (1 + k)]
        verified = self.runner.verify(self.tstate, ids, tokens, num_draft=k, recovery=self.recovery,
                                      copy=self._tracing)  # read by this step's acceptance and catch-up only
        self._trace(verified.logits)
        if self.sampler is not None:
            rows = sampled_accept_rows(verified.logits, proposed, probs, self.sampler, self.generator)
        elif self.force_accept is not None:
            rows = forced_accept_rows(verified.logits, proposed, self.force_accept)
        else:
            rows = greedy_accept_rows(verified.logits, proposed)  # [n, 2 + k]
        if self.accept_hook is not None:  # forced counts: the kept drafts are the proposals, whatever the target chose
            rows = torch.cat([rows, proposed], dim=1).tolist()  # the step's one read
            accepted = self._forced(ids, {r: row[0] for r, row in zip(ids, rows)})
            emitted = {r: row[2 + k:1 + k + accepted[r]] + [row[accepted[r]]] for r, row in zip(ids, rows)}
            self.tstate = verified.accept(accepted)
            self._catch_up_verify(tuple(ids), emitted, accepted, verified.hidden)
        else:
            caught_up = self._catch_up_rows(tuple(ids), rows, verified.hidden)
            rows = rows.tolist()  # the step's one read
            accepted = {r: row[0] for r, row in zip(ids, rows)}
            emitted = {r: row[1:1 + row[0]] for r, row in zip(ids, rows)}
            self._pending = (verified, accepted)  # applied once the next step's proposals are launched (`tstate`)
            if self._tracing:  # the rows an eager catch-up computes
                k1 = k + 1
                self._trace(caught_up.logits[self._tokens([b * k1 + j for b, r in enumerate(ids)
                                                            for j in range(accepted[r])])])
            self.dstate = caught_up.accept(accepted)
        for r in ids:
            self.last[r] = emitted[r][-1]
        self.steps += 1
        return emitted

    def _catch_up_rows(self, ids, rows, hidden):
        """`_catch_up_verify` from the acceptance rows on the device (``rows`` [n, 2 + k]: each request's count,
        then its emitted tokens first), launched before the host knows the counts: the tokens past each count are
        0, and the next proposals come from the rows at ``count - 1``; ``-> the draft's Verified`` (its
        acceptance waits for the counts)."""
        k1 = self.k + 1
        count, emitted = rows[:, 0], rows[:, 1:]  # [n], [n, 1 + k]
        positions = torch.arange(k1, device=rows.device)
        tokens = torch.where(positions[None, :] < count[:, None], emitted, 0).reshape(-1)  # [n * (1 + k)]
        self.dstate = self.dstate.reserve({r: k1 for r in ids})
        verified = self.draft_runner.verify(self.dstate, ids, tokens, num_draft=self.k, hidden=hidden,
                                            copy=self._tracing)
        last = torch.arange(len(ids), device=rows.device) * k1 + count - 1  # [n]
        self._keep_proposals(ids, verified.logits.index_select(0, last), verified.hidden.index_select(0, last))
        return verified

    def _catch_up_verify(self, ids, emitted, accepted, hidden):
        """The catch-up through the draft runner: every request's ``1 + k`` positions of this step (its emitted
        tokens, padded with 0 past them) with the target's hidden rows of the verify, one fixed-shape step; the
        acceptance keeps each request's emitted ones, and its last gives the next proposal. Causal attention
        leaves the kept rows what a catch-up of those tokens alone computes."""
        k1 = self.k + 1
        self.dstate = self.dstate.reserve({r: k1 for r in ids})
        tokens = [t for r in ids for t in emitted[r] + [0] * (k1 - len(emitted[r]))]
        verified = self.draft_runner.verify(self.dstate, ids, self._tokens(tokens), num_draft=self.k,
                                            hidden=hidden)
        if self._tracing:  # the rows an eager catch-up computes
            kept = [b * k1 + j for b, r in enumerate(ids) for j in range(accepted[r])]
            self._trace(verified.logits[self._tokens(kept)])
        rows = self._tokens([b * k1 + accepted[r] - 1 for b, r in enumerate(ids)])
        self._keep_proposals(ids, verified.logits.index_select(0, rows), verified.hidden.index_select(0, rows))
        self.dstate = verified.accept(dict(accepted))

    def _accept(self, logits, batch, drafts, proposed, probs):
        """Greedy (or with a sampler, speculative sampling's) acceptance, or the counts ``accept_hook`` forces
        with the target's bonus after them."""
        if self.sampler is not None:
            rows = sampled_accept_rows(logits, proposed, probs, self.sampler, self.generator).tolist()
            return ({r: row[0] for r, row in zip(batch.request_ids, rows)},
                    {r: row[row[0]] for r, row in zip(batch.request_ids, rows)})
        accepted, bonus = greedy_accept(logits, batch, drafts)
        if self.accept_hook is None and self.force_accept is None:
            return accepted, bonus
        forced = self._forced(batch.request_ids, accepted)
        cu = batch.host_cu_seqlens
        for b, r in enumerate(batch.request_ids):
            if forced[r] != accepted[r]:
                accepted[r], bonus[r] = forced[r], int(logits[cu[b] + forced[r] - 1].argmax())
        return accepted, bonus

    def _forced(self, ids, accepted: dict) -> dict:
        """``accept_hook``'s counts for ``ids``, each checked: an int in 1 .. k + 1."""
        if self.force_accept is not None:
            return {r: self.force_accept for r in ids}
        forced = dict(self.accept_hook(self.steps, dict(accepted)))
        for r in ids:
            n = forced.get(r)
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.k + 1:
                fail("Speculator.accept_hook", f"accepted[{r}]", f"an int in 1..{self.k + 1}", n)
        return {r: forced[r] for r in ids}

    def release(self, request_id: int) -> None:
        """A finished or aborted request gives back every page and slot, in both states."""
        self.tstate = self.tstate.release(request_id)
        self.dstate = self.dstate.release(request_id)
        self.last.pop(request_id, None)
        self.proposal.pop(request_id, None)
