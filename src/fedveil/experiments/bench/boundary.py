"""Benchmark: FDML step 5 (Alg. 1) across the enclave boundary versus the direct in-process call.

FDML Table V (Sec. VIII) times Alg. 1 with the "batch all" strategy inside
SGX for 64 to 512 participants. For each participant count this measures, on the same embeddings as
the in-process benchmark, from each of its sources (:mod:`fedveil.experiments.bench.enclave`: the
synthetic clustered unit vectors, or a short FDML run's trained network; ``samples`` per participant,
``dim`` wide, float32, labelled by participant):

- ``direct_s``: :func:`fedveil.enclave.triplet.loss_and_derivatives` called in this process;
- ``boundary_s``: the whole boundary path: every client seals its embeddings, the host relays them to
  the enclave (``boundary="process"``: a separate process, over pipes), the enclave opens them, runs
  Alg. 1 within its memory plan, seals each client's derivatives, and every client opens its own;
- ``enclave_call_s``: only the host's call into the enclave (IPC, enclave-side crypto and the maths),
  what the FDML server waits for while the devices seal and open their own records in parallel.

``overhead`` is ``boundary_s / direct_s - 1`` (every client's crypto counted, one after another) and
``call_overhead`` is ``enclave_call_s / direct_s - 1``.

Medians over ``repeats`` after one warm-up of each; the direct calls run as one block before the
boundary calls, so neither competes with the other's leftover threads. Sessions are attested once,
outside the timing.
``max_abs_diff`` compares the derivatives the clients receive with the direct call's.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedveil.core.attestation_verify import EnclaveClientSession, SimulatedQuoteVerifier
from fedveil.enclave.measure import DEFAULT_MEMORY_LIMIT_BYTES, EnclaveConfig, measure_enclave
from fedveil.enclave.triplet import loss_and_derivatives
from fedveil.errors import ConfigError
from fedveil.experiments.bench.enclave import PAPER_TABLE_V_SECONDS, SYNTHETIC, EmbeddingSource
from fedveil.runtime.enclave_host import EnclaveHost
from fedveil.runtime.quoting import SimulatedPlatform
from fedveil.runtime.threads import thread_settings


def bench_enclave_boundary(
    participants: Sequence[int] = (64, 128, 256, 512),
    samples: int = 8,
    dim: int = 64,
    strategy: str = "batch-all",
    repeats: int = 5,
    seed: int = 0,
    *,
    boundary: str = "process",
    margin: float = 1.0,
    memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES,
    sources: Sequence[EmbeddingSource] = (SYNTHETIC,),
) -> list[dict[str, Any]]:
    """One row per participant count and source, in that order (module docstring); times in seconds,
    memory in bytes. Each source draws from its own generator seeded with ``seed``."""
    if repeats < 1 or samples < 2 or dim < 1 or not participants or min(participants) < 2:
        raise ConfigError(
            f"need repeats >= 1, samples >= 2, dim >= 1 and participant counts >= 2; got repeats={repeats}, "
            f"samples={samples}, dim={dim}, participants={list(participants)}"
        )
    for source in sources:
        source.check(participants, samples, dim)
    rngs = [np.random.default_rng(seed) for _ in sources]
    config = EnclaveConfig(memory_limit_bytes=memory_limit_bytes, margin=margin, strategy=strategy)
    platform = SimulatedPlatform.generate()
    verifier = SimulatedQuoteVerifier(platform.public_key)
    expected = measure_enclave(config).digest
    rows = []
    with EnclaveHost.start(config, platform=platform, boundary=boundary) as host:
        for count, (source, rng) in itertools.product(participants, list(zip(sources, rngs, strict=True))):
            ids = [f"p{i:04d}" for i in range(count)]
            sessions = {}
            for cid in ids:
                session = EnclaveClientSession(cid, verifier=verifier, expected_measurement=expected)
                session.establish(host.open_session(session.hello()))
                sessions[cid] = session
            stacked, labels = source(count, samples, dim, rng)
            embeddings = dict(zip(ids, np.split(stacked, count), strict=True))
            direct, through, call = [], [], []
            for rep in range(repeats + 1):
                start = time.perf_counter()
                reference = loss_and_derivatives(
                    stacked, labels, margin=margin, strategy=strategy, memory_limit_bytes=memory_limit_bytes
                )
                if rep:
                    direct.append(time.perf_counter() - start)
            received: dict[str, np.ndarray] = {}
            peak = 0
            for rnd in range(repeats + 1):
                start = time.perf_counter()
                sealed = {c: sessions[c].seal_embeddings(rnd, embeddings[c]) for c in ids}
                t_call = time.perf_counter()
                result = host.loss_and_derivatives(rnd, sealed, shape=(samples, dim))
                t_call = time.perf_counter() - t_call
                received = {c: sessions[c].open_derivatives(rnd, result.derivatives[c]) for c in ids}
                t_through = time.perf_counter() - start
                peak = max(peak, result.peak_bytes)
                if rnd:
                    through.append(t_through)
                    call.append(t_call)
            ours = np.concatenate([received[c] for c in ids])
            want = np.asarray(reference.derivatives, dtype=np.float32)
            d, b = statistics.median(direct), statistics.median(through)
            rows.append(
                {
                    "participants": count,
                    "source": source.name,
                    "source_details": source.details,
                    "samples_per_participant": samples,
                    "embeddings": count * samples,
                    "dim": dim,
                    "strategy": strategy,
                    "boundary": boundary,
                    "direct_s": d,
                    "boundary_s": b,
                    "enclave_call_s": statistics.median(call),
                    "overhead": b / d - 1,
                    "call_overhead": statistics.median(call) / d - 1,
                    "peak_bytes": peak,
                    "memory_limit_bytes": memory_limit_bytes,
                    "max_abs_diff": float(np.max(np.abs(ours - want))) if ours.size else 0.0,
                    "paper_table_v_s": PAPER_TABLE_V_SECONDS.get(count),
                    "repeats": repeats,
                    "threads": thread_settings(),
                }
            )
    return rows
