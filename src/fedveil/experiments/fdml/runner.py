"""Run one experiment from its config and write its run directory.

``runs/<name>/`` receives ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one JSON line per
round, fsynced as it is written, plus one ``{"eval": ...}`` line per evaluation), ``checkpoint.npz``
(the server's state after the latest round, written after that round's line), ``results.json`` (final
metrics) and PNG plots (:func:`~fedveil.experiments.fdml.figures.run_figures`: ``loss.png``,
``active_fraction.png``, ``accuracy.png``, ``roc.png``; ``round_timing.png`` where devices report
timings).
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from tqdm import tqdm

from fedveil.core.atomic import atomic_write
from fedveil.core.attestation_verify import EnclaveClientSession, SimulatedQuoteVerifier
from fedveil.core.heap import retain_freed_memory
from fedveil.core.provenance import code_identity
from fedveil.data.cameraauth import cameraauth_from_folder, synthetic_cameraauth
from fedveil.data.touch_csv import load_touch_population
from fedveil.data.touchauth import TouchAuthConfig, generate_touchauth
from fedveil.enclave.measure import EnclaveConfig, measure_enclave
from fedveil.errors import ConfigError, RunInterrupted
from fedveil.eval.verification import authentication_accuracy
from fedveil.experiments.checkpoint import (
    CHECKPOINT,
    Checkpoint,
    SpendLog,
    StopAtRoundEnd,
    check_checkpoint_identity,
    claim_device,
    config_digest,
    crash_point,
    differing_settings,
    identity_settings,
    load_checkpoint,
    prepare_run_dir,
    save_checkpoint,
    saved_settings,
)
from fedveil.experiments.config import ExperimentConfig, config_to_dict
from fedveil.experiments.fdml.figures import write_run_plots
from fedveil.experiments.fdml.privacy_setup import PrivacyPlan, plan_privacy
from fedveil.experiments.plots import plot_round_timing, summarise_timings
from fedveil.models.device import module_device, resolve_device
from fedveil.models.faces import ResNet34Embedding
from fedveil.models.flat import FlatModel
from fedveil.models.touchauth import TouchAuthNet
from fedveil.protocols.common import pool_rng_states, restore_pool_rngs
from fedveil.protocols.fdml import AttestedEnclave, DPRelease, FDMLClients, FDMLServer, LocalEnclave
from fedveil.protocols.fedavg import EmbeddingClassifier, FedAvgClients, FedAvgServer
from fedveil.runtime.enclave_host import EnclaveHost
from fedveil.runtime.quoting import SimulatedPlatform
from fedveil.runtime.simulation import LatencyModel, PhaseFaults, SimulationRuntime

EMBEDDING_DIM = 64


@dataclass
class Trainer:
    """A server, its runtime (the simulation with its client pool, or a network of device agents), how
    to read the embedding network off the server, what to close when the run ends (the enclave), and the
    ``device`` the embedding network ``embed_flat`` is evaluated on (where its module is)."""

    server: Any
    runtime: Any
    embed_flat: FlatModel
    embedding_weights: Callable[[], np.ndarray]
    enclave_host: Any = None
    pool: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def close(self) -> None:
        """Shut the enclave down (idempotent)."""
        if self.enclave_host is not None:
            self.enclave_host.close()


def build_population(cfg: ExperimentConfig) -> Any:
    """The users of the experiment: the synthetic TouchAuth population, real touch logs, or CameraAuth's
    people (synthetic faces or a VGGFace2-layout folder)."""
    d = cfg.data
    if d.kind.startswith("cameraauth"):
        sizes = {
            "train_people": d.train_people,
            "test_people": d.test_people,
            "train_photos": d.train_photos,
            "test_photos": d.test_photos,
            "size": d.image_size,
            "seed": d.seed,
        }
        if d.kind == "cameraauth-folder":
            return cameraauth_from_folder(d.path, **sizes)
        return synthetic_cameraauth(**sizes)
    if cfg.data.kind == "touchauth-csv":
        return load_touch_population(
            cfg.data.path, test_users_per_model=cfg.data.test_users_per_model[0], seed=cfg.data.seed
        )
    return generate_touchauth(
        TouchAuthConfig(
            seed=cfg.data.seed,
            train_users_per_model=cfg.data.train_users_per_model,
            test_users_per_model=cfg.data.test_users_per_model,
        )
    )


def _faults(cfg: ExperimentConfig) -> dict[str, PhaseFaults]:
    out = {}
    for phase in ("embed", "grad", "train"):
        sec = getattr(cfg.faults, phase)
        out[phase] = PhaseFaults(
            sec.fail_prob, LatencyModel(sec.latency.kind, sec.latency.mean, sec.latency.spread)
        )
    return out


def input_shape(cfg: ExperimentConfig) -> tuple[int, ...]:
    """The shape of one sample: a touch window ``(1, 30, 10)`` or a photo ``(3, S, S)``."""
    if cfg.data.kind.startswith("cameraauth"):
        return (3, cfg.data.image_size, cfg.data.image_size)
    return (1, 30, 10)


def _models(cfg: ExperimentConfig, num_users: int) -> tuple[FlatModel, FlatModel]:
    """(the embedding network, the model the protocol trains), initialised from ``cfg.seed``."""
    torch.manual_seed(cfg.seed)
    embed_net: torch.nn.Module
    if cfg.network == "resnet34":
        embed_net = ResNet34Embedding(EMBEDDING_DIM, width=cfg.model.width, norm=cfg.model.norm)
    else:
        embed_net = TouchAuthNet(EMBEDDING_DIM)
    embed_flat = FlatModel(embed_net)
    if cfg.protocol == "fdml":
        return embed_flat, embed_flat
    return embed_flat, FlatModel(EmbeddingClassifier(embed_net, EMBEDDING_DIM, num_users))


def build_clients(
    cfg: ExperimentConfig,
    population: Any,
    *,
    sessions: dict[str, EnclaveClientSession] | None = None,
    defer_uploads: bool = False,
) -> Any:
    """The device side of ``cfg.protocol`` for ``population``: the client pool the simulation runs
    in-process and a device agent hosts (the same code either way). ``sessions`` are the devices'
    attested enclave sessions (FDML through the emulated TEE); ``defer_uploads`` (the in-process
    simulation): FDML devices seal their gradients as the simulation runtime takes each upload
    (:class:`~fedveil.core.communicator.Deferred`), not all before the first, and FL-traditional devices
    write their new weights straight into their replies' bytes (``FedAvgClients(encoded_replies=True)``)."""
    ids = population.train_user_ids()
    attributes = {uid: dict(population.train.user(uid).attributes) for uid in ids}
    _, model = _models(cfg, len(ids))
    common: dict[str, Any] = {
        "attributes": attributes,
        "seed": cfg.seed,
        "batched": cfg.runtime.batched,
        "input_shape": input_shape(cfg),
        "device": cfg.device,
    }
    if cfg.protocol == "fdml":
        return FDMLClients(population, model, sessions=sessions, defer_uploads=defer_uploads, **common)
    return FedAvgClients(population, model, encoded_replies=defer_uploads, **common)


