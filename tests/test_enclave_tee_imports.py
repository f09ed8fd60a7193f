"""The enclave imports only numpy, the standard library, ``cryptography`` and its own trusted files."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import fedveil.enclave
from fedveil.enclave.measure import package_root, trusted_files

ALLOWED_THIRD_PARTY = {"numpy", "cryptography"}
ALLOWED_FEDVEIL = ("fedveil", "fedveil._version", "fedveil.errors", "fedveil.enclave")
# Compiled modules that numpy and cryptography load themselves.
ALLOWED_BINARY = {"_cffi_backend", "_openssl"}


def _enclave_modules() -> list[str]:
    return [
        f"fedveil.enclave.{m.name}" for m in pkgutil.walk_packages(fedveil.enclave.__path__) if not m.ispkg
    ] + ["fedveil.enclave"]


def _modules_after(script: str) -> list[str]:
    """``sys.modules`` of a fresh interpreter after running ``script`` (which prints it as JSON)."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _fedveil_allowed(name: str) -> bool:
    return name in ALLOWED_FEDVEIL or name.startswith("fedveil.enclave.")


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:``, which a type checker reads and Python never runs
    (the package's ``__init__`` names its public API there for type checkers and the API reference)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            assert not node.orelse, "an else branch of `if TYPE_CHECKING:` runs: keep it out of trusted files"
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def test_every_import_statement_of_the_enclave_is_allowed() -> None:
    root = package_root()
    files = [f for f in trusted_files() if f.endswith(".py")]
    assert "fedveil/enclave/service.py" in files
    for rel in files:
        tree = ast.parse((root / rel).read_text(), filename=rel)
        typing_only = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{rel}: relative import"
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                ok = (
                    top in sys.stdlib_module_names
                    or top in ALLOWED_THIRD_PARTY
                    or (top == "fedveil" and _fedveil_allowed(name))
                )
                assert ok, f"{rel} imports {name}"


def test_importing_every_enclave_module_loads_no_other_package() -> None:
    modules = _enclave_modules()
    assert "fedveil.enclave.process" in modules and "fedveil.enclave.triplet" in modules
    script = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    loaded = _modules_after(script)
    baseline = set(_modules_after("import json, sys\nprint(json.dumps(sorted(sys.modules)))\n"))
    tops = {m.split(".")[0] for m in set(loaded) - baseline}
    foreign = tops - set(sys.stdlib_module_names) - ALLOWED_THIRD_PARTY - ALLOWED_BINARY - {"fedveil"}
    assert not foreign, f"the enclave pulled in {sorted(foreign)}"
    for banned in (
        "torch",
        "scipy",
        "yaml",
        "galois",
        "dp_accounting",
        "matplotlib",
        "socket",
        "ssl",
        "asyncio",
    ):
        assert banned not in loaded, banned
    assert {m for m in loaded if m.startswith("fedveil")} <= {*ALLOWED_FEDVEIL, *modules}


def test_every_loaded_fedveil_module_is_a_measured_file() -> None:
    measured = set(trusted_files())
    root = package_root()
    for name in [*_enclave_modules(), "fedveil", "fedveil._version", "fedveil.errors"]:
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().relative_to(root).as_posix() in measured, name
