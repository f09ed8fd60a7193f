"""The ``--runtime network`` options shared by ``fedveil run`` and ``fedveil feduv run`` (argparse only:
the CLI builds its parsers without importing gRPC)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fedveil.errors import ConfigError


def add_network_arguments(
    parser: argparse.ArgumentParser, *, default_agents: int, clients: str, ray: bool = True
) -> None:
    """``--runtime``, ``--agents``, ``--listen``, ``--pki`` and ``--wait`` (and, with ``ray``, the Ray
    runtime's ``--address`` and ``--actors``); ``clients`` names what the devices are in the help text
    (e.g. "devices", "users")."""
    on_ray = f"; ray: the simulation with the {clients} sharded over Ray actors (fedveil[ray])" if ray else ""
    parser.add_argument(
        "--runtime",
        choices=("simulation", "network", "ray") if ray else ("simulation", "network"),
        default="simulation",
        help=f"simulation: in-process {clients} (default); network: a gRPC server and device agents over "
        f"mutual TLS{on_ray}",
    )
    if ray:
        parser.add_argument(
            "--address",
            default=None,
            help="with --runtime ray: the Ray head's HOST:PORT, or auto (default: start a local cluster)",
        )
        parser.add_argument(
            "--actors",
            type=int,
            default=2,
            metavar="N",
            help="with --runtime ray: actors holding the clients",
        )
    parser.add_argument(
        "--agents",
        type=int,
        default=default_agents,
        metavar="N",
        help=f"with --runtime network: agent processes started on loopback, each hosting an equal share of "
        f"the {clients}, one TLS connection and certificate each (default {default_agents}; 0: they connect "
        "by themselves, give --pki)",
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1:0",
        help="with --runtime network: server HOST:PORT (default: a free port)",
    )
    parser.add_argument(
        "--pki", type=Path, default=None, help="with --agents 0: PKI directory (fedveil certs init)"
    )
    parser.add_argument(
        "--wait", type=float, default=300.0, help="seconds to wait for the devices (default 300)"
    )


def network_plan(args: argparse.Namespace) -> Any:
    """The :class:`fedveil.experiments.network_run.NetworkPlan` the options ask for, or None (simulation)."""
    if args.runtime != "network":
        return None
    if args.agents < 0:
        raise ConfigError(f"--agents {args.agents} must be >= 0")
    from fedveil.experiments.network_run import NetworkPlan

    return NetworkPlan(listen=args.listen, pki=args.pki, agents=args.agents, wait_seconds=args.wait)


def ray_plan(args: argparse.Namespace) -> Any:
    """The :class:`fedveil.experiments.runner.RayPlan` the options ask for, or None."""
    if args.runtime != "ray":
        return None
    if args.actors < 1:
        raise ConfigError(f"--actors {args.actors} must be >= 1")
    from fedveil.experiments.runner import RayPlan

    return RayPlan(address=args.address, actors=args.actors)
