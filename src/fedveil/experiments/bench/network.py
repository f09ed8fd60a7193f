"""``fedveil bench network``: many device agents on loopback, FedAvg rounds of a ~1 MB model, every agent
selected.

The server is a :class:`~fedveil.runtime.network.server.NetworkRuntime` with mutual TLS (a throw-away
PKI, one certificate per device); the devices are spread over at most ``processes`` agent processes, each
device on its own TLS connection. A round broadcasts the global weights (``BenchWeights``), each device
returns its update (the weights plus a small seeded step) and the server folds each into a running
:class:`fedveil.core.aggregation.FedAvgSum` as it arrives (``Communicator.request``'s ``fold``), so it holds
no update beyond the one being added. TTE is *simulated*, as PoliFL Sec. 5.4 does: devices
do no training, and ``tte_mean`` (default 0) adds a replayed on-device time. The same rounds run in the
in-process simulation for comparison. Reported: agents, rounds, lost updates, per-phase latency
percentiles (TTD, TTE, TTR, TTP), the per-round wall time and server-side overhead (wall time minus the
slowest device's TTE), the server process's CPU seconds per round (on one machine the agents compete with
the server for the same cores, so this says what the server itself costs), server peak RSS (taken before
the simulation part runs; ``fedveil bench`` keeps freed memory in the server process's heap,
:func:`fedveil.core.heap.retain_freed_memory`, so each round reuses the last round's pages), and the
simulation's per-round time.
"""

from __future__ import annotations

import asyncio
import os
import resource
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedveil.core.aggregation import FedAvgSum
from fedveil.core.messages import array_field, message
from fedveil.errors import ConfigError
from fedveil.experiments.loopback import agent_processes, percentiles, throwaway_pki, wait_connected
from fedveil.runtime.network import certs
from fedveil.runtime.network.agent import AgentHost
from fedveil.runtime.network.server import NetworkRuntime
from fedveil.runtime.simulation import LatencyModel, SimulationRuntime
from fedveil.runtime.threads import thread_settings


@message("bench.net.weights")
@dataclass(frozen=True)
class BenchWeights:
    """The global model of a benchmark round (flat float32)."""

    round: int
    weights: np.ndarray = array_field(dtype="float32", ndim=1, finite=True)


@message("bench.net.update")
@dataclass(frozen=True)
class BenchUpdate:
    """A device's returned model and its sample count."""

    round: int
    num_samples: int
    weights: np.ndarray = array_field(dtype="float32", ndim=1, finite=True)


class BenchPool:
    """Devices that return the weights moved by a small seeded step (no training: TTE is simulated)."""

    def __init__(self, ids: list[str], seed: int = 0) -> None:
        self.ids = ids
        self.rng = np.random.default_rng(seed)

    def client_ids(self) -> list[str]:
        """Every device of the benchmark."""
        return self.ids

    def handle_batch(self, msgs: Mapping[str, object]) -> dict[str, object]:
        """One update per addressed device."""
        out: dict[str, object] = {}
        for cid, m in msgs.items():
            assert isinstance(m, BenchWeights)
            step = np.float32(self.rng.normal(0, 1e-3))
            out[cid] = BenchUpdate(m.round, 50, m.weights + step)
        return out


def device_names(n: int) -> list[str]:
    """``dev-00000`` ... for ``n`` devices."""
    return [f"dev-{i:05d}" for i in range(n)]


