"""Crash-safe run state: atomic checkpoints and the durable privacy-spend log (nothing lost on a crash).

``checkpoint.npz`` holds the server's arrays (weights, optimizer moments), ``round`` (an int64 scalar)
and one ``meta`` entry, UTF-8 JSON as a ``uint8`` array (random generator states, optimizer scalars). It
is written to a temporary file in the same directory, flushed, fsynced and renamed over the old one, and
the directory is fsynced: a crash leaves either the old or the new checkpoint, never half of one. It is
read with ``allow_pickle=False``.

``privacy_spent.jsonl`` has one line per round whose derivatives the enclave released, appended and
fsynced **before** the release (FDML's ``before_release`` hook). A resumed run counts every line, also
the rounds that crashed after their release and before their checkpoint: their spend is real.

A run directory holds one run (:func:`prepare_run_dir`): a new run refuses a directory that holds
anything unless told to continue it (``resume``) or to clear it first (``overwrite``), and a checkpoint
names the config it was trained under (:func:`config_digest`), so that one run's weights never continue
another run. A run records the device it computes on (``device.json``, :func:`claim_device`): a resumed
run continues on that device, however the device option spells it. :class:`StopAtRoundEnd` is every
runner's Ctrl-C: the first stops the run at the end of its round, after the round's checkpoint; a second
stops it at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from fedveil.core.atomic import atomic_file, atomic_write, fsync_dir
from fedveil.errors import ConfigError

if TYPE_CHECKING:
    import torch

CHECKPOINT = "checkpoint.npz"
SPEND_LOG = "privacy_spent.jsonl"
#: The file of a run directory (or a folder of parts) that says where it computed (:func:`claim_device`).
DEVICE_RECORD = "device.json"
#: Files whose presence marks a directory as a fedveil run directory (what ``overwrite`` may clear).
RUN_FILES = (
    "config.yaml",
    "config.json",
    "metrics.jsonl",
    "results.json",
    CHECKPOINT,
    SPEND_LOG,
    DEVICE_RECORD,
)
#: Test hook (:func:`crash_point`): ``NAME:ROUND`` makes the process SIGKILL itself there.
CRASH_ENV = "FEDVEIL_CRASH_AT"


@dataclass
class Checkpoint:
    """A run's state after round ``round``: server ``arrays`` and JSON-ready ``meta``."""

    round: int
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any]


def save_checkpoint(directory: str | Path, ckpt: Checkpoint, *, name: str = CHECKPOINT) -> Path:
    """Write ``directory/checkpoint.npz`` atomically (``name``: another file name, for a run whose parts
    train side by side, each with its own checkpoint)."""
    out = Path(directory)
    if {"meta", "round"} & set(ckpt.arrays):
        raise ConfigError("checkpoint arrays may not be named 'meta' or 'round'")
    meta = json.dumps({"round": ckpt.round, **ckpt.meta}, sort_keys=True).encode("utf-8")
    with atomic_file(out / name) as fh:
        np.savez(fh, meta=np.frombuffer(meta, dtype=np.uint8), round=np.int64(ckpt.round), **ckpt.arrays)
    return out / name


def load_checkpoint(directory: str | Path, *, name: str = CHECKPOINT) -> Checkpoint | None:
    """The checkpoint ``name`` in ``directory``, or None if there is none (never unpickles)."""
    path = Path(directory) / name
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


def config_digest(resolved: str | bytes) -> str:
    """The identity of a run's resolved config (its text): SHA-256, hex. A checkpoint records it, and a
    resumed run continues the checkpoint only under the same digest."""
    data = resolved.encode("utf-8") if isinstance(resolved, str) else resolved
    return hashlib.sha256(data).hexdigest()


def identity_settings(settings: Mapping[str, Any], *, free: Iterable[str] = ()) -> dict[str, Any]:
    """The settings that name a run's numbers, as JSON values: ``settings`` without the ``free`` ones
    (threads, workers: how fast, not what) and without ``device``. The device is not compared as it was
    spelled (``auto``, ``cuda`` and ``cuda:0`` are one GPU on a one-GPU machine, ``auto`` and ``cpu`` one
    CPU on a machine without CUDA): a run records the device it resolved to (:func:`claim_device`)."""
    skip = {"device", *free}
    return {k: v for k, v in json.loads(json.dumps(dict(settings), default=str)).items() if k not in skip}


