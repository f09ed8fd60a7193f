"""``fedveil demo``: FDML on the embedded synthetic TouchAuth population, in a few minutes."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from fedveil.experiments.checkpoint import add_run_dir_arguments
from fedveil.experiments.config import load_config
from fedveil.experiments.report import format_results


def demo_config_path() -> Path:
    """The packaged demo config (``fedveil/configs/demo.yaml``)."""
    return Path(str(resources.files("fedveil") / "configs" / "demo.yaml"))


def register(subparsers: Any) -> None:
    """Add the ``demo`` command."""
    p = subparsers.add_parser(
        "demo", help="train FDML on synthetic TouchAuth users and print accuracy and EER"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of the demo config, e.g. --set rounds=50",
    )
    p.add_argument(
        "--out", type=Path, default=Path("runs") / "demo", help="run directory (default: runs/demo)"
    )
    add_run_dir_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Train the demo and print its results table."""
    from fedveil.experiments.fdml.runner import run_experiment

    cfg = load_config(demo_config_path(), args.overrides, refuse_ignored=True)
    print(
        f"fedveil demo: FDML, {cfg.rounds} rounds of {cfg.fdml.num_required} users x "
        f"{cfg.fdml.samples_per_client} samples on the synthetic TouchAuth population; run dir {args.out}"
    )
    results = run_experiment(
        cfg, args.out, progress=sys.stderr.isatty(), resume=args.resume, overwrite=args.overwrite
    )
    print(format_results(results, args.out))
    return 0
