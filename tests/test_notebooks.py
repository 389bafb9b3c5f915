"""The notebooks under docs/notebooks run as a reader runs them: in a real Jupyter kernel, cells in order.

Each one is executed by nbclient from an empty working directory, with runtime checks on
(``FNATTN_CHECKS=1``) and this checkout first on the path. A notebook whose metadata says
``"fnattn": {"requires": "cuda"}`` is skipped, with that reason, where torch sees no GPU. The notebooks
are stored without outputs, so a diff shows only what changed in the code or the prose.
"""

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "docs" / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 120  # a cell that needs more is not a notebook's job on a CPU


def requirement(nb) -> str | None:
    return nb.metadata.get("fnattn", {}).get("requires")


def shown(cell) -> str:
    """The text a code cell displayed: its streams and its results' plain text."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


def execute(path: Path, workdir: Path):
    """``-> (the executed notebook, None)``, or ``(None, the reason it was skipped)``; a cell that raises
    raises here, with its traceback."""
    nb = nbformat.read(path, as_version=4)
    if requirement(nb) == "cuda" and not torch.cuda.is_available():
        return None, f"{path.name} needs a CUDA device; torch sees none"
    env = {**os.environ, "FNATTN_CHECKS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(workdir)}})
    client.execute(cwd=str(workdir), env=env)
    return nb, None


@pytest.fixture(scope="module")
def executed(request, tmp_path_factory):
    """The selected notebooks, two at a time (a kernel spends its first seconds importing), then waited for."""
    selected = [item.callspec.params["path"] for item in request.session.items
                if item.originalname == "test_notebook_runs_in_a_kernel"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        running = {path.name: pool.submit(execute, path, tmp_path_factory.mktemp(path.stem)) for path in selected}
        return {name: future.exception() or future.result() for name, future in running.items()}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_in_a_kernel(path, executed):
    result = executed[path.name]
    if isinstance(result, BaseException):
        raise result
    nb, skipped = result
    if skipped:
        pytest.skip(skipped)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code, f"{path.name} has no code"
    assert "".join(shown(cell) for cell in code).strip(), "a notebook shows its results"
    assert not any(out.output_type == "error" for cell in code for out in cell.outputs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name} cell {i}: clear its outputs"


def test_the_notebooks_are_there():
    names = {p.stem for p in NOTEBOOKS}
    assert {"quickstart", "new_kind", "debugging", "speculative", "transfer", "captured_steps"} <= names, names
