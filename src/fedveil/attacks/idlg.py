"""Improved Deep Leakage from Gradients (iDLG): Zhao, Mopuri and Bilen, arXiv:2001.02610 (2020).

For a batch of one, cross-entropy loss and a last fully connected layer ``z = W h + b`` whose input ``h``
is non-negative (after a sigmoid or ReLU), the gradient of row ``i`` of ``W`` is

    dl/dW_i = (softmax(z)_i - 1[i = c]) h,

which is non-positive for the true class ``c`` and non-negative for every other class. iDLG reads the
label off the sign: here the row whose sum is the most negative (for ``h >= 0`` it is the only negative
one). It then runs DLG (:mod:`.dlg`: squared L2 gradient distance, L-BFGS at learning rate 1) with the
label fixed as a hard one-hot target, optimising only the dummy input.

For a batch of ``B > 1`` the signs mix. The heuristic used here is the label restoration of Yin et al.,
"See through Gradients: Image Batch Recovery via GradInversion" (CVPR 2021): rank the classes by the
minimum entry of their row of ``dl/dW`` (most negative first) and take the first ``B``; it assumes
the labels of a batch are distinct, so a batch with a repeated label loses at least one label (for
``B > K`` classes the ranking is repeated cyclically). Its accuracy is what
:func:`~fedveil.attacks.inversion.evaluate_inversion` reports, not assumed.

The last layer is found by running the model once on a probe batch and taking the last leaf module with
parameters that runs: it must be an ``nn.Linear`` with one output per class, and its weight must be among
the view's parameters (the AIoT private projector, [AIoT], is hidden: iDLG cannot run).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call

from fedveil.attacks.dlg import DLG_ITERATIONS, DLG_LR, DLG_RESTART_TOLERANCE, l2_stop_below
from fedveil.attacks.inversion import (
    GradientTarget,
    InversionResult,
    gradient_matching,
    gradient_target,
    squared_l2_distance,
)
from fedveil.attacks.views import ObserverView
from fedveil.errors import ValidationError

__all__ = ["idlg_attack", "infer_labels", "infer_target_labels", "last_linear_weight"]


def last_linear_weight(target: GradientTarget, attack: str = "iDLG") -> str:
    """The parameter name of the weight of the model's last layer, which must be a seen ``nn.Linear``.

    Raises :class:`ValidationError` naming the layer when the last layer with parameters is not an
    ``nn.Linear`` with ``num_classes`` outputs, or its weight is not in the view's update.
    """
    model = target.view.model
    order: list[str] = []
    names = {id(m): n for n, m in model.named_modules()}
    hooks = [
        m.register_forward_hook(lambda mod, _inp, _out: order.append(names[id(mod)]))
        for m in model.modules()
        if next(m.parameters(recurse=False), None) is not None
    ]
    probe = torch.zeros((1, *target.image_shape), dtype=target.observed[0].dtype)
    try:
        with torch.no_grad():
            functional_call(model, {**target.params, **target.buffers}, (probe,))
    finally:
        for h in hooks:
            h.remove()
    if not order:
        raise ValidationError(f"{attack}: the model has no layer with parameters")
    last = order[-1]
    layer = model.get_submodule(last)
    if not isinstance(layer, nn.Linear) or layer.out_features != target.num_classes:
        raise ValidationError(
            f"{attack}: the model's last layer {last!r} is a {type(layer).__name__}; label inference needs "
            f"an nn.Linear with {target.num_classes} outputs (one per class)"
        )
    weight = f"{last}.weight" if last else "weight"
    if weight not in target.names:
        where = "hidden from the observer" if weight in target.view.hidden else "not in the update"
        raise ValidationError(
            f"{attack}: the last layer's weight {weight!r} is {where}; label inference needs its gradient "
            f"among the view's parameters ({', '.join(target.names[:4])}...)"
        )
    return weight


def infer_target_labels(target: GradientTarget, attack: str = "iDLG") -> torch.Tensor:
    """The labels of ``target``'s batch read off the last layer's gradient (module docstring), ``(B,)``."""
    grad = target.observed[target.names.index(last_linear_weight(target, attack))]
    if target.batch_size == 1:
        return grad.sum(dim=1).argmin().reshape(1)
    ranking = grad.min(dim=1).values.argsort()
    repeats = -(-target.batch_size // target.num_classes)
    return ranking.repeat(repeats)[: target.batch_size].clone()


def infer_labels(
    view: ObserverView, *, image_shape: Sequence[int], batch_size: int | None = None
) -> torch.Tensor:
    """iDLG's label inference on ``view`` (Yin et al. 2021's ranking for batches > 1), ``(B,)`` int64."""
    target = gradient_target(view, "iDLG label inference", image_shape=image_shape, batch_size=batch_size)
    return infer_target_labels(target, "iDLG label inference")


def idlg_attack(
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
    """Run iDLG (Zhao et al. 2020) on ``view``: infer the labels, then DLG with them fixed (hard one-hot).

    Arguments as :func:`~fedveil.attacks.dlg.dlg_attack`. A sealed view raises
    :class:`~fedveil.attacks.views.NoPlaintextView`; a model whose last layer is not a seen ``nn.Linear``
    raises :class:`ValidationError`.
    """
    target = gradient_target(view, "iDLG", image_shape=image_shape, batch_size=batch_size, device=device)
    labels = infer_target_labels(target)
    return gradient_matching(
        target,
        attack="iDLG",
        distance=squared_l2_distance,
        optimizer="lbfgs",
        iterations=iterations,
        lr=DLG_LR,
        seed=seed,
        init=init,
        labels=labels,
        label_source="inferred",
        restarts=restarts,
        stop_below=l2_stop_below(target, restart_tolerance),
        snapshot_every=snapshot_every,
        optimize_hidden=optimize_hidden,
    )
