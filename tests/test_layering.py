"""fedveil's packages form layers, and its modules import one another without a cycle.

Every import statement counts: at module level, under ``if TYPE_CHECKING:``, or inside a function (a
lazy import keeps a heavy module off the start-up path; it does not make a cycle or a reach upwards any
less real). A module may import modules of its own layer or of a layer below it, never above.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import fedveil

LAYERS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (
        "foundation",
        ("fedveil.errors", "fedveil._version"),
        "the error hierarchy and the version number: they import nothing of fedveil",
    ),
    (
        "enclave",
        ("fedveil.enclave",),
        "the trusted computing base: numpy, the standard library, cryptography and the errors only "
        "(tests/test_enclave_tee_imports.py checks the third-party side)",
    ),
    (
        "core",
        ("fedveil.core",),
        "messages and the wire codec, the Communicator, aggregation, host-side quote verification (which "
        "reads the enclave's report and record formats)",
    ),
    (
        "building blocks",
        ("fedveil.data", "fedveil.models", "fedveil.privacy", "fedveil.eval"),
        "datasets and partitioners, the model zoo, DP accounting and policies, verification metrics",
    ),
    (
        "protocols",
        ("fedveil.protocols",),
        "round logic and client handlers; they reach clients through a Communicator and the enclave "
        "through the host they are given",
    ),
    (
        "runtimes and attacks",
        ("fedveil.runtime", "fedveil.attacks"),
        "runtimes deliver the protocols' messages (simulation, network, Ray, the Flower Communicator, the "
        "enclave host); attacks read what an observer of those messages saw",
    ),
    (
        "experiments",
        ("fedveil.experiments",),
        "each system assembled from the layers below: configs, run directories, checkpoints, plots, the "
        "networked runs, the benchmarks",
    ),
    (
        "applications",
        ("fedveil", "fedveil.api", "fedveil.service"),
        "the public API (the package itself and fedveil.api) and the PoliFL web service, over the "
        "experiments' runners",
    ),
    ("commands", ("fedveil.commands",), "one module per `fedveil` subcommand"),
    (
        "entry points",
        ("fedveil.cli", "fedveil.__main__", "fedveil.flower_app"),
        "the `fedveil` command and the Flower App (its ServerApp runs the command line)",
    ),
)
"""The layers, lowest first: ``(name, module prefixes, what it holds)``. A module belongs to the layer of
the longest prefix naming it or a package above it; the bare ``fedveil`` names only the package itself."""

PRIVATE: dict[str, tuple[str, ...]] = {
    "fedveil.experiments.bench": ("fedveil.commands",),
}
"""Packages only the listed packages (and they themselves) may import: the benchmarks are run by
``fedveil bench`` and are no library for the experiments beside them."""


@dataclass(frozen=True)
class Import:
    """One import statement of ``source`` (at ``line``) that loads the fedveil module ``target``."""

    source: str
    target: str
    line: int


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root`` (a folder with ``__init__.py``) by dotted name."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(root: Path) -> Iterator[Import]:
    """Every import, anywhere in a module of the package at ``root``, of another of its modules. ``from
    P import N`` loads ``P.N`` when that is a module, else ``P``; relative imports are resolved."""
    found = modules(root)
    top = root.name
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in found else base for a in node.names]
            for target in targets:
                if target != top and not target.startswith(top + "."):
                    continue
                while target not in found:
                    target = target.rpartition(".")[0]
                if target != name:
                    yield Import(name, target, node.lineno)


def cycles(edges: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each a set of modules that import
    one another in a circle), by Tarjan's algorithm, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_of(module: str, layers: tuple[tuple[str, tuple[str, ...], str], ...] = LAYERS) -> int | None:
    """The index in ``layers`` of ``module``'s layer (longest matching prefix), or None if no package
    of it is listed (the bare package name matches only itself)."""
    best: tuple[int, int] | None = None
    for level, (_, prefixes, _) in enumerate(layers):
        for prefix in prefixes:
            nested = "." in prefix and module.startswith(prefix + ".")
            if (module == prefix or nested) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), level)
    return None if best is None else best[1]


def edges_of(found: list[Import]) -> dict[str, dict[str, int]]:
    """``source -> {target: first line}`` of ``found``."""
    edges: dict[str, dict[str, int]] = {}
    for imp in found:
        edges.setdefault(imp.source, {}).setdefault(imp.target, imp.line)
    return edges


def cycle_report(found: list[Import]) -> list[str]:
    """One line per import inside a cycle, naming the file's line."""
    edges = edges_of(found)
    lines = []
    for component in cycles(edges):
        members = set(component)
        for source in component:
            for target, line in sorted(edges.get(source, {}).items()):
                if target in members:
                    lines.append(f"{source}:{line} imports {target} (cycle {' / '.join(component)})")
    return lines


