"""Run one experiment from its config and write its run directory (DESIGN.md, "Results").

``runs/<name>/`` receives ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one JSON line per
round, flushed as it is written, plus one ``{"eval": ...}`` line per evaluation), ``checkpoint.npz``
(the latest global weights, written at every evaluation), ``results.json`` (final metrics) and PNG
plots (``loss.png``, ``accuracy.png``, ``roc.png``).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from tqdm import tqdm

from fedveil.core.attestation_verify import EnclaveClientSession, SimulatedQuoteVerifier
from fedveil.data.touch_csv import load_touch_population
from fedveil.data.touchauth import TouchAuthConfig, generate_touchauth
from fedveil.enclave.channel import RECORD_OVERHEAD
from fedveil.enclave.measure import EnclaveConfig, measure_enclave
from fedveil.eval.plots import plot_roc
from fedveil.eval.verification import authentication_accuracy
from fedveil.experiments.config import ExperimentConfig, config_to_dict
from fedveil.experiments.plots import plot_series
from fedveil.experiments.privacy_setup import plan_privacy
from fedveil.models.flat import FlatModel
from fedveil.models.touchauth import TouchAuthNet
from fedveil.protocols.fdml import AttestedEnclave, DPRelease, FDMLClients, FDMLServer, LocalEnclave
from fedveil.protocols.fedavg import EmbeddingClassifier, FedAvgClients, FedAvgServer
from fedveil.runtime.enclave_host import EnclaveHost
from fedveil.runtime.quoting import SimulatedPlatform
from fedveil.runtime.simulation import LatencyModel, PhaseFaults, SimulationRuntime

EMBEDDING_DIM = 64


@dataclass
class Trainer:
    """A server, its simulated clients, how to read the embedding network off the server, and what
    to close when the run ends (the enclave process)."""

    server: Any
    runtime: SimulationRuntime
    embed_flat: FlatModel
    embedding_weights: Callable[[], np.ndarray]
    enclave_host: Any = None

    def close(self) -> None:
        """Shut the enclave down (idempotent)."""
        if self.enclave_host is not None:
            self.enclave_host.close()


def build_population(cfg: ExperimentConfig) -> Any:
    """The users of the experiment: the synthetic TouchAuth population or real touch logs."""
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


def build_trainer(
    cfg: ExperimentConfig, population: Any, dp: DPRelease | None = None, *, tap: Any = None
) -> Trainer:
    """Server, clients and runtime for ``cfg.protocol``, seeded from ``cfg.seed``; ``dp`` makes the
    FDML enclave release derivatives by Alg. 2; ``tap(direction, data)`` sees every byte string the
    server handles (runtime messages and enclave traffic), for tests."""
    torch.manual_seed(cfg.seed)
    embed_net = TouchAuthNet(EMBEDDING_DIM)
    embed_flat = FlatModel(embed_net)
    ids = population.train_user_ids()
    attributes = {uid: dict(population.train.user(uid).attributes) for uid in ids}
    server_rng = np.random.default_rng([cfg.seed, 1])
    runtime_rng = np.random.default_rng([cfg.seed, 2])
    host = None
    if cfg.protocol == "fdml":
        if cfg.enclave.boundary == "none":
            dp_rng = np.random.default_rng(cfg.seed) if dp else None
            enclave: Any = LocalEnclave(margin=cfg.fdml.margin, strategy=cfg.fdml.strategy, dp=dp, rng=dp_rng)
            sessions = None
        else:
            enclave, host, sessions = start_enclave(cfg, ids, dp, tap=tap)
        pool: Any = FDMLClients(
            population,
            embed_flat,
            attributes=attributes,
            seed=cfg.seed,
            batched=cfg.runtime.batched,
            sessions=sessions,
        )
        server: Any = FDMLServer(cfg.fdml, embed_flat.initial(), EMBEDDING_DIM, enclave, server_rng)

        def embedding_weights() -> np.ndarray:
            return server.weights

    else:
        model = EmbeddingClassifier(embed_net, EMBEDDING_DIM, len(ids))
        full = FlatModel(model)
        pool = FedAvgClients(
            population, full, attributes=attributes, seed=cfg.seed, batched=cfg.runtime.batched
        )
        server = FedAvgServer(cfg.fedavg, full.initial(), server_rng)

        def embedding_weights() -> np.ndarray:
            return server.weights[: embed_flat.num_params]

    runtime = SimulationRuntime(
        pool, rng=runtime_rng, faults=_faults(cfg), max_message_bytes=cfg.runtime.max_message_bytes, tap=tap
    )
    return Trainer(server, runtime, embed_flat, embedding_weights, host)


def start_enclave(
    cfg: ExperimentConfig, client_ids: list[str], dp: DPRelease | None, *, tap: Any = None
) -> tuple[AttestedEnclave, EnclaveHost, dict[str, EnclaveClientSession]]:
    """Launch the emulated TEE for an FDML run: a simulated platform measures and launches the
    enclave (Alg. 1/2 config measured, DP noise seeded from ``cfg.seed`` for reproducibility), and
    every device gets a session that expects that measurement and pins the platform's key."""
    config = EnclaveConfig(
        memory_limit_bytes=int(cfg.enclave.memory_limit_mib * 2**20),
        margin=cfg.fdml.margin,
        strategy=cfg.fdml.strategy,
        dp_mode=dp.mode if dp else None,
        dp_bound_T=dp.bound_T if dp else 0.0,
        dp_noise_b=dp.noise_b if dp else 0.0,
        dp_drop_rate=dp.drop_rate if dp else 0.0,
        dp_seed=cfg.seed if dp else None,
    )
    platform = SimulatedPlatform.generate()
    host = EnclaveHost.start(config, platform=platform, boundary=cfg.enclave.boundary, tap=tap)
    expected = measure_enclave(config).digest
    verifier = SimulatedQuoteVerifier(platform.public_key)
    sessions = {
        c: EnclaveClientSession(c, verifier=verifier, expected_measurement=expected) for c in client_ids
    }
    return AttestedEnclave(host, record_overhead=RECORD_OVERHEAD + 64), host, sessions


