"""``fedveil server CONFIG``: run an experiment's server for device agents that connect over the network."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from fedveil.experiments.checkpoint import add_run_dir_arguments
from fedveil.experiments.config import load_config
from fedveil.experiments.report import format_results


def register(subparsers: Any) -> None:
    """Add the ``server`` command."""
    p = subparsers.add_parser(
        "server", help="serve an experiment to device agents over gRPC with mutual TLS (docs/deployment.md)"
    )
    p.add_argument("config", type=Path, help="experiment YAML (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--listen", default="0.0.0.0:7443", help="device port, HOST:PORT (default 0.0.0.0:7443)")
    p.add_argument("--enrol-listen", default=None, help="enrolment port (token -> certificate), HOST:PORT")
    p.add_argument("--pki", type=Path, default=Path("pki"), help="PKI directory from `fedveil certs init`")
    p.add_argument(
        "--insecure", action="store_true", help="plaintext, unauthenticated devices (not for real use)"
    )
    p.add_argument("--out", type=Path, default=None, help="run directory (default: runs/<name>)")
    add_run_dir_arguments(p)
    p.add_argument("--min-devices", type=int, default=None, help="devices to wait for (default: all users)")
    p.add_argument("--wait", type=float, default=600.0, help="seconds to wait for them (default 600)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load the config, listen, wait for the devices, train, and write the run directory."""
    from fedveil.experiments.fdml.runner import run_experiment
    from fedveil.experiments.network_run import NetworkPlan

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config, args.overrides, refuse_ignored=True)
    out = args.out or Path("runs") / cfg.name
    if args.insecure:
        print(
            "fedveil server: WARNING: --insecure: no TLS, device ids are not authenticated", file=sys.stderr
        )
    plan = NetworkPlan(
        listen=args.listen,
        pki=None if args.insecure else args.pki,
        insecure=args.insecure,
        wait_seconds=args.wait,
        min_devices=args.min_devices,
        enrol_listen=args.enrol_listen,
    )
    results = run_experiment(
        cfg, out, progress=sys.stderr.isatty(), resume=args.resume, overwrite=args.overwrite, network=plan
    )
    print(format_results(results, out))
    return 0