async def _rounds(
    comm: Any, ids: list[str], weights: np.ndarray, rounds: int, timeout: float
) -> dict[str, Any]:
    walls, lost, tte_max = [], 0, []
    for rnd in range(1, rounds + 1):
        t0 = time.perf_counter()
        msg = BenchWeights(rnd, weights)
        total = FedAvgSum(weights.shape)

        def fold(cid: str, update: BenchUpdate, total: FedAvgSum = total) -> int:
            total.add(cid, update.weights, update.num_samples)
            return update.num_samples

        replies = await comm.request(
            {c: msg for c in ids},
            phase="train",
            min_replies=len(ids),
            timeout=timeout,
            expected=BenchUpdate,
            fold=fold,
        )
        weights = total.result()
        walls.append(time.perf_counter() - t0)
        lost += len(ids) - len(replies)
        ttes = [t.tte for t in comm.stats().timings[-len(replies) :] if t.tte is not None] if replies else []
        tte_max.append(max(ttes) if ttes else 0.0)
    return {"walls": walls, "lost": lost, "tte_max": tte_max}


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def bench_network(
    *,
    agents: int = 1000,
    rounds: int = 3,
    processes: int = 8,
    model_bytes: int = 2**20,
    tte_mean: float = 0.0,
    timeout: float = 120.0,
    connect_timeout: float = 300.0,
    workdir: str | Path | None = None,
) -> dict[str, Any]:
    """Run the benchmark (module docstring) and return its figures."""
    if agents < 1 or rounds < 1 or processes < 1:
        raise ConfigError(f"agents {agents}, rounds {rounds} and processes {processes} must all be >= 1")
    if model_bytes < 4:
        raise ConfigError(f"model_bytes {model_bytes} must be >= 4")
    processes = min(processes, agents)
    ids = device_names(agents)
    weights = np.zeros(model_bytes // 4, dtype=np.float32)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        root = Path(tmp)
        pki, devices, cert_seconds = throwaway_pki(root, ids)

        async def go() -> dict[str, Any]:
            runtime = NetworkRuntime("127.0.0.1:0", pki=pki, max_message_bytes=2 * model_bytes + 2**16)
            port = await runtime.start()
            commands = [
                [
                    sys.executable,
                    "-m",
                    "fedveil.experiments.bench.network",
                    f"127.0.0.1:{port}",
                    str(devices),
                    f"{i}/{processes}",
                    str(agents),
                    str(tte_mean),
                    str(2 * model_bytes + 2**16),
                ]
                for i in range(processes)
            ]
            async with agent_processes(runtime, commands):
                connect_seconds = await wait_connected(runtime, agents, connect_timeout)
                cpu0 = _cpu_seconds(resource.RUSAGE_SELF)
                net = await _rounds(runtime, ids, weights, rounds, timeout)
                net["server_cpu"] = _cpu_seconds(resource.RUSAGE_SELF) - cpu0
                timings = list(runtime.stats().timings)
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                return {"net": net, "timings": timings, "connect_seconds": connect_seconds, "rss": rss}

        result = asyncio.run(go())
    sim_runtime = SimulationRuntime(BenchPool(ids), rng=np.random.default_rng(0))
    sim = asyncio.run(_rounds(sim_runtime, ids, weights, rounds, timeout))
    net, timings = result["net"], result["timings"]
    walls = net["walls"]
    overhead = [w - t for w, t in zip(walls, net["tte_max"], strict=True)]
    return {
        "agents": agents,
        "processes": processes,
        "rounds": rounds,
        "model_bytes": int(weights.nbytes),
        "lost_updates": int(net["lost"]),
        "tte_simulated_mean_seconds": tte_mean,
        "ttd": percentiles([t.ttd for t in timings]),
        "tte": percentiles([t.tte for t in timings]),
        "ttr": percentiles([t.ttr for t in timings]),
        "ttp": percentiles([t.ttp for t in timings]),
        "round_seconds": walls,
        "round_seconds_median": float(np.median(walls)),
        "server_overhead_seconds": overhead,
        "server_overhead_seconds_median": float(np.median(overhead)),
        "server_cpu_seconds_per_round": net["server_cpu"] / rounds,
        "simulation_round_seconds_median": float(np.median(sim["walls"])),
        "overhead_vs_simulation": float(np.median(walls) / np.median(sim["walls"])),
        "connect_seconds": result["connect_seconds"],
        "certificate_seconds": cert_seconds,
        "server_peak_rss_bytes": result["rss"],
        "cpus": os.cpu_count(),
        "threads": thread_settings(),
    }


def _agent_main(argv: list[str]) -> int:
    """An agent process of the benchmark: ``SERVER CRED_DIR I/N AGENTS TTE_MEAN MAX_BYTES``."""
    server, cred_dir, shard, agents, tte_mean, max_bytes = argv
    i, n = (int(x) for x in shard.split("/"))
    mine = device_names(int(agents))[i::n]
    creds = {d: certs.DeviceCredentials.read(Path(cred_dir) / d) for d in mine}
    tte = LatencyModel("exponential", float(tte_mean), 0.0) if float(tte_mean) > 0 else None
    host = AgentHost(
        server,
        creds,
        BenchPool(mine, seed=i),
        max_message_bytes=int(max_bytes),
        give_up_after=120.0,
        tte=tte,
        seed=i,
    )
    endings = asyncio.run(host.run())
    return 0 if all(e == "finished" for e in endings.values()) else 1


if __name__ == "__main__":
    sys.exit(_agent_main(sys.argv[1:]))
