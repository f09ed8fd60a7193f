"""Packaging: fedveil declares a PyTorch range; the exact CPU wheel is pinned only by the install commands."""

from __future__ import annotations

import re
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
    spec = _torch_requirement().specifier
    assert not any(s.operator in ("==", "===") for s in spec), f"torch is pinned in pyproject.toml: {spec}"
    assert Version("2.1") in spec and Version("2.13.0") in spec and Version("2.99") in spec
    assert Version("2.0.1") not in spec and Version("3.0") not in spec


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
    assert "scripts/bootstrap" in (ROOT / ".ci" / "run").read_text()
