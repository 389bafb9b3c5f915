"""The benchmark lab stays outside the library: a kind's package holds its own story and no bench code, the
package never imports the repository's ``benchmarks/`` scripts, and those scripts reach the library only through
its modules (read from the source: every ``import``, in function bodies too)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("fnattn", "kernels", "models")  # the folders installed as the fnattn package


def _imported(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports, as absolute dotted names (``package``: the one relative imports start in)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found |= {module} | {f"{module}.{a.name}" for a in node.names}
    return found


def _package_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).parent.parts)
    if parts[0] != "fnattn":  # kernels/ and models/ install as fnattn.kernels and fnattn.models
        parts = ["fnattn", *parts]
    return ".".join(parts)


def _library_files():
    for folder in LIBRARY:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_kind_package_holds_bench_code():
    kinds = ROOT / "fnattn" / "kinds"
    assert not sorted(kinds.rglob("bench.py")), "a kind's package holds its config, storage, reference, fast paths"
    for path in sorted(kinds.rglob("*.py")):
        bench = {m for m in _imported(path, _package_of(path)) if m == "fnattn.bench" or
                 m.startswith("fnattn.bench.")}
        assert not bench, f"{path.relative_to(ROOT)} imports {sorted(bench)}"


def test_the_library_never_imports_the_benchmarks():
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    for path in _library_files():
        text = path.read_text()
        # the scripts are no package: loading one by its path is the other way in
        assert not ("spec_from_file_location" in text and "benchmarks" in text), path.relative_to(ROOT)
        for module in _imported(path, _package_of(path)):
            top = module.split(".")[0]
            assert top != "benchmarks" and top not in scripts, f"{path.relative_to(ROOT)} imports {module}"


def test_the_standard_cases_live_in_the_bench_package():
    cases = {p.stem for p in (ROOT / "fnattn" / "bench" / "cases").glob("*.py")} - {"__init__"}
    assert cases == {"full", "mla", "sparse_mla", "delta_rule", "dsv4"}
    cli = _imported(ROOT / "fnattn" / "bench" / "cli.py", "fnattn.bench")
    assert {f"fnattn.bench.cases.{c}" for c in cases} <= cli  # every case module is reached by `fnattn bench`


def test_benchmark_scripts_import_only_what_exists():
    """A script naming a bench module that moved would fail on the GPU machine only: check every import here."""
    import importlib.util

    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("fnattn.bench"):
                assert importlib.util.find_spec(node.module) is not None, f"{path.name}: {node.module}"
