"""``fedveil run CONFIG.yaml [--set key=value ...] [--seed S] [--out DIR] [--no-progress] [--resume |
--overwrite]``: train one experiment."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fedveil.experiments.checkpoint import add_run_arguments, check_run_dir, run_sets
from fedveil.experiments.config import load_config
from fedveil.experiments.network_options import add_network_arguments, ray_plan, with_runtime
from fedveil.experiments.report import announce_stand_in, format_results


def register(subparsers: Any) -> None:
    """Add the ``run`` command."""
    p = subparsers.add_parser(
        "run", help="train an experiment from a YAML config and write its run directory"
    )
    p.add_argument("config", type=Path, help="experiment YAML (see configs/)")
    add_run_arguments(p)
    add_network_arguments(p, default_agents=8, clients="devices")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load and check the whole config and the run directory first, then train."""
    from fedveil.experiments.fdml.runner import run_experiment

    cfg = load_config(args.config, run_sets(args), refuse_ignored=True)
    out = args.out or Path("runs") / cfg.name
    check_run_dir(out, resume=args.resume, overwrite=args.overwrite)
    if cfg.data.stand_in:
        announce_stand_in(cfg.data.stand_in)
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
