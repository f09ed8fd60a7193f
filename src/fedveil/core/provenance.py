"""Which code produced a run: written into every run's ``results.json`` as ``code``.

A number in the docs must come from a command run on the code as committed. Long experiments here run from
a fixed worktree of an older commit (``PYTHONPATH=<worktree>/src``) while the checkout moves on, so the
current directory's commit says nothing about the code that ran. :func:`code_identity` asks the folder
``fedveil`` was imported from: its version, its path, and, when that folder is in a git checkout, the
commit and whether any file under it differs from that commit (changed, or new and not ignored).
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

from fedveil import _version

__all__ = ["code_identity"]


@functools.cache
def code_identity() -> dict[str, Any]:
    """``{"version", "source", "git_commit", "git_dirty"}`` of the imported ``fedveil`` package; the two
    git fields are ``None`` where the source is not in a git checkout or git is not installed. Computed
    once per process."""
    source = Path(_version.__file__).resolve().parent
    commit = _git(source, "rev-parse", "HEAD")
    dirty = _git(source, "status", "--porcelain", "--", ".")
    return {
        "version": _version.__version__,
        "source": str(source),
        "git_commit": commit or None,
        "git_dirty": None if commit is None or dirty is None else bool(dirty),
    }


def _git(folder: Path, *args: str) -> str | None:
    """``git -C folder args`` stripped, or ``None`` when git fails or is absent."""
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
