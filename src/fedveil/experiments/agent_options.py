"""The device-agent commands (``fedveil agent``, ``fedveil feduv agent``): their arguments, and the client
pool a command describes.

The servers describe their devices by a device-agent command line: local agent processes run it, and a
Flower ClientApp (:mod:`fedveil.runtime.flower`) parses it, without running it, to build the same
clients in its own process (:func:`pool_from_command`). The command line and the ClientApp read the same
argument definitions, here (argparse only: the CLI builds its parsers without importing torch).
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedveil.errors import ConfigError

__all__ = [
    "AGENT_COMMANDS",
    "add_agent_arguments",
    "add_feduv_agent_arguments",
    "parse_agent_command",
    "pool_from_command",
]

AGENT_COMMANDS = (("agent",), ("feduv", "agent"))
"""The device-agent commands: the ones that describe clients."""


def _add_connection_arguments(p: argparse.ArgumentParser, *, device: str, shard: str) -> None:
    """What every device agent needs to reach its server: ``--server``, the devices it runs (``--device``
    or ``--shard``, with these help texts), ``--credentials`` or ``--insecure``, ``--give-up-after``."""
    p.add_argument("--server", required=True, help="the server's HOST:PORT")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--device", action="append", default=[], help=device)
    who.add_argument("--shard", default=None, help=shard)
    p.add_argument(
        "--credentials", type=Path, default=None, help="DIR/<device>/{device.crt,device.key,ca.crt}"
    )
    p.add_argument("--insecure", action="store_true", help="plaintext, unauthenticated (not for real use)")
    p.add_argument(
        "--give-up-after", type=float, default=None, help="exit after this many seconds without a server"
    )


def add_agent_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``fedveil agent`` (FDML and FL-traditional devices of an experiment config)."""
    p.add_argument("--config", type=Path, required=True, help="the experiment YAML the server runs")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    _add_connection_arguments(
        p,
        device="a device id to run (repeatable)",
        shard="I/N: every N-th device of the population from I",
    )
    p.add_argument(
        "--platform-key", type=Path, default=None, help="the emulated TEE platform's public key file"
    )
    p.add_argument("--server-name", default=None, help="TLS name to expect in the server certificate")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")


def add_feduv_agent_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``fedveil feduv agent`` (users of a FedUV run)."""
    p.add_argument("--config", type=Path, required=True, help="the run's config (its config.json)")
    p.add_argument("--method", choices=("feduv", "fedaws", "softmax"), required=True)
    p.add_argument("--code-length", type=int, default=None, help="FedUV's code length c")
    _add_connection_arguments(p, device="a user id to run (repeatable)", shard="I/N: every N-th user from I")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--train-device",
        default=None,
        help="where these users train: auto (CUDA when available), cpu, cuda or cuda:N (default: the run's "
        "device; a device this machine lacks is refused before the agent dials the server)",
    )


def parse_agent_command(command: Sequence[str]) -> argparse.Namespace:
    """The arguments of the device-agent ``command`` (e.g. ``["agent", "--config", "c.yaml"]``), as the
    command line reads them; the server address it is given here is a placeholder (``flower:0``)."""
    command = [str(c) for c in command]
    if not any(command[: len(c)] == list(c) for c in AGENT_COMMANDS):
        known = ", ".join(" ".join(c) for c in AGENT_COMMANDS)
        raise ConfigError(f"{command[:2]} is not a device-agent command ({known})")
    parser = argparse.ArgumentParser(prog="fedveil", exit_on_error=False)
    commands = parser.add_subparsers(dest="command", required=True)
    add_agent_arguments(commands.add_parser("agent", exit_on_error=False))
    feduv = commands.add_parser("feduv", exit_on_error=False)
    add_feduv_agent_arguments(
        feduv.add_subparsers(dest="action", required=True).add_parser("agent", exit_on_error=False)
    )
    try:
        return parser.parse_args([*command, "--server", "flower:0", "--insecure"])
    except (argparse.ArgumentError, SystemExit):
        raise ConfigError(f"bad device-agent command {shlex.join(command)!r}") from None


def pool_from_command(command: Sequence[str]) -> Any:
    """The client pool (every client of the population) that the device-agent ``command`` describes,
    built as that agent would build it, with its torch threads."""
    import torch

    args = parse_agent_command(command)
    torch.set_num_threads(max(1, args.threads))
    if args.command == "agent":
        from fedveil.experiments.config import load_config
        from fedveil.experiments.fdml.agent import agent_pool

        cfg = load_config(args.config, args.overrides)
        key = args.platform_key.read_bytes() if args.platform_key else None
        return agent_pool(cfg, platform_public_key=key)[0]
    from fedveil.experiments.feduv.runner import agent_clients

    return agent_clients(args.config, args.method, args.code_length, device=args.train_device)
