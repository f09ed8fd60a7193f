"""Helpers for tests that drive real ``fedveil`` processes."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def wait_for_file(path: Path, proc: subprocess.Popen, seconds: float, *, poll: float = 0.05) -> None:
    """Wait until ``path`` is a file while ``proc`` runs; fail (with its exit status and output) if it
    ends first, or if ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while not path.is_file():
        if proc.poll() is not None:
            raise AssertionError(
                f"the process exited with {proc.returncode} before {path} existed: {proc.communicate()}"
            )
        assert time.monotonic() < deadline, f"no {path} after {seconds:g} s"
        time.sleep(poll)
