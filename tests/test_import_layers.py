"""The modules stack in layers: no import circle, function-level imports counted, and the built-in kinds are
registered by the package, not by the core they build on."""

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of fnattn, fnattn.kernels and fnattn.models."""
    found = {}
    for folder, prefix in (("fnattn", ""), ("kernels", "fnattn."), ("models", "fnattn.")):
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[prefix + ".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """The modules of ``modules`` that ``name`` imports anywhere in its file (a TYPE_CHECKING block too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            out |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
    return {m for m in out if m in modules and m != name}


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    modules = _modules()
    edges = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _circles(edges) == []


def test_the_core_names_no_kind():
    modules = _modules()
    for name in ("fnattn.declare", "fnattn.registry", "fnattn.spec", "fnattn.state", "fnattn.batch"):
        assert not any(m.startswith("fnattn.kinds") for m in _imports(name, modules[name], modules)), name


def test_a_built_in_kind_resolves_by_name_with_nothing_else_imported():
    code = ("import fnattn; info = fnattn.kind_info('full'); print(info.config.__name__, info.builtin, "
            "'mla' in fnattn.known_kinds())")
    done = subprocess.run([sys.executable, "-c", code], env=os.environ, capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["FullAttentionConfig", "True", "True"]