def build_trainer(
    cfg: ExperimentConfig,
    population: Any,
    dp: DPRelease | None = None,
    *,
    tap: Any = None,
    runtime: Any = None,
    platform: SimulatedPlatform | None = None,
    dp_seed: int | None = None,
    ray: RayPlan | None = None,
) -> Trainer:
    """Server and runtime for ``cfg.protocol``, seeded from ``cfg.seed``; ``dp`` makes the FDML enclave
    release derivatives by Alg. 2; ``tap(direction, data)`` sees every byte string the server handles
    (runtime messages and enclave traffic), for tests.

    With ``runtime=None`` the clients are simulated in this process (their enclave sessions are made
    here too, pinned to a fresh simulated platform, and DP noise is seeded by ``dp_seed``, default
    ``cfg.seed``, for reproducibility). With a network ``runtime`` the devices are elsewhere: the
    enclave is launched by ``platform`` (whose public key the devices pin) and ``dp_seed`` must be
    None: DP noise in a deployment comes from the operating system's entropy. With ``ray`` the simulated
    clients live in Ray actors (:mod:`fedveil.runtime.ray`), each building its shard from ``cfg``
    (:func:`shard_clients`): the population must be ``build_population(cfg)``'s.

    The embedding network is evaluated where the clients train: on ``cfg.device`` (resolved here) when
    they are simulated in this process, on the CPU when they train elsewhere (agents, Ray actors: this
    machine need not have their GPU).
    """
    simulated = runtime is None
    if simulated and dp_seed is None:
        dp_seed = cfg.seed
    if not simulated and dp_seed is not None:
        raise ConfigError(
            "dp_seed makes the enclave's DP noise reproducible, which is for simulation only: a deployed "
            "enclave must draw its noise from OS entropy (leave dp_seed unset)"
        )
    ids = population.train_user_ids()
    embed_flat, model = _models(cfg, len(ids))
    device = resolve_device(cfg.device) if simulated and ray is None else torch.device("cpu")
    server_rng = np.random.default_rng([cfg.seed, 1])
    runtime_rng = np.random.default_rng([cfg.seed, 2])
    host = None
    sessions = None
    if cfg.protocol == "fdml":
        if cfg.enclave.boundary == "none":
            dp_rng = np.random.default_rng(dp_seed) if dp else None
            enclave: Any = LocalEnclave(margin=cfg.fdml.margin, strategy=cfg.fdml.strategy, dp=dp, rng=dp_rng)
        else:
            config = enclave_config(cfg, dp, dp_seed=dp_seed)
            platform = platform or SimulatedPlatform.generate()
            host = EnclaveHost.start(config, platform=platform, boundary=cfg.enclave.boundary, tap=tap)
            enclave = AttestedEnclave(host)
            if simulated and ray is None:
                sessions = device_sessions(ids, platform.public_key, measure_enclave(config).digest)
        server: Any = FDMLServer(cfg.fdml, model.initial(), EMBEDDING_DIM, enclave, server_rng)

        def embedding_weights() -> np.ndarray:
            return server.weights

    else:
        server = FedAvgServer(cfg.fedavg, model.initial(), server_rng)

        def embedding_weights() -> np.ndarray:
            return server.weights[: embed_flat.num_params]

    pool = None
    if simulated:
        if ray is not None:
            digest = measure_enclave(config).digest if host is not None else b""
            key = platform.public_key if platform is not None and host is not None else b""
            pool = ray.pool(functools.partial(shard_clients, cfg, key, digest), ids)
        else:
            pool = build_clients(cfg, population, sessions=sessions, defer_uploads=True)
        runtime = SimulationRuntime(
            pool,
            rng=runtime_rng,
            faults=_faults(cfg),
            max_message_bytes=cfg.runtime.max_message_bytes,
            tap=tap,
        )
    embed_flat.module.to(device)
    return Trainer(server, runtime, embed_flat, embedding_weights, host, pool, device)


