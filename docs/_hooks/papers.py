"""MkDocs hook over every page's HTML, docstrings rendered by mkdocstrings included.

- Every plain-text citation of a paper ([FDML], [FedUV], [AIoT], [PoliFL], [PPFL]) becomes a link to its
  entry on the papers page (``papers.md#fdml`` ...). Text inside links, code and preformatted blocks is
  left alone.
- The docstrings' Sphinx roles (``:func:`fedveil.run```, ``:class:`~fedveil.errors.ConfigError```)
  become mkdocs-autorefs cross-references: a link where the API reference renders that object, plain
  code where it does not; ``~`` shows only the last component of the name, as in Sphinx."""

from __future__ import annotations

import re
from typing import Any

TAGS = ("FDML", "FedUV", "AIoT", "PoliFL", "PPFL")
PAPERS = "papers.md"

_CITATION = re.compile(r"\[(" + "|".join(TAGS) + r")\]")
_TAG = re.compile(r"<(/?)([a-zA-Z][a-zA-Z0-9]*)\b[^>]*?(/?)>")
_SKIP = {"a", "code", "pre", "script", "style", "kbd"}
_ROLE = re.compile(r":(func|class|meth|mod|attr|data|exc|obj):<code>(~?)([A-Za-z_][\w.]*)</code>")


def link_roles(html: str) -> str:
    """``html`` with each rendered Sphinx role (``:func:<code>name</code>``) replaced by an optional
    mkdocs-autorefs reference to ``name`` (its last component shown when the name starts with ``~``). A
    function, class, constant or exception named without its module is tried as the public
    ``fedveil.<name>`` too, which is how the API reference renders the names a public object's docstring
    takes from its own module."""

    def autoref(match: re.Match[str]) -> str:
        role, short, name = match.group(1), match.group(2), match.group(3)
        relative = "." not in name and role in ("func", "class", "data", "exc")
        fallback = f' slug="fedveil.{name}"' if relative else ""
        shown = name.rsplit(".", 1)[-1] if short else name
        return f'<autoref identifier="{name}"{fallback} optional><code>{shown}</code></autoref>'

    return _ROLE.sub(autoref, html)


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
    return link_citations(link_roles(html), papers.url_relative_to(page.file))
