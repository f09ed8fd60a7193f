"""Benchmark: FDML training rounds per second in the simulation runtime, and the floor under it.

Measures whole rounds (selection, codec round trips of every message, client forward and backward
passes, enclave loss and derivatives, Eq. 2, Adam) at the paper's TouchAuth setting (64
participants x 8 samples) on the full synthetic population, after a warm-up. ``protocol="fedavg"``
measures Table I's FL-traditional baseline the same way (64 devices x 8 samples, one local SGD step,
FedAvg's weighted average), with a floor of its own: the devices' FLOPs at the peak GEMM rate, every
message encoded and decoded once, and one read of every reply for the average.

The floor (what no implementation can beat) is measured in the same run:

- ``device_flops_per_round``: floating-point operations of the devices' work in one round (forward of
  the cohort's samples and the per-device backward), *counted* by torch's ``FlopCounterMode`` over the
  client pool's calls, not estimated;
- ``peak_gemm_gflops``: a large square float32 matmul at the same thread count, on the run's ``device``
  (the machine's best case: the CPU's, or the GPU's when the devices train on one);
- ``alg1_seconds``: the enclave's Alg. 1 on a round's embeddings (participants x samples, 64-d): a
  cohort drawn after the timed blocks and embedded by the network as it then stands
  (:func:`fedveil.experiments.bench.enclave.cohort_embeddings`), so untrained or trained as the timed
  rounds saw them; ``alg1_active_fraction`` is the share of its valid triplets that are active;
- ``sealed_bytes_per_round``: the uploads and the derivatives (what crosses the enclave channel), each
  byte sealed once and opened once, at the measured AES-256-GCM rate;
- ``copied_bytes_per_round`` at the measured memcpy rate: every distinct message written once and read
  once (a broadcast is encoded once for all its recipients: ``bytes_down_coded_per_round``, not the
  metered ``bytes_down_per_round``), and the aggregation's one read of every upload (Eq. 2);
- on a GPU only, ``host_to_device_bytes_per_round`` (every distinct message sent down,
  ``bytes_down_coded_per_round``) and ``device_to_host_bytes_per_round`` (every upload,
  ``bytes_up_per_round``) at the measured copy rates each way (``host_to_device_bytes_per_second``,
  ``device_to_host_bytes_per_second``): the codec and the enclave work in host memory, so each message
  crosses between the host and the GPU at least once;
- ``floor_seconds`` = device FLOPs at the peak GEMM rate + Alg. 1 + sealing + copying (+ crossing, on a
  GPU), and
  ``fraction_of_floor`` = floor_seconds / measured seconds per round (1.0 would be a round at the floor).

Two cases for FDML, side by side (``trained_lr``): the config as given (FDML's lr 1e-4 by default, at
which the embedding network barely moves in a warm-up of tens of rounds, so the timed rounds see an
untrained network's embeddings: every triplet active), and under ``"trained"`` the same bench with
``fdml.lr`` set to ``trained_lr`` for the warm-up and the timed rounds (3e-3, the repository's FDML
configs', by default from ``fedveil bench rounds``): the case a user's training runs, on embeddings
that have spread out, part of the triplets inactive. The peak GEMM, AES-GCM and memcpy rates are
measured once for both.
"""

from __future__ import annotations

import asyncio
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedveil.core.heap import retain_freed_memory
from fedveil.enclave.triplet import TripletResult, loss_and_derivatives
from fedveil.errors import ConfigError
from fedveil.experiments.bench.enclave import cohort_embeddings
from fedveil.experiments.bench.floor import host_device_bytes_per_second, peak_gemm_flops_per_second
from fedveil.experiments.config import ExperimentConfig, load_config
from fedveil.experiments.fdml.runner import EMBEDDING_DIM, build_population, build_trainer
from fedveil.models.device import resolve_device
from fedveil.runtime.threads import thread_settings


