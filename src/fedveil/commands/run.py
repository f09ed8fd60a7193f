"""``fedveil run CONFIG.yaml [--set key=value ...] [--out DIR]``: train one experiment."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fedveil.experiments.checkpoint import add_run_dir_arguments
from fedveil.experiments.config import load_config
from fedveil.experiments.network_options import add_network_arguments, ray_plan, with_runtime
from fedveil.experiments.report import format_results


def register(subparsers: Any) -> None:
    """Add the ``run`` command."""
    p = subparsers.add_parser(
        "run", help="train an experiment from a YAML config and write its run directory"
    )
    p.add_argument("config", type=Path, help="experiment YAML (see configs/)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set fdml.lr=0.001 (repeatable)",
    )
    p.add_argument("--out", type=Path, default=None, help="run directory (default: runs/<name>)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_run_dir_arguments(p)
    add_network_arguments(p, default_agents=8, clients="devices")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load and check the whole config first, then train."""
    from fedveil.experiments.fdml.runner import run_experiment

    cfg = load_config(args.config, args.overrides, refuse_ignored=True)
    out = args.out or Path("runs") / cfg.name
    results = with_runtime(
        args,
        lambda network: run_experiment(
            cfg,
            out,
            progress=not args.no_progress and sys.stderr.isatty(),
            resume=args.resume,
            overwrite=args.overwrite,
            network=network,
            ray=ray_plan(args),
        ),
    )
    print(format_results(results, out))
    return 0
