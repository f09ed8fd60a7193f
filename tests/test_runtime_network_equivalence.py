"""The same protocol code over the network gives the same model as in simulation (loopback, mutual TLS).

With no faults the network runtime delivers every request and returns the replies in the order the
devices were addressed, as the simulation does when every reply has the same latency (a sampled latency
reorders the simulation's replies, and step 5 stacks embeddings in reply order), and the devices run the
same client pools with the same seeds, so FDML (through the emulated TEE) and FedUV end bit-identical
when the client work is one device at a time. With batched client work the agent batches whatever
requests wait together within its batch window; a grouping other than the simulation's (the cohort at
once) sums float32 in another order, which Adam amplifies past 1e-5 in three rounds. Here the window is
long enough for each phase's requests to form one batch, and the models are bit-identical again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedveil.data.mnist_uv import MnistUvConfig, generate_mnist_uv
from fedveil.enclave.measure import measure_enclave
from fedveil.experiments.config import load_config
from fedveil.experiments.fdml.runner import build_clients, build_trainer, device_sessions, enclave_config
from fedveil.protocols.feduv import FedUVMethod, FedUVServer, UvClients, UvModel
from fedveil.runtime.network import certs
from fedveil.runtime.network.agent import AgentHost
from fedveil.runtime.network.server import NetworkRuntime
from fedveil.runtime.quoting import SimulatedPlatform
from fedveil.runtime.simulation import SimulationRuntime
from test_experiments_runner import SMALL as RUNNER_SMALL
from test_protocols_feduv import CFG, CODE_LENGTH, TinyNet

SMALL = [
    *RUNNER_SMALL,
    "enclave.boundary=inprocess",
    # no faults, and every reply arriving at once: the simulation then keeps the addressed order too
    "faults.embed.latency.kind=constant",
    "faults.grad.latency.kind=constant",
    "faults.train.latency.kind=constant",
]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    certs.init_pki(root)
    return root


async def _over_network(pki: Path, pool: Any, ids: list[str], work: Any, window: float | None = None) -> Any:
    runtime = NetworkRuntime("127.0.0.1:0", pki=pki, heartbeat_seconds=1.0)
    port = await runtime.start()
    host = AgentHost(
        f"127.0.0.1:{port}",
        {d: certs.issue_device(pki, d) for d in ids},
        pool,
        give_up_after=10,
        seed=0,
        worker_init=lambda: torch.set_num_threads(1),
    )
    if window is not None:
        host.batch_window = window
    agents = asyncio.create_task(host.run())
    try:
        assert await runtime.wait_for_devices(ids, 20) == sorted(ids)
        return await asyncio.wait_for(work(runtime), 120)
    finally:
        await runtime.close()
        assert set((await agents).values()) == {"finished"}


def _fdml_rounds(trainer: Any, rounds: int) -> Any:
    async def work(comm: Any) -> np.ndarray:
        await trainer.server.register(comm)
        for rnd in range(1, rounds + 1):
            report = await trainer.server.run_round(rnd, comm)
            assert report.applied
        return trainer.server.weights

    return work


@pytest.mark.parametrize(("protocol", "batched"), [("fdml", False), ("fdml", True), ("fedavg", False)])
def test_fdml_and_fedavg_over_the_network_equal_the_simulation(
    pki: Path, toy_population: Any, protocol: str, batched: bool
) -> None:
    cfg = load_config(None, [f"protocol={protocol}", f"runtime.batched={str(batched).lower()}", *SMALL])
    sim = build_trainer(cfg, toy_population)
    try:
        expected = asyncio.run(_fdml_rounds(sim, 3)(sim.runtime))
    finally:
        sim.close()

    platform = SimulatedPlatform.generate()
    net = build_trainer(cfg, toy_population, runtime=object(), platform=platform)
    ids = toy_population.train_user_ids()
    sessions = None
    if protocol == "fdml":
        measurement = measure_enclave(enclave_config(cfg, None, dp_seed=None)).digest
        sessions = device_sessions(ids, platform.public_key, measurement)
    pool = build_clients(cfg, toy_population, sessions=sessions)
    try:
        got = asyncio.run(_over_network(pki, pool, ids, _fdml_rounds(net, 3), 0.5 if batched else None))
    finally:
        net.close()
    assert not np.array_equal(got, build_trainer(cfg, toy_population).server.weights), (
        "training moved nothing"
    )
    np.testing.assert_array_equal(got, expected)


def test_feduv_over_the_network_equals_the_simulation(pki: Path) -> None:
    data = generate_mnist_uv(
        MnistUvConfig(
            seed=7, writers=6, train=5, val=4, test=3, unseen_writers=3, sub_images_per_digit=(2, 2, 2)
        )
    )

    def make() -> tuple[FedUVServer, UvClients]:
        torch.manual_seed(0)
        model = UvModel(TinyNet(CODE_LENGTH))
        server = FedUVServer(CFG, model, np.random.default_rng(1), code_length=CODE_LENGTH)
        return server, UvClients(FedUVMethod(), model, data, seed=5, batched=False)

    def rounds(server: FedUVServer) -> Any:
        async def work(comm: Any) -> np.ndarray:
            await server.setup(comm)
            for rnd in range(1, 4):
                await server.run_round(rnd, comm)
            return server.weights

        return work

    server, pool = make()
    expected = asyncio.run(rounds(server)(SimulationRuntime(pool, rng=np.random.default_rng(2))))
    server, pool = make()
    got = asyncio.run(_over_network(pki, pool, pool.client_ids(), rounds(server)))
    np.testing.assert_array_equal(got, expected)
