"""LiRA at user level against a released embedding network (metric learning).

Carlini et al.'s Likelihood Ratio Attack ("Membership Inference Attacks From First Principles", IEEE S&P
2022; :mod:`fedveil.attacks.lira`) asks, per candidate, whether the target model's statistic looks more
like that of shadow models trained WITH the candidate (IN) or WITHOUT it (OUT). Here a candidate is a
user (one participant: membership means the user's data was in training), the models are embedding
networks, and the shadows are trained on random halves of the attacker's population of users.

A triplet-trained network has no class logits, so the statistic is LiRA's logit-scaled confidence over
a prototype classifier of the candidate users: each model embeds ``S`` samples of each of the ``U``
candidates (``e_us``), takes each user's centroid ``c_j = mean_s e_js`` as its prototype, and scores a
sample by the negative squared distances to the prototypes, ``z_usj = -||e_us - c_j||^2 / tau``, where
``tau`` is the mean squared distance of a sample to its own user's centroid under that model (the
within-user spread, so the statistic does not change when a network rescales its embedding space). The
user's statistic is

    phi_u = mean_s [ z_usu - logsumexp_{j != u} z_usj ] = mean_s log(p_us / (1 - p_us)),

``p = softmax_j(z)``: a soft triplet margin of the user's samples (close to their own centroid, far from
every other user's), the quantity a triplet loss drives up for every user it trains on. The likelihood
ratio of ``phi_u`` under the IN and OUT Gaussians (or the one-sided OUT test, offline) is
:func:`fedveil.attacks.lira.lira_scores`, with the shadows drawn by
:func:`fedveil.attacks.lira.shadow_phis`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from numpy.typing import ArrayLike

from fedveil.attacks.lira import SubsetTrainFn, check_lira_settings, lira_reports, logit_margin, shadow_phis
from fedveil.attacks.mia_metric import user_embeddings
from fedveil.attacks.scores import FPR_TARGETS, AttackScores, as_binary_labels
from fedveil.attacks.views import ObserverView, require_model_view
from fedveil.errors import ConfigError, ValidationError

__all__ = ["prototype_confidence", "user_lira_attack"]


def prototype_confidence(embeddings: ArrayLike) -> np.ndarray:
    """``phi_u`` ``(U,)`` float64 (module docstring) of ``embeddings`` ``(U, S, d)``: ``S`` embedded
    samples of each of ``U >= 2`` users, under one model."""
    emb = torch.as_tensor(np.asarray(embeddings, dtype=np.float64))
    if emb.ndim != 3 or emb.shape[0] < 2 or emb.shape[1] < 1:
        raise ValidationError(f"embeddings must be (users >= 2, samples, dim), got shape {tuple(emb.shape)}")
    if not torch.isfinite(emb).all():
        raise ValidationError("embeddings have NaN or inf entries (the network diverged)")
    users, per_user = emb.shape[:2]
    flat = emb.reshape(users * per_user, -1)
    squared = torch.cdist(flat, emb.mean(dim=1)) ** 2
    owner = torch.arange(users).repeat_interleave(per_user)
    scale = squared.gather(1, owner[:, None]).mean()
    if not scale > 0:
        raise ValidationError(
            "every user's embeddings sit on their centroid; the prototype confidence is undefined"
        )
    return logit_margin(-squared / scale, owner).reshape(users, per_user).mean(axis=1)


def user_lira_attack(
    target: ObserverView,
    samples: ArrayLike,
    is_member: ArrayLike,
    train_subset: SubsetTrainFn,
    *,
    rng: np.random.Generator,
    num_shadow: int = 16,
    variants: Sequence[str] = ("online", "offline"),
    controls: Mapping[str, ObserverView] | None = None,
    global_variance: bool | None = None,
    fpr_targets: Sequence[float] = FPR_TARGETS,
    batch_size: int = 1024,
    progress: bool = False,
) -> dict[str, AttackScores]:
    """User-level LiRA against the embedding network of ``target`` (a :class:`ModelView`).

    ``samples`` ``(U, S, *input_shape)`` are ``S >= 2`` samples of each of the ``U`` candidate users (the
    same samples are embedded by every model); ``is_member`` ``(U,)`` is the truth, used only for the
    report. ``train_subset(inside, seed)`` trains one shadow network on the candidates where the bool mask
    ``inside`` ``(U,)`` holds, the way the target was trained; it is called ``num_shadow`` times on random
    halves drawn from ``rng`` (each candidate IN ``floor(num_shadow / 2)`` of them). Each of ``controls``
    (name -> view) is attacked with the same shadows and the same truth. Returns ``{"target/<variant>":
    report, "<control name>/<variant>": report}``; ``global_variance=None`` pools the variance below 64
    shadow models. A sealed view raises :class:`NoPlaintextView`.
    """
    view = require_model_view(target, "user-level LiRA")
    others = {name: require_model_view(v, "user-level LiRA") for name, v in (controls or {}).items()}
    if "target" in others:
        raise ConfigError("a control may not be named 'target'; that name is the target's report")
    x = np.asarray(samples, dtype=np.float32)
    if x.ndim < 3 or x.shape[0] < 2 or x.shape[1] < 2:
        raise ValidationError(f"samples must be (users >= 2, samples >= 2, ...), got shape {x.shape}")
    truth = as_binary_labels(is_member, x.shape[0], name="is_member")
    if not callable(train_subset):
        raise ConfigError(
            f"train_subset must be callable as train_subset(inside, seed) -> nn.Module, got {train_subset!r}"
        )
    check_lira_settings(num_shadow, variants)

    def phi(model: torch.nn.Module) -> np.ndarray:
        return prototype_confidence(user_embeddings(model, x, batch_size=batch_size))

    shadow_phi, shadow_in = shadow_phis(
        x.shape[0], phi, train_subset, rng=rng, num_shadow=int(num_shadow), progress=progress, what="user"
    )
    reports: dict[str, AttackScores] = {}
    for name, model_view in {"target": view, **others}.items():
        found = lira_reports(
            phi(model_view.model),
            shadow_phi,
            shadow_in,
            truth,
            variants=variants,
            global_variance=global_variance,
            name="user_lira",
            fpr_targets=fpr_targets,
            details={"statistic": "prototype_confidence", "samples_per_user": int(x.shape[1])},
        )
        reports.update({f"{name}/{variant}": report for variant, report in found.items()})
    return reports