def saved_settings(path: Path) -> dict[str, Any]:
    """The settings a run recorded in ``path`` (``config.json``, or YAML for a ``.yaml`` file), or a
    :class:`~fedveil.errors.ConfigError` naming the file when it is not a readable mapping of settings
    (truncated, edited, not UTF-8)."""
    try:
        text = path.read_text(encoding="utf-8")
        value = yaml.safe_load(text) if path.suffix == ".yaml" else json.loads(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        value, why = None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    else:
        why = "empty" if value is None else f"a {type(value).__name__}, not a mapping of settings"
    if not isinstance(value, dict):
        raise ConfigError(
            f"{path} is not a readable run config ({why}): start afresh with --overwrite, or choose "
            "another --out"
        )
    return value


def differing_settings(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[str]:
    """The names of the settings whose values differ between ``mine`` and ``theirs`` (sorted)."""
    return sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))


def claim_device(out: Path, device: torch.device, *, artefacts: Sequence[str]) -> None:
    """Make sure everything a run keeps in ``out`` is computed on one device: record ``device`` (resolved
    by :func:`~fedveil.models.device.resolve_device`, so a GPU is ``cuda:N`` however it was asked for) in
    ``out/device.json``, or refuse, naming both devices, when ``out`` was computed on another (a resumed
    run never mixes devices: their floating-point results differ). A folder holding any of ``artefacts``
    (glob patterns, e.g. ``checkpoint.npz``, ``parts/*.json``) without the record was written before runs
    recorded their device, when fedveil computed everything on the CPU: it counts as the CPU's."""
    record = out / DEVICE_RECORD
    if record.is_file():
        try:
            earlier = str(json.loads(record.read_text(encoding="utf-8"))["device"])
        except (ValueError, TypeError, KeyError):
            raise ConfigError(
                f'{record} is not a device record ({{"device": ...}}): delete {out} to compute its parts '
                "afresh, or give another output folder"
            ) from None
    elif any(any(out.glob(pattern)) for pattern in artefacts):
        earlier = "cpu"
    else:
        earlier = None
    if earlier is not None and earlier != str(device):
        raise ConfigError(
            f"{out} holds parts computed on {earlier}, and this run is on {device}: resume it with "
            f"--device {earlier}, or give another output folder (or delete {out}) to compute everything "
            f"on {device}"
        )
    if not record.is_file():
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(record, (json.dumps({"device": str(device)}, indent=2) + "\n").encode())


def add_run_dir_arguments(parser: Any) -> None:
    """Add ``--resume`` and ``--overwrite`` (:func:`prepare_run_dir`) to a run command's ``parser``."""
    parser.add_argument(
        "--resume", action="store_true", help="continue the run in the run directory from its last checkpoint"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="clear the run directory (checkpoint and DP spend log included) and start afresh",
    )


def add_run_arguments(parser: Any, *, out_default: Path | None = None) -> None:
    """Add the options every system's ``run`` (and ``demo``) shares to ``parser``: ``--out`` (default
    ``out_default``, else ``runs/<the config's name>``), ``--set KEY=VALUE`` (repeatable, into
    ``overrides``), ``--seed``, ``--no-progress``, ``--device`` and ``--resume`` / ``--overwrite``
    (:func:`add_run_dir_arguments`). :func:`run_sets` gives the overrides they ask for."""
    where = f"default: {out_default}" if out_default is not None else "default: runs/<name>"
    parser.add_argument("--out", type=Path, default=out_default, help=f"run directory ({where})")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of the config, dotted for nested ones, e.g. --set rounds=5 (repeatable; "
        "an unknown key or a wrong value fails before training, naming it)",
    )
    parser.add_argument("--seed", type=int, default=None, help="the config's seed (same as --set seed=S)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument(
        "--device",
        default=None,
        help="where training runs: auto (CUDA when available), cpu, cuda or cuda:N (same as --set device=D)",
    )
    add_run_dir_arguments(parser)


def run_sets(args: Any) -> list[str]:
    """The ``--set`` items of a command that has :func:`add_run_arguments`, with ``--seed S`` and
    ``--device D`` last (``seed=S``, ``device=D``: they win over a ``--set seed=...`` or ``device=...``)."""
    seed = [] if args.seed is None else [f"seed={args.seed}"]
    device = [] if args.device is None else [f"device={args.device}"]
    return [*args.overrides, *seed, *device]


