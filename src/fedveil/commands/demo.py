"""``fedveil demo``: FDML on the embedded synthetic TouchAuth population, in about a minute on a 2-core
machine (the measured time is in ``fedveil/configs/demo.yaml``)."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from fedveil.experiments.checkpoint import add_run_arguments, check_run_dir, run_sets
from fedveil.experiments.config import load_config
from fedveil.experiments.report import announce_stand_in, format_results


def demo_config_path() -> Path:
    """The packaged demo config (``fedveil/configs/demo.yaml``)."""
    return Path(str(resources.files("fedveil") / "configs" / "demo.yaml"))


def register(subparsers: Any) -> None:
    """Add the ``demo`` command."""
    p = subparsers.add_parser(
        "demo", help="train FDML on synthetic TouchAuth users and print accuracy and EER"
    )
    add_run_arguments(p, out_default=Path("runs") / "demo")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Train the demo and print its results table."""
    from fedveil.experiments.fdml.runner import run_experiment

    cfg = load_config(demo_config_path(), run_sets(args), refuse_ignored=True)
    check_run_dir(args.out, resume=args.resume, overwrite=args.overwrite)
    if cfg.data.stand_in:
        announce_stand_in(cfg.data.stand_in)
    print(
        f"fedveil demo: FDML, {cfg.rounds} rounds of {cfg.fdml.num_required} users x "
        f"{cfg.fdml.samples_per_client} samples on the synthetic TouchAuth population; run dir {args.out}"
    )
    results = run_experiment(
        cfg,
        args.out,
        progress=not args.no_progress and sys.stderr.isatty(),
        resume=args.resume,
        overwrite=args.overwrite,
    )
    print(format_results(results, args.out))
    return 0
