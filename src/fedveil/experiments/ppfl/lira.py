"""PPFL Table 2's membership row by LiRA (Carlini et al. 2022), with shadows trained the way each target was.

This gives LiRA's TPR at FPR 1e-3 beside the paper's MIA precision. That figure needs at least
1,000 non-members, and shadow models that imitate how the target was trained. This experiment trains one
member split three ways:

- ``e2e``: undefended end-to-end FedAvg; the observer sees the released model.
- ``ppfl-released``: PPFL with every layer released to the REE after its stage; the observer sees the
  whole model.
- ``ppfl-kept``: PPFL with the last layer kept in the clients' TEEs. The observer sees the released
  convolutional layers only, and attacks them with its own classifier head trained on auxiliary
  examples, as in :func:`fedveil.experiments.ppfl.attacks.ppfl_attack_table`.

Candidates are the target's ``n`` members and ``n`` non-members from the same split
(:func:`fedveil.experiments.attacks.runs.membership_run`; 25 clients x 40 images gives 1,000 of each).

Each of the ``shadows`` shadow models trains on a random half of the candidates, so it has the target's
number of examples. The half is split into the target's number of clients and trained by the same system
and recipe:
- FedAvg for ``e2e``;
- PPFL, stage by stage, in emulated TEEs, for the PPFL rows;
- for ``ppfl-kept``, also the observer's head on the same auxiliary examples.

Online and offline LiRA then score the candidates with a global variance
(:func:`fedveil.attacks.lira.lira_variants`).

The run is long: ``3 x (shadows + 1)`` federated trainings, or ``2 x (shadows + 1)`` when both PPFL rows
are attacked (one PPFL training serves both). With an output folder, every shadow's phis
are kept in ``shadows/<system>/`` and every finished system in ``parts/``. A rerun with the same
settings resumes from them.

**Where it runs.** ``images.device`` (:func:`~fedveil.models.device.resolve_device`) is where every
target and shadow trains (E2E FedAvg's clients, PPFL's REEs and emulated client TEEs, the ``ppfl-kept``
observer's head: their examples move there once per training) and where each model is scored (LiRA's
logits, the target's test accuracy). The candidates stay in host memory, where the shadow cache's
fingerprint reads them, and move to the device in LiRA's scoring batches; what the report holds comes back
to host memory, and it records the resolved device (``run.device``). An output folder's shadows and parts
are all computed on one device: a rerun on another is refused, naming both
(:func:`~fedveil.experiments.checkpoint.claim_device`).
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedveil.attacks.lira import lira_variants
from fedveil.attacks.views import ModelView
from fedveil.core.atomic import atomic_write
from fedveil.data.images import ImageData
from fedveil.data.partition import partition, to_federated
from fedveil.errors import ConfigError
from fedveil.experiments.attacks.runs import membership_run
from fedveil.experiments.checkpoint import claim_device
from fedveil.experiments.fedavg_images import FedAvgRun, ImageSplit, split_images, train_fedavg
from fedveil.experiments.ppfl.attacks import (
    _attacker_head,
    _part,
    _ppfl_run,
    _settings_images,
    auxiliary_examples,
    ppfl_like,
)
from fedveil.experiments.ppfl.runner import TrainedPpfl, train_ppfl
from fedveil.models.device import module_device, resolve_device
from fedveil.protocols.ppfl import PpflConfig, conv_units

__all__ = ["SYSTEMS", "ppfl_lira_table"]

SYSTEMS = ("e2e", "ppfl-released", "ppfl-kept")

KEPT = ("parts/*.json", "shadows/*/shadow*.npz")
"""What an earlier run of :func:`ppfl_lira_table` leaves in its output folder (resumed from)."""


def _shadow_split(
    split: ImageSplit, images: FedAvgRun, x: np.ndarray, y: np.ndarray, seed: int
) -> ImageSplit:
    """A shadow's data: its half of the candidates split among the target's number of clients (by the
    target's scheme), the target's test subset, and no non-members of its own."""
    members = replace(split.members, x=x, y=y)
    parts = partition(members.y, images.scheme, images.clients, np.random.default_rng(seed))
    none = np.zeros(0, np.int64)
    empty = replace(split.members, x=x[:0], y=y[:0])
    return ImageSplit(
        members, members, empty, split.test, to_federated(members, parts), np.arange(len(y)), none
    )


def ppfl_lira_table(
    *,
    images: FedAvgRun | None = None,
    ppfl: PpflConfig | None = None,
    systems: tuple[str, ...] = SYSTEMS,
    shadows: int = 16,
    tee_mib: float = 64.0,
    aux_examples: int = 2000,
    head_epochs: int = 20,
    out: Path | None = None,
) -> dict[str, Any]:
    """LiRA against each of ``systems`` (module docstring). Returns (and writes to ``out/ppfl_lira.json``)
    the run's settings and, per system, online and offline LiRA's scores (AUC, TPR at FPR 1e-3 and 1e-2,
    precision) and the target's test accuracy.

    ``images`` is the member split and E2E recipe. The default is :func:`membership_run` with 25 clients,
    giving 1,000 members and 1,000 non-members. PPFL trains the same clients with the same local settings,
    each stage for E2E's rounds divided by the number of stages. ``shadows`` is at least 4.

    Everything trains and is scored on ``images.device`` (module docstring), resolved before anything
    runs: a device this machine lacks, or an ``out`` whose shadows and parts were computed on another,
    fails first.
    """
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise ConfigError(f"systems {list(systems)} must be among {', '.join(SYSTEMS)}")
    if isinstance(shadows, bool) or not isinstance(shadows, int) or shadows < 4:
        raise ConfigError(
            f"shadows={shadows!r}: online LiRA needs at least 4 (two IN and two OUT per example)"
        )
    images = images or membership_run(clients=25)
    where = resolve_device(images.device)
    if out is not None:
        claim_device(out, where, artefacts=KEPT)
    split = split_images(images)
    n = len(split.members)
    if len(split.non_members) < n:
        raise ConfigError(f"{len(split.non_members)} non-members for {n} members: raise test_samples")
    x = np.concatenate([split.members.x, split.non_members.x[:n]])
    y = np.concatenate([split.members.y, split.non_members.y[:n]])
    is_member = np.r_[np.ones(n, bool), np.zeros(n, bool)]
    cfg = ppfl or ppfl_like(images)
    aux = auxiliary_examples(split, images.seed, aux_examples)
    # the observer's examples move to the device once, for the head of every shadow
    aux_x, aux_y = torch.from_numpy(np.array(aux.x)).to(where), torch.from_numpy(np.array(aux.y)).to(where)
    settings = {
        "images": _settings_images(images),
        "ppfl": repr(cfg),
        "shadows": shadows,
        "tee_mib": tee_mib,
        "aux_examples": aux_examples,
        "head_epochs": head_epochs,
    }

    kept_views: dict[tuple[int, str], nn.Module] = {}

    def kept_view(trained: TrainedPpfl, client: str, seed: int) -> nn.Module:
        """The ``ppfl-kept`` observer's model on the device: the released convolutional units under its
        own head."""
        frozen = nn.Sequential(*trained.pool.frozen[client][: conv_units(trained.model)])
        head = copy.deepcopy(nn.Sequential(*trained.model.layer_units()[conv_units(trained.model) :]))
        return _attacker_head(frozen, head, aux_x, aux_y, epochs=head_epochs, seed=seed, device=where)

    def train(system: str, data: ImageSplit, seed: int) -> nn.Module:
        """One model of ``system`` on ``data``, as the observer sees it. Keeping the last layer in the TEEs
        changes only what the final stage releases, so when both PPFL rows are attacked, one training
        serves both: the ``ppfl-kept`` view is taken from the ``ppfl-released`` training's convolutional
        units (tested equal to training with the layer kept) and used when that row asks for it. The model
        returned is on the device, where LiRA scores it."""
        if system == "e2e":
            trained_e2e = train_fedavg(replace(images, seed=seed), split=data, progress=False)
            return trained_e2e.model().eval().to(where)
        key = (seed, _fingerprint(data))
        if system == "ppfl-kept" and key in kept_views:
            return kept_views.pop(key)
        keep = system == "ppfl-kept"
        trained = train_ppfl(
            _ppfl_run(
                replace(images, seed=seed), replace(cfg, keep_classifier_in_tee=keep, seed=seed), tee_mib
            ),
            data,
        )
        client = next(c for c in trained.pool.client_ids() if c not in trained.pool.evaluators)
        if keep:
            return kept_view(trained, client, seed)
        if "ppfl-kept" in systems:
            kept_views[key] = kept_view(trained, client, seed)
        return trained.pool.trained_model(client).eval().to(where)

    def rows(system: str) -> dict[str, Any]:
        target = train(system, split, images.seed)
        accuracy = _accuracy(target, split.test)

        def shadow(xs: torch.Tensor, ys: torch.Tensor, seed: int) -> nn.Module:
            return train(system, _shadow_split(split, images, xs.cpu().numpy(), ys.cpu().numpy(), seed), seed)

        view = ModelView(f"{system}: what the observer sees of the released model", target)
        cache = None if out is None else out / "shadows" / system
        both = lira_variants(
            view,
            torch.from_numpy(x),
            torch.from_numpy(y),
            is_member,
            shadow,
            rng=np.random.default_rng(images.seed),
            num_shadow=shadows,
            cache=cache,
        )
        return {**{f"lira-{v}/{system}": s for v, s in both.items()}, f"accuracy/{system}": accuracy}

    table: dict[str, Any] = {}
    for system in systems:
        table.update(_part(out, f"lira-{system}", settings, lambda s=system: rows(s)))
    summary = {
        "run": {
            "data": split.train.describe(),
            "synthetic_data": split.train.synthetic,
            "model": images.model,
            "clients": images.clients,
            "samples_per_client": images.samples_per_client,
            "members": n,
            "non_members": n,
            "e2e_rounds": images.rounds,
            "ppfl_rounds_per_stage": cfg.rounds_per_stage,
            "local_epochs": cfg.local_epochs,
            "shadows": shadows,
            "aux_examples": aux_examples,
            "device": str(where),
        },
        "attacks": table,
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / "ppfl_lira.json", (json.dumps(summary, indent=2, sort_keys=True) + "\n").encode())
    return summary


def _fingerprint(data: ImageSplit) -> str:
    """A digest of a training split's examples, labels and clients' shares."""
    digest = hashlib.sha256()
    for part in (data.members.x, data.members.y):
        digest.update(np.ascontiguousarray(part).tobytes())
    for user in data.data.user_ids:
        digest.update(str(user).encode() + np.ascontiguousarray(data.data.array(user, "y")).tobytes())
    return digest.hexdigest()


def _accuracy(model: nn.Module, test: ImageData) -> float:
    """``model``'s accuracy on ``test``, computed where the model is (the test inputs move there once)."""
    with torch.no_grad():
        logits = model.eval()(torch.from_numpy(np.array(test.x)).to(module_device(model)))
    return float((logits.argmax(1).cpu().numpy() == test.y).mean())
