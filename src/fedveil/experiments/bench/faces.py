"""``fedveil bench mobilefacenet``: images per second of MobileFaceNet's forward + backward:
an ArcFace loss over ``classes`` identities on random images of the given side,
batch ``batch_size``, at each of ``threads`` torch thread counts; the median of ``repeats`` timed steps
after one warm-up step, BatchNorm in training mode (pre-training) and frozen (fine-tuning, Sec. 4.1).

``client_updates`` adds the AIoT setting's FedAvg client updates per second: a device of
:mod:`fedveil.protocols.projector` (4 synthetic identities x 5 photos, batches of 8, one local epoch,
its own ArcFace projector, frozen BatchNorm, warm-up) answering a :class:`FitRequest`, ``devices`` of
them per timed call, median of ``repeats`` calls after a warm-up call.

``device`` (:func:`~fedveil.models.device.resolve_device`) is where both run; on a GPU each timed step
ends when the device has finished it (:func:`~fedveil.models.device.synchronize`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fedveil.data.faces import face_devices, synthetic_faces
from fedveil.errors import ConfigError
from fedveil.models.device import resolve_device, synchronize
from fedveil.models.faces import ArcFace, MobileFaceNet
from fedveil.protocols.local import LocalOptimizer
from fedveil.protocols.messages import FitRequest
from fedveil.protocols.projector import ProjectorClients, backbone_flat

__all__ = ["bench_client_updates", "bench_mobilefacenet"]


def bench_client_updates(
    *,
    image_size: int,
    width: float,
    threads: int,
    repeats: int,
    devices: int = 5,
    seed: int = 0,
    device: str = "cpu",
) -> float:
    """AIoT client updates per second (module docstring) at ``threads`` torch threads."""
    faces, _ = synthetic_faces(4 * devices, 4, size=image_size, seed=seed)
    model = MobileFaceNet(image_size=image_size, width=width)
    pool = ProjectorClients(
        model,
        face_devices(faces, 4),
        embedding_dim=model.embedding_dim,
        optimizer=LocalOptimizer(lr=0.001, momentum=0.9),
        seed=seed,
        device=device,
    )
    request = FitRequest(1, 0.001, 1, 8, backbone_flat(model).initial())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = []
        for r in range(repeats + 1):
            start = time.perf_counter()
            pool.handle_batch({cid: request for cid in pool.client_ids()})
            if r:
                times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return devices / statistics.median(times)


def bench_mobilefacenet(
    *,
    image_size: int = 112,
    width: float = 1.0,
    batch_size: int = 32,
    threads: Sequence[int] = (1, 2),
    repeats: int = 5,
    classes: int = 1000,
    seed: int = 0,
    client_updates: bool = True,
    device: str = "cpu",
) -> dict[str, Any]:
    """Images per second per thread count and BatchNorm mode, and client updates per second per thread
    count (module docstring)."""
    if batch_size < 2 or repeats < 1 or not threads or min(threads) < 1:
        raise ConfigError(
            f"batch {batch_size} must be >= 2, repeats {repeats} and threads {list(threads)} >= 1"
        )
    where = resolve_device(device)
    gen = torch.Generator().manual_seed(seed)
    model = MobileFaceNet(image_size=image_size, width=width).to(where)
    head = ArcFace(model.embedding_dim, classes).to(where)
    x = torch.rand(batch_size, *model.input_shape, generator=gen).to(where)
    y = torch.randint(0, classes, (batch_size,), generator=gen).to(where)
    before = torch.get_num_threads()
    rows = []
    try:
        for n in threads:
            torch.set_num_threads(n)
            for frozen in (False, True):
                model.train(not frozen)
                times = []
                for r in range(repeats + 1):
                    start = time.perf_counter()
                    loss = nn.functional.cross_entropy(head(model(x), y), y)
                    loss.backward()
                    synchronize(where)
                    elapsed = time.perf_counter() - start
                    model.zero_grad(set_to_none=True)
                    head.zero_grad(set_to_none=True)
                    if r:
                        times.append(elapsed)
                rows.append(
                    {
                        "threads": n,
                        "batchnorm": "frozen" if frozen else "training",
                        "images_per_second": batch_size / statistics.median(times),
                    }
                )
    finally:
        torch.set_num_threads(before)
    updates = [
        {
            "threads": n,
            "client_updates_per_second": bench_client_updates(
                image_size=image_size, width=width, threads=n, repeats=repeats, seed=seed, device=device
            ),
        }
        for n in (threads if client_updates else ())
    ]
    return {
        "model": "mobilefacenet",
        "device": str(where),
        "image_size": image_size,
        "width": width,
        "batch_size": batch_size,
        "repeats": repeats,
        "classes": classes,
        "rows": rows,
        "client_updates": updates,
    }
