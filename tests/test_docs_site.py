"""The documentation site: ``mkdocs build --strict`` passes (a broken internal link or anchor, a missing nav
page or a bad mkdocstrings reference fails it); in a real browser (Debian's Chromium, headless, on
loopback) the built pages' internal links all resolve and nothing is fetched from outside the machine;
the site's hook links paper citations and docstring roles; and every tutorial's code runs as its page
shows it.

A tutorial page's ```` ```bash ```` and ```` ```python ```` blocks are its program: they run in order, in
a fresh folder that holds the repository's ``configs/`` (the pages run from the repository root), each
python block as one script, and every run directory they write under ``runs/`` must hold its
``results.json``. Blocks of any other language (``text``, ``yaml``) are shown, not run."""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TUTORIALS = ("fdml", "feduv", "aiot", "polifl", "ppfl")
_BLOCK = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def tutorial_blocks(page: Path) -> list[tuple[str, str]]:
    """The ``(language, code)`` of every ``bash`` and ``python`` fenced block of ``page``, in order."""
    return [
        (lang, code) for lang, code in _BLOCK.findall(page.read_text("utf-8")) if lang in ("bash", "python")
    ]


def test_tutorial_blocks_are_found_in_order(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("intro\n```bash\necho one\n```\n```text\nout\n```\n```python\nprint(2)\n```\n", "utf-8")
    assert tutorial_blocks(page) == [("bash", "echo one\n"), ("python", "print(2)\n")]


def _hook():
    """The site's MkDocs hook module (``docs/_hooks/papers.py``, which ``mkdocs.yml`` names)."""
    spec = importlib.util.spec_from_file_location("papers_hook", DOCS / "_hooks" / "papers.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def test_sphinx_roles_become_optional_cross_references() -> None:
    html = ":class:<code>~fedveil.errors.ConfigError</code>, :meth:<code>Foo.run</code>, "
    html += ":func:<code>run</code>"
    assert _hook().link_roles(html) == (
        '<autoref identifier="fedveil.errors.ConfigError" optional><code>ConfigError</code></autoref>, '
        '<autoref identifier="Foo.run" optional><code>Foo.run</code></autoref>, '
        '<autoref identifier="run" slug="fedveil.run" optional><code>run</code></autoref>'
    )


def test_citations_in_code_and_links_are_left_alone() -> None:
    hook = _hook()
    html = '<p>[FDML], <code>[PPFL]</code>, <a href="x">[AIoT]</a><br/>[Other]</p><pre>[FedUV]</pre>[PoliFL]'
    assert hook.link_citations(html, "../papers/") == (
        '<p><a href="../papers/#fdml">[FDML]</a>, <code>[PPFL]</code>, <a href="x">[AIoT]</a><br/>[Other]</p>'
        '<pre>[FedUV]</pre><a href="../papers/#polifl">[PoliFL]</a>'
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--clean",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stderr[-6000:]}"
    return out


def test_the_site_builds_strictly_with_every_page(site: Path) -> None:
    for page in (
        "index.html",
        "getting-started/index.html",
        "architecture/index.html",
        "papers/index.html",
        "api/index.html",
        *(f"tutorials/{name}/index.html" for name in (*TUTORIALS, "byo")),
    ):
        assert (site / page).is_file(), page
    home = (site / "index.html").read_text("utf-8")
    # nothing is fetched from the network at view time: no web fonts, no external scripts or styles
    assert "fonts.googleapis" not in home and "fonts.gstatic" not in home
    assert not re.search(r'<(?:script|link)[^>]+(?:src|href)="(?:https?:)?//', home)


def test_paper_citations_link_to_the_papers_page(site: Path) -> None:
    papers = (site / "papers" / "index.html").read_text("utf-8")
    for tag in ("fdml", "feduv", "aiot", "polifl", "ppfl"):
        assert f'id="{tag}"' in papers, tag
    tutorial = (site / "tutorials" / "fdml" / "index.html").read_text("utf-8")
    assert '<a href="../../papers/#fdml">[FDML]</a>' in tutorial


def test_docstring_roles_are_rendered_as_cross_references(site: Path) -> None:
    api = (site / "api" / "index.html").read_text("utf-8")
    assert not re.search(r":(?:func|class|meth|mod|attr|data|exc|obj):<code>", api)
    assert "autorefs-internal" in api


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def served(site: Path):
    """The built site over HTTP on loopback, from a thread that stops with the module."""
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=site)
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def _internal_links(page, base: str) -> set[str]:
    hrefs = page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)")
    links = set()
    for href in hrefs:
        target, _ = urldefrag(href)
        if urlparse(target).netloc == urlparse(base).netloc:
            links.add(target)
    return links


def test_no_broken_internal_link_nor_outside_request_in_a_browser(served: str, chromium_page) -> None:
    page = chromium_page
    checked: dict[str, int] = {}
    outside: list[str] = []

    def record(request) -> None:
        if urlparse(request.url).netloc != urlparse(served).netloc:
            outside.append(request.url)

    page.on("request", record)
    for path in ("", "tutorials/fdml/", "api/"):
        response = page.goto(urljoin(served, path))
        page.wait_for_load_state("networkidle")
        assert response is not None and response.status == 200, path
        assert page.locator("article h1").count() >= 1, f"{path}: no page content rendered"
        links = _internal_links(page, served)
        assert len(links) > 10, f"{path}: only {len(links)} internal links (is the nav rendered?)"
        for link in sorted(links - checked.keys()):
            checked[link] = page.request.get(link).status
    page.remove_listener("request", record)
    broken = {link: status for link, status in checked.items() if status != 200}
    assert not broken, f"broken internal links: {broken}"
    assert not outside, f"the site fetched from outside the machine: {outside}"


@pytest.mark.parametrize("name", TUTORIALS)
def test_tutorial_runs_as_written(name: str, tmp_path: Path) -> None:
    page = DOCS / "tutorials" / f"{name}.md"
    blocks = tutorial_blocks(page)
    assert any(lang == "bash" for lang, _ in blocks) and any(lang == "python" for lang, _ in blocks), (
        f"{page.name} must run its system from the command line and from Python"
    )
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for i, (lang, code) in enumerate(blocks):
        if lang == "bash":
            command = ["bash", "-e", "-o", "pipefail", "-c", code]
        else:
            script = tmp_path / f"block{i}.py"
            script.write_text(code, "utf-8")
            command = [sys.executable, str(script)]
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        # a traceback on stderr is a failure even where the block's process exits 0 (a child process's)
        assert done.returncode == 0 and "Traceback (most recent call last)" not in done.stderr, (
            f"{page.name}, block {i + 1} ({lang}) failed:\n{code}\n--- stdout\n{done.stdout[-3000:]}"
            f"\n--- stderr\n{done.stderr[-3000:]}"
        )
    runs = sorted((tmp_path / "runs").iterdir()) if (tmp_path / "runs").is_dir() else []
    assert runs, f"{page.name}: its code wrote no run directory under runs/"
    for run in runs:
        assert (run / "results.json").is_file(), f"{page.name}: {run.name} has no results.json"
