"""The docs site builds with `mkdocs build --strict` (a warning fails it) and documents every public name."""

import importlib
import inspect
import os
import posixpath
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import urlsplit

import pytest

for needed in ("mkdocs", "material", "mkdocs_static_i18n", "mkdocstrings_handlers.python"):
    pytest.importorskip(needed, reason=f"the docs site needs {needed} (the test extra installs it)")

import fnattn  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# The modules users import beyond `fnattn` itself; each is documented whole on one API page.
PUBLIC_MODULES = ["fnattn.speculative", "fnattn.transfer", "fnattn.graph", "fnattn.lanes", "fnattn.generation",
                  "fnattn.driver", "fnattn.models.registry"]
KIND_PACKAGES = ["fnattn.kinds.full", "fnattn.kinds.mla", "fnattn.kinds.sparse_mla", "fnattn.kinds.delta_rule",
                 "fnattn.kinds.dsv4"]
ANCHOR = re.compile(r'id="(fnattn\.[\w.]+)"')
HREF = re.compile(r'href="([^"]*)"')


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site), "-f", str(config)],
                          cwd=config.parent, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = build(ROOT / "mkdocs.yml", out)
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stdout}\n{built.stderr}"
    return out


def api_anchors(site: Path, language_root: str = "") -> set[str]:
    pages = (site / language_root / "api").glob("*/index.html")
    return {anchor for page in pages for anchor in ANCHOR.findall(page.read_text(encoding="utf-8"))}


def defined_public_names(module) -> list[str]:
    """A module's public names: its __all__, else what it defines itself (not what it imports)."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [name for name, value in vars(module).items() if not name.startswith("_")
            and (inspect.isclass(value) or inspect.isfunction(value)) and value.__module__ == module.__name__]


def test_every_exported_name_has_an_api_entry(site):
    anchors = api_anchors(site)
    missing = [name for name in fnattn.__all__ if not any(anchor.endswith(f".{name}") for anchor in anchors)]
    assert not missing, f"fnattn exports names the API reference does not document: {missing}"
    for anchor in ("fnattn.state.State.apply", "fnattn.model_attention.ModelAttention", "fnattn.probe.probe",
                   "fnattn.session.AttentionSession"):
        assert anchor in anchors


@pytest.mark.parametrize("module_name", PUBLIC_MODULES + KIND_PACKAGES)
def test_public_modules_are_documented_whole(site, module_name):
    module = importlib.import_module(module_name)
    anchors = api_anchors(site)
    names = defined_public_names(module)
    assert names, f"{module_name} has no public names to look for"
    missing = [name for name in names if f"{module_name}.{name}" not in anchors]
    assert not missing, f"{module_name}: not in the API reference: {missing}"


def test_the_chinese_site_holds_every_page(site):
    english = {path.relative_to(site) for path in site.rglob("index.html") if path.relative_to(site).parts[:1]
               not in {("zh",), ("repo",)}}
    chinese = {path.relative_to(site / "zh") for path in (site / "zh").rglob("index.html")}
    assert english <= chinese, f"pages without a Chinese site counterpart: {sorted(map(str, english - chinese))}"
    guide = (site / "zh" / "guide" / "index.html").read_text(encoding="utf-8")
    assert 'lang="zh"' in guide and "指南" in guide
    assert api_anchors(site, "zh") == api_anchors(site)


def test_every_relative_link_lands_on_a_built_file(site):
    broken = []
    for page in site.rglob("*.html"):
        folder = posixpath.dirname(page.relative_to(site).as_posix())
        for href in HREF.findall(page.read_text(encoding="utf-8")):
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or not parts.path:
                continue
            # The 404 pages and the home page's language switcher link from the site's root.
            path = parts.path[1:] if parts.path.startswith("/") else posixpath.join(folder, parts.path)
            target = site / posixpath.normpath(path or ".")
            if not (target / "index.html" if href.endswith("/") or target.is_dir() else target).exists():
                broken.append(f"{page.relative_to(site)} -> {href}")
    assert not broken, "links to nothing in the built site:\n" + "\n".join(sorted(broken)[:20])


def tiny_project(tmp_path: Path, link: str) -> Path:
    """A site of one page, built with the repository's hooks, whose page links to `link`."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text(f"# Records\n\nSee [the record]({link}).\n", encoding="utf-8")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "present.json").write_text('{"value": 1}\n', encoding="utf-8")
    config = tmp_path / "mkdocs.yml"
    config.write_text(textwrap.dedent(f"""\
        site_name: tiny
        hooks:
          - {ROOT / "docs" / "api" / "site_hooks.py"}
        """), encoding="utf-8")
    return config


def test_a_link_beyond_docs_is_served_when_its_file_exists(tmp_path):
    config = tiny_project(tmp_path, "../results/present.json")
    built = build(config, tmp_path / "site")
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "repo" / "results" / "present.json").read_text() == '{"value": 1}\n'
    assert 'href="repo/results/present.json"' in (tmp_path / "site" / "index.html").read_text(encoding="utf-8")


def test_a_link_beyond_docs_to_a_missing_file_fails_the_build(tmp_path):
    built = build(tiny_project(tmp_path, "../results/missing.json"), tmp_path / "site")
    assert built.returncode != 0
    assert "../results/missing.json" in built.stderr
