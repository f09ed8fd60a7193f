"""Benchmark: FDML Alg. 1 in the enclave (closed-form triplet loss and derivatives) against Table V.

FDML (Sec. VIII-4, Table V) times Alg. 1 with the "batch all" strategy inside
SGX on an i7-7700HQ: 0.48 s for 64 participants up to 63.65 s for 512. For each participant count this
times :func:`fedveil.enclave.triplet.loss_and_derivatives` in this process on float32 embeddings (what
the protocol sends): ``samples`` per participant, ``dim`` wide, labelled by participant, drawn around a
per-participant centre and normalised to unit length, like a metric-learning embedding.

Each row: ``seconds`` (median wall time of ``repeats`` calls after one warm-up) and ``cpu_seconds``
(their median process CPU time, all threads), ``peak_bytes`` (:mod:`tracemalloc` peak of one more
call), and ``max_rel_err`` = ``max |g - g_ref| / max |g_ref|`` against the float64 torch autograd
reference over the enumerated triplets on the same data (``None``, with the reason in ``reference``,
where that enumeration does not fit in ``reference_limit`` bytes).

The matrix products run in numpy's BLAS, with the threads the caller set (``fedveil bench`` runs with
:func:`fedveil.runtime.threads.blas_threads`: one by default, ``FEDVEIL_BLAS_THREADS`` to change it);
each row records them in ``threads`` (:func:`fedveil.runtime.threads.thread_settings`).
"""

from __future__ import annotations

import statistics
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedveil.enclave.triplet import DEFAULT_MEMORY_LIMIT_BYTES, STRATEGIES, loss_and_derivatives
from fedveil.errors import ConfigError
from fedveil.experiments.fdml.triplet_reference import (
    REFERENCE_MEMORY_BYTES,
    reference_fits,
    reference_loss_and_derivatives,
)
from fedveil.runtime.threads import thread_settings

__all__ = ["PAPER_TABLE_V_SECONDS", "bench_enclave", "clustered_embeddings"]

PAPER_TABLE_V_SECONDS = {64: 0.48, 128: 2.19, 256: 11.07, 512: 63.65}
"""FDML Table V: TEE processing time (s) of Alg. 1, batch-all, by number of participants."""

NOISE = 0.5
"""Per-coordinate spread of a participant's samples around its centre (centres have spread 1)."""


def clustered_embeddings(
    participants: int, samples: int, dim: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``(participants * samples, dim)`` float32 unit vectors around per-participant centres, and labels."""
    centres = rng.normal(0.0, 1.0, (participants, 1, dim))
    x = (centres + NOISE * rng.normal(0.0, 1.0, (participants, samples, dim))).reshape(-1, dim)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32), np.repeat(np.arange(participants, dtype=np.int64), samples)


def bench_enclave(
    participants: Sequence[int],
    samples: int,
    dim: int,
    strategy: str,
    repeats: int = 5,
    seed: int = 0,
    reference_limit: int = REFERENCE_MEMORY_BYTES,
    *,
    margin: float = 1.0,
    memory_limit_bytes: int | None = DEFAULT_MEMORY_LIMIT_BYTES,
) -> list[dict[str, Any]]:
    """One row per participant count (see the module docstring); seconds, bytes, counts."""
    if not participants or min(participants) < 2 or samples < 2 or dim < 1 or repeats < 1:
        raise ConfigError(
            f"need participant counts >= 2, samples >= 2, dim >= 1 and repeats >= 1; got participants="
            f"{list(participants)}, samples={samples}, dim={dim}, repeats={repeats}"
        )
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    rng = np.random.default_rng(seed)
    rows = []
    for count in participants:
        x, labels = clustered_embeddings(count, samples, dim, rng)

        def call(x: np.ndarray = x, labels: np.ndarray = labels) -> Any:
            return loss_and_derivatives(
                x, labels, margin=margin, strategy=strategy, memory_limit_bytes=memory_limit_bytes
            )

        result = call()
        wall, cpu = [], []
        for _ in range(repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            call()
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        tracemalloc.start()
        try:
            call()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        n = x.shape[0]
        if reference_fits(n, dim, reference_limit):
            _, want = reference_loss_and_derivatives(
                x.astype(np.float64), labels, margin=margin, strategy=strategy, memory_bytes=reference_limit
            )
            got = result.derivatives.astype(np.float64)
            max_rel_err: float | None = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))
            reference = "float64 torch autograd over the enumerated triplets"
        else:
            max_rel_err = None
            reference = f"skipped: the N^3 = {n**3} triplet grid does not fit in {reference_limit} bytes"
        rows.append(
            {
                "participants": count,
                "samples_per_participant": samples,
                "embeddings": n,
                "dim": dim,
                "strategy": strategy,
                "margin": margin,
                "seconds": statistics.median(wall),
                "seconds_min": min(wall),
                "cpu_seconds": statistics.median(cpu),
                "peak_bytes": peak,
                "workspace_bytes": result.workspace_bytes,
                "tile_size": result.tile_size,
                "num_active": result.num_active,
                "num_valid": result.num_valid,
                "max_rel_err": max_rel_err,
                "reference": reference,
                "paper_seconds": PAPER_TABLE_V_SECONDS.get(count),
                "threads": thread_settings(),
            }
        )
    return rows
