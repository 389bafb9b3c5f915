"""The switch registry: every fast-path switch and tile override stack, declared once where its path lives.

A switch is a list whose last element is in force: ``[default]`` at import, one more element per open
``with`` block (`switched`), so blocks nest and the innermost wins. A module declares its switch with
`declare`, which records what the switch changes and why it exists (a `Switch`) and hands back the list
the module's fast path reads; a tile override stack (a dict of launch fields over the kernel's own choice)
is declared with `declare_tiles`. Everything else reads them through this registry (`snapshot`, `setting`),
never through another module's private names. `fnattn.switches` re-exports it, loading every declaring
module first.

Importing it imports neither torch nor triton (`fnattn.kernels` imports nothing from fnattn).
"""

import contextlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    """One boolean switch: its name, its default, what each side of it runs, and why it exists."""

    name: str
    default: bool
    on: str  # what runs with the switch on
    off: str  # what runs with it off
    why: str  # the measurement (or need) that set its default and keeps the other side
    module: str  # where it is declared: the public function of the same name lives there


@dataclass(frozen=True)
class Tiles:
    """One tile override stack: the launch fields a ``configured``-style block puts over a kernel's choice."""

    name: str
    overrides: str  # which kernel's launch, and where its own choice comes from
    module: str


_SWITCHES: dict[str, Switch] = {}
_TILES: dict[str, Tiles] = {}
_STACKS: dict[str, list] = {}  # name -> the list its module reads ([-1] in force)


def _claim(name: str, module: str) -> None:
    owner = (_SWITCHES.get(name) or _TILES.get(name))
    if owner is not None and owner.module != module:  # the same module again: a reload, which takes the name over
        raise ValueError(f"{name}: already declared by {owner.module}")


def declare(name: str, default: bool, module: str, *, on: str, off: str, why: str) -> list:
    """Registers the switch ``name`` of ``module`` and returns its list (``[default]``), which the module reads
    as ``stack[-1]`` and sets with `switched`. Every text must say something: the registry is the switches'
    documentation."""
    if not isinstance(default, bool):
        raise ValueError(f"{name}: expected a default of True or False, got {default!r}")
    if not all(text.strip() for text in (on, off, why)):
        raise ValueError(f"{name}: on, off and why must each say something")
    _claim(name, module)
    _SWITCHES[name] = Switch(name, default, on, off, why, module)
    _STACKS[name] = stack = [default]
    return stack


def declare_tiles(name: str, module: str, *, overrides: str) -> list:
    """Registers the tile override stack ``name`` of ``module`` and returns it (``[{}]``: no field overridden)."""
    if not overrides.strip():
        raise ValueError(f"{name}: overrides must say something")
    _claim(name, module)
    _TILES[name] = Tiles(name, overrides, module)
    _STACKS[name] = stack = [{}]
    return stack


@contextlib.contextmanager
def switched(stack: list, name: str, enabled):
    """Within this block ``stack[-1]`` is ``enabled`` (a bool: anything else is refused, naming ``name``)."""
    if not isinstance(enabled, bool):
        raise ValueError(f"{name}: expected True or False, got {enabled!r}")
    stack.append(enabled)
    try:
        yield
    finally:
        stack.pop()


def switches() -> dict[str, Switch]:
    """Every switch declared so far, by name."""
    return dict(_SWITCHES)


def tiles() -> dict[str, Tiles]:
    """Every tile override stack declared so far, by name."""
    return dict(_TILES)


def value(name: str):
    """The value in force of the switch (a bool) or tile stack (a dict of overridden fields) ``name``."""
    if name not in _STACKS:
        raise KeyError(f"{name}: expected a declared switch or tile stack, one of {', '.join(sorted(_STACKS))}")
    current = _STACKS[name][-1]
    return dict(current) if isinstance(current, dict) else current


def snapshot() -> dict:
    """``{name: value in force}`` for every switch and tile stack declared so far (switches first)."""
    return {name: value(name) for name in [*_SWITCHES, *_TILES]}


@contextlib.contextmanager
def setting(**values):
    """Within this block each named switch is set to its value (``setting(pdl=False, split_norm=True)``);
    an undeclared name or a non-bool is refused before any is set. Tile stacks keep their own ``configured``
    functions, which check their fields."""
    unknown = sorted(set(values) - set(_SWITCHES))
    if unknown:
        raise KeyError(f"{', '.join(unknown)}: expected switches, one of {', '.join(sorted(_SWITCHES))}")
    for name, enabled in values.items():
        if not isinstance(enabled, bool):
            raise ValueError(f"{name}: expected True or False, got {enabled!r}")
    with contextlib.ExitStack() as blocks:
        for name, enabled in values.items():
            blocks.enter_context(switched(_STACKS[name], name, enabled))
        yield
