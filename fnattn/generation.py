"""Generation beyond the attention step: streaming text, stop conditions and sampling.

* `TextStream` turns generated ids into text chunks whose concatenation is
  ``tokenizer.decode(ids)``: through ``tokenizers.decoders.DecodeStream`` when the
  tokenizer is a ``tokenizers.Tokenizer``, else through `IncrementalDetokenizer`.
* `StopCriteria` says when a request is finished (eos ids, stop strings,
  ``max_new_tokens``); `StopText` cuts the text at the first stop string.
* `Sampler` picks the next token from logits in torch (CPU and GPU).
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .checks import fail

REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode shows for bytes that are not (yet) a character


class IncrementalDetokenizer:
    """Incremental decoding for any tokenizer with ``decode(ids) -> str``.

    Each step decodes a short window: the ids of the last emitted chunk (as
    context, so decoders that strip a leading space or merge bytes see the same
    neighbours as a whole decode) plus the ids not emitted yet. Text whose decode
    ends in U+FFFD may be an incomplete UTF-8 sequence, so it is held back until a
    later id completes it; `finish` releases whatever is still held. Cost per id is
    the window's length, not the output's. (A long run of invalid bytes keeps
    ending in U+FFFD and grows the window until a complete character arrives,
    as ``DecodeStream`` does.)
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        if not callable(getattr(tokenizer, "decode", None)):
            fail("IncrementalDetokenizer", "tokenizer", "an object with decode(ids) -> str", type(tokenizer).__name__)
        self._tokenizer, self._skip = tokenizer, skip_special_tokens
        self._context: list[int] = []  # ids of the last emitted chunk
        self._context_text = ""  # their decode, kept so that each step decodes once
        self._pending: list[int] = []  # ids fed since

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _new_text(self) -> str:
        after = self._decode(self._context + self._pending)
        if not after.startswith(self._context_text):  # a decoder that rewrote its context: the new ids alone
            return self._decode(self._pending)
        return after[len(self._context_text):]

    def _emitted(self) -> None:
        """The pending ids were shown: they become the next step's context."""
        self._context, self._pending = self._pending, []
        self._context_text = self._decode(self._context)

    def push(self, token_id: int, *, emitted: bool) -> None:
        """Record an id decoded elsewhere (``DecodeStream``), so that `finish` knows what is held."""
        self._pending.append(int(token_id))
        if emitted:
            self._emitted()

    def step(self, token_id: int) -> str | None:
        """Feed one id; ``-> the text it completes, or None while held back``."""
        self._pending.append(int(token_id))
        text = self._new_text()
        if not text or text.endswith(REPLACEMENT):
            return None
        self._emitted()
        return text

    def finish(self) -> str:
        """The text still held back (the decode of the ids after the last chunk)."""
        if not self._pending:
            return ""
        text = self._new_text()
        self._emitted()
        return text


class _DecodeStreamDetokenizer:
    """``tokenizers.decoders.DecodeStream`` plus the `finish` it lacks (held ids are tracked here)."""

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._tail = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self._tokenizer = tokenizer

    def step(self, token_id: int) -> str | None:
        chunk = self._stream.step(self._tokenizer, int(token_id))
        # The fallback mirrors the held ids so that `finish` can release them in bounded time.
        self._tail.push(token_id, emitted=chunk is not None)
        return chunk or None

    def finish(self) -> str:
        return self._tail.finish()


def _has_decode_stream(tokenizer) -> bool:
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401 (absent in old tokenizers)
    except ImportError:
        return False
    return isinstance(tokenizer, Tokenizer)


