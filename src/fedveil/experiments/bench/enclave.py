"""Benchmark: FDML Alg. 1 in the enclave (closed-form triplet loss and derivatives) against Table V.

FDML (Sec. VIII-4, Table V) times Alg. 1 with the "batch all" strategy inside
SGX on an i7-7700HQ: 0.48 s for 64 participants up to 63.65 s for 512. For each participant count this
times :func:`fedveil.enclave.triplet.loss_and_derivatives` in this process on float32 embeddings (what
the protocol sends), ``samples`` per participant, labelled by participant, from each of its sources:

- :data:`SYNTHETIC`: ``dim`` wide, drawn around a per-participant centre and normalised to unit length,
  like a metric-learning embedding (:func:`clustered_embeddings`);
- :class:`TrainedEmbeddings`: the outputs of the embedding network of a short real FDML run (the
  simulation, ``rounds`` rounds at ``lr``), for ``participants`` training users of its population, each
  embedding ``samples`` of its own training samples drawn as a device draws them; ``dim`` must be the
  network's width (64). Alg. 1's cost depends on how the embeddings spread: on trained ones part of the
  triplets fall inactive and more pairs are close against their norms (the exact path).

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

import itertools
import statistics
import time
import tracemalloc
from collections.abc import Sequence
from functools import cached_property
from typing import Any, Protocol

import numpy as np

from fedveil.enclave.triplet import DEFAULT_MEMORY_LIMIT_BYTES, STRATEGIES, loss_and_derivatives
from fedveil.errors import ConfigError
from fedveil.experiments.fdml.triplet_reference import (
    REFERENCE_MEMORY_BYTES,
    reference_fits,
    reference_loss_and_derivatives,
)
from fedveil.runtime.threads import thread_settings

__all__ = [
    "PAPER_TABLE_V_SECONDS",
    "SYNTHETIC",
    "TRAINED_LR",
    "TRAINED_ROUNDS",
    "EmbeddingSource",
    "TrainedEmbeddings",
    "bench_enclave",
    "clustered_embeddings",
    "cohort_embeddings",
]

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


TRAINED_LR = 3e-3
"""Learning rate of the short FDML run behind trained embeddings: that of the repository's FDML configs
(``configs/table1_fdml.yaml``), at which the embedding network spreads its outputs within tens of
rounds; at FDML's own 1e-4 (the config's default) it would take thousands."""

TRAINED_ROUNDS = 60
"""Rounds of that run by default: as many as ``fedveil bench rounds`` warms up for."""


class EmbeddingSource(Protocol):
    """Where a benchmark's embeddings come from: ``name`` (recorded in each row as ``source``),
    ``details`` (recorded as ``source_details``), :meth:`check` of the sizes before any timing, and the
    call that draws ``(participants * samples, dim)`` float32 embeddings and their participant labels."""

    name: str

    @property
    def details(self) -> dict[str, Any]:
        """What a row records about the source."""
        ...

    def check(self, participants: Sequence[int], samples: int, dim: int) -> None:
        """Raise :class:`~fedveil.errors.ConfigError` where the source cannot give these sizes."""
        ...

    def __call__(
        self, participants: int, samples: int, dim: int, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """Embeddings ``(participants * samples, dim)`` float32 and labels ``(participants * samples,)``."""
        ...


class _Synthetic:
    """:func:`clustered_embeddings` as an :class:`EmbeddingSource`."""

    name = "synthetic"

    @property
    def details(self) -> dict[str, Any]:
        """The spread of a participant's samples around its centre."""
        return {"noise": NOISE}

    def check(self, participants: Sequence[int], samples: int, dim: int) -> None:
        """Any sizes will do."""

    def __call__(
        self, participants: int, samples: int, dim: int, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """:func:`clustered_embeddings`."""
        return clustered_embeddings(participants, samples, dim, rng)


SYNTHETIC: EmbeddingSource = _Synthetic()
"""The seeded clustered unit embeddings (:func:`clustered_embeddings`)."""


def cohort_embeddings(
    population: Any, flat: Any, weights: np.ndarray, participants: int, samples: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """What the enclave sees in a round of ``participants`` devices: that many distinct training users
    of ``population`` drawn by ``rng``, each embedding ``samples`` of its training samples (drawn by
    ``rng`` as a device draws them) with the network ``flat`` under ``weights``, embedded where ``flat``'s
    module is (a trainer's: on its run's device). Returns float32 ``(participants * samples, d)`` in host
    memory and the labels ``(participants * samples,)``, by participant."""
    from fedveil.experiments.fdml.runner import embed_samples

    ids = population.train_user_ids()
    _check_users(participants, len(ids))
    users = [ids[i] for i in rng.choice(len(ids), size=participants, replace=False)]
    inputs = np.stack([population.sample_training(uid, samples, rng) for uid in users])
    x = embed_samples(flat, weights, inputs).reshape(participants * samples, -1)
    labels = np.repeat(np.arange(participants, dtype=np.int64), samples)
    return np.ascontiguousarray(x, dtype=np.float32), labels


def _check_users(participants: int, users: int) -> None:
    """A cohort draws distinct users: at most as many as the population's training users."""
    if participants > users:
        raise ConfigError(
            f"{participants} participants, but the population has {users} training users: draw at most "
            f"{users}, or build a larger population (data.train_users_per_model)"
        )


class TrainedEmbeddings:
    """Embeddings of the network a short real FDML run trained, as an :class:`EmbeddingSource`.

    The run is ``fedveil run``'s FDML simulation of the default config with ``overrides`` (its cohort
    ``fdml.num_required`` x ``fdml.samples_per_client``, 64 x 8 by default), ``fdml.lr`` set to ``lr``
    and Alg. 1 called in-process (``enclave.boundary=none``: the same numbers as through the emulated TEE,
    without its processes), for ``rounds`` rounds from the seeded initial network. The population is
    built here, so :meth:`check` refuses sizes before the run; the run itself happens at the first draw.
    Each draw is :func:`cohort_embeddings` of the trained network.
    """

    name = "trained"

    def __init__(
        self, overrides: Sequence[str] = (), *, rounds: int = TRAINED_ROUNDS, lr: float = TRAINED_LR
    ) -> None:
        from fedveil.experiments.config import load_config
        from fedveil.experiments.fdml.runner import EMBEDDING_DIM, build_population

        if rounds < 0 or not lr > 0:
            raise ConfigError(
                f"training rounds {rounds} must be >= 0 (--train-rounds) and lr {lr} > 0 (--train-lr)"
            )
        self.cfg = load_config(
            None, ["protocol=fdml", *overrides, f"fdml.lr={lr}", "enclave.boundary=none"], refuse_ignored=True
        )
        self.rounds = rounds
        self.width = EMBEDDING_DIM
        self.population = build_population(self.cfg)
        self.losses: list[float] = []

    @property
    def details(self) -> dict[str, Any]:
        """The run: rounds, learning rate, cohort, and its first and last rounds' triplet loss."""
        return {
            "train_rounds": self.rounds,
            "train_lr": self.cfg.fdml.lr,
            "train_cohort": [self.cfg.fdml.num_required, self.cfg.fdml.samples_per_client],
            "train_loss_first": self.losses[0] if self.losses else None,
            "train_loss_last": self.losses[-1] if self.losses else None,
        }

    def check(self, participants: Sequence[int], samples: int, dim: int) -> None:
        """``dim`` must be the network's width, and every count at most the training users."""
        if dim != self.width:
            raise ConfigError(
                f"dim {dim}: trained embeddings are the FDML network's outputs, {self.width} wide; use dim "
                f"{self.width}, or synthetic embeddings only"
            )
        _check_users(max(participants), len(self.population.train_user_ids()))

    @cached_property
    def _network(self) -> tuple[Any, np.ndarray]:
        """Run the training once: the embedding network and its trained weights."""
        import asyncio

        from fedveil.experiments.fdml.runner import build_trainer

        trainer = build_trainer(self.cfg, self.population)

        async def go() -> None:
            await trainer.server.register(trainer.runtime)
            for rnd in range(1, self.rounds + 1):
                report = await trainer.server.run_round(rnd, trainer.runtime)
                if report.loss is not None:
                    self.losses.append(float(report.loss))

        try:
            asyncio.run(go())
        finally:
            trainer.close()
        return trainer.embed_flat, trainer.embedding_weights()

    def __call__(
        self, participants: int, samples: int, dim: int, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """:func:`cohort_embeddings` of the trained network (trained at the first call)."""
        self.check([participants], samples, dim)
        flat, weights = self._network
        return cohort_embeddings(self.population, flat, weights, participants, samples, rng)


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
    sources: Sequence[EmbeddingSource] = (SYNTHETIC,),
) -> list[dict[str, Any]]:
    """One row per participant count and source, in that order (see the module docstring); seconds,
    bytes, counts. Each source draws from its own generator seeded with ``seed``."""
    if not participants or min(participants) < 2 or samples < 2 or dim < 1 or repeats < 1:
        raise ConfigError(
            f"need participant counts >= 2, samples >= 2, dim >= 1 and repeats >= 1; got participants="
            f"{list(participants)}, samples={samples}, dim={dim}, repeats={repeats}"
        )
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    for source in sources:
        source.check(participants, samples, dim)
    rngs = [np.random.default_rng(seed) for _ in sources]
    rows = []
    for count, (source, rng) in itertools.product(participants, list(zip(sources, rngs, strict=True))):
        x, labels = source(count, samples, dim, rng)

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
                "source": source.name,
                "source_details": source.details,
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
