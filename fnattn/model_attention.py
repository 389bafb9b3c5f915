"""ModelAttention: pick a backend for every (layer, phase), group, bind, explain."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

from .batch import PHASES
from .checks import fail
from .errors import NoBackendError
from .kernels.invariant import invariant_on
from .registry import Backend, all_backends, backend_names
from .spec import LayerSpec
from .workspace import Workspace

#: How the built-in backends rank for decode and verify when ``prefer`` is not given; backends a
#: user registered come first (newest first): registering one is asking for it. Every name is one a
#: built-in backend registers on any machine (one whose library is missing is refused by its
#: capability check), so these orders also serve as ``prefer``.
DEFAULT_PREFER = ("triton_fused", "triton", "flashmla", "flashinfer", "fla", "sdpa", "torch", "reference")
#: Prefill's order (the same names): there the peers' kernels beat ours on the H200. fla-core's chunked
#: GDN / KDA is 2.4-2.7x our Triton chunk (benchmarks/results/bench_gdn_prefill.json); FlashInfer's
#: prefill attention 1.7x our Triton kernel at 16k tokens (bench_prefill.json).
DEFAULT_PREFER_PREFILL = ("fla", "flashmla", "flashinfer", "triton_fused", "triton", "sdpa", "torch", "reference")


@dataclass(frozen=True)
class Choice:
    layer: int
    phase: str
    backend: Backend | None
    refused: tuple[tuple[str, tuple[str, ...]], ...]  # (backend name, reasons)
    group: int | None  # layers in one group share one plan per step


class ModelAttention:
    """Binds each layer spec to one backend per phase, by capability and preference.

    ``prefer`` lists backend names in order of preference; names not listed are
    never chosen, and a name no backend has is an error (listing the known
    ones). An entry may also be a `Backend` value (a function not in the
    registry, e.g. a probe's own reference) for its kind and phase. Without
    ``prefer``, backends a user registered rank first (newest first), then
    the built-in ones by `DEFAULT_PREFER` (by `DEFAULT_PREFER_PREFILL` for
    prefill). Layers of the same config, dtype, phase and backend form one
    group: a backend's plan is built once per group per step.
    """

    def __init__(
        self,
        specs: Iterable[LayerSpec],
        *,
        prefer: Sequence[str | Backend] | None = None,
        device: str | torch.device = "cpu",
        phases: Sequence[str] = PHASES,
    ):
        self.specs = tuple(specs)
        if not self.specs or not all(isinstance(s, LayerSpec) for s in self.specs):
            fail("ModelAttention", "specs", "a non-empty sequence of LayerSpec", specs)
        indices = [s.index for s in self.specs]
        if len(set(indices)) != len(indices):
            fail("ModelAttention", "specs", "layer specs with unique indices", indices)
        if isinstance(phases, str) or not all(p in PHASES for p in phases):
            fail("ModelAttention", "phases", f"a sequence of phases from {PHASES}", phases)
        backends = all_backends()
        if prefer is None:
            self.prefer = None
        elif isinstance(prefer, str) or not all(isinstance(p, (str, Backend)) for p in prefer):
            fail("ModelAttention", "prefer", "a sequence of backend names (or Backend values)", prefer)
        else:
            known = backend_names()
            for p in prefer:
                if isinstance(p, str) and p not in known:
                    fail("ModelAttention", "prefer", f"names of registered backends (known: {known})", p)
            self.prefer = tuple(prefer)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.spec_by_layer = {s.index: s for s in self.specs}

        group_ids: dict[tuple, int] = {}
        self.choices: dict[tuple[int, str], Choice] = {}
        # The invariant mode is a property of the choices: while it is on, only backends that honour it.
        self.invariant = invariant_on()
        for spec in self.specs:
            for phase in phases:
                options = self._options(backends, spec.kind, phase)
                refused, chosen = [], None
                for b in options:
                    reasons = tuple(b.supports(spec, self.device))
                    if self.invariant and not b.invariant:
                        reasons += ("does not honour the invariant mode, which is on (fnattn.kernels.invariant)",)
                    if reasons:
                        refused.append((b.name, reasons))
                    else:
                        chosen = b
                        break
                group = None
                if chosen is not None:
                    key = (phase, chosen.name, spec.config, spec.dtype)
                    group = group_ids.setdefault(key, len(group_ids))
                self.choices[(spec.index, phase)] = Choice(spec.index, phase, chosen, tuple(refused), group)
        self.workspace = Workspace(self.device)
        #: the chosen backends that do not honour the invariant mode: a session refuses to run them in it
        self.not_invariant = tuple(sorted({c.backend.name for c in self.choices.values()
                                           if c.backend is not None and not c.backend.invariant}))

    def _options(self, backends: list[Backend], kind: str, phase: str) -> list[Backend]:
        """The backends of one (kind, phase), most preferred first."""
        mine = [b for b in backends if (b.kind, b.phase) == (kind, phase)]
        if self.prefer is None:  # this kind's own registrations first (newest first), then the built-in order
            user = [b for b in reversed(mine) if not b.builtin]
            order = DEFAULT_PREFER_PREFILL if phase == "prefill" else DEFAULT_PREFER
            shipped = sorted((b for b in mine if b.builtin and b.name in order), key=lambda b: order.index(b.name))
            return user + shipped
        ranked = []
        for p in self.prefer:
            if isinstance(p, Backend):
                ranked += [p] if (p.kind, p.phase) == (kind, phase) else []
            else:
                ranked += [b for b in mine if b.name == p]
        return ranked

    def backend(self, layer: int, phase: str) -> Backend:
        choice = self.choices.get((layer, phase))
        if choice is None:
            fail("ModelAttention", "layer, phase", f"a layer of {sorted(self.spec_by_layer)} and a phase this "
                 "ModelAttention was built for", (layer, phase))
        if choice.backend is None:
            why = "; ".join(f"{n}: {', '.join(r)}" for n, r in choice.refused) or \
                f"no backend named in prefer={self.prefer} is registered for this kind"
            raise NoBackendError(f"layer {layer} ({self.spec_by_layer[layer].kind}), phase {phase!r}: {why}")
        return choice.backend

    def page_sizes(self, phase: str | None = None) -> tuple[tuple[str, int], ...]:
        """(backend name, the one page size it serves) of the chosen backends that declare one
        (`fnattn.register`'s ``page_size``), in ``phase`` or in every phase; built once per phase (the choices
        never change after construction). A session refuses a batch of another page size."""
        cache = self.__dict__.setdefault("_page_sizes", {})
        if phase not in cache:
            cache[phase] = tuple(sorted({(c.backend.name, c.backend.page_size) for (_, p), c in self.choices.items()
                                         if c.backend is not None and c.backend.page_size is not None
                                         and (phase is None or p == phase)}))
        return cache[phase]

    @property
    def page_size(self) -> int | None:
        """The page size the chosen backends need (`page_sizes`); None: any. Two chosen backends that need
        different sizes cannot share a State: that raises, naming them."""
        need = self.page_sizes()
        sizes = {size for _, size in need}
        if len(sizes) > 1:
            fail("ModelAttention.page_size", "backends", "chosen backends that agree on a page size", list(need))
        return next(iter(sizes), None)

    def groups(self, phase: str) -> Mapping[int, tuple[LayerSpec, ...]]:
        """group -> the specs that share its plan in ``phase``, built once per phase (as `dispatch`)."""
        cache = self.__dict__.setdefault("_groups", {})
        if phase not in cache:
            out: dict[int, list[LayerSpec]] = {}
            for (layer, p), c in self.choices.items():
                if p == phase and c.group is not None:
                    out.setdefault(c.group, []).append(self.spec_by_layer[layer])
            cache[phase] = MappingProxyType({g: tuple(s) for g, s in out.items()})
        return cache[phase]

    def dispatch(self, phase: str) -> dict:
        """layer -> (spec, backend or None, the kind's input types, group) for ``phase``: what a session's
        `forward` looks up per layer, built once per phase (the choices never change after construction)."""
        cache = self.__dict__.setdefault("_dispatch", {})
        if phase not in cache:
            from .declare import kind_info

            specs = self.spec_by_layer
            cache[phase] = {layer: (specs[layer], c.backend, kind_info(specs[layer].kind).inputs, c.group)
                            for (layer, p), c in self.choices.items() if p == phase}
        return cache[phase]

    def check_storage_of(self, state, where: str) -> None:
        """``state`` holds storage for every layer of this ModelAttention as its spec says, or the error names
        the first that differs. A State's specs are its storage's for good (its successor handles share the same
        tuple): compared once per tuple."""
        checked, specs = self.__dict__.setdefault("_storage_specs_checked", {}), state.specs
        if checked.get(id(specs)) is specs:
            return
        for spec in self.specs:
            if state.spec(spec.index) != spec:
                fail(where, "state", f"storage for layer {spec.index} as {spec}", state.spec(spec.index))
        if len(checked) >= 8:  # the States a ModelAttention serves are few; keep the recent ones
            checked.clear()
        checked[id(specs)] = specs  # held: its id cannot be reused while it is here

    def session(self, state, batch, *, defer_capturable: bool = False):
        """The step's `AttentionSession`. ``defer_capturable``: the groups of capturable prefill backends
        plan at their first layer's forward instead of on entry (`fnattn.prefill_graph`: inside the graph
        piece that holds them)."""
        from .session import AttentionSession

        if self.not_invariant and invariant_on():
            self.refuse_outside_the_mode("ModelAttention.session")
        return AttentionSession(self, state, batch, defer_capturable=defer_capturable)

    def refuse_outside_the_mode(self, where: str) -> None:
        """Raise: the invariant mode is on, and this ModelAttention, built outside it, chose backends that do
        not honour it (their steps would be batch- and phase-dependent while the caller expects otherwise)."""
        fail(where, "the invariant mode", f"off, as when this ModelAttention chose its backends (those that do "
             f"not honour the mode: {', '.join(self.not_invariant)}); build the ModelAttention (and any runner "
             "over it) inside `fnattn.switches.set(invariant=True)`", "on")

    def explain(self) -> str:
        """A table of the backend chosen for every (layer, phase); each refusal is stated once below it,
        and rows name the refusals that apply to them by number."""
        notes: dict[str, int] = {}
        rows = [("layer", "kind", "phase", "backend", "group", "refused")]
        for (layer, phase), c in self.choices.items():
            refs = [notes.setdefault(f"{n} ({', '.join(r)})", len(notes) + 1) for n, r in c.refused]
            rows.append((str(layer), self.spec_by_layer[layer].kind, phase, c.backend.name if c.backend else "NONE",
                         "-" if c.group is None else str(c.group), " ".join(f"[{i}]" for i in refs) or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(6)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "-" * max(len(line) for line in lines))
        if notes:
            lines.append("refused:")
            lines += [f"  [{i}] {text}" for text, i in notes.items()]
        return "\n".join(lines)
