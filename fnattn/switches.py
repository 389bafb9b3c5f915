"""The fast-path switches: one registry of every switch and tile override stack, what each changes and why.

A switch chooses between two bodies of one contract (a fused kernel or the launches it replaces, one tiling
or another); both sides compute the same thing, and the default is the side measured faster. Each is
declared once, beside the code it steers (`declare`), with its default, what runs on either side and the
measurement behind the default; that module keeps a public function of the switch's name
(``fnattn.models.fused.split_norm(False)``), and this module sets any of them by name::

    import fnattn.switches

    with fnattn.switches.set(pdl=False, split_norm=False):
        ...  # steps traced here run the other sides
    fnattn.switches.snapshot()  # {name: value in force}: what a benchmark record carries
    print(fnattn.switches.describe())

Tile override stacks (`fnattn.kernels.skinny_linear.configured` and its kind) are registered too: `snapshot`
holds the fields each overrides now (``{}``: the kernel's own choice).

The mechanism lives in `fnattn.kernels` (which imports nothing from fnattn), in a module that imports
neither torch nor triton; this one adds loading every declaring module, so that the registry is whole.
"""

import importlib

from .kernels._switch import Switch, Tiles, declare, declare_tiles, setting, switched
from .kernels._switch import snapshot as _snapshot_declared
from .kernels._switch import switches as _declared_switches
from .kernels._switch import tiles as _declared_tiles
from .kernels._switch import value as _declared_value

__all__ = ["Switch", "Tiles", "declare", "declare_tiles", "describe", "set", "snapshot", "switched", "switches",
           "tiles", "value"]

# Every module that declares a switch or a tile stack (tests/test_switches.py checks that none is missed).
DECLARING_MODULES = (
    "fnattn.kernels._triton",
    "fnattn.kernels.launch",
    "fnattn.kernels.invariant",
    "fnattn.kernels.gdn_conv",
    "fnattn.kernels.gdn_decode_fused",
    "fnattn.kernels.paged_attention",
    "fnattn.kernels.skinny_linear",
    "fnattn.kernels.indexer",
    "fnattn.kernels.latent_absorb",
    "fnattn.models.fused",
    "fnattn.kinds.mla.latent",
    "fnattn.kinds.delta_rule.triton",
    "fnattn.kinds.sparse_mla.flashmla",
)


_loaded = False


def _load_all() -> None:
    # Imported on first use, not here: the declaring modules import this one for `switched`.
    global _loaded
    if not _loaded:
        for module in DECLARING_MODULES:
            importlib.import_module(module)
        _loaded = True


def _in_module_order(records: dict) -> dict:
    """``records`` in `DECLARING_MODULES`' order, each module's in its declaration order: the same whatever order
    the modules happened to be imported in."""
    rank = {module: i for i, module in enumerate(DECLARING_MODULES)}
    return dict(sorted(records.items(), key=lambda item: rank[item[1].module]))


def switches() -> dict[str, Switch]:
    """Every switch, by name."""
    _load_all()
    return _in_module_order(_declared_switches())


def tiles() -> dict[str, Tiles]:
    """Every tile override stack, by name."""
    _load_all()
    return _in_module_order(_declared_tiles())


def value(name: str):
    """The value in force of the switch or tile stack ``name`` (a KeyError names the declared ones)."""
    _load_all()
    return _declared_value(name)


def snapshot() -> dict:
    """``{name: value in force}`` for every switch (a bool) and tile stack (the fields it overrides now), in the
    order of `switches` then `tiles`."""
    names = [*switches(), *tiles()]  # loads every declaring module first
    values = _snapshot_declared()
    return {name: values[name] for name in names}


def set(**values):  # noqa: A001 - read as fnattn.switches.set(...), beside the builtin it never meets here
    """A ``with`` block within which each named switch has its value (``set(pdl=False)``); an unknown name or
    a non-bool is refused before any switch is set."""
    _load_all()
    return setting(**values)


def describe() -> str:
    """Every switch and tile stack in Markdown: its default, what runs on either side and why it exists."""
    lines = ["| switch | default | on | off | why |", "| --- | --- | --- | --- | --- |"]
    for s in switches().values():
        lines.append(f"| `{s.name}` (`{s.module}`) | {'on' if s.default else 'off'} | {s.on} | {s.off} | {s.why} |")
    lines += ["", "| tile stack | overrides |", "| --- | --- |"]
    lines += [f"| `{t.name}` (`{t.module}`) | {t.overrides} |" for t in tiles().values()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(describe())
