"""The simulation with its clients sharded over Ray actors (a local cluster of 2 CPUs): the same model as
in-process for FDML (through the emulated TEE) and FedAvg, an actor that dies is a dropout and the run
goes on, a cluster address that does not answer is refused in bounded time, and ``fedveil run --runtime
ray`` works end to end."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedveil.errors import ConfigError
from fedveil.experiments.config import effective_overrides, load_config
from fedveil.experiments.fdml.runner import RayPlan, build_population, build_trainer
from fedveil.runtime.ray import connect
from test_experiments_runner import SMALL as RUNNER_SMALL

ray = pytest.importorskip(
    "ray", reason="the Ray runtime is the fedveil[ray] extra (installed by scripts/bootstrap)"
)

SMALL = [
    *RUNNER_SMALL,
    "enclave.boundary=inprocess",
    "runtime.batched=false",
    "faults.embed.latency.kind=constant",
    "faults.grad.latency.kind=constant",
    "faults.train.latency.kind=constant",
]


@pytest.fixture(scope="module", autouse=True)
def cluster():
    connect(None, num_cpus=2)
    yield
    ray.shutdown()


def _rounds(trainer: Any, rounds: int) -> np.ndarray:
    async def work() -> np.ndarray:
        if hasattr(trainer.server, "register"):
            await trainer.server.register(trainer.runtime)
        for rnd in range(1, rounds + 1):
            await trainer.server.run_round(rnd, trainer.runtime)
        return trainer.server.weights

    try:
        return asyncio.run(work())
    finally:
        trainer.close()


@pytest.mark.parametrize("protocol", ["fdml", "fedavg"])
def test_ray_gives_the_in_process_model_bit_for_bit(protocol: str) -> None:
    cfg = load_config(None, [f"protocol={protocol}", *SMALL])
    population = build_population(cfg)
    expected = _rounds(build_trainer(cfg, population), 3)
    on_ray = build_trainer(cfg, population, ray=RayPlan(actors=2))
    assert on_ray.pool.actors == 2
    got = _rounds(on_ray, 3)
    assert not np.array_equal(got, build_trainer(cfg, population).server.weights), "training moved nothing"
    np.testing.assert_array_equal(got, expected)
    stats = on_ray.runtime.stats()
    assert stats.bytes_up > 0 and stats.bytes_down > 0 and not stats.dropouts


def test_an_actor_that_dies_is_a_dropout_and_the_run_goes_on() -> None:
    cfg = load_config(None, ["protocol=fedavg", *SMALL])
    trainer = build_trainer(cfg, build_population(cfg), ray=RayPlan(actors=2))
    stats = trainer.runtime.stats()

    async def work() -> int:
        await trainer.server.register(trainer.runtime)
        await trainer.server.run_round(1, trainer.runtime)
        trainer.pool.kill_actor(0)
        await trainer.server.run_round(2, trainer.runtime)
        for rnd in range(3, 30):  # Ray restarts the actor, rebuilt from the factory, and it serves again
            before = len(stats.dropouts)
            report = await trainer.server.run_round(rnd, trainer.runtime)
            if len(stats.dropouts) == before and report.applied:
                return rnd
            await asyncio.sleep(0.5)
        raise AssertionError("the killed actor never served again")

    try:
        asyncio.run(work())
    finally:
        trainer.close()
    lost = [d for d in stats.dropouts if "Ray actor 0 failed" in d.reason]
    assert lost and {d.client for d in lost} <= set(trainer.pool.client_ids()[0::2])


def test_a_ray_address_that_does_not_answer_is_refused_quickly() -> None:
    from fedveil.runtime.ray import check_address

    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"no Ray cluster answers at 127\.0\.0\.1:9"):
        check_address("127.0.0.1:9", timeout=2.0)
    assert time.monotonic() - started < 5
    with pytest.raises(ConfigError, match="is not HOST:PORT"):
        check_address("nowhere", timeout=2.0)


def test_fedveil_run_on_ray(tmp_path: Path) -> None:
    ray.shutdown()  # the command starts its own local cluster
    try:
        items = ["protocol=fdml", "rounds=2", "eval.every=2", "name=r"]
        items += [kv for kv in SMALL if "latency" not in kv]
        args = [x for kv in effective_overrides(_config()[0], items) for x in ("--set", kv)]
        command = [sys.executable, "-m", "fedveil", "run", *_config(), "--runtime", "ray", "--actors", "2"]
        result = subprocess.run(
            [*command, "--out", str(tmp_path), "--no-progress", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        results = json.loads((tmp_path / "results.json").read_text())
        assert results["runtime"] == "ray" and results["rounds"] == 2
    finally:
        connect(None, num_cpus=2)


def _config() -> list[str]:
    return [str(Path(__file__).resolve().parents[1] / "configs" / "table1_fdml.yaml")]