class TextStream:
    """Text of generated ids, chunk by chunk: ``"".join(chunks) + finish() == tokenizer.decode(ids)``.

    ``incremental=True`` forces `IncrementalDetokenizer` even when ``DecodeStream`` is available.
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True, incremental: bool = False):
        use_stream = not incremental and _has_decode_stream(tokenizer)
        cls = _DecodeStreamDetokenizer if use_stream else IncrementalDetokenizer
        self._impl = cls(tokenizer, skip_special_tokens=skip_special_tokens)
        self.text = ""

    def step(self, token_id: int) -> str:
        """Feed one id; ``-> the new text ("" while a character is incomplete)``."""
        chunk = self._impl.step(token_id) or ""
        self.text += chunk
        return chunk

    def finish(self) -> str:
        chunk = self._impl.finish()
        self.text += chunk
        return chunk


def _token_ids(where: str, name: str, value) -> frozenset[int]:
    if value is None:
        return frozenset()
    values = [value] if isinstance(value, int) else value
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        fail(where, name, "an int, a list of ints or None", value)
    values = list(values)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        fail(where, name, "non-negative int token ids", value)
    return frozenset(values)


@dataclass(frozen=True)
class StopCriteria:
    """When a request stops: ``max_new_tokens`` generated, an eos id, or a stop string in its text.

    The eos id is kept in the ids (as transformers does) but not in the text; the
    text ends before the first stop string.
    """

    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            fail("StopCriteria", "max_new_tokens", "an int >= 1", n)
        object.__setattr__(self, "eos_token_ids", _token_ids("StopCriteria", "eos_token_ids", self.eos_token_ids))
        stops = (self.stop_strings,) if isinstance(self.stop_strings, str) else tuple(self.stop_strings)
        if any(not isinstance(s, str) or not s for s in stops):
            fail("StopCriteria", "stop_strings", "non-empty strings", self.stop_strings)
        object.__setattr__(self, "stop_strings", stops)

    def is_eos(self, token_id: int) -> bool:
        return token_id in self.eos_token_ids


class StopText:
    """Text released up to the first stop string; a tail that may start one is held back."""

    def __init__(self, stop_strings: Sequence[str]):
        self._stops = tuple(stop_strings)
        self._keep = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self.stopped = False

    def push(self, chunk: str) -> str:
        """Add text; ``-> what can be shown now`` (sets `stopped` when a stop string appeared)."""
        if self.stopped:
            return ""
        self._held += chunk
        # Only the held tail is searched: it holds every place a stop string can still start.
        cut = min((i for i in (self._held.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, out, self._held = True, self._held[:cut], ""
            return out
        keep = self._partial_len()
        out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep:]
        return out

    def _partial_len(self) -> int:
        """Length of the longest held suffix that is a proper prefix of a stop string."""
        for n in range(min(self._keep, len(self._held)), 0, -1):
            tail = self._held[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

    def finish(self) -> str:
        out, self._held = ("" if self.stopped else self._held), ""
        return out


SAMPLING_KERNELS = ("torch", "flashinfer", "auto")


@dataclass(frozen=True)
class Sampler:
    """Next-token choice: greedy when ``temperature == 0``, else sampling after the warpers below.

    The order is transformers': temperature, top-k, top-p, min-p, then one
    ``torch.multinomial`` draw per row from ``generator``. ``top_k=0``, ``top_p=1``
    and ``min_p=0`` switch a filter off. ``seed`` seeds the generator of a run
    (`generator`); ``None`` draws a fresh seed.

    ``kernel``: ``"torch"`` runs the warpers and the draw in torch (CPU or GPU;
    the same tokens as transformers for the same seed); ``"flashinfer"`` runs the
    same filters with FlashInfer's fused sampling kernels on CUDA (renormalised
    top-k and top-p, then a min-p or plain draw, no sort), which draw from their own
    Philox stream: the same seed gives the same tokens run after run, but not the
    torch path's; ``"auto"`` picks FlashInfer for CUDA logits when it is installed.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    kernel: str = "torch"  # "torch" | "flashinfer" | "auto"

    def __post_init__(self):
        def number(name, lo, hi, value, what):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not lo <= value <= hi:
                fail("Sampler", name, what, value)

        number("temperature", 0.0, math.inf, self.temperature, "a finite float >= 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            fail("Sampler", "top_k", "an int >= 0 (0: off)", self.top_k)
        number("top_p", 0.0, 1.0, self.top_p, "a float in (0, 1]")
        if self.top_p == 0:
            fail("Sampler", "top_p", "a float in (0, 1]", self.top_p)
        number("min_p", 0.0, 1.0, self.min_p, "a float in [0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            fail("Sampler", "seed", "a non-negative int or None", self.seed)
        if self.kernel not in SAMPLING_KERNELS:
            fail("Sampler", "kernel", f"one of {SAMPLING_KERNELS}", self.kernel)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: str | torch.device = "cpu") -> torch.Generator | None:
        """A new generator for one run (None when greedy: nothing is drawn)."""
        if self.greedy:
            return None
        g = torch.Generator(device=torch.device(device))
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g

    def warp(self, logits: Float[Tensor, "B V"]) -> Float[Tensor, "B V"]:
        """Logits after temperature and the filters (removed tokens at -inf), in float32."""
        scores = logits.float() / self.temperature
        if self.top_k:
            kth = torch.topk(scores, min(self.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if self.top_p < 1:
            ordered, index = torch.sort(scores, dim=-1, descending=False)
            cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
            remove = cumulative <= 1 - self.top_p
            remove[..., -1] = False  # the most likely token always stays
            scores = scores.masked_fill(remove.scatter(-1, index, remove), -math.inf)
        if self.min_p > 0:
            probs = scores.softmax(dim=-1)
            remove = probs < self.min_p * probs.amax(dim=-1, keepdim=True)
            scores = scores.masked_fill(remove, -math.inf)
        return scores

    def sample(self, logits: Float[Tensor, "B V"], generator: torch.Generator | None = None) -> Int[Tensor, " B"]:
        """One token per row of ``logits``."""
        if logits.ndim != 2:
            fail("Sampler.sample", "logits", "a [B, V] tensor", tuple(logits.shape))
        if self.greedy:
            return logits.argmax(dim=-1)
        if generator is None:
            fail("Sampler.sample", "generator", "a torch.Generator (Sampler.generator(device)) when sampling", None)
        if self._flashinfer(logits):
            return self._flashinfer_sample(logits, generator)
        probs = self.warp(logits).softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    def _flashinfer(self, logits: Tensor) -> bool:
        if self.kernel == "torch":
            return False
        available = logits.is_cuda and importlib.util.find_spec("flashinfer") is not None
        if self.kernel == "flashinfer" and not available:
            fail("Sampler", "kernel", "'torch' or 'auto' unless the logits are on CUDA with flashinfer installed",
                 self.kernel)
        return available

    def _flashinfer_sample(self, logits: Tensor, generator: torch.Generator) -> Tensor:
        """temperature, then top-k, top-p (each renormalising the probabilities), then min-p: fused kernels."""
        from flashinfer import sampling

        probs = (logits.float() / self.temperature).softmax(dim=-1)  # [B, V]
        if self.top_k:
            probs = sampling.top_k_renorm_probs(probs, min(self.top_k, probs.shape[-1]))
        if self.top_p < 1:
            probs = sampling.top_p_renorm_probs(probs, self.top_p)
        if self.min_p > 0:
            return sampling.min_p_sampling_from_probs(probs, self.min_p, generator=generator).long()
        return sampling.sampling_from_probs(probs, generator=generator).long()


@dataclass
class Completion:
    """One request's generation: ids (eos included), text (stop string excluded), why it ended, timings."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "eos", "stop" or "length"
    first_token_s: float | None = None  # seconds from the start of the run to the first token
    finished_s: float | None = None  # seconds from the start of the run to the last token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestStream:
    """A request's ids -> (text chunks, finish reason) under a `StopCriteria` (text only with a tokenizer)."""

    def __init__(self, prompt: Sequence[int], stop: StopCriteria, tokenizer=None):
        if stop.stop_strings and tokenizer is None:
            fail("generate", "tokenizer", "a tokenizer when stop strings are given", None)
        self.completion = Completion(prompt=list(prompt))
        self.stop = stop
        self._text = TextStream(tokenizer) if tokenizer is not None else None
        self._cut = StopText(stop.stop_strings)

    def push(self, token_id: int, now: float) -> str:
        """Record one generated id; ``-> the text it shows`` (finishing the request when a stop applies)."""
        c = self.completion
        c.ids.append(int(token_id))
        if c.first_token_s is None:
            c.first_token_s = now
        shown = ""
        if self.stop.is_eos(token_id):
            c.finish_reason = "eos"
        elif self._text is not None:
            shown = self._cut.push(self._text.step(token_id))
            if self._cut.stopped:
                c.finish_reason = "stop"
        if c.finish_reason is None and len(c.ids) >= self.stop.max_new_tokens:
            c.finish_reason = "length"
        if c.finished:
            c.finished_s = now
            if self._text is not None and c.finish_reason != "stop":
                shown += self._cut.push(self._text.finish())
                shown += self._cut.finish() if not self._cut.stopped else ""
                if self._cut.stopped:
                    c.finish_reason = "stop"
        c.text += shown
        return shown


class Progress:
    """Decode progress: a tqdm bar on a terminal; a log (not a terminal) gets one summary line at the end."""

    def __init__(self, total: int, stream=None):
        from tqdm import tqdm

        self.stream = stream or sys.stderr  # looked up per run: tests and notebooks swap sys.stderr
        self.total, self.done, self.started = total, 0, time.perf_counter()
        self.tty = bool(getattr(self.stream, "isatty", None) and self.stream.isatty())
        self.bar = tqdm(total=total, desc="decode", unit="tok", file=self.stream, disable=not self.tty)

    def __call__(self, done: int) -> None:
        self.bar.update(done - self.done)
        self.done = done
        if done == self.total:
            self.bar.close()
            if not self.tty:
                rate = done / max(time.perf_counter() - self.started, 1e-9)
                self.stream.write(f"decode {done}/{self.total}  {rate:6.1f} tok/s\n")
