"""Differential privacy for an FDML run: calibrate the Laplace scale, build the ledger, refuse a plan
that cannot meet its whole-training target."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from fedveil.enclave.dp import (
    paper_noise_scale,
    paper_round_epsilon,
    strict_noise_scale,
    strict_round_epsilon,
)
from fedveil.errors import ConfigError
from fedveil.experiments.config import ExperimentConfig
from fedveil.privacy.ledger import PrivacyLedger, calibrate_fdml_noise, fdml_ledger, fdml_participation_rate
from fedveil.protocols.fdml import DPRelease


@dataclass
class PrivacyPlan:
    """What a DP run releases (``release``), how it is accounted (``ledger``), and the numbers a user
    reads before training: calibrated ``noise_b``, per-round epsilons under both accountings and the
    per-round selection probability ``participation_rate``."""

    release: DPRelease
    ledger: PrivacyLedger
    target_epsilon: float | None
    summary: dict[str, Any]


def plan_privacy(cfg: ExperimentConfig, population: Any, embedding_dim: int) -> PrivacyPlan | None:
    """Calibrate and check ``cfg.dp`` against the population's phone-model groups; None when DP is off.

    Raises :class:`ConfigError` before any training when a ``target_epsilon`` cannot cover
    ``cfg.rounds`` rounds.
    """
    dp = cfg.dp
    if not dp.enabled:
        return None
    ids = population.train_user_ids()
    groups = Counter(population.train.user(u).attributes["phone_model"] for u in ids)
    q = fdml_participation_rate(num_addressed=cfg.fdml.num_addressed, group_sizes=list(groups.values()))
    n = cfg.fdml.samples_per_client
    common = {"bound_T": dp.bound_T, "drop_rate": dp.drop_rate}
    if dp.noise_b is not None:
        b = dp.noise_b
    elif dp.round_epsilon is not None:
        if dp.mode == "paper":
            b = paper_noise_scale(dp.round_epsilon, dp.bound_T, dp.drop_rate)
        else:
            b = strict_noise_scale(
                dp.round_epsilon, mode=dp.mode, vectors_received=n, dim=embedding_dim, **common
            )
    else:
        b = calibrate_fdml_noise(
            dp.target_epsilon,
            dp.delta,
            accounting=dp.mode,
            rounds=cfg.rounds,
            participation_rate=q,
            mode=dp.mode,
            vectors_received=n,
            dim=embedding_dim,
            **common,
        )
    ledger = fdml_ledger(
        mode=dp.mode,
        noise_b=b,
        participation_rate=q,
        vectors_received=n,
        dim=embedding_dim,
        delta=dp.delta,
        **common,
    )
    if dp.target_epsilon is not None:
        affordable = ledger.affordable_rounds(dp.target_epsilon, limit=cfg.rounds)
        if affordable < cfg.rounds and dp.when_exhausted == "refuse":
            raise ConfigError(
                f"dp.target_epsilon: {dp.target_epsilon} at delta {dp.delta} covers only {affordable} of the "
                f"{cfg.rounds} rounds under {dp.mode} accounting; lower rounds, raise the noise or the "
                "target, or set dp.when_exhausted=stop to train until the budget is spent"
            )
    summary = {
        "dp_mode": dp.mode,
        "noise_b": b,
        "bound_T": dp.bound_T,
        "drop_rate": dp.drop_rate,
        "delta": dp.delta,
        "participation_rate": q,
        "epsilon_round_paper": paper_round_epsilon(dp.bound_T, b, dp.drop_rate),
        "epsilon_round_strict": strict_round_epsilon(
            mode=dp.mode, noise_b=b, vectors_received=n, dim=embedding_dim, **common
        ),
        "target_epsilon": dp.target_epsilon,
    }
    release = DPRelease(mode=dp.mode, bound_T=dp.bound_T, noise_b=b, drop_rate=dp.drop_rate)
    return PrivacyPlan(release, ledger, dp.target_epsilon, summary)
