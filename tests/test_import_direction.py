"""Imports that run one way: a module that builds on another is never imported back by it.

A draft model builds on its target family's module (config, layers, decoder layer), so the family module reaches its
draft only through the `DraftHook` the draft module fills when imported; ``fnattn bench linear`` is dispatched by the
bench's argument parser and takes the command line it records from it. The arrows are read from the source (every
``import``, in function bodies too), so a lazy import back counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from fnattn.models.mtp import DraftHook
from fnattn.models.registry import family_named

from fnattn.models import deepseek_mtp, deepseek_v4_mtp, qwen3_5_mtp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"models": "fnattn.models", "fnattn/bench": "fnattn.bench"}  # folder -> the package its modules live in

# (module, the module it builds on)
BUILDS_ON = [("models/deepseek_mtp.py", "models/deepseek_v32.py"),
             ("models/deepseek_v4_mtp.py", "models/deepseek_v4.py"),
             ("models/qwen3_5_mtp.py", "models/qwen3_5.py"),
             ("fnattn/bench/cli.py", "fnattn/bench/linear.py")]


def _dotted(path: str) -> str:
    folder, _, name = path.rpartition("/")
    return f"{PACKAGES[folder]}.{name.removesuffix('.py')}"


def imported(path: str) -> set[str]:
    """Every module ``path`` imports (absolute dotted names; ``from pkg import mod`` counts ``pkg.mod`` too)."""
    package = _dotted(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            found |= {module} | {f"{module}.{a.name}" for a in node.names}
    return found


@pytest.mark.parametrize(("upper", "lower"), BUILDS_ON, ids=[u for u, _ in BUILDS_ON])
def test_a_module_is_not_imported_back_by_the_one_it_builds_on(upper, lower):
    assert _dotted(lower) in imported(upper)  # the arrow that stays (and proof the reading sees imports)
    assert _dotted(upper) not in imported(lower)


@pytest.mark.parametrize(("family", "module"), [("qwen3_5", qwen3_5_mtp), ("qwen3_next", qwen3_5_mtp),
                                                ("deepseek_v3", deepseek_mtp), ("deepseek_v32", deepseek_mtp),
                                                ("glm5", deepseek_mtp), ("deepseek_v4", deepseek_v4_mtp)])
def test_each_family_reaches_the_draft_its_module_registered(family, module):
    hook = family_named(family).draft
    assert isinstance(hook, DraftHook) and hook.build is module.draft


def test_a_hook_without_a_builder_names_the_module_that_registers_one():
    hook = DraftHook("models/example_mtp.py")
    with pytest.raises(RuntimeError, match="models/example_mtp.py"):
        hook(None, None)


def test_a_hook_forwards_to_its_builder_and_refuses_a_second_one():
    def build(cfg, target_params, weights=None, *, seed=0):
        return (cfg, target_params, weights, seed)

    hook = DraftHook("models/example_mtp.py")
    hook.register(build)
    assert hook("cfg", "params", seed=3) == ("cfg", "params", None, 3)
    with pytest.raises(ValueError, match="already"):
        hook.register(build)