@dataclass(frozen=True)
class RayPlan:
    """Simulated clients on a Ray cluster: its head's ``address`` (None: a local cluster), the number of
    ``actors`` holding the clients, torch ``threads`` per actor."""

    address: str | None = None
    actors: int = 2
    threads: int = 1

    def pool(self, factory: Any, ids: list[str]) -> Any:
        """The :class:`~fedveil.runtime.ray.RayPool` of ``ids``."""
        from fedveil.runtime.ray import RayPool

        return RayPool(factory, ids, actors=self.actors, address=self.address, threads=self.threads)


def shard_clients(cfg: ExperimentConfig, platform_key: bytes, measurement: bytes, ids: list[str]) -> Any:
    """A Ray actor's client pool: the population built from ``cfg`` and, for FDML through the emulated
    TEE, the shard's enclave sessions pinned to the platform's public key and the enclave's measurement
    (as device agents make them: the sessions' keys are made where the clients live)."""
    population = build_population(cfg)
    sessions = device_sessions(ids, platform_key, measurement) if platform_key else None
    return build_clients(cfg, population, sessions=sessions)


def uses_enclave(cfg: ExperimentConfig) -> bool:
    """Whether the run attests an enclave (FDML through the emulated TEE)."""
    return cfg.protocol == "fdml" and cfg.enclave.boundary != "none"


def enclave_config(cfg: ExperimentConfig, dp: DPRelease | None, *, dp_seed: int | None) -> EnclaveConfig:
    """The measured configuration of an FDML run's enclave (Alg. 1/2 settings, memory bound): devices
    compute it from the same experiment config to know which measurement to expect."""
    return EnclaveConfig(
        memory_limit_bytes=int(cfg.enclave.memory_limit_mib * 2**20),
        margin=cfg.fdml.margin,
        strategy=cfg.fdml.strategy,
        dp_mode=dp.mode if dp else None,
        dp_bound_T=dp.bound_T if dp else 0.0,
        dp_noise_b=dp.noise_b if dp else 0.0,
        dp_drop_rate=dp.drop_rate if dp else 0.0,
        dp_seed=dp_seed if dp else None,
    )


def device_sessions(
    client_ids: Sequence[str], platform_public_key: bytes, measurement: bytes
) -> dict[str, EnclaveClientSession]:
    """One attested-session object per device, pinning the platform's key and the expected measurement."""
    verifier = SimulatedQuoteVerifier(platform_public_key)
    return {
        c: EnclaveClientSession(c, verifier=verifier, expected_measurement=measurement) for c in client_ids
    }


