"""The loss-threshold membership inference attack of Yeom et al. 2018.

Yeom, Giacomelli, Fredrikson and Jha, "Privacy Risk in Machine Learning: Analyzing the Connection to
Overfitting" (CSF 2018): the adversary queries the observed model ``f`` on an example ``z = (x, y)`` and
predicts "member" when its loss is at most the model's expected training loss,

    A(z) = 1  iff  l(f, z) <= tau,   tau = E_{z' in S}[l(f, z')],

with ``l`` the cross-entropy. The membership score here is ``-l(f, z)`` (higher = more likely a member),
so the rule reads ``score >= -tau``. When the attacker knows the mean training loss ``tau`` (it is an
argument) the report carries Yeom's threshold figures; otherwise only the threshold-free figures (AUC,
TPR at low FPR). This is the attack PPFL (Sec. 2.2) lists among MIAs that
work on the final model alone.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numpy.typing import ArrayLike
from torch import nn
from torch.nn import functional as F

from fedveil.attacks.scores import (
    AttackScores,
    as_binary_labels,
    as_examples,
    check_labels_fit,
    model_logits,
    score_attack,
)
from fedveil.attacks.views import ObserverView, require_model_view
from fedveil.errors import ConfigError

__all__ = ["per_example_loss", "yeom_attack", "yeom_scores"]


def per_example_loss(
    model: nn.Module, x: ArrayLike | torch.Tensor, y: ArrayLike | torch.Tensor, *, batch_size: int = 1024
) -> np.ndarray:
    """Cross-entropy ``l(f, (x_i, y_i))`` of each example, ``(n,)`` float64 (eval mode, no autograd)."""
    xt, yt = as_examples(x, y)
    logits = model_logits(model, xt, batch_size=batch_size)
    check_labels_fit(logits, yt)
    return F.cross_entropy(logits.double(), yt, reduction="none").numpy()


def yeom_scores(
    target: ObserverView, x: ArrayLike | torch.Tensor, y: ArrayLike | torch.Tensor, *, batch_size: int = 1024
) -> np.ndarray:
    """Yeom et al. 2018 membership scores ``-l(f, z_i)``, ``(n,)``, of the model in ``target``."""
    view = require_model_view(target, "Yeom loss-threshold MIA")
    return -per_example_loss(view.model, x, y, batch_size=batch_size)


def yeom_attack(
    target: ObserverView,
    x: ArrayLike | torch.Tensor,
    y: ArrayLike | torch.Tensor,
    is_member: ArrayLike,
    *,
    mean_train_loss: float | None = None,
    batch_size: int = 1024,
) -> AttackScores:
    """Run Yeom's loss-threshold attack on ``target`` (a :class:`ModelView`) and score it against the truth.

    ``x`` ``(n, ...)``, ``y`` ``(n,)`` are the candidate examples and ``is_member`` ``(n,)`` whether each was
    in the model's training set (both kinds needed). ``mean_train_loss`` is Yeom's ``tau`` when the
    attacker knows it: the report then uses the threshold ``-tau`` (``threshold_source="attack"``);
    without it the report has no threshold figures. A sealed view raises :class:`NoPlaintextView`.
    """
    scores = yeom_scores(target, x, y, batch_size=batch_size)
    truth = as_binary_labels(is_member, scores.size, name="is_member")
    threshold = None
    if mean_train_loss is not None:
        if isinstance(mean_train_loss, bool) or not (
            isinstance(mean_train_loss, (int, float, np.floating))
            and math.isfinite(mean_train_loss)
            and mean_train_loss >= 0
        ):
            raise ConfigError(f"mean_train_loss must be a finite loss >= 0, got {mean_train_loss!r}")
        threshold = -float(mean_train_loss)
    return score_attack(
        "yeom_loss_threshold",
        scores,
        truth,
        threshold=threshold,
        choose_threshold=False,
        details={"mean_train_loss": None if mean_train_loss is None else float(mean_train_loss)},
    )
