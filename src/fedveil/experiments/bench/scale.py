"""``fedveil bench scale``: how fedveil's simulation scales with registered clients and Ray actors.

FedAvg with the small CNN (LeNet: two 5 x 5 convolutions and two fully connected layers, 1,256,080
parameters) on 28 x 28 grayscale images:

- real Fashion-MNIST when installed, else its labelled synthetic stand-in;
- ``samples`` images per client, ``per_round`` clients per round, 1 local epoch, batch 10, SGD lr 0.05.

Registered clients grow from 1e3 to 1e5. Each client's images are a *view* into one shared array of the
training images (a window of ``samples`` consecutive images of a seeded permutation), so registering
clients costs their records and generators, not copies of the pixels. The clients run in-process, or
sharded over ``actors`` Ray actors (each actor builds the shared array once). In-process, the clients
train on ``device`` (:func:`~fedveil.models.device.resolve_device`; their images move there once, as
the FedAvg engine moves client data); the Ray actors are given CPUs only, so a setting on Ray needs the
CPU device, and asking for another is refused before anything starts (:func:`check_scale_device`).

Each setting runs in a fresh process, so its peak RSS (``ru_maxrss``) is its own. With Ray, that is the
driver's only; the actors' memory is not included, and the output says so. Reported per setting:

- the clients, actors and the device they trained on;
- the median seconds per round over ``rounds`` rounds, after one warm-up round, and rounds per second;
- the median CPU seconds per round of this process and its descendants (Ray's actors included);
- start-up seconds: building the clients, and the actors with Ray; the warm-up round's seconds;
- peak RSS;
- the test accuracy of the global model after the warm-up and timed rounds (``fedveil bench peers``
  compares it with other frameworks').
"""

from __future__ import annotations

import asyncio
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedveil.errors import ConfigError
from fedveil.experiments.bench.floor import tree_cpu_seconds
from fedveil.models.device import resolve_device

__all__ = [
    "SCALE_BATCH",
    "SCALE_EPOCHS",
    "SCALE_LR",
    "SCALE_MODEL",
    "bench_scale",
    "check_scale_device",
    "measure_in_subprocess",
    "measure_setting",
    "scale_clients",
    "scale_users",
]

SCALE_MODEL = "lenet"
SCALE_LR = 0.05
SCALE_BATCH = 10
SCALE_EPOCHS = 1
"""The local training of every client: ``SCALE_EPOCHS`` epoch of plain SGD, lr and batch size as named."""


def scale_users(clients: int, samples: int, seed: int, ids: Sequence[str] | None = None) -> list[Any]:
    """The ``UserData`` of ``clients`` clients (only ``ids`` of them, for a Ray shard), each with
    ``samples`` images viewed from one shared training array (module docstring): client ``i`` holds the
    window starting at ``i * samples`` (modulo the windows that fit) of a permutation of the training
    images seeded by ``seed``."""
    from fedveil.data.federated import UserData
    from fedveil.data.images import load_image_dataset

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
    return users


def check_scale_device(device: str, actors: Sequence[int]) -> str:
    """The resolved ``device`` (:func:`~fedveil.models.device.resolve_device`) as text, after checking
    that no setting puts clients on Ray actors (``actors`` above 0) with a device other than the CPU:
    the actors are given CPUs only (module docstring). A :class:`ConfigError` names both otherwise."""
    where = resolve_device(device)
    ray = [a for a in actors if a > 0]
    if ray and where.type != "cpu":
        raise ConfigError(
            f"device {device!r} ({where}) with Ray actors {ray}: the actors are given CPUs only; measure "
            "the Ray settings with --device cpu, or give --actors '' (no Ray) to measure on the device"
        )
    return str(where)


def scale_clients(
    clients: int, samples: int, seed: int, ids: Sequence[str] | None = None, device: str = "cpu"
) -> Any:
    """The client pool of :func:`scale_users`' clients (only ``ids`` of them, for a Ray shard), training
    on ``device``."""
    import torch

    from fedveil.data.federated import FederatedDataset
    from fedveil.models.flat import FlatModel
    from fedveil.models.zoo import build_model
    from fedveil.protocols.fedavg import ModelClients
    from fedveil.protocols.local import LocalOptimizer

    users = scale_users(clients, samples, seed, ids)
    torch.manual_seed(seed)
    flat = FlatModel(build_model(SCALE_MODEL, num_classes=10, in_channels=1, image_size=28, seed=seed))
    return ModelClients(
        flat, FederatedDataset(users), optimizer=LocalOptimizer("sgd", SCALE_LR), seed=seed, device=device
    )


