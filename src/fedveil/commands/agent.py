"""``fedveil agent``: run one or more devices of an experiment against a fedveil server."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from fedveil.experiments.agent_options import add_agent_arguments
from fedveil.experiments.config import load_config


def register(subparsers: Any) -> None:
    """Add the ``agent`` command."""
    p = subparsers.add_parser("agent", help="run devices that dial a fedveil server (docs/deployment.md)")
    add_agent_arguments(p)
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