def upward_report(
    found: list[Import], layers: tuple[tuple[str, tuple[str, ...], str], ...] = LAYERS
) -> list[str]:
    """One line per import of a module in a higher layer than the importer's."""
    lines = []
    for imp in found:
        low, high = layer_of(imp.source, layers), layer_of(imp.target, layers)
        if low is not None and high is not None and high > low:
            lines.append(
                f"{imp.source}:{imp.line} ({layers[low][0]}) imports {imp.target} ({layers[high][0]})"
            )
    return lines


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def private_report(found: list[Import], private: Mapping[str, tuple[str, ...]] = PRIVATE) -> list[str]:
    """One line per import of a private package by a module that is neither in it nor one of its users."""
    lines = []
    for imp in found:
        for package, users in private.items():
            allowed = (package, *users)
            if _within(imp.target, package) and not any(_within(imp.source, a) for a in allowed):
                lines.append(f"{imp.source}:{imp.line} imports {imp.target} (only {', '.join(users)} may)")
    return lines


PACKAGE = Path(fedveil.__file__).resolve().parent


@functools.cache
def _package_imports() -> list[Import]:
    """Every import in fedveil, read once for all the tests."""
    return list(imports(PACKAGE))


def test_every_module_has_a_layer() -> None:
    names = modules(PACKAGE)
    assert "fedveil.experiments.fdml.runner" in names and "fedveil.core.codec" in names
    missing = sorted(m for m in names if layer_of(m) is None)
    assert not missing, f"put these modules' packages in LAYERS: {missing}"


def test_no_import_cycle() -> None:
    found = _package_imports()
    assert len(found) > 500  # the whole package was read, function-level imports included
    report = cycle_report(found)
    assert not report, "import cycles:\n" + "\n".join(report)


def test_each_layer_imports_only_its_own_and_lower_layers() -> None:
    report = upward_report(_package_imports())
    assert not report, "imports from a higher layer:\n" + "\n".join(report)


def test_private_packages_are_imported_only_by_their_users() -> None:
    report = private_report(_package_imports())
    assert not report, "imports of a private package:\n" + "\n".join(report)


def _write(root: Path, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_a_cycle_hidden_in_a_function_or_under_type_checking_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    _write(
        pkg,
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/a.py": "def f():\n    from pkg.high import b\n",
            "low/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..high.d import X\n",
            "high/__init__.py": "",
            "high/b.py": "from pkg.low import a\n",
            "high/d.py": "from pkg.low.c import Y\nX = 1\n",
            "high/e.py": "import pkg.low.a\n",
        },
    )
    found = list(imports(pkg))
    assert Import("pkg.low.a", "pkg.high.b", 2) in found and Import("pkg.low.c", "pkg.high.d", 3) in found
    assert Import("pkg.high.e", "pkg.low.a", 1) in found
    assert cycles(edges_of(found)) == [["pkg.high.b", "pkg.low.a"], ["pkg.high.d", "pkg.low.c"]]
    assert len(cycle_report(found)) == 4
    layers = (("low", ("pkg.low",), ""), ("high", ("pkg.high", "pkg"), ""))
    assert layer_of("pkg", layers) == 1 and layer_of("pkg.low.a", layers) == 0
    assert layer_of("pkg.other", layers) is None
    assert upward_report(found, layers) == [
        "pkg.low.a:2 (low) imports pkg.high.b (high)",
        "pkg.low.c:3 (low) imports pkg.high.d (high)",
    ]
    assert private_report(found, {"pkg.low": ("pkg.high.b",)}) == [
        "pkg.high.d:1 imports pkg.low.c (only pkg.high.b may)",
        "pkg.high.e:1 imports pkg.low.a (only pkg.high.b may)",
    ]
