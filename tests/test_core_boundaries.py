"""No module reads another's private attributes or stashes values in another's objects.

A `State`'s bookkeeping and its `Storage` are read through their public names (``state.requests``,
``state.shared_pages``, ``state.storage``, ``state.write`` / ``state.advance``, ``storage.derived`` ...);
only the module that defines a class touches its instances' private attributes or their ``__dict__``.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("fnattn", "kernels", "models", "benchmarks")

# Private attributes of State (fnattn/state.py) and Storage (fnattn/storage.py).
PRIVATE = {
    "_storage", "_requests", "_shared", "_boundary", "_free_slots", "_free_pages", "_spec_by_layer",
    "_check_live", "_advance", "_apply", "_views", "_successor", "_step_checks", "_admit_prefix", "_derived",
}
# The modules that define the classes those attributes belong to.
OWNERS = {"fnattn/state.py": PRIVATE, "fnattn/storage.py": {"_views", "_derived"}}

# (module, name of the object whose __dict__ it writes): a class's own module copying or stamping its instances.
OWN_DICT_WRITES = {
    ("fnattn/state.py", "new"),  # State._successor: a successor handle
    ("fnattn/batch.py", "fresh"),  # rebound: a Batch for another handle
    ("fnattn/deltas.py", "out"),  # Writes.bound: writes bound to a layer; StepDeltas.accept: the accepted copy
}


_DICT_WRITES = {"update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__"}


def _base_name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


def _offenses(rel: str, tree: ast.AST) -> list[str]:
    """``path:line: what`` for each private read on a non-``self`` object and each write into another
    object's ``__dict__``."""
    allowed = OWNERS.get(rel, set())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE and node.attr not in allowed:
            if _base_name(node.value) not in ("self", "cls"):
                found.append(f"{rel}:{node.lineno}: reads .{node.attr} of {ast.unparse(node.value)}")
        # x.__dict__.update(...) / .setdefault(...) / ...
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _DICT_WRITES:
            target = node.func.value
            if isinstance(target, ast.Attribute) and target.attr == "__dict__":
                owner = _base_name(target.value)
                if owner != "self" and (rel, owner) not in OWN_DICT_WRITES:
                    found.append(f"{rel}:{node.lineno}: writes into {ast.unparse(target)}")
        # x.__dict__[k] = v / del x.__dict__[k]
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr == "__dict__":
                    owner = _base_name(t.value.value)
                    if owner != "self" and (rel, owner) not in OWN_DICT_WRITES:
                        found.append(f"{rel}:{node.lineno}: writes into {ast.unparse(t.value)}")
    return sorted(found, key=lambda f: int(f.split(":")[1]))


def _scan() -> list[str]:
    found = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            found += _offenses(rel, ast.parse(path.read_text(), filename=rel))
    return found


def test_no_module_reads_state_privates_or_writes_another_objects_dict():
    found = _scan()
    assert not found, "private attributes read or __dict__ written across modules:\n" + "\n".join(found)


def test_the_scan_finds_what_it_looks_for():
    code = ("def f(state, batch, ma):\n"
            "    state._storage.pools\n"
            "    state._advance(c, 1, s)\n"
            "    self._storage.pools\n"
            "    ma.__dict__.setdefault('_cache', {})\n"
            "    batch.__dict__['x'] = 1\n"
            "    self.__dict__.setdefault('_mine', {})\n")
    found = _offenses("fnattn/example.py", ast.parse(code))
    assert [f.split(": ", 1)[1] for f in found] == [
        "reads ._storage of state", "reads ._advance of state", "writes into ma.__dict__",
        "writes into batch.__dict__"]
    # State's module reads its own privates, and still writes into no other object's __dict__
    assert [f.split(": ", 1)[1] for f in _offenses("fnattn/state.py", ast.parse(code))] == [
        "writes into ma.__dict__", "writes into batch.__dict__"]

