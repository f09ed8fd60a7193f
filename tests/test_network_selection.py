"""Connected-only selection in every protocol that samples devices on the FedAvg engine (FedUV, PPFL,
PoliFL, and through :class:`~fedveil.protocols.fedavg.ModelServer` AIoT and image FedAvg): a device that
is down (not in ``Communicator.available()``) is never in a round's selected set, and the round completes
with the devices that are connected."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from fedveil.core.communicator import ClientId, CommStats, Message
from fedveil.data.mnist_uv import MnistUvConfig, UvSplits, generate_mnist_uv
from fedveil.errors import ConfigError
from fedveil.experiments.fdml.runner import device_sessions
from fedveil.privacy.groups import GroupLedger
from fedveil.protocols.fedavg import select_connected
from fedveil.protocols.polifl import run_stage, stage_of, start_pair
from fedveil.protocols.ppfl import PpflClients, PpflServer
from fedveil.runtime.enclave_host import EnclaveHost
from fedveil.runtime.quoting import SimulatedPlatform
from fedveil.runtime.simulation import SimulationRuntime
from test_protocols_feduv import CFG, _setup
from test_protocols_polifl import _setup as polifl_setup
from test_protocols_ppfl import SMALL, _data, _model


class _Down:
    """A runtime whose devices in ``down`` are not connected: they are not ``available()``, and a request
    addressed to one reaches only the connected devices (the one addressed is a dropout, as on the network).
    ``addressed`` records, per phase, every device a request was addressed to."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.down: set[ClientId] = set()
        self.addressed: dict[str, set[ClientId]] = {}

    def available(self) -> list[ClientId]:
        return [c for c in self.runtime.available() if c not in self.down]

    async def request(
        self, msgs: Mapping[ClientId, Message], *, phase: str, min_replies: int, **kwargs: Any
    ) -> dict[ClientId, Message]:
        self.addressed.setdefault(phase, set()).update(msgs)
        up = {c: m for c, m in msgs.items() if c not in self.down}
        return await self.runtime.request(up, phase=phase, min_replies=min(min_replies, len(up)), **kwargs)

    def stats(self) -> CommStats:
        return self.runtime.stats()


@pytest.fixture(scope="module")
def uv_data() -> UvSplits:
    return generate_mnist_uv(
        MnistUvConfig(
            seed=3, writers=6, train=4, val=2, test=2, unseen_writers=2, sub_images_per_digit=(2, 2, 2)
        )
    )


def test_selection_draws_only_connected_members_and_nobody_connected_is_an_empty_cohort() -> None:
    rng = np.random.default_rng(0)
    members = ["a", "b", "c", "d"]
    for _ in range(20):
        assert set(select_connected(members, ["d", "b", "x"], 2, rng)) == {"b", "d"}
    assert select_connected(members, ["c"], 3, rng) == ["c"]
    assert select_connected(members, [], 3, rng) == []
    with pytest.raises(ConfigError, match="no clients to select from"):
        select_connected([], ["a"], 3, rng)


@pytest.mark.parametrize("method", ["feduv", "softmax"])
def test_feduv_selects_only_connected_users(uv_data: Any, method: str) -> None:
    server, runtime, _ = _setup(uv_data, method)
    comm = _Down(runtime)
    comm.down = set(server.members[::2])
    kappa = CFG.cohort_size(len(server.members))

    async def rounds() -> list[Any]:
        return [await server.run_round(rnd, comm) for rnd in range(1, 5)]

    reports = asyncio.run(rounds())
    assert not comm.addressed["train"] & comm.down, "a device that is down was selected"
    connected = len(server.members) - len(comm.down)
    assert all(r.applied and r.gradients == min(kappa, connected) for r in reports)
    assert all(not r.dropouts for r in reports), "no round loses a selected device to a dropout"


def test_ppfl_selects_only_connected_devices() -> None:
    data = _data()
    model = _model()
    platform = SimulatedPlatform.generate()
    host = EnclaveHost.start(None, platform=platform, boundary="inprocess")
    pool = PpflClients(
        model,
        data,
        optimizer=SMALL.optimizer(),
        seed=0,
        block_size=SMALL.block_size,
        sessions=device_sessions(data.user_ids, platform.public_key, host.measurement),
        tee_bytes={c: 64 * 2**20 for c in data.user_ids},
        evaluators=["eval"],
    )
    comm = _Down(SimulationRuntime(pool, rng=np.random.default_rng(1)))
    server = PpflServer(model, SMALL, host, np.random.default_rng(2))

    async def go() -> None:
        await server.setup(comm)
        comm.down = {"c1", "c3"}
        await server.train(comm)

    try:
        asyncio.run(go())
    finally:
        host.close()
    assert not comm.addressed["train"] & comm.down, "a device that is down was selected"
    lines = [line for r in server.reports for line in r.rounds]
    assert len(lines) == 3 * SMALL.rounds_per_stage
    assert all(line["applied"] and line["clients"] == 2 and not line["dropouts"] for line in lines)


def test_polifl_selects_only_connected_devices_when_one_goes_down_mid_stage() -> None:
    _, runtime, server, group, flat = polifl_setup(
        ("get_data(data_type='MPU')", "filter(sensors=['mic','loc'])")
    )
    comm = _Down(runtime)
    gone = group.members[0]

    def after(rnd: int, report: Any) -> None:
        comm.down = {gone}

    result = asyncio.run(
        run_stage(
            stage_of([group], 4),
            job="t",
            model=start_pair(flat.initial()),
            server=server,
            comm=comm,
            ledger=GroupLedger(["nomic"], delta=1e-5),
            clip_norm=1.0,
            dp_mode="central",
            rng=np.random.default_rng(3),
            on_round=after,
        )
    )
    assert gone in comm.addressed["job"], "the device was up when the job started"
    first, *later = result.reports
    assert first.participants == 3
    assert all(r.applied and r.participants == 2 and not r.dropouts for r in later)