def bench_rounds(
    *,
    rounds: int = 30,
    repeats: int = 3,
    batched: bool = True,
    threads: int = 2,
    overrides: tuple[str, ...] = (),
    profile: bool = False,
    warmup: int = 60,
    protocol: str = "fdml",
    trained_lr: float | None = None,
) -> dict[str, Any]:
    """Median rounds per second of ``protocol`` (``fdml`` or ``fedavg``, FL-traditional) over ``repeats``
    timed blocks of ``rounds`` rounds each, after ``warmup`` untimed training rounds; ``profile`` adds one
    more block of ``rounds`` rounds under cProfile and reports seconds per round by phase.

    The warm-up matters: Alg. 1's cost depends on the embeddings. From the initial model every valid
    triplet is active; once training has spread the embeddings part of the triplets fall inactive and
    more pairs are close against their norms. At the config's learning rate (FDML's 1e-4) tens of
    rounds do not get there; ``trained_lr`` (FDML only) adds the case that does, under ``"trained"``: the
    same fields, with ``fdml.lr`` = ``trained_lr`` for the warm-up and the timed rounds (module docstring).
    """
    if protocol not in PROTOCOL_PHASES:
        raise ConfigError(f"protocol {protocol!r} is not one of {', '.join(PROTOCOL_PHASES)}")
    if trained_lr is not None and (protocol != "fdml" or not trained_lr > 0):
        raise ConfigError(
            f"trained_lr {trained_lr!r}: the trained case is FDML's (Alg. 1 on trained embeddings) and its "
            f"learning rate must be > 0; protocol is {protocol!r}"
        )
    torch.set_num_threads(threads)
    retain_freed_memory()
    settings = [f"protocol={protocol}", f"runtime.batched={str(batched).lower()}", *overrides]
    cfg = load_config(None, settings)
    population = build_population(cfg)
    rates = _machine_rates(threads, str(resolve_device(cfg.device)))
    case = {"rounds": rounds, "repeats": repeats, "threads": threads, "profile": profile, "warmup": warmup}
    row = _bench_case(cfg, population, rates, **case)
    if trained_lr is not None:
        trained = load_config(None, [*settings, f"fdml.lr={trained_lr}"])
        row["trained"] = _bench_case(trained, population, rates, **case)
    return row


def _bench_case(
    cfg: ExperimentConfig,
    population: Any,
    rates: dict[str, float],
    *,
    rounds: int,
    repeats: int,
    threads: int,
    profile: bool,
    warmup: int,
) -> dict[str, Any]:
    """:func:`bench_rounds`'s fields for one config: a fresh trainer, warmed up, timed, floored."""
    protocol = cfg.protocol
    trainer = build_trainer(cfg, population)
    per_block: list[float] = []
    warm: dict[str, Any] = {}

    async def go() -> None:
        await trainer.server.register(trainer.runtime)
        warm["flops"] = await _count_device_flops(trainer, 0)  # the warm-up round, counted
        for rnd in range(1, warmup + 1):
            await trainer.server.run_round(rnd, trainer.runtime)
        warm["stats"] = trainer.runtime.stats().copy()
        rnd = warmup + 1
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(rounds):
                await trainer.server.run_round(rnd, trainer.runtime)
                rnd += 1
            per_block.append(rounds / (time.perf_counter() - start))
        warm["stats"] = _stats_minus(trainer.runtime.stats().copy(), warm["stats"])
        if profile:
            warm["profile"] = await _profile_rounds(trainer, rnd, rounds, protocol)

    try:
        asyncio.run(go())
    finally:
        trainer.close()
    alg1 = None
    if protocol == "fdml":
        participants, samples = cfg.fdml.num_required, cfg.fdml.samples_per_client
        x, labels = cohort_embeddings(
            population,
            trainer.embed_flat,
            trainer.embedding_weights(),
            participants,
            samples,
            np.random.default_rng([cfg.seed, 3]),
        )
        alg1 = functools.partial(
            loss_and_derivatives, x, labels, margin=cfg.fdml.margin, strategy=cfg.fdml.strategy
        )
    else:
        participants, samples = cfg.fedavg.clients_per_round, cfg.fedavg.samples_per_client
    timed = rounds * repeats
    rate = statistics.median(per_block)
    bytes_up = warm["stats"].bytes_up / timed
    bytes_down = warm["stats"].bytes_down / timed
    coded_down = warm["stats"].bytes_down_coded / timed
    if protocol == "fdml":
        # sealed: what devices upload (embeddings, gradients) and the derivatives sent back, each byte
        # sealed once and opened once; the weights broadcast travels in plaintext
        sealed = bytes_up + participants * samples * EMBEDDING_DIM * 4
        sealed_bytes = 2 * sealed if cfg.enclave.boundary != "none" else 0.0
    else:
        sealed_bytes = 0.0  # FL-traditional has no enclave
    floor = _floor(
        flops=warm["flops"],
        alg1=alg1,
        sealed_bytes=sealed_bytes,
        # every distinct message written once and read once, and the aggregation's read of every upload
        # (Eq. 2 in the enclave, FedAvg's average on the server)
        copied_bytes=2 * (bytes_up + coded_down) + bytes_up,
        crossing_bytes={"host_to_device": coded_down, "device_to_host": bytes_up},
        rates=rates,
    )
    return {
        "protocol": protocol,
        "enclave_boundary": cfg.enclave.boundary if protocol == "fdml" else "none",
        "participants": participants,
        "samples": samples,
        "lr": cfg.fdml.lr if protocol == "fdml" else cfg.fedavg.lr,
        "batched": cfg.runtime.batched,
        "threads": threads,
        "thread_settings": thread_settings(),
        "warmup_rounds": warmup,
        "rounds_per_second": rate,
        "rounds_per_second_runs": per_block,
        "seconds_for_15000_rounds": 15000 / rate,
        "bytes_up_per_round": bytes_up,
        "bytes_down_per_round": bytes_down,
        "bytes_down_coded_per_round": coded_down,
        **floor,
        "device_gflops_achieved": warm["flops"] / 1e9 * rate,
        "fraction_of_floor": floor["floor_seconds"] * rate,
        **({"profile_seconds_per_round": warm["profile"]} if profile else {}),
    }