def check_run_dir(directory: str | Path, *, resume: bool, overwrite: bool) -> list[str]:
    """Refuse ``directory`` as :func:`prepare_run_dir` would, touching nothing; the names it holds.

    A command calls it before it prints anything (the stand-in banner), so that a refused run says only
    why it was refused."""
    out = Path(directory)
    if resume and overwrite:
        raise ConfigError("--resume continues the run in the directory and --overwrite clears it: give one")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"run directory {str(out)!r} is a file, not a directory: choose another --out")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not resume:
        if not overwrite:
            shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
            raise ConfigError(
                f"run directory {str(out)!r} is not empty ({shown}): continue the run in it with --resume, "
                "clear it with --overwrite, or choose another --out"
            )
        if not set(entries) & set(RUN_FILES):
            raise ConfigError(
                f"--overwrite: {str(out)!r} does not hold a fedveil run (none of {', '.join(RUN_FILES)}); "
                "it is left as it is: choose another --out"
            )
    return entries


def prepare_run_dir(directory: str | Path, *, resume: bool, overwrite: bool) -> Path:
    """Make ``directory`` ready for a run and return it.

    A new run (neither flag) needs a missing or empty directory: one holding anything is refused, naming
    ``--resume`` (continue the run there) and ``--overwrite`` (clear it first). ``overwrite`` empties it
    before anything of the new run is written (checkpoint and DP spend log included), and only when it
    holds a run (:data:`RUN_FILES`), so that a mistyped ``--out`` never deletes a user's folder.
    ``resume`` keeps it as it is. The refusals are :func:`check_run_dir`'s."""
    out = Path(directory)
    entries = check_run_dir(out, resume=resume, overwrite=overwrite)
    if entries and not resume:
        for name in entries:
            path = out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        fsync_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def check_checkpoint_identity(
    out: Path, ckpt: Checkpoint, digest: str, *, name: str = CHECKPOINT, legacy: str | None = None
) -> None:
    """Refuse to continue ``ckpt`` (the file ``name`` in ``out``) under a config whose
    :func:`config_digest` is not the one it was trained under (or a checkpoint that names none).
    ``legacy``: the digest the same config had before digests left out the device's spelling
    (:func:`identity_settings`), which a checkpoint written then names."""
    theirs = ckpt.meta.get("config_sha256")
    if theirs != digest and (legacy is None or theirs != legacy):
        why = "names no config" if theirs is None else "was trained under another config"
        raise ConfigError(
            f"{out / name} (round {ckpt.round}) {why}: it is not this run's and is not resumed; "
            "resume with the config it was started with, or start afresh with --overwrite"
        )


def crash_point(name: str, rnd: int) -> None:
    """Test hook for crash tests: when the environment variable :data:`CRASH_ENV` is ``name:rnd``, this
    process kills itself with SIGKILL here (as a power cut would stop it). Unset, it does nothing."""
    if os.environ.get(CRASH_ENV) == f"{name}:{rnd}":
        os.kill(os.getpid(), signal.SIGKILL)


class StopRequested(KeyboardInterrupt):
    """Raised by :meth:`StopAtRoundEnd.check` at the end of a round after a Ctrl-C. A
    ``KeyboardInterrupt``, so that it passes every ``except Exception`` between the round loop and the
    runner (asyncio tasks, a sandboxed program's host calls), which turns it into
    :class:`~fedveil.errors.RunInterrupted` as it does a second Ctrl-C."""


class StopAtRoundEnd:
    """Ctrl-C for a training loop, the same in every runner (a context manager).

    While it is active (in the main thread: signals reach no other), the first SIGINT only sets
    :attr:`requested` and says so on stderr; the loop calls :meth:`check` at the end of each round, after
    the round's checkpoint, and stops there (:class:`StopRequested`). A second SIGINT raises
    ``KeyboardInterrupt`` at once. The runner turns either into :class:`~fedveil.errors.RunInterrupted`
    saying where the run stopped; the command line prints it in one line, with the command that
    continues. ``what`` names the run in the stderr note; ``also`` (optional) is a second way to ask,
    for a worker process whose parent received the Ctrl-C (e.g. a shared event's ``is_set``)."""

    def __init__(self, what: str = "the run", *, also: Callable[[], bool] | None = None) -> None:
        self.what = what
        self.also = also
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> StopAtRoundEnd:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            f"\nCtrl-C: {self.what} stops at the end of this round, after its checkpoint "
            "(Ctrl-C again stops it at once)",
            file=sys.stderr,
            flush=True,
        )

    def check(self) -> None:
        """Raise :class:`StopRequested` if Ctrl-C was pressed (call at the end of a round)."""
        if self.requested or (self.also is not None and self.also()):
            raise StopRequested
