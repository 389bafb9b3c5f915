"""The repository root is a safe working directory: its kernels/ and models/ folders hide no installed package.

Python puts the working directory first on its search path (``python -m pytest``, ``python -c``, a
notebook started there). The two folders carry no ``__init__.py``, so from the root they are at most
namespace portions, and an installed package of the same name (transformers imports one called
``kernels``) still wins; fnattn maps them in as ``fnattn.kernels`` and ``fnattn.models``.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_python(code, cwd, **env):
    """Run ``python -c code`` in ``cwd`` as a user would; -> its stdout (the test fails on its stderr)."""
    full_env = {**os.environ, **env}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("name", ["kernels", "models"])
def test_no_top_level_name_resolves_to_a_folder_of_the_repository(name):
    where = json.loads(run_python(
        "import importlib.util, json\n"
        f"spec = importlib.util.find_spec({name!r})\n"
        "print(json.dumps(spec and spec.origin))",
        cwd=ROOT))
    # None: nothing of that name, or only a namespace portion, which any installed package outranks.
    assert where is None or not Path(where).resolve().is_relative_to(ROOT), where


def test_an_installed_kernels_package_wins_from_the_root():
    installed = run_python("import importlib.util; s = importlib.util.find_spec('kernels'); print(s and s.origin)",
                           cwd=ROOT.parent)
    if installed.strip() in ("None", ""):
        pytest.skip("no package named kernels is installed")
    assert run_python("import kernels; print(kernels.__file__)", cwd=ROOT) == installed


def test_the_subpackages_import_from_a_bare_checkout(tmp_path):
    """A checkout that is only on the search path (not installed) still has fnattn.kernels / fnattn.models."""
    out = run_python(
        "import importlib.util as u, fnattn.kernels\n"
        "print(u.find_spec('fnattn.kernels.scatter').origin, u.find_spec('fnattn.models.tiny').origin, "
        "'scatter_rows' in fnattn.kernels.__all__)",
        cwd=tmp_path, PYTHONPATH=str(ROOT))
    assert out.split() == [str(ROOT / "kernels" / "scatter.py"), str(ROOT / "models" / "tiny.py"), "True"]


def test_the_kernels_folder_imports_nothing_from_fnattn():
    """kernels/ is plain tensors in and out; its package file (fnattn/kernels/__init__.py) may know fnattn."""
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "fnattn" for a in node.names), path.name
            elif isinstance(node, ast.ImportFrom):
                assert node.level <= 1 and (node.level or node.module.split(".")[0] != "fnattn"), path.name
