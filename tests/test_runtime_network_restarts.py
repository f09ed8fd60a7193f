"""Restarts over the network, with real processes on loopback: a server SIGKILLed and resumed ends with the
uninterrupted run's model; an agent SIGKILLed and restarted has its devices attested afresh and back in
the rounds, and none of its devices is selected while it is down (every process is bounded in time and
killed on exit)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedveil.experiments.checkpoint import CRASH_ENV, load_checkpoint
from fedveil.experiments.config import load_config
from fedveil.experiments.fdml.agent import build_agent
from fedveil.experiments.fdml.runner import build_population, build_trainer
from fedveil.protocols.fdml import EmbedRequest
from fedveil.runtime.network import certs
from fedveil.runtime.network.agent import RoundSeededPool
from fedveil.runtime.network.server import NetworkRuntime
from fedveil.runtime.quoting import PLATFORM_PUB, platform_for
from test_runtime_network_processes import _free_port, _rounds, _wait_for

ROUNDS = 10
CONFIG = f"""\
name: net-restarts
protocol: fdml
seed: 5
rounds: {ROUNDS}
data:
  train_users_per_model: [4, 4]
  test_users_per_model: [11, 11]
fdml:
  num_required: 3
  samples_per_client: 4
  lr: 3.0e-3
  t_embed: 10
  t_grad: 10
  max_attempts: 3
  min_gradients: 2
enclave:
  boundary: inprocess
runtime:
  batched: false
  threads: 1
"""


class _Deployment:
    """A PKI, device credentials and the processes of one test (all killed at the end)."""

    def __init__(self, tmp: Path, config: str) -> None:
        self.tmp = tmp
        self.cfg_path = tmp / "net.yaml"
        self.cfg_path.write_text(config)
        self.cfg = load_config(self.cfg_path)
        self.population = build_population(self.cfg)
        self.ids = self.population.train_user_ids()
        self.pki = tmp / "pki"
        certs.init_pki(self.pki)
        platform_for(self.pki)
        self.creds = tmp / "creds"
        for name in self.ids:
            certs.issue_device(self.pki, name).write(self.creds / name)
        self.port = _free_port()
        self.run = tmp / "run"
        self.procs: list[subprocess.Popen] = []
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
        }
        self.logs = 0

    def _start(self, cmd: list[str], log: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        self.logs += 1
        with open(self.tmp / f"{log}-{self.logs}.log", "wb") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**self.env, **(env or {})})
        self.procs.append(proc)
        return proc

    def server(self, *extra: str, crash_at: str | None = None) -> subprocess.Popen:
        """``fedveil server`` of this deployment; ``crash_at`` (``POINT:ROUND``) makes it SIGKILL itself
        there (:func:`fedveil.experiments.checkpoint.crash_point`)."""
        return self._start(
            [
                sys.executable, "-m", "fedveil", "server", str(self.cfg_path), "--pki", str(self.pki),
                "--listen", f"127.0.0.1:{self.port}", "--out", str(self.run), "--wait", "60", *extra,
            ],
            "server",
            {CRASH_ENV: crash_at} if crash_at else None,
        )  # fmt: skip

    def agent(self, shard: str) -> subprocess.Popen:
        return self._start(
            [
                sys.executable, "-m", "fedveil", "agent", "--server", f"127.0.0.1:{self.port}",
                "--config", str(self.cfg_path), "--shard", shard, "--credentials", str(self.creds),
                "--platform-key", str(self.pki / PLATFORM_PUB), "--give-up-after", "60",
            ],
            "agent",
        )  # fmt: skip

    def kill(self, proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        self.procs.remove(proc)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.fixture
def deployment(tmp_path: Path) -> Any:
    """The test's deployment of :data:`CONFIG`; its processes are killed when the test ends."""
    dep = _Deployment(tmp_path, CONFIG)
    try:
        yield dep
    finally:
        dep.close()


async def _uninterrupted(dep: _Deployment) -> np.ndarray:
    """The same config over the network with nothing killed, server and agent in this process."""
    runtime = NetworkRuntime("127.0.0.1:0", pki=dep.pki)
    trainer = build_trainer(dep.cfg, dep.population, runtime=runtime, platform=platform_for(dep.pki))
    try:
        port = await runtime.start()
        host = build_agent(
            dep.cfg,
            f"127.0.0.1:{port}",
            credentials=dep.creds,
            platform_public_key=(dep.pki / PLATFORM_PUB).read_bytes(),
            population=dep.population,
            give_up_after=20,
        )
        agents = asyncio.create_task(host.run())
        try:
            assert await runtime.wait_for_devices(dep.ids, 20) == sorted(dep.ids)
            await trainer.server.register(runtime)
            for rnd in range(1, ROUNDS + 1):
                assert (await trainer.server.run_round(rnd, runtime)).applied
            return trainer.server.weights
        finally:
            await runtime.close()
            assert set((await agents).values()) == {"finished"}
    finally:
        trainer.close()


