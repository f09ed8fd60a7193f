"""``fedveil bench fedavg`` and ``fedveil bench dlg``: the FedAvg engine's client updates per second
(batched cohort vs client by client) and DLG iterations per second.

``bench_fedavg_updates`` times :class:`~fedveil.protocols.fedavg.ModelClients` answering one
:class:`~fedveil.protocols.messages.FitRequest` for ``clients`` clients that each run ``local_epochs`` over
``samples`` examples in batches of ``batch_size`` (the default setting: LeNet on 28 x 28 inputs, batch 16,
one epoch of 500 samples), after one untimed warm-up, through the client pool directly (no codec).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

from fedveil.attacks.dlg import dlg_attack
from fedveil.attacks.inversion import client_gradient_view
from fedveil.data.federated import FederatedDataset, UserData
from fedveil.data.images import synthetic_fashion_mnist
from fedveil.models.device import resolve_device
from fedveil.models.flat import FlatModel
from fedveil.models.zoo import build_model
from fedveil.protocols.fedavg import ModelClients
from fedveil.protocols.local import LocalOptimizer
from fedveil.protocols.messages import FitRequest

__all__ = ["bench_dlg", "bench_fedavg_updates"]


def bench_fedavg_updates(
    *,
    model: str = "lenet",
    clients: int = 8,
    samples: int = 500,
    batch_size: int = 16,
    local_epochs: int = 1,
    repeats: int = 3,
    threads: int = 2,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, Any]:
    """Client updates per second, batched (one ``vmap`` over the cohort) and one by one, side by side,
    training on ``device`` (:func:`~fedveil.models.device.resolve_device`; the clients' data moves there
    in the untimed first call, and every reply comes back to the host, so a timed call is all its work)."""
    torch.set_num_threads(threads)
    data = synthetic_fashion_mnist(clients * samples, seed=seed)
    users = [
        UserData(
            f"c{i}",
            {},
            {"x": data.x[i * samples : (i + 1) * samples], "y": data.y[i * samples : (i + 1) * samples]},
        )
        for i in range(clients)
    ]
    fed = FederatedDataset(users)
    flat = FlatModel(build_model(model, num_classes=10, in_channels=1, image_size=28, seed=seed))
    out: dict[str, Any] = {
        "model": model,
        "device": str(resolve_device(device)),
        "num_params": flat.num_params,
        "clients": clients,
        "samples": samples,
        "batch_size": batch_size,
        "local_epochs": local_epochs,
        "threads": threads,
        "repeats": repeats,
        "data": "synthetic stand-in (speed does not depend on pixel values)",
    }
    request = FitRequest(1, 0.05, local_epochs, batch_size, flat.initial())
    for batched in (True, False):
        pool = ModelClients(
            flat, fed, optimizer=LocalOptimizer(lr=0.05), seed=seed, batched=batched, device=device
        )
        msgs = dict.fromkeys(pool.client_ids(), request)
        pool.handle_batch(msgs)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            pool.handle_batch(msgs)
            times.append(time.perf_counter() - t0)
        key = "batched" if batched else "one_by_one"
        out[f"{key}_seconds_median"] = statistics.median(times)
        out[f"{key}_updates_per_second"] = clients / statistics.median(times)
    out["speedup"] = out["batched_updates_per_second"] / out["one_by_one_updates_per_second"]
    return out


def bench_dlg(
    *, iterations: int = 50, repeats: int = 3, threads: int = 2, seed: int = 0, device: str = "cpu"
) -> dict[str, Any]:
    """DLG iterations per second at batch 1 on the DLG paper's sigmoid LeNet (28 x 28 x 1): the full
    L-BFGS step (up to 20 gradient-matching evaluations each), timed from a fresh random start, on
    ``device`` (each evaluation reads its loss back to the host, so the timing is the work's)."""
    torch.set_num_threads(threads)
    data = synthetic_fashion_mnist(repeats, seed=seed)
    rates, evals = [], []
    for i in range(repeats):
        net = build_model("lenet-sigmoid", num_classes=10, in_channels=1, image_size=28, seed=seed + i)
        view = client_gradient_view(
            net, torch.from_numpy(data.x[i : i + 1]), torch.from_numpy(data.y[i : i + 1])
        )
        result = dlg_attack(
            view, image_shape=(1, 28, 28), iterations=iterations, seed=seed + i, device=device
        )
        rates.append(result.iterations_per_second)
        evals.append(result.evaluations / result.seconds)
    return {
        "model": "lenet-sigmoid",
        "device": str(resolve_device(device)),
        "iterations": iterations,
        "repeats": repeats,
        "threads": threads,
        "iterations_per_second_median": statistics.median(rates),
        "evaluations_per_second_median": statistics.median(evals),
        "data": "synthetic stand-in",
        "note": "an L-BFGS iteration runs up to 20 evaluations; once converged it runs about one",
        "seed": int(np.int64(seed)),
    }
