"""The ``fedveil`` command.

Each module in :mod:`fedveil.commands` contributes one top-level sub-command through a
``register(subparsers)`` function that adds its parser and sets ``func`` (called with the parsed
namespace, returning an exit status). The logic behind every command lives in the library, so a
user can call it from Python too.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import pkgutil
import shlex
import signal
import sys
from collections.abc import Sequence

from fedveil import commands
from fedveil._version import __version__
from fedveil.core.heap import retain_freed_memory
from fedveil.errors import FedveilError, RunInterrupted

#: The commands that train models (or attack them, or benchmark training): their process keeps freed memory
#: in its heap (:func:`fedveil.core.heap.retain_freed_memory`), so each client and round reuses the pages
#: the last one freed instead of faulting fresh ones in.
TRAINING_COMMANDS = frozenset(
    {"agent", "aiot", "attack", "bench", "demo", "feduv", "polifl", "ppfl", "reproduce", "run", "server"}
)

#: What to do about a file system error, by errno (a full or read-only disk ends a run with one line).
DISK_ERRORS = {
    errno.ENOSPC: "free some space there, or choose another --out",
    errno.EDQUOT: "free some of your quota there, or choose another --out",
    errno.EROFS: "the file system is read-only: choose a writable --out",
    errno.EACCES: "you may not write there: choose another --out",
    errno.EPERM: "you may not write there: choose another --out",
    errno.ENOTDIR: "a part of the path is a file, not a directory: choose another --out",
    errno.EISDIR: "a directory stands where a file is expected: choose another --out",
    errno.EIO: "the disk reported an I/O error: check it, or choose another --out",
}


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every sub-command found in :mod:`fedveil.commands`."""
    parser = argparse.ArgumentParser(
        prog="fedveil",
        description="Privacy-preserving federated learning: FDML, FedUV and friends, simulated or deployed.",
    )
    parser.add_argument("--version", action="version", version=f"fedveil {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    name = args.command
    if name in TRAINING_COMMANDS:
        retain_freed_memory()
    try:
        return _run(args, argv, name)
    except KeyboardInterrupt:
        # a Ctrl-C outside a run's own handling: before its rounds began, or while the stop that a
        # first Ctrl-C asked for is being reported. A run's checkpoints are written atomically, so a
        # command that resumes can always continue from the last one.
        if hasattr(args, "resume"):
            print(
                f"fedveil {name}: interrupted; continue with: {continue_command(argv, args)}", file=sys.stderr
            )
            return 2
        print(f"fedveil {name}: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace, argv: Sequence[str], name: str) -> int:
    """Run the command ``args`` chose; its errors as one line on stderr and an exit status."""
    from fedveil.runtime.threads import blas_threads  # numpy: not needed for --help

    try:
        with blas_threads():  # numpy's BLAS on purpose, not one spinning worker per core
            return int(args.func(args) or 0)
    except RunInterrupted as exc:
        print(f"fedveil {name}: {exc}; continue with: {continue_command(argv, args)}", file=sys.stderr)
        return 2
    except FedveilError as exc:
        print(f"fedveil {name}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno not in DISK_ERRORS:
            raise
        where = exc.filename or getattr(args, "out", None) or "."
        print(
            f"fedveil {name}: error: cannot write {str(where)!r}: {exc.strerror}; {DISK_ERRORS[exc.errno]}"
            + (f"; then continue with: {continue_command(argv, args)}" if hasattr(args, "resume") else ""),
            file=sys.stderr,
        )
        return 2


def continue_command(argv: Sequence[str], args: argparse.Namespace) -> str:
    """The command that continues an interrupted run: ``argv`` with ``--resume`` (and without
    ``--overwrite``) for a command that has ``--resume``, else ``argv`` itself (a command that resumes
    by itself, as ``reproduce`` does)."""
    words = list(argv)
    if hasattr(args, "resume"):
        words = [w for w in words if w != "--overwrite"]
        if "--resume" not in words:
            words.append("--resume")
    return shlex.join(["fedveil", *words])


def entry() -> None:
    """The ``fedveil`` console script and ``python -m fedveil``: :func:`main`, then exit with its status.

    Once the command has returned, Ctrl-C is ignored: a run stopped by a first Ctrl-C returns at its
    round's end and exits, and a second Ctrl-C that lands while the interpreter shuts down (torch's
    finalisers, the enclave's pipes) must not print a traceback over the line that says how to
    continue."""
    code = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    entry()
