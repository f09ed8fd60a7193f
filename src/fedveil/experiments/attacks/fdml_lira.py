"""User-level LiRA against [FDML]'s global embedding network (the uncovered view), beside a control.

FDML's DP (Alg. 2) covers the derivatives a participant receives, not the global model: it is updated
from un-noised device gradients and sent to every selected device (docs/privacy.md). This experiment
measures that model's membership leakage with Carlini et al.'s LiRA ("Membership Inference Attacks From
First Principles", IEEE S&P 2022) at the level FDML protects, one participant = one user
(:mod:`fedveil.attacks.lira_metric`):

- the world: ``users`` SYNTHETIC TouchAuth training users of one phone model are the candidates; a coin
  per run (``rng``) picks exactly half of them as the target's members; ``users // 2`` further users are
  the control's training set;
- the target: FDML (Alg. 1, no DP) trained by the in-process simulation on the members, ``rounds`` rounds
  of ``devices`` devices with ``samples_per_client`` random-start windows each, Adam at ``lr``;
- the shadows: ``shadows`` networks, each trained on a random half of the candidates (each candidate IN
  half of them), CENTRALLY (:func:`~fedveil.experiments.fdml.central.train_triplet_steps`): the same
  batch-all triplet loss, batches and Adam steps as the target's rounds (FDML's aggregated gradient is the
  gradient of that loss over the round's embeddings), from the target's initial network, which every
  device selected in round 1 received;
- the statistic: the prototype confidence of each candidate's ``candidate_samples`` windows (drawn once,
  the same windows for every model);
- the control: the same attack, with the same shadows and truth, against FDML trained by the same recipe
  on the control's users, which excludes every candidate: it must sit at chance.

Beside them, the user-spread score of ``fedveil attack fdml-membership`` on the same target and
candidates. There is no epsilon to state: no DP covers this model.

Everything that trains or embeds runs on one ``device`` (:func:`~fedveil.models.device.resolve_device`):
FDML's devices (the run's ``device`` setting), the shadow networks (each round's windows moved there as
they are drawn, as FDML's devices draw theirs) and every network the attacks embed the candidates with;
the statistics and the report, which records the device, are in host memory.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedveil.attacks.lira_metric import user_lira_attack
from fedveil.attacks.mia_metric import metric_membership_attack
from fedveil.attacks.scores import FPR_TARGETS
from fedveil.attacks.views import ModelView
from fedveil.core.atomic import atomic_write
from fedveil.data.touchauth import TouchAuthConfig, TouchAuthPopulation, generate_touchauth
from fedveil.errors import ConfigError
from fedveil.experiments.attacks.fdml_views import MEMBERSHIP_FPR_TARGETS, SEC_VII_C_MIN_USERS, train_fdml
from fedveil.experiments.config import load_config
from fedveil.experiments.fdml.central import train_triplet_steps
from fedveil.experiments.fdml.runner import evaluate_weights, input_shape
from fedveil.models.device import resolve_device

__all__ = ["LIRA_FPR_TARGETS", "fdml_lira_table"]

LIRA_FPR_TARGETS = tuple(sorted({*FPR_TARGETS, *MEMBERSHIP_FPR_TARGETS}))
"""The FPRs the LiRA rows report TPR at: Carlini et al.'s 0.1% and 1%, and fdml-membership's 2/5/10%."""


def _subpopulation(
    population: TouchAuthPopulation, data: TouchAuthConfig, ids: list[str]
) -> TouchAuthPopulation:
    """``population`` restricted to the training users ``ids`` (its test users kept)."""
    return TouchAuthPopulation(
        population.train.subset(ids),
        population.test,
        events_per_sample=data.events_per_sample,
        window_minutes=data.window_minutes,
        min_train_samples=data.min_train_samples,
        test_samples=data.test_samples,
    )


def fdml_lira_table(
    *,
    users: int = 200,
    shadows: int = 16,
    rounds: int = 100,
    devices: int = 16,
    samples_per_client: int = 8,
    lr: float = 3e-3,
    candidate_samples: int = 16,
    seed: int = 0,
    num_threads: int | None = 1,
    out: Path | None = None,
    progress: bool = False,
    device: str = "auto",
) -> dict[str, Any]:
    """The table of the module docstring: ``users`` candidates (an even number >= 4), ``shadows`` shadow
    networks, FDML ``rounds`` rounds of ``devices`` devices x ``samples_per_client`` windows at Adam
    ``lr``, ``candidate_samples`` windows per candidate; everything random from ``seed``. ``num_threads``
    limits torch's intra-op threads during the call (restored afterwards; ``None``: torch's setting): the
    small batches run fastest on one thread, and far faster than on two on a loaded machine. ``device``
    (resolved before anything trains) is where the networks train and embed (module docstring). Returns
    (and writes to ``out/fdml_lira.json``) the attacks on the target and on the control."""
    if isinstance(users, bool) or not isinstance(users, int) or users < 4 or users % 2:
        raise ConfigError(f"users must be an even integer >= 4 (half of them are members), got {users!r}")
    if isinstance(candidate_samples, bool) or not isinstance(candidate_samples, int) or candidate_samples < 2:
        raise ConfigError(f"candidate_samples must be an integer >= 2, got {candidate_samples!r}")
    if num_threads is not None and (
        isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
    ):
        raise ConfigError(f"num_threads must be a positive integer or None, got {num_threads!r}")
    where = resolve_device(device)
    previous_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        summary = _table(
            users, shadows, rounds, devices, samples_per_client, lr, candidate_samples, seed, progress, where
        )
    finally:
        torch.set_num_threads(previous_threads)
    summary["run"]["num_threads"] = torch.get_num_threads() if num_threads is None else num_threads
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / "fdml_lira.json", (json.dumps(summary, indent=2, sort_keys=True) + "\n").encode())
    return summary


def _table(
    users: int,
    shadows: int,
    rounds: int,
    devices: int,
    samples_per_client: int,
    lr: float,
    candidate_samples: int,
    seed: int,
    progress: bool,
    device: torch.device,
) -> dict[str, Any]:
    """:func:`fdml_lira_table`'s training and attacks, on torch's current threads and on ``device``."""
    data = TouchAuthConfig(
        seed=seed, train_users_per_model=(users + users // 2,), test_users_per_model=(SEC_VII_C_MIN_USERS,)
    )
    cfg = load_config(
        None,
        [
            f"seed={seed}",
            f"data.seed={seed}",
            f"fdml.num_required={devices}",
            f"fdml.samples_per_client={samples_per_client}",
            f"fdml.lr={lr}",
            f"rounds={rounds}",
            f"device={device}",
            "enclave.boundary=none",  # the global model is the same across boundaries; no enclave needed
        ],
    )
    population = generate_touchauth(data)
    ids = population.train_user_ids()
    candidates, control_users = ids[:users], ids[users:]
    coin_rng, sample_rng, shadow_rng, train_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence([seed, 11]).spawn(4)
    )
    is_member = np.zeros(users, bool)
    is_member[coin_rng.permutation(users)[: users // 2]] = True
    members = [u for u, inside in zip(candidates, is_member, strict=True) if inside]

    target_population = _subpopulation(population, data, members)
    embed_flat, initial, trained = train_fdml(cfg, target_population, progress=progress, desc="FDML target")
    _, _, control = train_fdml(
        cfg, _subpopulation(population, data, control_users), progress=progress, desc="FDML control"
    )
    accuracy = evaluate_weights(embed_flat, trained, target_population, cfg.eval.seed, device=device)[0][
        "accuracy_percent"
    ]
    samples = np.stack([population.sample_training(u, candidate_samples, sample_rng) for u in candidates])
    samples = samples.reshape(*samples.shape[:2], *input_shape(cfg))

    def network(weights: np.ndarray) -> torch.nn.Module:
        return copy.deepcopy(embed_flat.load_into_module(weights)).to(device)

    def train_shadow(inside: np.ndarray, shadow_seed: int) -> torch.nn.Module:
        net = network(initial)
        chosen = [u for u, keep in zip(candidates, inside, strict=True) if keep]
        train_triplet_steps(
            net,
            _subpopulation(population, data, chosen),
            steps=rounds,
            batch_users=devices,
            samples_per_user=samples_per_client,
            lr=cfg.fdml.lr,
            margin=cfg.fdml.margin,
            rng=np.random.default_rng([shadow_seed, int(train_rng.integers(2**31 - 1))]),
        )
        return net

    target_view = ModelView("every selected device: the global embedding network", network(trained))
    control_view = ModelView("the same recipe on users disjoint from every candidate", network(control))
    rows = user_lira_attack(
        target_view,
        samples,
        is_member,
        train_shadow,
        rng=shadow_rng,
        num_shadow=shadows,
        controls={"control/disjoint-users": control_view},
        fpr_targets=LIRA_FPR_TARGETS,
        progress=progress,
    )
    rows["target/spread"] = metric_membership_attack(
        target_view, samples, is_member, fpr_targets=LIRA_FPR_TARGETS
    )
    non_members = int((~is_member).sum())
    summary = {
        "run": {
            "data": "SYNTHETIC TouchAuth",
            "members": int(is_member.sum()),
            "non_members": non_members,
            "control_training_users": len(control_users),
            "rounds": rounds,
            "devices": devices,
            "samples_per_client": samples_per_client,
            "candidate_samples": candidate_samples,
            "lr": cfg.fdml.lr,
            "shadows": shadows,
            "shadow_training": "central: the target's loss, batches and Adam steps, from its initial network",
            "statistic": "prototype confidence: logit-scaled softmax over the candidates' centroids",
            "variants": "online (per-user IN and OUT Gaussians) and offline (OUT only)",
            "seed": seed,
            "device": str(device),
            "accuracy_percent": accuracy,
            "min_resolvable_fpr": 1.0 / non_members,
            "fpr_note": (
                f"{non_members} non-members resolve FPRs down to 1/{non_members} only; TPR at a lower FPR "
                "is reported as null (no value), not as 0"
            ),
            "observer": "every selected device: the global embedding network",
            "epsilon": None,
            "dp": "none: the global model is updated from un-noised gradients (Alg. 2 covers only the "
            "derivatives a participant receives)",
        },
        "attacks": {name: r.as_dict() for name, r in rows.items()},
    }
    return summary
