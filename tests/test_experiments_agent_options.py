"""A device-agent command line means the same to the ``fedveil`` command and to a Flower ClientApp,
which parses it without running it (:mod:`fedveil.experiments.agent_options`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedveil.cli import build_parser
from fedveil.errors import ConfigError
from fedveil.experiments.agent_options import parse_agent_command

COMMANDS = [
    ["agent", "--config", "c.yaml", "--set", "rounds=3", "--platform-key", "k.pub", "--threads", "2"],
    ["agent", "--config", "c.yaml", "--shard", "1/4", "--give-up-after", "5"],
    ["feduv", "agent", "--config", "run/config.json", "--method", "feduv", "--code-length", "127"],
    [
        "feduv",
        "agent",
        "--config",
        "run/config.json",
        "--method",
        "softmax",
        "--device",
        "u1",
        "--device",
        "u2",
    ],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:3]))
def test_the_client_app_reads_a_command_as_the_command_line_does(command: list[str]) -> None:
    args = vars(parse_agent_command(command))
    cli = vars(build_parser().parse_args([*command, "--server", "flower:0", "--insecure"]))
    assert args["config"] == Path(command[command.index("--config") + 1])
    assert args == {k: v for k, v in cli.items() if k in args}
    assert set(cli) - set(args) <= {"func"}


def test_what_is_not_a_device_agent_command_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"\['serve', '--demo'\] is not a device-agent command \(agent, "):
        parse_agent_command(["serve", "--demo"])
    with pytest.raises(ConfigError, match="bad device-agent command 'agent --nope'"):
        parse_agent_command(["agent", "--nope"])
    with pytest.raises(ConfigError, match=r"bad device-agent command 'feduv agent --config c\.json'"):
        parse_agent_command(["feduv", "agent", "--config", "c.json"])  # no --method
