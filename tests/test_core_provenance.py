"""Which code produced a run: ``code_identity`` asks the folder ``fedveil`` was imported from."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import fedveil
from fedveil.core import provenance


def test_the_imported_package_s_checkout_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    provenance.code_identity.cache_clear()
    code = provenance.code_identity()
    source = Path(fedveil.__file__).resolve().parent
    assert code["version"] == fedveil.__version__ and code["source"] == str(source)
    if shutil.which("git") is None:
        assert code["git_commit"] is None and code["git_dirty"] is None
        return
    head = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:  # installed outside a checkout
        assert code["git_commit"] is None
        return
    assert code["git_commit"] == head.stdout.strip() and isinstance(code["git_dirty"], bool)
    status = subprocess.run(
        ["git", "-C", str(source), "status", "--porcelain", "--", "."], capture_output=True, text=True
    )
    assert code["git_dirty"] == bool(status.stdout.strip())


def test_no_git_or_no_checkout_gives_none(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert provenance._git(tmp_path, "rev-parse", "HEAD") is None  # not a checkout
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
    assert provenance._git(Path(fedveil.__file__).parent, "rev-parse", "HEAD") is None
    provenance.code_identity.cache_clear()
    try:
        code = provenance.code_identity()
        assert code["git_commit"] is None and code["git_dirty"] is None and code["version"]
    finally:
        provenance.code_identity.cache_clear()
