"""The ``--runtime`` options shared by ``fedveil run`` and ``fedveil feduv run`` (argparse only: the CLI
builds its parsers without importing gRPC, Ray or Flower)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from fedveil.errors import ConfigError

T = TypeVar("T")


def add_network_arguments(
    parser: argparse.ArgumentParser, *, default_agents: int, clients: str, ray: bool = True
) -> None:
    """``--runtime``, ``--agents``, ``--listen``, ``--pki`` and ``--wait`` (and, with ``ray``, the Ray
    runtime's ``--address`` and ``--actors``); ``clients`` names what the devices are in the help text
    (e.g. "devices", "users")."""
    on_ray = f"; ray: the simulation with the {clients} sharded over Ray actors (fedveil[ray])" if ray else ""
    parser.add_argument(
        "--runtime",
        choices=("simulation", "network", "ray", "flower") if ray else ("simulation", "network", "flower"),
        default="simulation",
        help=f"simulation: in-process {clients} (default); network: a gRPC server and device agents over "
        f"mutual TLS{on_ray}; flower: the {clients} in Flower ClientApps on Flower's simulation engine "
        "(fedveil[flower], docs/flower.md)",
    )
    parser.add_argument(
        "--supernodes",
        type=int,
        default=4,
        metavar="N",
        help=f"with --runtime flower: SuperNodes, each hosting an equal share of the {clients} (default 4)",
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
    """The :class:`fedveil.experiments.fdml.runner.RayPlan` the options ask for, or None."""
    if args.runtime != "ray":
        return None
    if args.actors < 1:
        raise ConfigError(f"--actors {args.actors} must be >= 1")
    from fedveil.experiments.fdml.runner import RayPlan

    return RayPlan(address=args.address, actors=args.actors)


def with_runtime(args: argparse.Namespace, work: Callable[[Any], T]) -> T:
    """``work(network)`` with the network plan the options ask for: None (in-process or Ray), a
    :class:`~fedveil.experiments.network_run.NetworkPlan`, or, with ``--runtime flower``, a
    :class:`~fedveil.runtime.flower.FlowerPlan` inside a Flower ServerApp."""
    if args.runtime != "flower":
        return work(network_plan(args))
    if args.supernodes < 1:
        raise ConfigError(f"--supernodes {args.supernodes} must be >= 1")
    try:
        from fedveil.runtime.flower import run_on_flower
    except ImportError as exc:
        raise ConfigError(f"--runtime flower needs Flower: pip install 'fedveil[flower]' ({exc})") from None
    from fedveil.experiments.agent_options import pool_from_command

    return run_on_flower(work, pool_from_command, supernodes=args.supernodes, wait_seconds=args.wait)
