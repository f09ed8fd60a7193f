"""``fedveil bench polifl``: client updates per second for each PoliFL use case, with the devices enforcing
their policies (:class:`~fedveil.protocols.polifl.PolicyDevices`: job start, the ``runFL`` check per
request, clipping) against the engine's plain :class:`~fedveil.protocols.fedavg.ModelClients` on the same
data and settings, measured side by side in one process (the median of ``repeats`` cohorts each)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedveil.data.federated import FederatedDataset, UserData
from fedveil.experiments.polifl.runner import build_task, load_polifl_run
from fedveil.models.device import resolve_device
from fedveil.privacy.pairs import DataPolicyPair
from fedveil.privacy.policy import parse
from fedveil.protocols.fedavg import ModelClients
from fedveil.protocols.local import LocalOptimizer
from fedveil.protocols.messages import FitRequest
from fedveil.protocols.polifl import JobStart, PolicyDevices

__all__ = ["USE_CASES", "bench_polifl"]

USE_CASES = {
    "images": "configs/polifl/images_fig7.yaml",
    "mpu": "configs/polifl/mpu_dp.yaml",
    "text": "configs/polifl/text_2groups.yaml",
}


def _timed(pool: Any, msgs: dict[str, Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        pool.handle_batch(msgs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_polifl(
    *, repeats: int = 3, root: str | Path = ".", threads: int = 2, device: str = "cpu"
) -> list[dict[str, Any]]:
    """One row per use case (module docstring), the devices training on ``device``
    (:func:`~fedveil.models.device.resolve_device`)."""
    torch.set_num_threads(threads)
    rows = []
    for name, config in USE_CASES.items():
        run = load_polifl_run(Path(root) / config)
        task = build_task(run)
        group = run.groups[0]
        cohort = task.members[group.name][: run.clients_per_round]
        optimizer = LocalOptimizer("sgd", run.lr)
        pairs = {c: DataPolicyPair(task.values[c], parse(group.policy)) for c in cohort}
        devices = PolicyDevices(
            task.flat, pairs, optimizer=optimizer, seed=0, loss=task.loss, batched=task.batched, device=device
        )
        devices.handle_batch(
            {c: JobStart("bench", tuple(group.commands), "", run.clip_norm, 0.0) for c in cohort}
        )
        plain = ModelClients(
            task.flat,
            FederatedDataset(
                UserData(c, {}, {"x": task.values[c]["x"], "y": task.values[c]["y"]}) for c in cohort
            ),
            optimizer=optimizer,
            seed=0,
            loss=task.loss,
            batched=task.batched,
            device=device,
        )
        request = FitRequest(1, run.lr, run.local_epochs, run.batch_size, task.initial)
        msgs = {c: request for c in cohort}
        policy_s = _timed(devices, msgs, repeats)
        plain_s = _timed(plain, msgs, repeats)
        rows.append(
            {
                "use_case": name,
                "config": config,
                "model_parameters": int(task.flat.num_params),
                "examples_per_client": float(np.mean([len(task.values[c]["y"]) for c in cohort])),
                "clients": len(cohort),
                "client_updates_per_second": len(cohort) / policy_s,
                "plain_client_updates_per_second": len(cohort) / plain_s,
                "enforcement_overhead": policy_s / plain_s - 1.0,
                "threads": threads,
                "repeats": repeats,
                "device": str(resolve_device(device)),
            }
        )
    return rows