def embed_samples(flat: FlatModel, weights: np.ndarray, samples: np.ndarray, batch: int = 1024) -> np.ndarray:
    """Embeddings ``(U, S, d)`` of test samples ``(U, S, 30, 10)`` under ``weights``."""
    u, s = samples.shape[:2]
    x = torch.from_numpy(np.array(samples, dtype=np.float32)).reshape(u * s, 1, *samples.shape[2:])
    p = torch.from_numpy(np.array(weights, dtype=np.float32))
    with torch.no_grad():
        out = torch.cat([flat(p, x[i : i + batch]) for i in range(0, len(x), batch)])
    return out.numpy().reshape(u, s, -1)


def evaluate(trainer: Trainer, population: Any, seed: int) -> tuple[dict[str, Any], Any]:
    """Sec. VII-C accuracy, EER, AUC and TPR at FPRs of the current embedding network."""
    _, samples = population.test_samples()
    emb = embed_samples(trainer.embed_flat, trainer.embedding_weights(), samples)
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
    fh.write(json.dumps(obj, sort_keys=True) + "\n")
    fh.flush()


def run_experiment(
    cfg: ExperimentConfig, out_dir: str | Path, *, progress: bool = True, population: Any = None
) -> dict[str, Any]:
    """Train and evaluate ``cfg``; write the run directory ``out_dir``; return ``results.json``'s data."""
    torch.set_num_threads(cfg.runtime.threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), encoding="utf-8")
    population = population if population is not None else build_population(cfg)
    privacy = plan_privacy(cfg, population, EMBEDDING_DIM)
    trainer = build_trainer(cfg, population, privacy.release if privacy else None)
    losses: list[tuple[int, float]] = []
    evals: list[tuple[int, float]] = []
    totals = {"bytes_up": 0, "bytes_down": 0, "sim_seconds": 0.0, "dropouts": 0, "applied": 0, "rounds": 0}
    started = time.perf_counter()
    metrics: dict[str, Any] = {}
    roc = None
    stopped: str | None = None

    async def train(fh: Any) -> None:
        nonlocal metrics, roc, stopped
        await trainer.server.register(trainer.runtime)
        bar = tqdm(range(1, cfg.rounds + 1), desc=cfg.name, unit="round", disable=not progress, leave=True)
        for rnd in bar:
            if (
                privacy
                and privacy.target_epsilon is not None
                and privacy.ledger.would_exceed(privacy.target_epsilon)
            ):
                stopped = (
                    f"stopped before round {rnd}: it would take the whole-training epsilon past the target "
                    f"{privacy.target_epsilon} at delta {privacy.ledger.delta} "
                    f"({privacy.ledger.guard} accounting)"
                )
                _json_line(fh, {"stopped": stopped})
                metrics, roc = evaluate(trainer, population, cfg.eval.seed)
                _json_line(fh, {"eval": {"round": rnd - 1, **metrics}})
                break
            t0 = time.perf_counter()
            report = await trainer.server.run_round(rnd, trainer.runtime)
            line = report.as_dict()
            if privacy and report.loss is not None:
                privacy.ledger.record_round()
            if privacy:
                line.update({f"privacy_{k}": v for k, v in privacy.ledger.report().items()})
            line["real_seconds"] = time.perf_counter() - t0
            _json_line(fh, line)
            for key in ("bytes_up", "bytes_down", "sim_seconds", "dropouts"):
                totals[key] += line[key]
            totals["applied"] += int(report.applied)
            totals["rounds"] += 1
            if report.loss is not None:
                losses.append((rnd, float(report.loss)))
            bar.set_postfix(
                loss=f"{report.loss:.4f}" if report.loss is not None else "-",
                dropouts=totals["dropouts"],
                refresh=False,
            )
            if (cfg.eval.every and rnd % cfg.eval.every == 0) or rnd == cfg.rounds:
                metrics, roc = evaluate(trainer, population, cfg.eval.seed)
                evals.append((rnd, metrics["accuracy_percent"]))
                _json_line(fh, {"eval": {"round": rnd, **metrics}})
                np.savez(out / "checkpoint.npz", weights=trainer.server.weights, round=np.int64(rnd))

    try:
        with open(out / "metrics.jsonl", "w", encoding="utf-8") as fh:
            asyncio.run(train(fh))
    finally:
        trainer.close()
    real = time.perf_counter() - started
    results = {
        "name": cfg.name,
        "protocol": cfg.protocol,
        "rounds": totals["rounds"],
        "rounds_applied": totals["applied"],
        **metrics,
        "final_loss": losses[-1][1] if losses else None,
        "bytes_up": totals["bytes_up"],
        "bytes_down": totals["bytes_down"],
        "dropouts": totals["dropouts"],
        "sim_seconds": totals["sim_seconds"],
        "real_seconds": real,
        "rounds_per_second": totals["rounds"] / real if real > 0 else math.inf,
    }
    if privacy:
        results["privacy"] = {**privacy.summary, **privacy.ledger.report()}
    if stopped:
        results["stopped"] = stopped
    (out / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if losses:
        plot_series({"loss": losses}, out / "loss.png", title=f"{cfg.name}: training loss", ylabel="loss")
    if evals:
        plot_series(
            {"accuracy": evals},
            out / "accuracy.png",
            title=f"{cfg.name}: Sec. VII-C accuracy",
            ylabel="accuracy (%)",
        )
    if roc is not None:
        plot_roc({cfg.name: roc}, out / "roc.png", title=f"{cfg.name}: ROC on test users")
    return results