def test_a_server_killed_at_two_points_and_resumed_ends_with_the_uninterrupted_model(
    deployment: _Deployment,
) -> None:
    """The server is SIGKILLed twice and resumed each time. First between round 2's metrics line and its
    checkpoint, the agents kept (they have drawn for a round the checkpoint does not hold). Then
    mid-round: one agent paused, so the server waits for uploads its devices may already have drawn
    samples for; that agent is kept, the other is killed too and started afresh (it has drawn nothing).
    Each round's draws come from that round's seed, so none of this changes the model."""
    dep = deployment
    server = dep.server(crash_at="metrics:2")
    kept = dep.agent("0/2")
    other = dep.agent("1/2")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = asyncio.run(_uninterrupted(dep))  # while the processes start
    finally:
        torch.set_num_threads(threads)

    assert server.wait(120) == -signal.SIGKILL, "the server kills itself after round 2's metrics line"
    dep.procs.remove(server)
    server = dep.server("--resume")
    _wait_for(lambda: len(_rounds(dep.run)) >= 4, 120, "four rounds", dep.procs)
    kept.send_signal(signal.SIGSTOP)  # the server now waits for this agent's replies in a round
    try:
        time.sleep(0.3)
        dep.kill(server)
        dep.kill(other)
    finally:
        kept.send_signal(signal.SIGCONT)
    killed_at = len(_rounds(dep.run))
    assert killed_at < ROUNDS, "the run must still be going when the server is killed"
    server = dep.server("--resume")
    other = dep.agent("1/2")
    assert server.wait(120) == 0
    for agent in (kept, other):
        assert agent.wait(60) == 0, "agents exit when the server says training is over"

    rounds = _rounds(dep.run)
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1)), "every round exactly once"
    assert all(r["applied"] and r["dropouts"] == 0 for r in rounds)
    ckpt = load_checkpoint(dep.run)
    assert ckpt is not None and ckpt.round == ROUNDS
    assert not np.array_equal(expected, build_trainer(dep.cfg, dep.population).server.weights)
    np.testing.assert_array_equal(ckpt.arrays["weights"], expected)
    results = json.loads((dep.run / "results.json").read_text())
    assert results["resumed_after_round"] >= killed_at - 1


def _devices_per_round(run: Path) -> dict[int, set[str]]:
    path = run / "devices.jsonl"
    out: dict[int, set[str]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            out[obj["round"]] = {d["client"] for d in obj["devices"]}
    return out


def test_a_restarted_agent_is_attested_afresh_and_its_devices_are_not_selected_while_it_is_down(
    tmp_path: Path,
) -> None:
    """Two agents; one is SIGKILLed: the rounds that follow select among the other's devices only (no
    dropouts); restarted, its devices register, attest the enclave on new sessions and train again."""
    dep = _Deployment(tmp_path, CONFIG.replace(f"rounds: {ROUNDS}", "rounds: 100000"))
    mine = set(dep.ids[1::2])  # shard 1/2
    try:
        dep.server()
        dep.agent("0/2")
        agent = dep.agent("1/2")
        _wait_for(lambda: len(_rounds(dep.run)) >= 3, 120, "three rounds", dep.procs)
        dep.kill(agent)
        killed_at = len(_rounds(dep.run))
        _wait_for(
            lambda: len(_rounds(dep.run)) >= killed_at + 8, 120, "rounds while the agent is down", dep.procs
        )
        down = [r for r in _rounds(dep.run) if r["round"] > killed_at + 2]
        seen = _devices_per_round(dep.run)
        assert all(r["dropouts"] == 0 and r["applied"] for r in down), "a disconnected device is not selected"
        assert not any(seen.get(r["round"], set()) & mine for r in down)

        dep.agent("1/2")
        restarted_at = len(_rounds(dep.run))

        def back() -> bool:
            rounds = _devices_per_round(dep.run)
            return sum(1 for r, who in rounds.items() if r > restarted_at and who & mine) >= 3

        _wait_for(back, 120, "the restarted agent's devices back in three rounds", dep.procs)
        rounds = _rounds(dep.run)
        seen = _devices_per_round(dep.run)
        first_back = min(r for r, who in seen.items() if r > restarted_at and who & mine)
        after = [r for r in rounds if r["round"] >= first_back]
        assert all(r["dropouts"] == 0 and r["applied"] for r in after), "its sealed replies are accepted"
        assert any(r["enclave_rejected"] == 0 and r["gradients"] >= 2 for r in after)
        assert "admitting" in (tmp_path / "server-1.log").read_text(), "the server says whom it admits"
    finally:
        dep.close()


def test_round_seeded_devices_draw_the_same_for_a_round_whatever_came_before(toy_population: Any) -> None:
    """What a device draws for a round depends on the run's seed, the device and the round (and attempt)
    only: not on the rounds it was asked for before, nor on the pool being a fresh one."""
    from fedveil.experiments.fdml.runner import build_clients

    cfg = load_config(None, ["protocol=fdml", "runtime.batched=false", "fdml.samples_per_client=4"])
    cid = toy_population.train_user_ids()[0]

    def embed(pool: Any, rnd: int, attempt: int = 1) -> np.ndarray:
        return pool.handle_batch({cid: EmbedRequest(rnd, attempt, 4, weights)})[cid].embeddings

    fresh = RoundSeededPool(build_clients(cfg, toy_population), cfg.seed)
    used = RoundSeededPool(build_clients(cfg, toy_population), cfg.seed)
    weights = fresh.pool.flat.initial()
    for rnd in (1, 2, 3, 5):
        embed(used, rnd)
    np.testing.assert_array_equal(embed(used, 4), embed(fresh, 4))
    np.testing.assert_array_equal(embed(used, 4), embed(used, 4))
    assert not np.array_equal(embed(fresh, 4), embed(fresh, 4, attempt=2))
    assert not np.array_equal(embed(fresh, 4), embed(fresh, 6))
