"""Build hooks for the docs site: links to repository files beyond docs/ and to a page's other language.

Pages link to benchmark records and test records by their place in the repository
(``../benchmarks/results/x.json``), which reads right on a code host but leaves the site's
source folder. Instead of silencing those links, the build copies each linked file into the
site under ``repo/`` and points the link there, so the site is whole and a link to a file that
does not exist still fails a strict build.

A page also links to its twin in another language (``guide.zh.md`` from guide.md). Each language
is built as its own site, where the twin is not a documentation file; the link is pointed at the
twin's address in the other language's site.
"""

from __future__ import annotations

import html
import os
import posixpath
import re

from mkdocs.structure.files import File, InclusionLevel
from mkdocs.utils import get_relative_url

# A Markdown link or image target, up to an optional #anchor or "title".
LINK = re.compile(r"(\]\()([^)\s#]+)")
# A whole inline link without a title: [text](target).
INLINE_LINK = re.compile(r"(?<!!)\[([^\]\n]*)\]\(([^)\s#]+)\)")
SERVED_UNDER = "repo"
LANGUAGE_TWIN = re.compile(r"^(?P<stem>.+)\.(?P<locale>[a-z]{2}(?:_[A-Z]{2})?)\.md$")


def _outside_target(page_uri: str, link: str, docs_dir: str) -> str | None:
    """The repository-relative path of a relative link that leaves docs_dir, else None."""
    if "://" in link or link.startswith(("/", "mailto:")):
        return None
    from_docs = posixpath.normpath(posixpath.join(posixpath.dirname(page_uri), link))
    if not from_docs.startswith("../"):
        return None
    repo_root = os.path.dirname(os.path.abspath(docs_dir))
    target = os.path.normpath(os.path.join(os.path.abspath(docs_dir), from_docs))
    if os.path.commonpath([repo_root, target]) != repo_root:
        return None  # beyond the repository: left for the strict build to report
    return os.path.relpath(target, repo_root).replace(os.sep, "/")


def _outside_targets(files, docs_dir: str) -> set[str]:
    found = set()
    for file in files.documentation_pages():
        with open(file.abs_src_path, encoding="utf-8") as source:
            for _, link in LINK.findall(source.read()):
                target = _outside_target(file.src_uri, link, docs_dir)
                if target is not None:
                    found.add(target)
    return found


def on_files(files, config):
    repo_root = os.path.dirname(os.path.abspath(config.docs_dir))
    for target in sorted(_outside_targets(files, config.docs_dir)):
        if not os.path.isfile(os.path.join(repo_root, target)):
            continue  # the page's link is reported as not found
        uri = f"{SERVED_UNDER}/{target}"
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, abs_src_path=os.path.join(repo_root, target),
                                        inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def _twin_url(page, link: str, config) -> str | None:
    """Where a link to the page's twin in another language lands in that language's site.

    ``x.zh.md`` names the Chinese twin; in a non-default language's site a link to the page's
    own default-language name (``x.md`` from ``x.zh.md``) names the default-language twin.
    """
    i18n = config.plugins.get("i18n")
    if i18n is None or "://" in link or link.startswith("/"):
        return None
    source = posixpath.normpath(posixpath.join(posixpath.dirname(page.file.src_uri), link))
    named = LANGUAGE_TWIN.match(source)
    if named is not None and named["locale"] in i18n.all_languages and named["locale"] != i18n.current_language:
        locale, in_default = named["locale"], named["stem"] + ".md"
    elif i18n.current_language != i18n.default_language and source == _in_default(page.file.src_uri, i18n):
        locale, in_default = i18n.default_language, source
    else:
        return None
    if not os.path.isfile(os.path.join(config.docs_dir, source)):
        return None  # left for the strict build to report
    url = File(in_default, "", "", config.use_directory_urls).url
    site_root = "" if locale == i18n.default_language else locale + "/"
    return get_relative_url(site_root + url, page.file.url)


def _in_default(src_uri: str, i18n) -> str:
    named = LANGUAGE_TWIN.match(src_uri)
    return named["stem"] + ".md" if named is not None and named["locale"] in i18n.all_languages else src_uri


def on_page_markdown(markdown, page, config, files):
    def twin(match):
        text, link = match.groups()
        url = _twin_url(page, link, config)
        if url is None:
            return match.group(0)
        # Raw HTML: each language is its own site, so the other one's pages are not files the
        # link checker can know; the target file was checked above.
        return f'<a href="{html.escape(url)}">{html.escape(text)}</a>'

    def served(match):
        prefix, link = match.groups()
        target = _outside_target(page.file.src_uri, link, config.docs_dir)
        if target is None or files.get_file_from_path(f"{SERVED_UNDER}/{target}") is None:
            return match.group(0)
        page_dir = posixpath.dirname(page.file.src_uri)
        return prefix + posixpath.relpath(f"{SERVED_UNDER}/{target}", page_dir or ".")

    return LINK.sub(served, INLINE_LINK.sub(twin, markdown))
