"""``fedveil reproduce TABLE``: run every cell of a paper table and write its summary beside the paper's."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fedveil.experiments.fdml.reproduce import TABLES, reproduce


def register(subparsers: Any) -> None:
    """Add the ``reproduce`` command."""
    p = subparsers.add_parser(
        "reproduce",
        help="reproduce a paper table (FDML Tables I-IV: TouchAuth, CameraAuth) in one command, over N seeds",
    )
    p.add_argument("table", choices=sorted(TABLES), help="which table")
    p.add_argument("--configs", type=Path, default=Path("configs"), help="directory of the table configs")
    p.add_argument("--out", type=Path, default=Path("runs"), help="runs go to OUT/TABLE/<config name>/")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override every cell's config, e.g. --set rounds=200 (repeatable)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="where every cell trains: auto (CUDA when available), cpu, cuda or cuda:N (same as --set "
        "device=D; default: each config's, auto)",
    )
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per run (default: cores / jobs)")
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="training seeds per cell: N runs each cell with seed=0..N-1 into OUT/TABLE/<config>/seed<i>/ "
        "and reports mean +- std (default 1: the config's seed, into OUT/TABLE/<config>/)",
    )
    p.add_argument(
        "--rounds-scale",
        type=int,
        default=1,
        metavar="K",
        help="run each cell for K times its config's rounds (FL-traditional keeps its 3:1 ratio to FDML; "
        "default 1)",
    )
    p.add_argument(
        "--cells",
        type=_positions,
        default=None,
        metavar="I,J,...",
        help="run only these cells, by their 1-based position in the table (default: all)",
    )
    p.set_defaults(func=run)


def _positions(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positions") from None


def run(args: argparse.Namespace) -> int:
    """Run the table and print its summary; a ``--device`` this machine lacks fails before any cell."""
    if args.device is not None:
        from fedveil.models.device import resolve_device

        resolve_device(args.device)
    summary = reproduce(
        args.table,
        configs=args.configs,
        out=args.out,
        overrides=[*args.overrides, *([f"device={args.device}"] if args.device is not None else [])],
        jobs=args.jobs,
        threads=args.threads,
        seeds=args.seeds,
        only=args.cells,
        rounds_scale=args.rounds_scale,
    )
    print((args.out / args.table / "summary.md").read_text())
    failed = [c for c in summary["cells"] if c["results"] is None and not (c.get("stats") or {}).get("n")]
    return 1 if failed else 0
