"""`fedveil --help` and every sub-command's parser load without the heavy libraries (torch, dp-accounting,
galois, gRPC, matplotlib): they are imported where they are used. Checked in a fresh interpreter by
what is imported, not by a timing (speed is measured in docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "dp_accounting", "galois", "grpc", "scipy", "matplotlib")


def test_building_every_parser_imports_no_heavy_library() -> None:
    code = (
        "import sys, fedveil.cli\n"
        "fedveil.cli.build_parser()\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_help_of_every_command_works() -> None:
    from fedveil.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert {"run", "server", "agent", "certs", "enrol", "bench", "privacy", "feduv"} <= set(commands)
    for name, sub in commands.items():
        assert sub.format_help().startswith("usage: fedveil " + name)
