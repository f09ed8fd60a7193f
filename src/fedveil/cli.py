"""The ``fedveil`` command.

Each module in :mod:`fedveil.commands` contributes one top-level sub-command through a
``register(subparsers)`` function that adds its parser and sets ``func`` (called with the parsed
namespace, returning an exit status). The logic behind every command lives in the library, so a
user can call it from Python too.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from fedveil import __version__, commands
from fedveil.errors import FedveilError


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
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except FedveilError as exc:
        print(f"fedveil {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