def _stats_minus(after: Any, before: Any) -> Any:
    """Traffic of the timed blocks alone (a profiled block may follow them)."""
    after.bytes_up -= before.bytes_up
    after.bytes_down -= before.bytes_down
    after.bytes_down_coded -= before.bytes_down_coded
    return after


#: Phases of an FDML round and the functions whose cumulative time makes each (``(module suffix, name)``);
#: a phase's own time excludes the phases nested in it (the embeddings' sealing inside the forward
#: phase, the derivatives' opening inside the backward phase, the codec inside the runtime). Gradients
#: are sealed as the runtime takes each upload (a ``Deferred`` reply), outside the backward phase, and
#: each valid upload goes into step 9's stream then (``enclave_step9_stream``: writing the requests into
#: the shared region); ``enclave_step9_eq2`` is the wait for the requests still running after the last.
PHASES: dict[str, tuple[tuple[str, str], ...]] = {
    "device_forward": (("protocols/fdml.py", "_embed"),),
    "device_backward": (("protocols/fdml.py", "_backprop"),),
    "device_sealing": (
        ("core/attestation_verify.py", "seal_embeddings"),
        ("core/attestation_verify.py", "seal_gradient"),
        ("core/attestation_verify.py", "open_derivatives"),
    ),
    "enclave_step5_alg1": (("protocols/fdml.py", "step_five"),),
    "enclave_step9_eq2": (("protocols/fdml.py", "step_nine"),),
    "enclave_step9_stream": (("runtime/enclave_host.py", "add"),),
    "adam": (("torch/optim/adam.py", "step"),),
    "codec": (("core/codec.py", "encode"), ("core/codec.py", "decode")),
}

#: Phases of an FL-traditional round: the devices' local step (each device's sampling included), FedAvg's
#: weighted average (the running sum each accepted upload is folded into, and its one division) and the
#: codec; ``other`` is selection, validation and Python.
FEDAVG_PHASES: dict[str, tuple[tuple[str, str], ...]] = {
    "device_step": (("protocols/fedavg.py", "_train"),),
    "aggregation": (
        ("core/aggregation.py", "weighted_average"),
        ("core/aggregation.py", "add"),
        ("core/aggregation.py", "result"),
    ),
    "codec": (("core/codec.py", "encode"), ("core/codec.py", "decode")),
}

PROTOCOL_PHASES = {"fdml": PHASES, "fedavg": FEDAVG_PHASES}


