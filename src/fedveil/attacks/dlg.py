"""Deep Leakage from Gradients (DLG): Zhu, Liu and Han, NeurIPS 2019, Algorithm 1.

From the gradient ``grad_W`` of one training step an observer recovers the private batch by optimising a
dummy input ``x'`` and a dummy label ``y'`` so that their gradient matches (Eq. 4):

    x'*, y'* = argmin_{x', y'} || d l(F(x', W), y') / dW - grad_W ||^2,

with ``y' = softmax(dummy logits)`` and ``l`` the cross-entropy with soft targets (Alg. 1 line 4), solved
with L-BFGS at learning rate 1 (the paper and its reference code: ``torch.optim.LBFGS(lr=1)``, one
iteration = one ``step`` of at most 20 inner evaluations, no line search), 300 iterations as the paper's
experiments. The dummy input is drawn from a seeded generator, by default uniformly on ``[0, 1]`` (the
pixel range); ``init="normal"`` is the reference code's ``randn``. On the paper's sigmoid LeNet at batch 1
(Fashion-MNIST, 30 runs each) both converge about equally often (25 and 24 of 30); a run that does not
converge stalls at an objective orders of magnitude above a converged one, which the attacker sees, so
``restarts > 1`` retries from a fresh draw until the objective falls below ``restart_tolerance`` times
``||grad_W||^2``. The distance runs over the parameters in ``view.update`` only (module docstring of
:mod:`.inversion`: hidden parameters, delta views).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fedveil.attacks.inversion import (
    GradientTarget,
    InversionResult,
    gradient_matching,
    gradient_target,
    squared_l2_distance,
)
from fedveil.attacks.views import ObserverView
from fedveil.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["DLG_ITERATIONS", "DLG_LR", "DLG_RESTART_TOLERANCE", "dlg_attack", "l2_stop_below"]

DLG_ITERATIONS = 300
DLG_LR = 1.0
DLG_RESTART_TOLERANCE = 1e-3


def l2_stop_below(target: GradientTarget, restart_tolerance: float) -> float:
    """The absolute objective under which DLG stops restarting: ``restart_tolerance * ||grad_W||^2``."""
    if (
        isinstance(restart_tolerance, bool)
        or not isinstance(restart_tolerance, (int, float))
        or not (0 <= restart_tolerance < float("inf"))
    ):
        raise ConfigError(
            f"restart_tolerance must be a non-negative finite number, got {restart_tolerance!r}"
        )
    return float(restart_tolerance) * float(sum(g.double().pow(2).sum() for g in target.observed))


def dlg_attack(
    view: ObserverView,
    *,
    image_shape: Sequence[int],
    batch_size: int | None = None,
    iterations: int = DLG_ITERATIONS,
    seed: int = 0,
    init: str = "uniform",
    restarts: int = 1,
    restart_tolerance: float = DLG_RESTART_TOLERANCE,
    snapshot_every: int | None = None,
    optimize_hidden: bool = False,
    device: str | torch.device = "cpu",
) -> InversionResult:
    """Run DLG (Zhu et al. 2019, Alg. 1) on ``view`` for a batch of ``image_shape`` ``(C, H, W)`` images.

    ``batch_size`` defaults to ``view.num_samples`` (else 1); ``iterations`` L-BFGS steps from a dummy
    drawn with ``seed`` (``init``: ``"uniform"`` or ``"normal"``); up to ``restarts`` runs, stopping at the
    first whose objective is below ``restart_tolerance * ||grad_W||^2``, the best kept; snapshots every
    ``snapshot_every`` iterations. ``optimize_hidden`` optimises the view's hidden parameters jointly with
    the dummy (the attacker of [AIoT], Sec. 5.5, who must guess the private projector).
    The labels returned are the argmax of the optimised dummy label. ``device``
    (:func:`~fedveil.models.device.resolve_device`) is where the matching runs; the result is in host
    memory. A sealed view raises :class:`~fedveil.attacks.views.NoPlaintextView`.
    """
    target = gradient_target(view, "DLG", image_shape=image_shape, batch_size=batch_size, device=device)
    return gradient_matching(
        target,
        attack="DLG",
        distance=squared_l2_distance,
        optimizer="lbfgs",
        iterations=iterations,
        lr=DLG_LR,
        seed=seed,
        init=init,
        restarts=restarts,
        stop_below=l2_stop_below(target, restart_tolerance),
        snapshot_every=snapshot_every,
        optimize_hidden=optimize_hidden,
    )
