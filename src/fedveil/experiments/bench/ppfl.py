"""``fedveil bench ppfl``: PPFL's client updates per second per stage (batched cohort vs device by
device) and what the sealing costs in a round.

For each stage of the model, in order, with the server's enclave in process and every device's session
attested: rounds of ``clients`` devices holding ``samples`` examples each, ``local_epochs`` epochs in
batches of ``batch_size`` (Table 3's settings: 100 samples, 10 epochs, batch 16), timed in three parts:

- ``broadcast``: the enclave seals ``theta_l`` to every device (:meth:`EnclaveHost.layer_broadcast`);
- ``train``: :meth:`PpflClients.handle_batch` on the fit requests (REE forward of the frozen layers, each
  TEE opening, training and sealing), once batched and once device by device, alternating;
- ``aggregate``: the enclave opens the sealed updates and averages them.

The devices' own opening and sealing is timed inside ``train`` (the sessions' calls, wrapped), so
``sealing_share`` = (broadcast + aggregate + devices' open and seal) / round is what the channel costs.
After its rounds a stage is released (random values: speed does not depend on them) and the next
begins. Data: the synthetic stand-in of the model's input shape.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedveil.data.federated import FederatedDataset, UserData
from fedveil.data.images import synthetic_cifar10, synthetic_fashion_mnist
from fedveil.errors import ConfigError
from fedveil.experiments.fdml.runner import device_sessions
from fedveil.models.device import resolve_device
from fedveil.models.flat import FlatModel
from fedveil.models.zoo import build_model
from fedveil.protocols.ppfl import PpflClients, PpflConfig, kept_on_release, param_specs
from fedveil.protocols.ppfl_messages import LayerFitReply, LayerFitRequest, LayerRelease
from fedveil.runtime.enclave_host import EnclaveHost
from fedveil.runtime.quoting import SimulatedPlatform

__all__ = ["bench_ppfl"]


def _timed(calls: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            calls.append(time.perf_counter() - start)

    return wrapper


def bench_ppfl(
    *,
    model: str = "lenet",
    data: str = "fashion-mnist",
    clients: int = 10,
    samples: int = 100,
    batch_size: int = 16,
    local_epochs: int = 10,
    repeats: int = 3,
    threads: int = 2,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, Any]:
    """Per stage: updates per second batched and one by one, phase seconds and the sealing share; the
    REEs' frozen layers and the emulated TEEs' training run on ``device``
    (:func:`~fedveil.models.device.resolve_device`)."""
    for name, value in (("clients", clients), ("samples", samples), ("repeats", repeats)):
        if value < 1:
            raise ConfigError(f"{name} {value} must be >= 1")
    if data not in ("fashion-mnist", "cifar10"):
        raise ConfigError(f"data {data!r} is not fashion-mnist or cifar10 (the input shape)")
    torch.set_num_threads(threads)
    images = (synthetic_fashion_mnist if data == "fashion-mnist" else synthetic_cifar10)(
        clients * samples, seed=seed
    )
    net = build_model(
        model, num_classes=10, in_channels=images.x.shape[1], image_size=images.x.shape[2], seed=seed
    )
    users = [
        UserData(
            f"c{i}",
            {},
            {"x": images.x[i * samples : (i + 1) * samples], "y": images.y[i * samples : (i + 1) * samples]},
        )
        for i in range(clients)
    ]
    fed = FederatedDataset(users)
    cfg = PpflConfig(local_epochs=local_epochs, batch_size=batch_size)
    platform = SimulatedPlatform.generate()
    rows = []
    with EnclaveHost.start(platform=platform) as host:
        sessions = device_sessions(fed.user_ids, platform.public_key, host.measurement)
        crypto: list[float] = []
        for session in sessions.values():
            session.establish(host.open_session(session.hello()))
            session.open_model = _timed(crypto, session.open_model)  # type: ignore[method-assign]
            session.seal_update = _timed(crypto, session.seal_update)  # type: ignore[method-assign]
        pool = PpflClients(net, fed, optimizer=cfg.optimizer(), seed=seed, sessions=sessions, device=device)
        ids = pool.client_ids()
        rnd = 0
        for stage in cfg.stages(net):
            stage_net = pool.net(stage.index)
            size = FlatModel(stage_net).num_params
            host.layer_begin(stage.index, param_specs(stage_net), seed)
            times: dict[str, list[float]] = {
                k: [] for k in ("batched", "one_by_one", "broadcast", "aggregate", "crypto")
            }
            for r in range(repeats + 1):
                for batched in (True, False):
                    rnd += 1
                    pool.batched = batched
                    start = time.perf_counter()
                    records = host.layer_broadcast(rnd, stage.index, ids)
                    broadcast = time.perf_counter() - start
                    msgs = {
                        c: LayerFitRequest(
                            rnd, stage.index, cfg.lr, cfg.epoch_decay, local_epochs, batch_size, records[c]
                        )
                        for c in ids
                    }
                    crypto.clear()
                    start = time.perf_counter()
                    replies = pool.handle_batch(msgs)
                    train = time.perf_counter() - start
                    bad = [c for c, m in replies.items() if not isinstance(m, LayerFitReply)]
                    if bad:
                        raise ConfigError(
                            f"devices {bad} failed to train stage {stage.index}: {replies[bad[0]]}"
                        )
                    start = time.perf_counter()
                    host.layer_aggregate(
                        rnd, stage.index, {c: m.record for c, m in replies.items()}, {c: samples for c in ids}
                    )
                    aggregate = time.perf_counter() - start
                    if r == 0:
                        continue  # warm-up
                    times["batched" if batched else "one_by_one"].append(train)
                    times["broadcast"].append(broadcast)
                    times["aggregate"].append(aggregate)
                    times["crypto"].append(sum(crypto))
            median = {k: statistics.median(v) for k, v in times.items()}
            round_seconds = median["broadcast"] + median["one_by_one"] + median["aggregate"]
            sealing = median["broadcast"] + median["aggregate"] + median["crypto"]
            rows.append(
                {
                    "stage": stage.index,
                    "units": list(stage.units),
                    "num_params": size,
                    "batched_updates_per_second": clients / median["batched"],
                    "one_by_one_updates_per_second": clients / median["one_by_one"],
                    "speedup": median["one_by_one"] / median["batched"],
                    "broadcast_seconds": median["broadcast"],
                    "aggregate_seconds": median["aggregate"],
                    "devices_open_and_seal_seconds": median["crypto"],
                    "round_seconds_one_by_one": round_seconds,
                    "sealing_share": sealing / round_seconds,
                    "sealed_bytes_per_round": 2 * clients * 4 * size,
                }
            )
            keep = kept_on_release(stage, stage_net, final=stage.last, keep_in_tee=False)
            released = host.layer_release(stage.index, keep=keep)
            pool.handle_batch({c: LayerRelease(stage.index, released) for c in ids})
    return {
        "model": model,
        "device": str(resolve_device(device)),
        "data": f"synthetic stand-in of {data}'s shape (speed does not depend on pixel values)",
        "clients": clients,
        "samples": samples,
        "batch_size": batch_size,
        "local_epochs": local_epochs,
        "repeats": repeats,
        "threads": threads,
        "seed": int(np.int64(seed)),
        "stages": rows,
    }
