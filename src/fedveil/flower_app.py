"""The Flower App of ``packaging/flower-app`` (``flwr run``; ``docs/flower.md``).

Its ServerApp (:data:`server_app`) runs the fedveil command line given as the run config's ``argv``
(e.g. ``"run configs/table1_fl_lr0.1.yaml --set rounds=3"``) on the run's grid; its ClientApp
(:data:`client_app`) hosts the clients each ``hello``'s device-agent command describes
(:func:`fedveil.experiments.agent_options.pool_from_command`). The runtime they ride on is
:mod:`fedveil.runtime.flower`; this module sits above the command line, which it runs.
"""

from __future__ import annotations

import shlex

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedveil.cli import main
from fedveil.errors import ConfigError
from fedveil.experiments.agent_options import pool_from_command
from fedveil.runtime.flower import client_app_for, serving

__all__ = ["client_app", "server_app"]

server_app = ServerApp()
"""The ServerApp: runs the fedveil command line in the run config's ``argv`` on this run's grid."""

client_app = client_app_for(pool_from_command)
"""The ClientApp hosting fedveil's clients (:mod:`fedveil.runtime.flower`)."""


@server_app.main()
def _serve_app(grid: Grid, context: Context) -> None:
    argv = context.run_config.get("argv")
    if not isinstance(argv, str) or not argv.strip():
        raise ConfigError(
            'the Flower run config needs argv, the fedveil command to run, e.g. argv = "run CONFIG.yaml"'
        )
    args = shlex.split(argv)
    if args[:1] not in (["run"], ["feduv"]):
        raise ConfigError(f"argv {argv!r} must be a `fedveil run` or `fedveil feduv run` command line")
    try:
        with serving(grid):
            status = main([*args, "--runtime", "flower"])
    except SystemExit as exc:  # argparse's verdict on a bad command line (its message is on stderr)
        status = exc.code if isinstance(exc.code, int) else 2
    if status:
        raise ConfigError(f"`fedveil {argv}` exited with status {status}")