def embed_samples(
    flat: FlatModel,
    weights: np.ndarray,
    samples: np.ndarray,
    batch: int = 1024,
    *,
    device: str | torch.device | None = None,
) -> np.ndarray:
    """Embeddings ``(U, S, d)`` of test samples ``(U, S, 30, 10)`` (touch windows, one channel) or
    ``(U, S, 3, H, W)`` (photos) under ``weights``, in host memory.

    The network runs on ``device`` (:func:`~fedveil.models.device.resolve_device`; None: where
    ``flat``'s module is), which ``flat``'s module moves to (its buffers, e.g. BatchNorm's statistics,
    must be where the inputs are): the weights move there once, the samples ``batch`` at a time, and
    each batch's embeddings come back as they are computed. On the CPU nothing is copied."""
    where = module_device(flat.module) if device is None else resolve_device(device)
    flat.module.to(where)
    u, s = samples.shape[:2]
    shape = (1, *samples.shape[2:]) if samples.ndim == 4 else samples.shape[2:]
    x = torch.from_numpy(np.array(samples, dtype=np.float32)).reshape(u * s, *shape)
    p = torch.from_numpy(np.array(weights, dtype=np.float32)).to(where)
    with torch.no_grad():
        out = torch.cat([flat(p, x[i : i + batch].to(where)).cpu() for i in range(0, len(x), batch)])
    return out.numpy().reshape(u, s, -1)


def evaluate(trainer: Trainer, population: Any, seed: int) -> tuple[dict[str, Any], Any]:
    """Sec. VII-C accuracy, EER, AUC and TPR at FPRs of the current embedding network, evaluated on the
    trainer's device."""
    return evaluate_weights(
        trainer.embed_flat, trainer.embedding_weights(), population, seed, device=trainer.device
    )


def untrained_accuracy(cfg: ExperimentConfig, population: Any, *, device: str | torch.device) -> float:
    """Sec. VII-C accuracy (percent) of the embedding network as ``cfg.seed`` initialises it, before any
    round, evaluated on ``device`` (the run's: :attr:`Trainer.device`): the no-learning baseline of
    ``accuracy.png`` (a network that only maps each user's inputs somewhere already separates some
    users; an uninformative one scores 50%, one minus the EER)."""
    embed_flat, _ = _models(cfg, len(population.train_user_ids()))
    metrics, _ = evaluate_weights(embed_flat, embed_flat.initial(), population, cfg.eval.seed, device=device)
    return float(metrics["accuracy_percent"])


def evaluate_weights(
    flat: FlatModel,
    weights: np.ndarray,
    population: Any,
    seed: int,
    *,
    device: str | torch.device | None = None,
) -> tuple[dict[str, Any], Any]:
    """Sec. VII-C accuracy, EER, AUC and TPR at FPRs of the embedding network ``flat`` under ``weights``
    on ``population``'s test users (the users drawn by ``seed``), embedded on ``device``
    (:func:`embed_samples`; None: where ``flat``'s module is) and scored in host memory."""
    _, samples = population.test_samples()
    emb = embed_samples(flat, weights, samples, device=device)
    rep = authentication_accuracy(emb, np.random.default_rng(seed))
    metrics = {
        "accuracy_percent": float(rep.accuracy_percent),
        "eer": float(rep.eer.eer),
        "auc": float(rep.auc),
        "tpr_at_fpr": {str(f): float(t) for f, t in zip(rep.fpr_targets, rep.tpr_at_fpr, strict=True)},
        "test_users": int(emb.shape[0]),
    }
    return metrics, rep.roc


