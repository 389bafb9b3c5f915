"""fnattn.switches: every switch and tile stack declared once, with what it changes and why; set and read by
name; no module reaches into another's switch lists."""

import re
from pathlib import Path

import pytest
import torch

import fnattn.switches
from fnattn.kernels import _switch

ROOT = Path(__file__).resolve().parents[1]
SOURCE_FOLDERS = ("fnattn", "kernels", "models")
DECLARED = re.compile(r"^(_[A-Z][A-Z0-9_]*) = (declare|declare_tiles)\(\s*\"(\w+)\"", re.M)
BARE_STACK = re.compile(r"^_[A-Z][A-Z0-9_]*(: list\[\w+\])? = \[(True|False|\{\})\]", re.M)


def _sources(*folders):
    return [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py")) if "__pycache__" not in p.parts]


def _declarations() -> dict[Path, list[tuple[str, str, str]]]:
    """``{file: [(private list name, declare or declare_tiles, registry name)]}`` as the sources spell them."""
    found = {}
    for path in _sources(*SOURCE_FOLDERS):
        hits = DECLARED.findall(path.read_text())
        if hits:
            found[path] = hits
    return found


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts if rel.parts[0] == "fnattn" else ("fnattn", *rel.parts)  # kernels/, models/ load under fnattn
    return ".".join(parts)


def test_every_switch_in_the_sources_is_registered_with_its_texts():
    declared = _declarations()
    switches, tiles = fnattn.switches.switches(), fnattn.switches.tiles()
    in_sources = {name: (kind, _module_name(path)) for path, hits in declared.items() for _, kind, name in hits}
    assert {n for n, (kind, _) in in_sources.items() if kind == "declare"} == set(switches)
    assert {n for n, (kind, _) in in_sources.items() if kind == "declare_tiles"} == set(tiles)
    assert sorted(fnattn.switches.DECLARING_MODULES) == sorted({module for _, module in in_sources.values()})
    for name, s in switches.items():
        assert s.module == in_sources[name][1] and isinstance(s.default, bool)
        assert all(text.strip() for text in (s.on, s.off, s.why)), name
    assert all(t.overrides.strip() and t.module == in_sources[t.name][1] for t in tiles.values())
    assert len(switches) == 25 and len(tiles) == 4  # a new switch or stack: this count and the docs' table


def test_no_switch_is_kept_outside_the_registry():
    """A module-level ``[True]`` / ``[False]`` / ``[{}]`` list is what a switch looked like before the registry:
    one would be a switch no record shows."""
    bare = {str(p.relative_to(ROOT)): BARE_STACK.findall(p.read_text()) for p in _sources(*SOURCE_FOLDERS)}
    assert {path: hits for path, hits in bare.items() if hits} == {}


def test_snapshot_has_every_switch_at_its_default_and_the_tile_stacks_empty():
    snap = fnattn.switches.snapshot()
    switches, tiles = fnattn.switches.switches(), fnattn.switches.tiles()
    assert list(snap) == [*switches, *tiles]
    assert all(snap[name] is s.default for name, s in switches.items())
    assert all(snap[name] == {} for name in tiles)
    off = sorted(name for name, s in switches.items() if not s.default)
    assert off == ["bound_launches", "invariant", "sparse_merge_values_kernel"]


def test_setting_by_name_is_what_the_fast_path_reads_and_what_the_module_function_sets():
    from fnattn.kernels import gdn_decode_fused

    # fill_device: the fused GDN decode's V tile at batch 1, 16 value heads, on 132 SMs (CPU-visible: a host choice)
    assert gdn_decode_fused.default_block_v(1, 16, 128, 128, 132) == 16
    with fnattn.switches.set(fill_device=False):
        assert gdn_decode_fused.default_block_v(1, 16, 128, 128, 132) == 64
        assert fnattn.switches.snapshot()["fill_device"] is False
        with gdn_decode_fused.fill_device(True):  # the module's own function sets the same switch
            assert fnattn.switches.value("fill_device") is True
            assert gdn_decode_fused.default_block_v(1, 16, 128, 128, 132) == 16
        assert fnattn.switches.value("fill_device") is False
    assert fnattn.switches.value("fill_device") is True


def test_grouped_experts_set_by_name_moves_a_static_cpu_step_off_the_grouped_gemms():
    from fnattn.lanes import static_shapes
    from fnattn.models import common

    x, down = torch.zeros(2, 8), torch.zeros(4, 8, 16)
    with static_shapes():
        assert common._grouped(x, down)
        with fnattn.switches.set(grouped_experts=False):
            assert not common._grouped(x, down)
        assert common._grouped(x, down)


def test_tile_stacks_show_their_overrides_in_the_snapshot():
    from fnattn.kernels.skinny_linear import configured

    with configured(prefetch=True):
        assert fnattn.switches.snapshot()["gemv_config"] == {"prefetch": True}
    assert fnattn.switches.value("gemv_config") == {}


def test_unknown_names_and_non_bools_are_refused_before_anything_is_set():
    before = fnattn.switches.snapshot()
    with pytest.raises(KeyError, match="nope: expected switches, one of"):
        with fnattn.switches.set(pdl=False, nope=True):
            pass
    with pytest.raises(ValueError, match="split_norm: expected True or False, got 1"):
        with fnattn.switches.set(pdl=False, split_norm=1):
            pass
    with pytest.raises(KeyError, match="nope: expected a declared switch or tile stack"):
        fnattn.switches.value("nope")
    assert fnattn.switches.snapshot() == before


def test_a_name_is_declared_once():
    with pytest.raises(ValueError, match="pdl: already declared by fnattn.kernels._triton"):
        _switch.declare("pdl", True, "elsewhere", on="x", off="y", why="z")
    with pytest.raises(ValueError, match="on, off and why must each say something"):
        _switch.declare("quiet", True, "elsewhere", on="x", off=" ", why="z")
    assert "quiet" not in fnattn.switches.switches()


def test_describe_has_a_row_for_every_switch_and_tile_stack():
    text = fnattn.switches.describe()
    for name, s in fnattn.switches.switches().items():
        assert f"| `{name}` (`{s.module}`) | {'on' if s.default else 'off'} |" in text
    assert all(f"| `{name}` (" in text for name in fnattn.switches.tiles())


def test_no_module_reads_another_modules_switch_list():
    """The private lists the declarations hand back are read only where they are declared: records, A/B runs
    and other modules read the registry (``fnattn.switches.value`` / ``snapshot``)."""
    owners = {}  # private name -> the files that declare a list by that name
    for path, hits in _declarations().items():
        for private, _, _ in hits:
            owners.setdefault(private, set()).add(path)
    names = "|".join(sorted(owners))
    reach_in = re.compile(rf"\w\.({names})\b|import[^\n]*\b({names})\b")
    found = []
    for path in _sources(*SOURCE_FOLDERS, "benchmarks"):
        for match in reach_in.finditer(path.read_text()):
            name = match.group(1) or match.group(2)
            if path not in owners[name]:
                found.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert found == []



@pytest.mark.parametrize("page", ["switches.md", "switches.zh.md"])
def test_the_docs_table_is_the_registry(page):
    text = (ROOT / "docs" / page).read_text()
    assert fnattn.switches.describe() in text, f"docs/{page}: paste `python -m fnattn.switches` in place of its table"


def test_the_table_does_not_depend_on_the_order_modules_were_imported():
    """A process that imports the declaring modules in another order describes the same table."""
    import subprocess
    import sys

    reversed_imports = "; ".join(f"import {m}" for m in reversed(fnattn.switches.DECLARING_MODULES))
    code = f"{reversed_imports}; import fnattn.switches as s; print(s.describe())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.rstrip("\n") == fnattn.switches.describe()
