"""Crash-safe run state: atomic checkpoints and the durable privacy-spend log (nothing lost on a crash).

``checkpoint.npz`` holds the server's arrays (weights, optimizer moments), ``round`` (an int64 scalar)
and one ``meta`` entry, UTF-8 JSON as a ``uint8`` array (random generator states, optimizer scalars). It
is written to a temporary file in the same directory, flushed, fsynced and renamed over the old one, and
the directory is fsynced: a crash leaves either the old or the new checkpoint, never half of one. It is
read with ``allow_pickle=False``.

``privacy_spent.jsonl`` has one line per round whose derivatives the enclave released, appended and
fsynced **before** the release (FDML's ``before_release`` hook). A resumed run counts every line, also
the rounds that crashed after their release and before their checkpoint: their spend is real.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedveil.core.atomic import atomic_file
from fedveil.errors import ConfigError

CHECKPOINT = "checkpoint.npz"
SPEND_LOG = "privacy_spent.jsonl"


@dataclass
class Checkpoint:
    """A run's state after round ``round``: server ``arrays`` and JSON-ready ``meta``."""

    round: int
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any]


def save_checkpoint(directory: str | Path, ckpt: Checkpoint) -> Path:
    """Write ``directory/checkpoint.npz`` atomically."""
    out = Path(directory)
    if {"meta", "round"} & set(ckpt.arrays):
        raise ConfigError("checkpoint arrays may not be named 'meta' or 'round'")
    meta = json.dumps({"round": ckpt.round, **ckpt.meta}, sort_keys=True).encode("utf-8")
    with atomic_file(out / CHECKPOINT) as fh:
        np.savez(fh, meta=np.frombuffer(meta, dtype=np.uint8), round=np.int64(ckpt.round), **ckpt.arrays)
    return out / CHECKPOINT


def load_checkpoint(directory: str | Path) -> Checkpoint | None:
    """The checkpoint in ``directory``, or None if there is none (never unpickles)."""
    path = Path(directory) / CHECKPOINT
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: np.array(data[k]) for k in data.files if k not in ("meta", "round")}
            meta = json.loads(bytes(data["meta"]).decode("utf-8"))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{path}: not a fedveil checkpoint ({exc}); move it away to start afresh") from exc
    if not isinstance(meta, dict) or type(meta.get("round")) is not int:
        raise ConfigError(f"{path}: checkpoint metadata has no round number")
    rnd = meta.pop("round")
    return Checkpoint(rnd, arrays, meta)


class SpendLog:
    """The append-only, fsynced log of rounds whose DP release happened (module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / SPEND_LOG

    def rounds(self) -> list[int]:
        """Round numbers paid for so far (a torn last line from a crash is ignored: its write never
        completed, so neither did the release after it)."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(int(json.loads(line)["round"]))
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def record(self, rnd: int, extra: Mapping[str, Any] | None = None) -> None:
        """Append round ``rnd`` and fsync before returning."""
        line = json.dumps({"round": int(rnd), **(extra or {})}, sort_keys=True) + "\n"
        with open(self.path, "a+b") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell():
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":  # a torn line from a crash: end it before appending
                    line = "\n" + line
            fh.write(line.encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())

    def reset(self) -> None:
        """Start a fresh run's log."""
        self.path.unlink(missing_ok=True)