def _json_line(fh: Any, obj: dict[str, Any]) -> None:
    """Append one line and make it durable (fsync) before returning: a round's line is on disk before
    its checkpoint is."""
    try:
        fh.write(json.dumps(obj, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    except OSError as exc:
        exc.filename = exc.filename or fh.name  # a full disk names the file it could not extend
        raise


def _rewrite_metrics(path: Path, upto: int) -> list[dict[str, Any]]:
    """Keep the lines of ``metrics.jsonl`` (or ``devices.jsonl``) of rounds <= ``upto`` (a resumed run's
    past), atomically."""
    kept: list[dict[str, Any]] = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            rnd = obj["eval"]["round"] if "eval" in obj else obj.get("round")
            if isinstance(rnd, int) and rnd <= upto:
                kept.append(obj)
    atomic_write(path, "".join(json.dumps(o, sort_keys=True) + "\n" for o in kept).encode("utf-8"))
    return kept


@dataclass
class _Setup:
    """A run directory made ready to train in (:func:`_prepare_run`).

    ``out`` is the directory, ``digest`` the resolved config's, ``resume`` as asked, ``previous`` the
    checkpoint a resumed run continues from, ``population`` the users, ``privacy`` the DP plan (None
    without DP) and ``spend`` its durable spend log. ``start`` is the first round after the checkpoint,
    ``lost`` the rounds from ``start`` on whose DP release was paid for before a crash (recorded, never
    run again under their number), and ``first_round`` the first round this process trains."""

    out: Path
    digest: str
    resume: bool
    previous: Checkpoint | None
    population: Any
    privacy: PrivacyPlan | None
    spend: SpendLog
    start: int
    lost: list[int]
    first_round: int


@dataclass
class _Record:
    """What a run has recorded: its past (a resumed run's kept lines, :func:`_read_past`), then each
    round this process trains. ``losses`` by round (the final loss), the ``totals`` summed into the
    results, the rounds ``evaluated``, the rounds the past held (``resumed_rounds``: this process's
    rounds per second count the others), the latest evaluation's ``metrics`` and ``roc``, why the run
    ``stopped`` early (a DP target), and the last round's device timings (``last_timing``)."""

    losses: list[tuple[int, float]]
    totals: dict[str, Any]
    evaluated: set[int]
    resumed_rounds: int
    metrics: dict[str, Any] = field(default_factory=dict)
    roc: Any = None
    stopped: str | None = None
    last_timing: dict[str, Any] = field(default_factory=dict)


def _prepare_run(
    cfg: ExperimentConfig,
    out_dir: str | Path,
    *,
    resume: bool,
    overwrite: bool,
    population: Any,
    device: torch.device | None,
) -> _Setup:
    """Step 1: the run directory (:func:`~fedveil.experiments.checkpoint.prepare_run_dir`), the checkpoint
    a resumed run continues from (refused under another config, or on another ``device``: where the
    clients train, None when they are not simulated here), the population, the DP plan (a plan it
    refuses leaves the directory as it was), the resolved ``config.yaml``, and the DP spend log (cleared
    for a new run) that says which rounds were paid for and restores the ledger from them."""
    out = prepare_run_dir(out_dir, resume=resume, overwrite=overwrite)
    settings = config_to_dict(cfg)
    resolved = yaml.safe_dump(settings, sort_keys=False)
    mine = identity_settings(settings)
    digest = config_digest(yaml.safe_dump(mine, sort_keys=False))
    previous = load_checkpoint(out) if resume else None
    saved = out / "config.yaml"
    if resume and saved.exists():
        theirs = identity_settings(saved_settings(saved))
        if theirs != mine:
            raise ConfigError(
                f"{saved} holds another config than this one ({', '.join(differing_settings(mine, theirs))}):"
                " resume with the same config, or choose another --out"
            )
    if previous is not None:
        check_checkpoint_identity(out, previous, digest, legacy=config_digest(resolved))
    population = population if population is not None else build_population(cfg)
    privacy = plan_privacy(cfg, population, EMBEDDING_DIM)
    atomic_write(out / "config.yaml", resolved.encode("utf-8"))
    if device is not None:
        claim_device(out, device, artefacts=(CHECKPOINT, "metrics.jsonl", "results.json"))
    spend = SpendLog(out)
    if not resume:
        spend.reset()
    paid = spend.rounds()
    start = previous.round + 1 if previous else 1
    lost = sorted(r for r in set(paid) if r >= start)
    if privacy:
        privacy.ledger.restore(len(paid))
    first_round = max([start - 1, *paid]) + 1
    return _Setup(out, digest, resume, previous, population, privacy, spend, start, lost, first_round)


def _start_trainer(cfg: ExperimentConfig, setup: _Setup, *, network: Any, ray: RayPlan | None) -> Trainer:
    """Step 2: the server, its runtime (``network``'s, Ray's or the in-process simulation's) and, for a
    resumed run, the checkpoint's state: the server's weights and optimizer, and in simulation the
    clients' and the runtime's generators. Each DP release is paid for (spend log, then ledger) before
    it happens. A resumed simulation draws fresh DP noise: replaying the stream of round 1 would
    correlate releases."""
    dp_seed = None
    if network is None and setup.first_round > 1:
        dp_seed = int(np.random.SeedSequence([cfg.seed, setup.first_round]).generate_state(1)[0])
    runtime, platform = (
        network.make_runtime(
            setup.out, max_message_bytes=cfg.runtime.max_message_bytes, attested=uses_enclave(cfg)
        )
        if network is not None
        else (None, None)
    )
    privacy = setup.privacy
    trainer = build_trainer(
        cfg,
        setup.population,
        privacy.release if privacy else None,
        runtime=runtime,
        platform=platform,
        dp_seed=dp_seed,
        ray=ray,
    )
    previous = setup.previous
    if previous is not None:
        trainer.server.load_state_dict(previous.arrays, previous.meta["server"])
        if trainer.pool is not None:
            restore_pool_rngs(trainer.pool, previous.meta.get("pool", {}))
            trainer.runtime.rng.bit_generator.state = previous.meta["runtime_rng"]
    if privacy:

        def pay(rnd: int) -> None:
            setup.spend.record(rnd)
            privacy.ledger.record_round()

        trainer.server.before_release = pay
    return trainer


def _read_past(setup: _Setup) -> _Record:
    """Step 3: a resumed run keeps the ``metrics.jsonl`` and ``devices.jsonl`` lines of the rounds up to
    its checkpoint and counts them into the totals; a new run starts with none."""
    history = _rewrite_metrics(setup.out / "metrics.jsonl", setup.start - 1) if setup.resume else []
    if setup.resume:
        _rewrite_metrics(setup.out / "devices.jsonl", setup.start - 1)
    losses: list[tuple[int, float]] = [
        (h["round"], float(h["loss"])) for h in history if "round" in h and h.get("loss") is not None
    ]
    totals = {"bytes_up": 0, "bytes_down": 0, "sim_seconds": 0.0, "dropouts": 0, "applied": 0, "rounds": 0}
    for h in history:
        if "round" in h and "applied" in h:
            for key in ("bytes_up", "bytes_down", "sim_seconds", "dropouts"):
                totals[key] += h.get(key, 0)
            totals["applied"] += int(bool(h["applied"]))
            totals["rounds"] += 1
    evaluated = {h["eval"]["round"] for h in history if "eval" in h}
    return _Record(losses, totals, evaluated, resumed_rounds=totals["rounds"])


class _RoundLoop:
    """Step 4, the training: the rounds from ``setup.first_round`` to ``cfg.rounds``, each one's metrics
    line fsynced to ``fh`` (its device timings to ``dh``), then its checkpoint, then a scheduled
    evaluation (:meth:`train`); over a ``network``, between the devices' start and stop (:meth:`run`).
    ``stop`` ends the run at a round's end after a Ctrl-C."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        setup: _Setup,
        trainer: Trainer,
        record: _Record,
        *,
        network: Any,
        progress: bool,
        stop: StopAtRoundEnd,
        fh: Any,
        dh: Any,
    ) -> None:
        self.cfg, self.setup, self.trainer, self.record = cfg, setup, trainer, record
        self.network, self.progress, self.stop, self.fh, self.dh = network, progress, stop, fh, dh

    def scheduled(self, rnd: int) -> bool:
        """Whether round ``rnd`` is followed by an evaluation (``eval.every``, and the last round)."""
        every = self.cfg.eval.every
        return bool(every and rnd % every == 0) or rnd == self.cfg.rounds

    def _evaluate_at(self, rnd: int) -> tuple[dict[str, Any], Any]:
        result = evaluate(self.trainer, self.setup.population, self.cfg.eval.seed)
        crash_point("eval", rnd)
        return result

    async def evaluation(self, rnd: int) -> None:
        """Evaluate the weights after round ``rnd``; write its line unless the run's past holds it."""
        record = self.record
        record.metrics, record.roc = await asyncio.to_thread(self._evaluate_at, rnd)
        if rnd not in record.evaluated:
            record.evaluated.add(rnd)
            _json_line(self.fh, {"eval": {"round": rnd, **record.metrics}})

    def save(self, rnd: int) -> None:
        """Checkpoint the server (and in simulation the clients' and the runtime's generators) after
        round ``rnd``, under the config's digest."""
        trainer = self.trainer
        arrays, meta = trainer.server.state_dict()
        extra: dict[str, Any] = {"server": meta, "config_sha256": self.setup.digest}
        if trainer.pool is not None:
            extra["pool"] = pool_rng_states(trainer.pool)
            extra["runtime_rng"] = trainer.runtime.rng.bit_generator.state
        save_checkpoint(self.setup.out, Checkpoint(rnd, arrays, extra))

    async def begin(self) -> None:
        """Start the devices (over a network: the agents, with the command that builds them), register
        them, record the rounds lost to a crash after their DP payment, and run the evaluation of the
        checkpoint's round that a crash cut off."""
        cfg, setup, trainer = self.cfg, self.setup, self.trainer
        if self.network is not None:
            ids = list(setup.population.train_user_ids())
            command = ["agent", "--config", str(setup.out / "config.yaml")]
            if uses_enclave(cfg):
                from fedveil.runtime.quoting import PLATFORM_PUB

                command += ["--platform-key", str(trainer.runtime.pki / PLATFORM_PUB)]
            await self.network.start(trainer.runtime, ids, setup.out, command)
        await trainer.server.register(trainer.runtime)
        trainer.runtime.stats().timings.clear()  # per-round device records start with round 1
        for rnd in setup.lost:
            _json_line(
                self.fh,
                {
                    "round": rnd,
                    "applied": False,
                    "interrupted": True,
                    "dropouts": 0,
                    "bytes_up": 0,
                    "bytes_down": 0,
                    "sim_seconds": 0.0,
                    "note": "DP release paid before a crash; not applied",
                },
            )
            self.record.totals["rounds"] += 1
        previous = setup.previous
        if (
            previous is not None
            and self.scheduled(previous.round)
            and previous.round not in self.record.evaluated
        ):
            await self.evaluation(previous.round)  # cut off by a crash after the round's checkpoint

    def over_budget(self, rnd: int) -> str | None:
        """Why round ``rnd`` must not run (it would take the whole-training epsilon past the DP target),
        or None."""
        privacy = self.setup.privacy
        if (
            privacy
            and privacy.target_epsilon is not None
            and privacy.ledger.would_exceed(privacy.target_epsilon)
        ):
            return (
                f"stopped before round {rnd}: it would take the whole-training epsilon past the target "
                f"{privacy.target_epsilon} at delta {privacy.ledger.delta} "
                f"({privacy.ledger.guard} accounting)"
            )
        return None

    async def round(self, rnd: int) -> Any:
        """Round ``rnd``: its metrics line (with the DP ledger and device timings), fsynced, then its
        checkpoint; returns the server's report."""
        trainer, record, privacy = self.trainer, self.record, self.setup.privacy
        if self.network is not None:
            from fedveil.experiments.network_run import admit_joined

            # devices that joined or reconnected (a restarted agent) register and attest afresh
            await admit_joined(trainer.server, trainer.runtime)
        t0 = time.perf_counter()
        crash_point("round", rnd)
        report = await trainer.server.run_round(rnd, trainer.runtime)
        line = report.as_dict()
        if privacy:
            line.update({f"privacy_{k}": v for k, v in privacy.ledger.report().items()})
        line["real_seconds"] = time.perf_counter() - t0
        stats = trainer.runtime.stats()
        if stats.timings:
            line.update(summarise_timings(stats.timings))
            record.last_timing.update(round=rnd, devices=[asdict(t) for t in stats.timings])
            stats.timings.clear()
            _json_line(self.dh, record.last_timing)
        _json_line(self.fh, line)
        crash_point("metrics", rnd)
        self.save(rnd)
        for key in ("bytes_up", "bytes_down", "sim_seconds", "dropouts"):
            record.totals[key] += line[key]
        record.totals["applied"] += int(report.applied)
        record.totals["rounds"] += 1
        if report.loss is not None:
            record.losses.append((rnd, float(report.loss)))
        return report

    async def train(self) -> None:
        """The rounds, each followed by its scheduled evaluation; a run stopped by its DP target, and
        one whose last evaluation did not run, evaluate the last round trained."""
        cfg, first, record = self.cfg, self.setup.first_round, self.record
        await self.begin()
        bar = tqdm(
            range(first, cfg.rounds + 1),
            desc=cfg.name,
            unit="round",
            disable=not self.progress,
            leave=True,
            initial=first - 1,
            total=cfg.rounds,
        )
        last = first - 1
        for rnd in bar:
            stopped = self.over_budget(rnd)
            if stopped:
                record.stopped = stopped
                _json_line(self.fh, {"stopped": stopped})
                await self.evaluation(rnd - 1)
                break
            report = await self.round(rnd)
            last = rnd
            bar.set_postfix(
                loss=f"{report.loss:.4f}" if report.loss is not None else "-",
                dropouts=record.totals["dropouts"],
                refresh=False,
            )
            if self.scheduled(rnd):
                await self.evaluation(rnd)
            if rnd < cfg.rounds:
                self.stop.check()
        if not record.metrics:
            await self.evaluation(last)

    async def run(self) -> None:
        """:meth:`train`; over a network, SIGTERM (a service manager stopping the server) unwinds like
        Ctrl-C, and the agents are told training is over (local agent processes are stopped) whatever
        ends it; the last checkpoint stays for ``--resume``. Signals reach only the main thread: a run
        inside a Flower ServerApp thread leaves them to Flower."""
        if self.network is None:
            await self.train()
            return
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        assert task is not None
        on_main = threading.current_thread() is threading.main_thread()
        if on_main:
            loop.add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            await self.train()
        finally:
            if on_main:
                loop.remove_signal_handler(signal.SIGTERM)
            await self.network.stop(self.trainer.runtime)


def _train(
    cfg: ExperimentConfig, setup: _Setup, trainer: Trainer, record: _Record, *, network: Any, progress: bool
) -> None:
    """Step 4: run the :class:`_RoundLoop` with ``metrics.jsonl`` and ``devices.jsonl`` open (appended to
    when resuming) and Ctrl-C deferred to a round's end; an interruption becomes
    :class:`~fedveil.errors.RunInterrupted` naming the last checkpoint. The enclave is shut down
    whatever happens."""
    out = setup.out
    stop = StopAtRoundEnd(f"run {cfg.name!r}")
    try:
        mode = "a" if setup.resume else "w"
        with (
            open(out / "metrics.jsonl", mode, encoding="utf-8") as fh,
            open(out / "devices.jsonl", mode, encoding="utf-8") as dh,
            stop,
        ):
            loop = _RoundLoop(
                cfg, setup, trainer, record, network=network, progress=progress, stop=stop, fh=fh, dh=dh
            )
            asyncio.run(loop.run())
    except (KeyboardInterrupt, asyncio.CancelledError):
        ckpt = load_checkpoint(out)
        done = f"after round {ckpt.round}, whose checkpoint is" if ckpt else "before its first checkpoint,"
        raise RunInterrupted(f"run {cfg.name!r} interrupted {done} in {out}") from None
    finally:
        trainer.close()


def _write_results(
    cfg: ExperimentConfig,
    setup: _Setup,
    record: _Record,
    *,
    real_seconds: float,
    network: Any,
    ray: RayPlan | None,
    device: torch.device,
) -> dict[str, Any]:
    """Step 5: ``results.json`` (the last evaluation, the untrained network's accuracy on the run's
    evaluation ``device``, the totals, the code that ran, the DP spend) and the plots; returns the
    results."""
    out, totals, privacy = setup.out, record.totals, setup.privacy
    untrained = untrained_accuracy(cfg, setup.population, device=device)
    results = {
        "name": cfg.name,
        "protocol": cfg.protocol,
        "seed": cfg.seed,
        "runtime": getattr(network, "name", "network")
        if network is not None
        else ("ray" if ray is not None else "simulation"),
        "rounds": totals["rounds"],
        "rounds_applied": totals["applied"],
        **record.metrics,
        "untrained_accuracy_percent": untrained,
        "final_loss": record.losses[-1][1] if record.losses else None,
        "bytes_up": totals["bytes_up"],
        "bytes_down": totals["bytes_down"],
        "dropouts": totals["dropouts"],
        "sim_seconds": totals["sim_seconds"],
        "real_seconds": real_seconds,
        "rounds_per_second": (totals["rounds"] - record.resumed_rounds) / real_seconds
        if real_seconds > 0
        else math.inf,
    }
    results["code"] = code_identity()
    if setup.resume and setup.previous is not None:
        results["resumed_after_round"] = setup.previous.round
    if privacy:
        results["privacy"] = {
            **privacy.summary,
            **privacy.ledger.report(),
            "rounds_paid": len(setup.spend.rounds()),
        }
    if record.stopped:
        results["stopped"] = record.stopped
    (out / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if record.last_timing:
        plot_round_timing(
            record.last_timing["devices"],
            out / "round_timing.png",
            title=f"{cfg.name}: round {record.last_timing['round']}",
        )
    write_run_plots(out, cfg.name, roc=record.roc, untrained_percent=untrained)
    return results


def run_experiment(
    cfg: ExperimentConfig,
    out_dir: str | Path,
    *,
    progress: bool = True,
    population: Any = None,
    resume: bool = False,
    overwrite: bool = False,
    network: Any = None,
    ray: RayPlan | None = None,
) -> dict[str, Any]:
    """Train and evaluate ``cfg``; write the run directory ``out_dir``; return ``results.json``'s data.

    ``out_dir`` must be missing or empty unless ``resume`` (continue the run in it) or ``overwrite``
    (clear it first) is given (:func:`~fedveil.experiments.checkpoint.prepare_run_dir`). After every
    round its ``metrics.jsonl`` line is fsynced, then the server's state is checkpointed atomically
    (``checkpoint.npz``: weights, optimizer moments, generator states, round, the config's digest), then
    a scheduled evaluation runs. ``resume=True`` continues from the checkpoint, only under the config it
    was trained with: the metrics of later rounds are dropped, a scheduled evaluation of the
    checkpoint's round that a crash cut off is run, DP rounds already paid for (``privacy_spent.jsonl``,
    written before each release) stay paid and are never run again under the same number. Ctrl-C stops
    the run at the end of its round (:class:`~fedveil.experiments.checkpoint.StopAtRoundEnd`). ``network`` (a
    :class:`fedveil.experiments.network_run.NetworkPlan`) trains over device agents instead of the
    in-process simulation; ``ray`` (:class:`RayPlan`) simulates the clients in Ray actors.
    """
    if network is not None and ray is not None:
        raise ConfigError("a run goes over the network or on Ray, not both")
    # devices simulated here: a device this machine lacks fails before the run directory is touched
    device = resolve_device(cfg.device) if network is None and ray is None else None
    torch.set_num_threads(cfg.runtime.threads)
    retain_freed_memory()
    setup = _prepare_run(
        cfg, out_dir, resume=resume, overwrite=overwrite, population=population, device=device
    )
    trainer = _start_trainer(cfg, setup, network=network, ray=ray)
    record = _read_past(setup)
    started = time.perf_counter()
    _train(cfg, setup, trainer, record, network=network, progress=progress)
    real_seconds = time.perf_counter() - started
    return _write_results(
        cfg, setup, record, real_seconds=real_seconds, network=network, ray=ray, device=trainer.device
    )
