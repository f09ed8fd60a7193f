"""Crash-safe file writes: a file is replaced whole or not at all (one implementation for the project).

A new file is written next to the target (created with its final permissions, so a private key is never
readable by others, not even for a moment), flushed and fsynced, renamed over the target, and the
directory is fsynced so that the rename itself survives a power cut. A disk error (full, read-only)
names the target, not the temporary file.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def fsync_dir(directory: str | Path) -> None:
    """Make a rename in ``directory`` durable (best effort where a directory cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems that refuse
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | Path, *, mode: int = 0o644) -> Iterator[BinaryIO]:
    """A binary file handle whose content replaces ``path`` atomically when the block ends without an
    exception (and is discarded otherwise)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except OSError as exc:
        exc.filename = str(target)  # a disk error names the file the user knows, not the temporary one
        raise
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename in (None, str(tmp)):
            exc.filename = str(target)
        raise
    fsync_dir(target.parent)


def atomic_write(path: str | Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically (module docstring)."""
    with atomic_file(path, mode=mode) as fh:
        fh.write(data)