def measure_setting(
    *,
    clients: int,
    per_round: int,
    rounds: int,
    samples: int,
    actors: int,
    seed: int,
    threads: int,
    device: str = "cpu",
) -> dict[str, Any]:
    """One setting in this process (module docstring), its in-process clients training on ``device``."""
    import functools

    import torch

    from fedveil.models.flat import FlatModel
    from fedveil.models.zoo import build_model
    from fedveil.protocols.fedavg import ImageFedAvgConfig, ModelServer
    from fedveil.protocols.local import LocalOptimizer
    from fedveil.runtime.simulation import SimulationRuntime

    where = check_scale_device(device, [actors])
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
        pool = scale_clients(clients, samples, seed, device=device)
    runtime = SimulationRuntime(pool, rng=np.random.default_rng(seed + 1))
    torch.manual_seed(seed)
    flat = FlatModel(build_model(SCALE_MODEL, num_classes=10, in_channels=1, image_size=28, seed=seed))
    cfg = ImageFedAvgConfig(
        clients_per_round=per_round,
        local_epochs=SCALE_EPOCHS,
        batch_size=SCALE_BATCH,
        optimizer=LocalOptimizer("sgd", SCALE_LR),
        eval_every=0,
    )
    server = ModelServer(cfg, flat, np.random.default_rng(seed + 2))
    server.setup(runtime)
    startup = time.perf_counter() - started

    async def run() -> tuple[list[float], list[float]]:
        times, cpu = [], []
        for rnd in range(rounds + 1):
            t0, c0 = time.perf_counter(), tree_cpu_seconds()
            await server.run_round(rnd + 1, runtime)
            times.append(time.perf_counter() - t0)
            cpu.append(tree_cpu_seconds() - c0)
        return times, cpu

    times, cpu = asyncio.run(run())
    per = statistics.median(times[1:])
    row = {
        "clients": clients,
        "clients_per_round": per_round,
        "actors": actors,
        "device": where,
        "rounds": rounds,
        "seconds_per_round": per,
        "rounds_per_second": 1.0 / per,
        "cpu_seconds_per_round": statistics.median(cpu[1:]),
        "first_round_seconds": times[0],
        "startup_seconds": startup,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_covers": "driver only (Ray actors not included)" if actors else "the whole run",
        "dropouts": len(runtime.stats().dropouts),
    }
    from fedveil.data.images import load_image_dataset

    test = load_image_dataset("fashion-mnist", "test", seed=seed)
    row["accuracy"] = server.evaluate(test.x, test.y)["accuracy"]
    if actors:
        import ray

        ray.shutdown()
    return row


def measure_in_subprocess(
    *,
    clients: int,
    per_round: int,
    rounds: int,
    samples: int,
    actors: int,
    seed: int,
    threads: int,
    device: str = "cpu",
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """:func:`measure_setting` in a fresh ``python -m fedveil bench scale --one`` process (its own RSS),
    on ``device``, with the environment ``env`` (default: this process's)."""
    command = [sys.executable, "-m", "fedveil", "bench", "scale", "--one", "--json"]
    command += ["--clients", str(clients), "--actors", str(actors), "--per-round", str(per_round)]
    command += ["--rounds", str(rounds), "--samples", str(samples), "--seed", str(seed)]
    command += ["--threads", str(threads), "--device", device]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600, env=env)
    if done.returncode != 0:
        raise ConfigError(f"setting clients={clients} actors={actors} failed: {done.stderr.strip()[-800:]}")
    return dict(json.loads(done.stdout))


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
    device: str = "cpu",
) -> dict[str, Any]:
    """Every setting, each in a fresh ``python -m fedveil bench scale --one`` process: in-process at each
    of ``clients``, then on Ray with ``ray_clients`` clients at each of ``actors`` (none: Ray skipped);
    the in-process clients train on ``device`` (:func:`check_scale_device`)."""
    for name, values in (("clients", clients), ("actors", actors)):
        if any(v < 1 for v in values):
            raise ConfigError(f"{name} {list(values)} must all be >= 1")
    if per_round < 1 or rounds < 1 or samples < 1:
        raise ConfigError("per_round, rounds and samples must be >= 1")
    check_scale_device(device, actors)
    settings = [(n, 0) for n in clients] + [(ray_clients, a) for a in actors]
    common = {
        "per_round": per_round,
        "rounds": rounds,
        "samples": samples,
        "seed": seed,
        "threads": threads,
        "device": device,
    }
    rows = [measure_in_subprocess(clients=n, actors=a, **common) for n, a in settings]
    from fedveil.data.images import load_image_dataset

    data = load_image_dataset("fashion-mnist", "train", seed=seed).name
    return {"model": SCALE_MODEL, "data": data, "samples_per_client": samples, "rows": rows}
