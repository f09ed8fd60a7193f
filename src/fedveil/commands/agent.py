"""``fedveil agent``: run one or more devices of an experiment against a fedveil server."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from fedveil.experiments.config import load_config


def register(subparsers: Any) -> None:
    """Add the ``agent`` command."""
    p = subparsers.add_parser("agent", help="run devices that dial a fedveil server (docs/deployment.md)")
    p.add_argument("--server", required=True, help="the server's HOST:PORT")
    p.add_argument("--config", type=Path, required=True, help="the experiment YAML the server runs")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--device", action="append", default=[], help="a device id to run (repeatable)")
    who.add_argument("--shard", default=None, help="I/N: every N-th device of the population from I")
    p.add_argument(
        "--credentials", type=Path, default=None, help="DIR/<device>/{device.crt,device.key,ca.crt}"
    )
    p.add_argument(
        "--platform-key", type=Path, default=None, help="the emulated TEE platform's public key file"
    )
    p.add_argument("--insecure", action="store_true", help="plaintext, unauthenticated (not for real use)")
    p.add_argument("--server-name", default=None, help="TLS name to expect in the server certificate")
    p.add_argument(
        "--give-up-after", type=float, default=None, help="exit after this many seconds without a server"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the devices from the config and serve until the server says training is over."""

    import torch

    from fedveil.experiments.fdml.agent import build_agent
    from fedveil.experiments.network_run import parse_shard, serve_devices

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(max(1, args.threads))
    cfg = load_config(args.config, args.overrides)
    host = build_agent(
        cfg,
        args.server,
        devices=args.device or None,
        shard=parse_shard(args.shard) if args.shard else None,
        credentials=args.credentials,
        insecure=args.insecure,
        platform_public_key=args.platform_key.read_bytes() if args.platform_key else None,
        give_up_after=args.give_up_after,
        server_name=args.server_name,
    )
    if args.insecure:
        print("fedveil agent: WARNING: --insecure: no TLS", file=sys.stderr)
    return serve_devices(host, "fedveil agent")
