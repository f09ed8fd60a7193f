"""Registration and rejoining: only connected devices are selected, and devices registered again during a
run keep their place in their group."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from fedveil.core.communicator import ClientId, CommStats, Message
from fedveil.experiments.config import load_config
from fedveil.experiments.fdml.runner import build_trainer
from fedveil.protocols.common import connected_groups
from fedveil.protocols.registration import rejoin_groups
from test_experiments_runner import SMALL


class _Disconnected:
    """A simulation runtime whose ``hidden`` clients are not connected: they are not ``available()``, and
    addressing one fails the test."""

    def __init__(self, runtime: Any, hidden: set[ClientId]) -> None:
        self.runtime = runtime
        self.hidden = hidden

    def available(self) -> list[ClientId]:
        return [c for c in self.runtime.available() if c not in self.hidden]

    async def request(self, msgs: Mapping[ClientId, Message], **kwargs: Any) -> dict[ClientId, Message]:
        addressed = sorted(set(msgs) & self.hidden)
        assert not addressed, f"disconnected devices {addressed} were addressed"
        return await self.runtime.request(msgs, **kwargs)

    def stats(self) -> CommStats:
        return self.runtime.stats()


@pytest.mark.parametrize("protocol", ["fdml", "fedavg"])
def test_only_connected_devices_are_selected(toy_population: Any, protocol: str) -> None:
    cfg = load_config(None, [f"protocol={protocol}", "enclave.boundary=none", *SMALL])
    trainer = build_trainer(cfg, toy_population)
    ids = toy_population.train_user_ids()
    hidden = set(ids[::2])
    comm = _Disconnected(trainer.runtime, hidden)

    nobody = _Disconnected(trainer.runtime, set(ids))

    async def rounds() -> list[Any]:
        await trainer.server.register(trainer.runtime)
        return [await trainer.server.run_round(rnd, comm) for rnd in range(1, 7)] + [
            await trainer.server.run_round(7, nobody)
        ]

    try:
        *reports, last = asyncio.run(rounds())
    finally:
        trainer.close()
    assert all(r.applied for r in reports), "the connected devices train on"
    assert not last.applied and last.participants == 0, "nobody connected: a round not applied"


def test_connected_groups_keep_the_group_order() -> None:
    groups = {"A": ["a1", "a2", "a3"], "B": ["b1"]}
    assert connected_groups(groups, ["a3", "a1", "b2"]) == {"A": ["a1", "a3"]}
    assert connected_groups(groups, ["a1", "a2", "a3", "b1"]) == groups


def test_a_device_registered_again_keeps_its_place_moves_or_leaves() -> None:
    groups = {"A": ["a1", "a2", "a3"], "B": ["b1", "b2"]}
    # a2 is back in A, b1 now registers as A, b2 did not register again; a4 is new
    registered = {"A": ["a2", "b1", "a4"]}
    assert rejoin_groups(groups, registered, ["a2", "b1", "b2", "a4"]) == {
        "A": ["a1", "a2", "a3", "b1", "a4"]
    }
    assert rejoin_groups(groups, {}, []) == groups
