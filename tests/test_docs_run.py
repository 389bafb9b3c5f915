"""The docs' Python blocks run as the pages say: each page's blocks in order, as one script.

Each script runs in a fresh process, started in an empty working directory (not the repository root)
with ``FNATTN_CHECKS=1`` and this checkout first on the path. A block that needs what a CPU test run
lacks says so on the line before its fence, ``<!-- skip: needs CUDA -->`` (or ``needs torch.distributed``,
``needs a checkpoint directory``); nothing else is left out. A Chinese twin runs too where its code differs
from the English page's by more than comments. The pages run side by side, one process each.
"""

import io
import os
import re
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = ("guide.md", "variants.md", "graphs.md", "transfer.md", "switches.md")
SKIP_REASONS = ("needs CUDA", "needs torch.distributed", "needs a checkpoint directory")
SKIP = re.compile(r"<!-- skip: (.*) -->")


@dataclass(frozen=True)
class Block:
    line: int  # of its first code line in the page, 1-based
    code: str
    skip: str | None  # the marker's reason, None: runs


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i] == "```python":
            end = lines.index("```", i + 1)
            marker = SKIP.fullmatch(lines[i - 1]) if i else None
            found.append(Block(i + 2, "\n".join(lines[i + 1:end]), marker[1] if marker else None))
            i = end
        i += 1
    return found


def script(page: Path) -> str:
    """The page's runnable blocks with every other line blank: a traceback's line is the page's line."""
    lines = [""] * len(page.read_text().splitlines())
    for block in blocks(page):
        if block.skip is None:
            code = block.code.splitlines()
            lines[block.line - 1:block.line - 1 + len(code)] = code
    return "\n".join(lines) + "\n"


def without_comments(code: str) -> list[tuple[int, str]]:
    tokens = tokenize.generate_tokens(io.StringIO(code).readline)
    return [(t.type, t.string) for t in tokens if t.type not in (tokenize.COMMENT, tokenize.NL)]


def twin(page: str) -> Path:
    return DOCS / page.replace(".md", ".zh.md")


def differs_from_english(page: str) -> bool:
    english, chinese = blocks(DOCS / page), blocks(twin(page))
    return [(b.skip, without_comments(b.code)) for b in english] != \
        [(b.skip, without_comments(b.code)) for b in chinese]


RUN = [DOCS / p for p in PAGES] + [twin(p) for p in PAGES if differs_from_english(p)]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """Every page's script started at once, then waited for: ``{page name: CompletedProcess-like}``."""
    env = {**os.environ, "FNATTN_CHECKS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    running = {}
    for page in RUN:
        workdir = tmp_path_factory.mktemp(page.stem.replace(".", "_"))
        path = workdir / f"{page.name}.py"
        path.write_text(script(page))
        running[page.name] = subprocess.Popen([sys.executable, path.name], cwd=workdir, env=env, text=True,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    done = {}
    for name, process in running.items():
        out, err = process.communicate(timeout=600)
        done[name] = (process.returncode, out, err)
    return done


@pytest.mark.parametrize("page", RUN, ids=lambda p: p.name)
def test_the_page_runs_as_one_script(page, finished):
    returncode, out, err = finished[page.name]
    assert returncode == 0, f"docs/{page.name} (line numbers are the page's):\n{err[-4000:]}"


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_every_page_with_code_runs_and_skips_only_by_a_known_reason(page):
    found = blocks(page)
    markers = [m[1] for m in SKIP.finditer(page.read_text())]
    assert markers == [b.skip for b in found if b.skip], "a skip marker must stand on the line before a ```python"
    for block in found:
        assert block.skip is None or block.skip in SKIP_REASONS, f"line {block.line}: skip reason {block.skip!r}"
    if found and any(b.skip is None for b in found):
        assert page in RUN or (page.name.endswith(".zh.md") and page.name.replace(".zh", "") in PAGES), \
            f"docs/{page.name} has code: list it in PAGES"


def test_the_script_keeps_the_page_line_numbers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# t\n\n```python\nx = 1\n```\n\n<!-- skip: needs CUDA -->\n```python\ncuda()\n```\n"
                    "text\n```python\ny = x + 1\n```\n")
    assert [(b.line, b.skip) for b in blocks(page)] == [(4, None), (9, "needs CUDA"), (13, None)]
    lines = script(page).splitlines()
    assert lines[3] == "x = 1" and lines[12] == "y = x + 1" and "cuda()" not in lines
