"""``fedveil bench scale``: how fedveil's simulation scales with registered clients and Ray actors.

FedAvg with the small CNN (LeNet: two 5 x 5 convolutions and two fully connected layers, 1,256,080
parameters) on 28 x 28 grayscale images:

- real Fashion-MNIST when installed, else its labelled synthetic stand-in;
- ``samples`` images per client, ``per_round`` clients per round, 1 local epoch, batch 10, SGD lr 0.05.

Registered clients grow from 1e3 to 1e5. Each client's images are a *view* into one shared array of the
training images (a window of ``samples`` consecutive images of a seeded permutation), so registering
clients costs their records and generators, not copies of the pixels. The clients run in-process, or
sharded over ``actors`` Ray actors (each actor builds the shared array once).

Each setting runs in a fresh process, so its peak RSS (``ru_maxrss``) is its own. With Ray, that is the
driver's only; the actors' memory is not included, and the output says so. Reported per setting:

- the clients and actors;
- the median seconds per round over ``rounds`` rounds, after one warm-up round, and rounds per second;
- start-up seconds: building the clients, and the actors with Ray;
- peak RSS.
"""

from __future__ import annotations

import asyncio
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedveil.errors import ConfigError

__all__ = ["SCALE_MODEL", "bench_scale", "measure_setting", "scale_clients"]

SCALE_MODEL = "lenet"


def scale_clients(clients: int, samples: int, seed: int, ids: Sequence[str] | None = None) -> Any:
    """The client pool of ``clients`` clients (only ``ids`` of them, for a Ray shard), each with
    ``samples`` images viewed from one shared training array (module docstring)."""
    import torch

    from fedveil.data.federated import FederatedDataset, UserData
    from fedveil.data.images import load_image_dataset
    from fedveil.models.flat import FlatModel
    from fedveil.models.zoo import build_model
    from fedveil.protocols.fedavg import ModelClients
    from fedveil.protocols.local import LocalOptimizer

    train = load_image_dataset("fashion-mnist", "train", seed=seed)
    order = np.random.default_rng(seed).permutation(len(train))
    x = np.ascontiguousarray(train.x[order], dtype=np.float32)
    y = np.ascontiguousarray(train.y[order])
    windows = len(x) - samples + 1
    if windows < 1:
        raise ConfigError(f"{samples} samples per client exceed the {len(x)} training images")
    wanted = set(ids) if ids is not None else None
    users = []
    for i in range(clients):
        cid = f"c{i:06d}"
        if wanted is not None and cid not in wanted:
            continue
        start = (i * samples) % windows
        users.append(UserData(cid, {}, {"x": x[start : start + samples], "y": y[start : start + samples]}))
    torch.manual_seed(seed)
    flat = FlatModel(build_model(SCALE_MODEL, num_classes=10, in_channels=1, image_size=28, seed=seed))
    return ModelClients(flat, FederatedDataset(users), optimizer=LocalOptimizer("sgd", 0.05), seed=seed)


def measure_setting(
    *, clients: int, per_round: int, rounds: int, samples: int, actors: int, seed: int, threads: int
) -> dict[str, Any]:
    """One setting in this process (module docstring)."""
    import functools

    import torch

    from fedveil.models.flat import FlatModel
    from fedveil.models.zoo import build_model
    from fedveil.protocols.fedavg import ImageFedAvgConfig, ModelServer
    from fedveil.protocols.local import LocalOptimizer
    from fedveil.runtime.simulation import SimulationRuntime

    torch.set_num_threads(threads)
    started = time.perf_counter()
    if actors > 0:
        from fedveil.runtime.ray import RayPool, connect

        connect(None, num_cpus=None)
        ids = [f"c{i:06d}" for i in range(clients)]
        pool: Any = RayPool(
            functools.partial(scale_clients, clients, samples, seed), ids, actors=actors, threads=1
        )
    else:
        pool = scale_clients(clients, samples, seed)
    runtime = SimulationRuntime(pool, rng=np.random.default_rng(seed + 1))
    torch.manual_seed(seed)
    flat = FlatModel(build_model(SCALE_MODEL, num_classes=10, in_channels=1, image_size=28, seed=seed))
    cfg = ImageFedAvgConfig(
        clients_per_round=per_round,
        local_epochs=1,
        batch_size=10,
        optimizer=LocalOptimizer("sgd", 0.05),
        eval_every=0,
    )
    server = ModelServer(cfg, flat, np.random.default_rng(seed + 2))
    server.setup(runtime)
    startup = time.perf_counter() - started

    async def run() -> list[float]:
        times = []
        for rnd in range(rounds + 1):
            t0 = time.perf_counter()
            await server.run_round(rnd + 1, runtime)
            times.append(time.perf_counter() - t0)
        return times[1:]

    times = asyncio.run(run())
    per = statistics.median(times)
    row = {
        "clients": clients,
        "clients_per_round": per_round,
        "actors": actors,
        "rounds": rounds,
        "seconds_per_round": per,
        "rounds_per_second": 1.0 / per,
        "startup_seconds": startup,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_covers": "driver only (Ray actors not included)" if actors else "the whole run",
        "dropouts": len(runtime.stats().dropouts),
    }
    if actors:
        import ray

        ray.shutdown()
    return row


def bench_scale(
    *,
    clients: Sequence[int] = (1_000, 10_000, 100_000),
    actors: Sequence[int] = (1, 2, 4),
    ray_clients: int = 1_000,
    per_round: int = 100,
    rounds: int = 5,
    samples: int = 50,
    seed: int = 0,
    threads: int = 2,
) -> dict[str, Any]:
    """Every setting, each in a fresh ``python -m fedveil bench scale --one`` process: in-process at each
    of ``clients``, then on Ray with ``ray_clients`` clients at each of ``actors`` (none: Ray skipped)."""
    for name, values in (("clients", clients), ("actors", actors)):
        if any(v < 1 for v in values):
            raise ConfigError(f"{name} {list(values)} must all be >= 1")
    if per_round < 1 or rounds < 1 or samples < 1:
        raise ConfigError("per_round, rounds and samples must be >= 1")
    settings = [(n, 0) for n in clients] + [(ray_clients, a) for a in actors]
    rows = []
    for n, a in settings:
        command = [sys.executable, "-m", "fedveil", "bench", "scale", "--one", "--json"]
        command += ["--clients", str(n), "--actors", str(a), "--per-round", str(per_round)]
        command += ["--rounds", str(rounds), "--samples", str(samples), "--seed", str(seed)]
        command += ["--threads", str(threads)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise ConfigError(f"setting clients={n} actors={a} failed: {done.stderr.strip()[-800:]}")
        rows.append(json.loads(done.stdout))
    from fedveil.data.images import load_image_dataset

    data = load_image_dataset("fashion-mnist", "train", seed=seed).name
    return {"model": SCALE_MODEL, "data": data, "samples_per_client": samples, "rows": rows}
