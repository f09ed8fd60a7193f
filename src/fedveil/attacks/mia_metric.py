"""User-level membership inference against a released embedding network (metric learning).

A triplet-trained embedding network has no per-example cross-entropy for Yeom et al.'s (CSF 2018)
loss-threshold attack, but it has the quantity its loss drives down for every training user: the spread
of that user's embeddings (a positive pair's distance enters every triplet). The attack embeds ``S``
samples of each candidate user with the released network and scores the user by minus the mean distance
of its embeddings to their centroid: a user the network trained on is expected to sit in a tighter
cluster than an unseen one. It is Yeom's threshold attack with the metric-learning loss in place of the
cross-entropy, at the level FDML protects (one participant = one user).

With a ``reference`` network (e.g. the initial model every selected device received in the first round)
the score is calibrated by the user's spread under it, ``-spread_trained / spread_reference``: difficulty
calibration (Watson et al., ICLR 2022), which removes how tight a user's samples are to begin with. The
same score on the reference network alone is the natural control: it never saw anyone, so it must sit at
chance.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from fedveil.attacks.scores import FPR_TARGETS, AttackScores, model_logits, score_attack
from fedveil.attacks.views import ObserverView, require_model_view
from fedveil.errors import ValidationError

__all__ = ["metric_membership_attack", "user_embeddings", "user_spread"]


def user_embeddings(
    model: nn.Module, samples: np.ndarray | torch.Tensor, *, batch_size: int = 1024
) -> np.ndarray:
    """The embeddings ``(U, S, d)`` float64 of ``samples`` ``(U, S, *input_shape)`` (``S >= 2`` samples of
    each of ``U`` users) under ``model``."""
    x = torch.as_tensor(np.asarray(samples, dtype=np.float32))
    if x.ndim < 3 or x.shape[1] < 2:
        raise ValidationError(f"samples must be (users, samples >= 2, ...), got shape {tuple(x.shape)}")
    users, per_user = x.shape[:2]
    emb = model_logits(model, x.reshape(users * per_user, *x.shape[2:]), batch_size=batch_size)
    return emb.double().numpy().reshape(users, per_user, -1)


def user_spread(
    view: ObserverView, samples: np.ndarray | torch.Tensor, *, batch_size: int = 1024
) -> np.ndarray:
    """The mean distance of each user's embeddings to their centroid, ``(U,)`` float64, for ``samples``
    ``(U, S, *input_shape)`` embedded by the network of ``view`` (a :class:`ModelView`)."""
    model = require_model_view(view, "metric membership inference").model
    emb = user_embeddings(model, samples, batch_size=batch_size)
    return np.linalg.norm(emb - emb.mean(axis=1, keepdims=True), axis=2).mean(axis=1)


def metric_membership_attack(
    target: ObserverView,
    samples: np.ndarray | torch.Tensor,
    is_member: np.ndarray,
    *,
    reference: ObserverView | None = None,
    fpr_targets: Sequence[float] = FPR_TARGETS,
) -> AttackScores:
    """Score every candidate user of ``samples`` ``(U, S, ...)`` by ``-spread`` under ``target`` (divided by
    its spread under ``reference`` when given) and report the attack against ``is_member`` ``(U,)``."""
    spread = user_spread(target, samples)
    name = "metric_spread"
    if reference is not None:
        spread = spread / np.maximum(user_spread(reference, samples), np.finfo(np.float64).tiny)
        name = "metric_spread_calibrated"
    return score_attack(name, -spread, is_member, choose_threshold=False, fpr_targets=fpr_targets)
