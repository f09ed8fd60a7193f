"""MkDocs hook: every plain-text citation of a paper ([FDML], [FedUV], [AIoT], [PoliFL], [PPFL]) in a
page's HTML, docstrings rendered by mkdocstrings included, becomes a link to its entry on the papers page
(``papers.md#fdml`` ...). Text inside links, code and preformatted blocks is left alone."""

from __future__ import annotations

import re
from typing import Any

TAGS = ("FDML", "FedUV", "AIoT", "PoliFL", "PPFL")
PAPERS = "papers.md"

_CITATION = re.compile(r"\[(" + "|".join(TAGS) + r")\]")
_TAG = re.compile(r"<(/?)([a-zA-Z][a-zA-Z0-9]*)\b[^>]*?(/?)>")
_SKIP = {"a", "code", "pre", "script", "style", "kbd"}


def link_citations(html: str, papers_url: str) -> str:
    """``html`` with each ``[TAG]`` outside ``a``, ``code``, ``pre``, ``script``, ``style`` and ``kbd``
    elements replaced by ``<a href="{papers_url}#tag">[TAG]</a>``."""
    out: list[str] = []
    depth = 0
    position = 0
    for tag in _TAG.finditer(html):
        text = html[position : tag.start()]
        out.append(text if depth else _CITATION.sub(lambda m: _link(m.group(1), papers_url), text))
        out.append(tag.group(0))
        closing, name, self_closing = tag.group(1), tag.group(2).lower(), tag.group(3)
        if name in _SKIP and not self_closing:
            depth = max(0, depth - 1) if closing else depth + 1
        position = tag.end()
    rest = html[position:]
    out.append(rest if depth else _CITATION.sub(lambda m: _link(m.group(1), papers_url), rest))
    return "".join(out)


def _link(tag: str, papers_url: str) -> str:
    return f'<a href="{papers_url}#{tag.lower()}">[{tag}]</a>'


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    papers = files.get_file_from_path(PAPERS)
    if papers is None:
        raise ValueError(f"the papers page {PAPERS} is missing from docs_dir: paper citations link to it")
    return link_citations(html, papers.url_relative_to(page.file))
