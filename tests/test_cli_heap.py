"""The commands that train keep freed memory in their process's heap (``fedveil.core.heap``); the others
leave malloc as it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedveil import cli


@pytest.fixture
def retained(monkeypatch) -> list[bool]:
    calls: list[bool] = []
    monkeypatch.setattr(cli, "retain_freed_memory", lambda: calls.append(True) or True)
    return calls


def test_a_training_command_turns_heap_retention_on_before_it_runs(
    retained: list[bool], tmp_path: Path
) -> None:
    assert (
        cli.main(["run", str(tmp_path / "missing.yaml")]) == 2
    )  # refused after the setting, before training
    assert retained == [True]


def test_a_command_that_does_not_train_leaves_malloc_alone(retained: list[bool]) -> None:
    assert cli.main(["data", "info", "--json"]) == 0
    assert retained == []


def test_every_training_command_is_a_command() -> None:
    commands = cli.build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(commands) >= cli.TRAINING_COMMANDS
    assert {"run", "reproduce", "bench", "feduv", "aiot", "polifl", "ppfl", "attack"} <= cli.TRAINING_COMMANDS
