"""Property inference from model updates: the batch-property attack of Melis et al. 2019.

Melis, Song, De Cristofaro and Shmatikov, "Exploiting Unintended Feature Leakage in Collaborative
Learning" (IEEE S&P 2019), the PIA PPFL (Sec. 2.2, 5.3) runs and reports by AUC
(Table 2). The attacker holds auxiliary data labelled with a property that need not relate to the main
task (e.g. a data subgroup). At each model snapshot ``theta`` an observer saw, it computes the updates a
client would upload for batches *with* the property (``b_prop``: a ``property_fraction`` of the batch has
it) and *without* it (``b_nonprop``), the same way the observed update was made:

- ``kind="gradient"``: ``g = d/d theta (1/|b|) sum_{(x, y) in b} l(f_theta(x), y)`` (one step);
- ``kind="delta"``: ``theta_T - theta_0`` after ``T = local_steps`` steps ``theta <- theta - lr * g``
  on the batch (the view's ``lr`` and ``local_steps``; the batch size is the view's ``num_samples``).

It trains a binary classifier (logistic regression on the flattened update of the chosen parameters,
standardised, seeded) to tell the two apart, and scores each observed update with it (the logit: higher =
more likely the client's batch had the property). Updates are computed with the model in eval mode (no
dropout, batch-norm running statistics) through ``torch.func`` on a copy of the parameters, vectorised
over batches; the observed model is never changed.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch
from numpy.typing import ArrayLike
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from fedveil.attacks.scores import (
    AttackScores,
    as_binary_labels,
    as_examples,
    eval_mode,
    fit_binary_classifier,
    score_attack,
)
from fedveil.attacks.views import ObserverView, UpdateKind, UpdateView, require_update_view
from fedveil.errors import ConfigError, ValidationError
from fedveil.models.device import resolve_device

__all__ = ["melis_attack", "simulate_updates", "update_vector"]

_ATTACK = "Melis batch-property inference"
_CHUNK_VALUES = 2**24  # parameter values held per vectorised chunk (about 64 MiB of float32 per copy)


def simulate_updates(
    model: nn.Module,
    xb: torch.Tensor,
    yb: torch.Tensor,
    *,
    names: Sequence[str],
    kind: UpdateKind,
    lr: float | None = None,
    local_steps: int = 1,
) -> torch.Tensor:
    """The updates ``(B, d)`` of ``model`` on each of ``B`` batches ``xb`` ``(B, b, ...)``, ``yb`` ``(B, b)``.

    ``kind="gradient"``: the gradient of the mean cross-entropy over the batch. ``kind="delta"``: the
    change after ``local_steps`` gradient steps of size ``lr`` on the batch (parameters with
    ``requires_grad=False`` stay fixed). Each row is the parameters ``names`` flattened and concatenated
    in that order.
    """
    params = dict(model.named_parameters())
    unknown = [n for n in names if n not in params]
    if unknown:
        raise ValidationError(f"{_ATTACK}: the model has no parameters {unknown}")
    trainable = {n: p.detach() for n, p in params.items() if p.requires_grad}
    fixed = {n: p.detach() for n, p in params.items() if not p.requires_grad}
    fixed.update({n: b.detach() for n, b in model.named_buffers()})
    if kind == "delta" and not (lr and lr > 0 and local_steps >= 1):
        raise ValidationError(
            f"{_ATTACK}: a delta needs lr > 0 and local_steps >= 1, got {lr!r}, {local_steps!r}"
        )

    def loss(p: dict[str, torch.Tensor], xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, {**p, **fixed}, (xs,)), ys)

    def one(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        if kind == "gradient":
            g = grad(loss)(trainable, xs, ys)
            return torch.cat(
                [g[n].flatten() if n in g else torch.zeros_like(params[n]).flatten() for n in names]
            )
        p = trainable
        for _ in range(local_steps):
            g = grad(loss)(p, xs, ys)
            p = {n: p[n] - lr * g[n] for n in p}
        return torch.cat(
            [
                (p[n] - trainable[n]).flatten() if n in p else torch.zeros_like(params[n]).flatten()
                for n in names
            ]
        )

    device = next(iter(params.values())).device
    chunk = max(1, min(64, _CHUNK_VALUES // max(1, sum(p.numel() for p in trainable.values()))))
    out = []
    with eval_mode(model):
        for start in range(0, xb.shape[0], chunk):
            out.append(vmap(one)(xb[start : start + chunk].to(device), yb[start : start + chunk].to(device)))
    return torch.cat(out).detach().cpu()


def update_vector(view: UpdateView, names: Sequence[str]) -> np.ndarray:
    """The observed update of the parameters ``names``, flattened and concatenated, ``(d,)`` float64."""
    missing = [n for n in names if n not in view.update]
    if missing:
        raise ValidationError(
            f"{_ATTACK}: {view.observer}'s update lacks parameters {missing} (it has {sorted(view.update)})"
        )
    return torch.cat([view.update[n].detach().double().cpu().flatten() for n in names]).numpy()


def _batches(
    rng: np.random.Generator, with_prop: np.ndarray, without: np.ndarray, count: int, size: int, k_prop: int
) -> np.ndarray:
    """``(count, size)`` example indices: ``k_prop`` from ``with_prop`` and the rest from ``without`` each."""
    rows = [
        np.concatenate(
            [rng.choice(with_prop, k_prop, replace=False), rng.choice(without, size - k_prop, replace=False)]
        )
        for _ in range(count)
    ]
    return np.stack(rows)


def melis_attack(
    views: Sequence[ObserverView],
    has_property: ArrayLike,
    aux_x: ArrayLike | torch.Tensor,
    aux_y: ArrayLike | torch.Tensor,
    aux_property: ArrayLike,
    *,
    rng: np.random.Generator,
    batches_per_snapshot: int = 256,
    batch_size: int | None = None,
    property_fraction: float = 0.5,
    params: Sequence[str] | None = None,
    steps: int = 300,
    lr: float = 0.01,
    weight_decay: float = 1e-2,
    device: str | torch.device = "cpu",
) -> AttackScores:
    """Melis et al. 2019's batch-property attack on the observed updates; the report against the truth.

    ``views`` are the observed uploads (each an :class:`UpdateView`; any :class:`SealedView` raises
    :class:`NoPlaintextView`); ``has_property`` ``(len(views),)`` says whether each client's batch had the
    property (for the report only). ``aux_x`` ``(m, ...)``, ``aux_y`` ``(m,)``, ``aux_property`` ``(m,)`` are
    the attacker's auxiliary data. For every distinct snapshot (the views' ``model`` objects, with their
    update kind, ``lr``, ``local_steps`` and batch size) ``rng`` draws ``batches_per_snapshot`` property
    batches (``max(1, round(property_fraction * b))`` property examples, the rest without) and as many
    batches without the property, of ``b = batch_size`` examples (default: the view's ``num_samples``).
    ``params`` selects the parameters used (default: those in the first view's update, in model order).
    The logistic-regression classifier (``steps``, ``lr``, ``weight_decay`` as in
    :func:`fit_binary_classifier`) is seeded from ``rng``; the report's threshold is its own (logit 0).
    The updates are simulated on ``device`` (:func:`~fedveil.models.device.resolve_device`), with a copy of
    each snapshot moved there (the views are not changed) and the auxiliary data moved there once; the
    features come back to host memory, where the classifier trains.
    """
    where = resolve_device(device)
    observed = [require_update_view(view, _ATTACK) for view in views]
    if not observed:
        raise ValidationError(f"{_ATTACK}: no observer view given")
    truth = as_binary_labels(has_property, len(observed), name="has_property")
    ax, ay = (t.to(where) for t in as_examples(aux_x, aux_y))
    aux_prop = as_binary_labels(aux_property, ax.shape[0], name="aux_property")
    count = batches_per_snapshot
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise ConfigError(f"batches_per_snapshot must be a positive integer, got {count!r}")
    if not 0.0 < property_fraction <= 1.0:
        raise ConfigError(f"property_fraction must lie in (0, 1], got {property_fraction!r}")
    first = observed[0]
    if params is None:
        names = [n for n, _ in first.model.named_parameters() if n in first.update]
    else:
        names = list(params)
        if not names:
            raise ConfigError("params is empty; name at least one parameter of the observed updates")
    vectors = [update_vector(view, names) for view in observed]
    if len({v.size for v in vectors}) != 1:
        raise ValidationError(
            f"{_ATTACK}: the observed updates of {names} differ in size "
            f"({sorted({v.size for v in vectors})}); all views must come from the same architecture"
        )
    observed_x = np.stack(vectors)
    with_prop, without = np.flatnonzero(aux_prop), np.flatnonzero(~aux_prop)

    groups: dict[tuple[int, UpdateKind, float | None, int | None, int], nn.Module] = {}
    for view in observed:
        size = batch_size if batch_size is not None else view.num_samples
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ConfigError(
                f"{_ATTACK}: {view.observer}'s batch size is unknown (num_samples={view.num_samples!r}); "
                f"pass batch_size, a positive integer (got {batch_size!r})"
            )
        if view.kind == "delta" and not (view.lr and view.local_steps):
            raise ValidationError(
                f"{_ATTACK}: {view.observer}'s delta has lr={view.lr!r}, local_steps={view.local_steps!r}; "
                "both are needed to simulate the client's local training"
            )
        key = (id(view.model), view.kind, view.lr, view.local_steps, int(size))
        groups.setdefault(key, view.model)

    features, labels = [], []
    for (_, kind, step_lr, local_steps, size), model in groups.items():
        k_prop = max(1, round(property_fraction * size))
        if with_prop.size < k_prop or without.size < size:
            raise ValidationError(
                f"{_ATTACK}: batches of {size} need {k_prop} auxiliary examples with the property and {size} "
                f"without; the auxiliary data has {with_prop.size} and {without.size}"
            )
        index = np.concatenate(
            [
                _batches(rng, with_prop, without, count, size, k_prop),
                _batches(rng, with_prop, without, count, size, 0),
            ]
        )
        picked = torch.from_numpy(index).to(where)
        updates = simulate_updates(
            copy.deepcopy(model).to(where),
            ax[picked],
            ay[picked],
            names=names,
            kind=kind,
            lr=step_lr,
            local_steps=local_steps or 1,
        )
        features.append(updates.double().numpy())
        labels.append(np.repeat([True, False], count))
    train_x = np.concatenate(features)
    if observed_x.shape[1] != train_x.shape[1]:
        raise ValidationError(
            f"{_ATTACK}: observed updates have {observed_x.shape[1]} values, "
            f"the simulated ones {train_x.shape[1]}"
        )
    classifier = fit_binary_classifier(
        train_x,
        np.concatenate(labels),
        seed=int(rng.integers(2**31 - 1)),
        hidden=0,
        steps=steps,
        lr=lr,
        weight_decay=weight_decay,
    )
    return score_attack(
        "melis_batch_property",
        classifier.decision_function(observed_x),
        truth,
        threshold=0.0,
        details={
            "snapshots": len(groups),
            "training_updates": int(train_x.shape[0]),
            "parameters": ",".join(names),
            "update_values": int(train_x.shape[1]),
            "property_fraction": float(property_fraction),
        },
    )