async def _profile_rounds(trainer: Any, first: int, rounds: int, protocol: str = "fdml") -> dict[str, float]:
    """Seconds per round by phase (:data:`PROTOCOL_PHASES`), from cProfile's cumulative times over
    ``rounds`` rounds. FDML's enclave phases are what the host waits for (the pipe, the enclave's work and
    its sealing); ``other`` is the rest of the round (selection, validation, Python). cProfile slows
    Python code, so the shares are indicative; ``profiled_round_seconds`` says by how much."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for rnd in range(first, first + rounds):
        await trainer.server.run_round(rnd, trainer.runtime)
    prof.disable()
    total = (time.perf_counter() - start) / rounds
    table = pstats.Stats(prof).stats  # type: ignore[attr-defined]

    def cumulative(keys: tuple[tuple[str, str], ...]) -> float:
        return (
            sum(
                ct
                for (path, _, name), (_, _, _, ct, _) in table.items()
                if any(path.replace("\\", "/").endswith(suffix) and name == fn for suffix, fn in keys)
            )
            / rounds
        )

    if protocol == "fedavg":
        out = {phase: cumulative(keys) for phase, keys in FEDAVG_PHASES.items()}
        out["other"] = total - sum(out.values())
        out["profiled_round_seconds"] = total
        return out
    raw = {phase: cumulative(keys) for phase, keys in PHASES.items()}
    sealing = raw["device_sealing"]
    out = {
        "device_forward": raw["device_forward"] - cumulative(PHASES["device_sealing"][:1]),
        "device_backward": raw["device_backward"] - cumulative(PHASES["device_sealing"][2:]),
        "device_sealing": sealing,
        "enclave_step5_alg1": raw["enclave_step5_alg1"],
        "enclave_step9_eq2": raw["enclave_step9_eq2"],
        "enclave_step9_stream": raw["enclave_step9_stream"],
        "adam": raw["adam"],
        "codec": raw["codec"],
    }
    out["other"] = total - sum(out.values())
    out["profiled_round_seconds"] = total
    return out


async def _count_device_flops(trainer: Any, rnd: int) -> float:
    """FLOPs of the devices' work in round ``rnd`` (matmuls and convolutions, as torch's
    ``FlopCounterMode`` counts them), over every call of the client pool in that round.

    A model without a written-out backward (no ``trace``, e.g. CameraAuth's ResNet-34) is counted on the
    pool's one-by-one path, which computes the same numbers (``tests/test_protocols_fdml.py``): under
    ``vmap(grad(...))`` the per-device weight gradients of a convolution run as grouped convolutions
    that ``FlopCounterMode`` counts many times over (351 GFLOP per CameraAuth round against about 20
    by the one-by-one path)."""
    from torch.utils.flop_counter import FlopCounterMode

    pool = trainer.pool
    inner = pool.handle_batch
    total = [0]
    batched = pool.batched
    if not (hasattr(pool.flat.module, "trace") or getattr(pool, "written_backward", False)):
        pool.batched = False

    def counted(msgs: Any) -> Any:
        counter = FlopCounterMode(display=False)
        with counter:
            out = inner(msgs)
        total[0] += counter.get_total_flops()
        return out

    pool.handle_batch = counted
    try:
        report = await trainer.server.run_round(rnd, trainer.runtime)
    finally:
        del pool.handle_batch
        pool.batched = batched
    if not report.applied or report.attempts != 1:
        raise RuntimeError(f"the counted round {rnd} did not run once cleanly ({report.as_dict()})")
    return float(total[0])


def _median_seconds(fn: Any, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _machine_rates(threads: int, device: str = "cpu") -> dict[str, float]:
    """The machine's rates under the floor, measured here: the peak GEMM (GFLOP/s on ``threads`` torch
    threads, on ``device``: where the devices train), AES-256-GCM sealing and memcpy (bytes per second,
    in host memory, where the codec and the enclave work), and on a GPU the copy rates between host
    memory and it, each way (:func:`~fedveil.experiments.bench.floor.host_device_bytes_per_second`)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    torch.set_num_threads(threads)
    peak = peak_gemm_flops_per_second(threads, device=device) / 1e9
    crossing = {}
    if torch.device(device).type == "cuda":
        crossing = {
            f"{way}_bytes_per_second": rate for way, rate in host_device_bytes_per_second(device).items()
        }
    block = os.urandom(2**20)
    aes, nonce = AESGCM(os.urandom(32)), os.urandom(12)
    aes_rate = len(block) / _median_seconds(lambda: aes.encrypt(nonce, block, None))
    big = np.ones(2**24, dtype=np.uint8)
    copy_rate = big.nbytes / _median_seconds(lambda: big.copy())
    return {
        "peak_gemm_gflops": peak,
        "aes_gcm_bytes_per_second": aes_rate,
        "memcpy_bytes_per_second": copy_rate,
        **crossing,
    }


def _floor(
    *,
    flops: float,
    alg1: Callable[[], TripletResult] | None,
    sealed_bytes: float,
    copied_bytes: float,
    crossing_bytes: dict[str, float],
    rates: dict[str, float],
) -> dict[str, Any]:
    """The floor's parts (module docstring) at the measured ``rates`` (:func:`_machine_rates`), with
    ``alg1`` (Alg. 1 on a round's embeddings; None: no enclave, FedAvg) timed here. ``crossing_bytes``
    (bytes a round moves ``host_to_device`` and ``device_to_host``) count only where ``rates`` has the
    copy rates between host and GPU, i.e. when the devices train on a GPU."""
    alg1_seconds = _median_seconds(alg1) if alg1 is not None else 0.0
    active = alg1().active_fraction if alg1 is not None else None
    parts = {
        **rates,
        "device_flops_per_round": flops,
        "device_seconds_at_peak": flops / (rates["peak_gemm_gflops"] * 1e9),
        "alg1_seconds": alg1_seconds,
        "alg1_active_fraction": active,
        "sealed_bytes_per_round": sealed_bytes,
        "copied_bytes_per_round": copied_bytes,
    }
    crossing_seconds = 0.0
    for way, nbytes in crossing_bytes.items():
        if f"{way}_bytes_per_second" in rates:
            parts[f"{way}_bytes_per_round"] = nbytes
            crossing_seconds += nbytes / rates[f"{way}_bytes_per_second"]
    parts["floor_seconds"] = (
        parts["device_seconds_at_peak"]
        + alg1_seconds
        + sealed_bytes / rates["aes_gcm_bytes_per_second"]
        + copied_bytes / rates["memcpy_bytes_per_second"]
        + crossing_seconds
    )
    return parts
