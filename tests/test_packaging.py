"""Packaging: fedveil declares a PyTorch range; the exact CPU wheel is pinned only by the install commands."""

from __future__ import annotations

import ast
import json
import re
import site
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _torch_requirement() -> Requirement:
    """fedveil's torch requirement as the installed metadata declares it (what `pip check` sees)."""
    reqs = [Requirement(r) for r in metadata.requires("fedveil") or []]
    (torch,) = [r for r in reqs if r.name == "torch"]
    return torch


def test_the_package_declares_a_torch_range_not_a_pin() -> None:
    """The floor is the oldest release that ``scripts/check-torch`` passed (2.3.0, beside numpy 2): 2.2's
    and 2.1's wheels were built against numpy 1 and cannot hand tensors to numpy 2 ("Numpy is not
    available"), which is what pip installs beside them."""
    spec = _torch_requirement().specifier
    assert not any(s.operator in ("==", "===") for s in spec), f"torch is pinned in pyproject.toml: {spec}"
    assert Version("2.3.0") in spec and Version("2.11.0") in spec and Version("2.13.0") in spec
    assert Version("2.99") in spec
    assert Version("2.2.2") not in spec and Version("2.1.0") not in spec and Version("3.0") not in spec


def _third_party_imports() -> dict[str, str]:
    """Each top-level module that fedveil's source imports from outside the standard library and fedveil
    itself, with one file that imports it."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "src" / "fedveil").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "fedveil":
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_every_package_the_source_imports_is_a_declared_dependency() -> None:
    """A package that fedveil imports itself is in its requirements (an extra's included), not only there
    because another requirement happens to pull it in today: scipy through dp-accounting, Starlette and
    Pydantic through FastAPI."""
    declared = {Requirement(r).name.lower().replace("_", "-") for r in metadata.requires("fedveil") or []}
    distributions = metadata.packages_distributions()
    undeclared = {
        module: where
        for module, where in _third_party_imports().items()
        # a module of no installed distribution (an extra's, absent here) is taken to be its own name
        if not {d.lower().replace("_", "-") for d in distributions.get(module, [module])} & declared
    }
    assert {"scipy", "torch", "numpy"} <= set(_third_party_imports())
    assert not undeclared, f"imported but not declared in pyproject.toml's dependencies: {undeclared}"


def test_the_installed_torch_satisfies_the_declared_range() -> None:
    installed = Version(metadata.version("torch").split("+")[0])
    assert installed in _torch_requirement().specifier


def test_the_cpu_constraints_pin_the_exact_wheel_and_every_install_command_uses_them() -> None:
    pins = [
        line.strip()
        for line in (ROOT / "constraints" / "cpu.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert pins == ["torch==2.13.0"]
    assert _torch_requirement().specifier.contains("2.13.0")
    bootstrap = (ROOT / "scripts" / "bootstrap").read_text()
    installs = [line for line in bootstrap.splitlines() if re.search(r"pip install", line)]
    assert installs and all("-c constraints/cpu.txt" in line for line in installs), installs
    readme = (ROOT / "README.md").read_text()
    quick_start = [line for line in readme.splitlines() if line.startswith("python3 -m pip install -e . ")]
    assert quick_start and all("-c constraints/cpu.txt" in line for line in quick_start), quick_start
    # every install of fedveil the docs show (its extras too) keeps the CPU wheel, but for --no-deps
    shown = [
        line
        for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
        for line in page.read_text().splitlines()
        if re.match(r"\s*(python3 -m )?pip install -e ", line) and "--no-deps" not in line
    ]
    assert len(shown) >= 4 and all("-c constraints/cpu.txt" in line for line in shown), shown
    assert "scripts/bootstrap" in (ROOT / ".ci" / "run").read_text()


def test_beside_the_installed_torch_a_no_deps_install_imports_and_runs_the_demo(tmp_path: Path) -> None:
    """The README's "beside an existing PyTorch": a fresh virtual environment that sees this interpreter's
    packages (torch included, as a GPU machine's own build would be), ``pip install --no-deps -e .`` (no
    resolver, no download), then the installed metadata accepts that torch, ``pip check`` finds nothing
    wrong with fedveil or torch, and ``fedveil demo`` trains and writes its results."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    (purelib,) = json.loads(
        subprocess.run(
            [str(python), "-c", "import json, site; print(json.dumps(site.getsitepackages()))"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    )
    parents = [p for p in site.getsitepackages() if Path(p).is_dir()]
    Path(purelib, "zz_parent_site.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in parents)
    )
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    probe = subprocess.run(
        [
            str(python),
            "-c",
            "import json, fedveil, torch; from importlib import metadata; "
            "print(json.dumps([fedveil.__file__, torch.__version__, metadata.requires('fedveil')]))",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    where, torch_version, requires = json.loads(probe.stdout)
    assert Path(where).resolve().is_relative_to(ROOT / "src")
    (torch_req,) = [Requirement(r) for r in requires if Requirement(r).name == "torch"]
    assert Version(torch_version.split("+")[0]) in torch_req.specifier
    check = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert not [
        line for line in check.stdout.splitlines() if re.match(r"(fedveil|torch) ", line, re.IGNORECASE)
    ], check.stdout
    run_dir = tmp_path / "demo"
    demo = subprocess.run(
        [
            str(venv / "bin" / "fedveil"),
            "demo",
            "--out",
            str(run_dir),
            "--set",
            "rounds=2",
            "--no-progress",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["rounds"] == 2 and results["rounds_applied"] == 2
    assert 0.0 <= results["accuracy_percent"] <= 100.0
