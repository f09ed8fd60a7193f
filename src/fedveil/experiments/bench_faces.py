"""``fedveil bench mobilefacenet``: images per second of MobileFaceNet's forward + backward (the AIoT
issue's speed row): an ArcFace loss over ``classes`` identities on random images of the given side,
batch ``batch_size``, at each of ``threads`` torch thread counts; the median of ``repeats`` timed steps
after one warm-up step, BatchNorm in training mode (pre-training) and frozen (fine-tuning, Sec. 4.1)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fedveil.errors import ConfigError
from fedveil.models.faces import ArcFace, MobileFaceNet

__all__ = ["bench_mobilefacenet"]


def bench_mobilefacenet(
    *,
    image_size: int = 112,
    width: float = 1.0,
    batch_size: int = 32,
    threads: Sequence[int] = (1, 2),
    repeats: int = 5,
    classes: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    """Images per second per thread count and BatchNorm mode (module docstring)."""
    if batch_size < 2 or repeats < 1 or not threads or min(threads) < 1:
        raise ConfigError(
            f"batch {batch_size} must be >= 2, repeats {repeats} and threads {list(threads)} >= 1"
        )
    gen = torch.Generator().manual_seed(seed)
    model = MobileFaceNet(image_size=image_size, width=width)
    head = ArcFace(model.embedding_dim, classes)
    x = torch.rand(batch_size, *model.input_shape, generator=gen)
    y = torch.randint(0, classes, (batch_size,), generator=gen)
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
    return {
        "model": "mobilefacenet",
        "image_size": image_size,
        "width": width,
        "batch_size": batch_size,
        "repeats": repeats,
        "classes": classes,
        "rows": rows,
    }
