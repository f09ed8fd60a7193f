"""A white-box membership inference attack on what a federated observer sees, after Nasr et al. 2019.

Nasr, Shokri and Houmansadr, "Comprehensive Privacy Analysis of Deep Learning: Passive and Active
White-box Inference Attacks against Centralized and Federated Learning" (IEEE S&P 2019), the attack PPFL
(Sec. 5.3 and Table 2) runs as its MIA and reports by precision. For each
example ``(x, y)`` and each model snapshot ``f`` the observer saw, the attack extracts what a white-box
observer can compute:

- ``log l(f, (x, y))``, the log of the cross-entropy loss,
- ``f(x)_y``, the softmax confidence in the true class,
- the top-``k`` softmax probabilities, sorted in decreasing order (label-independent output features),
- ``log ||d l(f, (x, y)) / d W_layer||_2`` for each layer (the per-example gradient, computed with
  ``torch.func.vmap(grad(...))``; the logs are this module's choice, the quantities span decades),

concatenates them over the snapshots (Nasr's federated attacker observes the model across rounds; a
per-client-update observer sees each client's locally trained model) and trains a binary attack
classifier on the examples whose membership the attacker knows. This is Nasr's *supervised* setting: the
attacker knows a fraction of the true members and of the non-members; the attack is scored on the
disjoint rest. Nasr's attack model is a larger multi-stream network; here it is a small MLP or logistic
regression on the concatenated features (:func:`fedveil.attacks.scores.fit_binary_classifier`).
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
    check_labels_fit,
    eval_mode,
    fit_binary_classifier,
    model_logits,
    score_attack,
)
from fedveil.attacks.views import ModelView, ObserverView, SealedView, UpdateView, require_model_view
from fedveil.errors import ConfigError, ValidationError
from fedveil.models.device import resolve_device

__all__ = ["nasr_attack", "nasr_features", "parameter_layers", "snapshot_model"]

_ATTACK = "Nasr white-box MIA"
_TINY = 1e-12


def snapshot_model(view: ObserverView, attack: str = _ATTACK) -> nn.Module:
    """The model an observer holds after seeing ``view``.

    A :class:`ModelView` gives its model. A delta :class:`UpdateView` (FedAvg upload) gives a copy of the
    broadcast model plus the delta, ``theta_global + (theta_local - theta_global)``, i.e. the client's
    locally trained model (hidden parameters keep the attacker's guess). A gradient view cannot be turned
    into a model (:class:`ValidationError`); a :class:`SealedView` raises :class:`NoPlaintextView`.
    """
    if isinstance(view, UpdateView):
        if view.kind != "delta":
            raise ValidationError(
                f"{attack}: {view.observer} saw a gradient, not a model; "
                "pass a ModelView or a delta UpdateView"
            )
        model = copy.deepcopy(view.model)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, delta in view.update.items():
                params[name].add_(delta.to(params[name].device, params[name].dtype))
        return model
    return require_model_view(view, attack).model


def parameter_layers(model: nn.Module) -> dict[str, list[str]]:
    """Trainable parameter names grouped by the module (layer) owning them, in ``named_parameters`` order.

    The layer of ``"features.0.weight"`` is ``"features.0"``; a parameter of the root module is in ``""``.
    """
    layers: dict[str, list[str]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            layers.setdefault(name.rpartition(".")[0], []).append(name)
    return layers


def _per_example_grad_norms(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, layers: dict[str, list[str]], batch_size: int
) -> torch.Tensor:
    """``(n, len(layers))`` L2 norms of each example's loss gradient w.r.t. each layer's parameters."""
    wanted = {name for names in layers.values() for name in names}
    all_params = dict(model.named_parameters())
    params = {name: all_params[name].detach() for name in wanted}
    fixed = {name: p.detach() for name, p in all_params.items() if name not in wanted}
    fixed.update({name: b.detach() for name, b in model.named_buffers()})
    device = next(iter(params.values())).device

    def loss_one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, {**p, **fixed}, (xi.unsqueeze(0),))
        return F.cross_entropy(out, yi.unsqueeze(0))

    per_example = vmap(grad(loss_one), in_dims=(None, 0, 0))
    norms = []
    with eval_mode(model):
        for start in range(0, x.shape[0], batch_size):
            g = per_example(
                params, x[start : start + batch_size].to(device), y[start : start + batch_size].to(device)
            )
            squared = [sum((g[n].flatten(1) ** 2).sum(1) for n in names) for names in layers.values()]
            norms.append(torch.stack(squared, dim=1).sqrt().double().cpu())
    return torch.cat(norms)


def nasr_features(
    models: Sequence[nn.Module],
    x: ArrayLike | torch.Tensor,
    y: ArrayLike | torch.Tensor,
    *,
    top_k: int = 3,
    grad_layers: Sequence[str] | None = None,
    batch_size: int = 256,
) -> tuple[np.ndarray, list[str]]:
    """Per-example white-box features ``(n, d)`` over the snapshots ``models``, and the column names.

    Per snapshot ``s`` the columns are ``s{s}/log_loss``, ``s{s}/true_class_confidence``,
    ``s{s}/top{j}`` (``j < min(top_k, classes)``) and ``s{s}/log_grad_norm/<layer>`` for each layer of
    ``grad_layers`` (default: every layer with trainable parameters, :func:`parameter_layers`).
    """
    if not models:
        raise ValidationError(f"{_ATTACK}: no model snapshot given")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
        raise ConfigError(f"top_k must be a positive integer, got {top_k!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    xt, yt = as_examples(x, y)
    columns: list[torch.Tensor] = []
    names: list[str] = []
    for s, model in enumerate(models):
        logits = model_logits(model, xt, batch_size=batch_size).double()
        check_labels_fit(logits, yt)
        loss = F.cross_entropy(logits, yt, reduction="none")
        probs = logits.softmax(dim=1)
        k = min(int(top_k), probs.shape[1])
        layers = parameter_layers(model)
        if grad_layers is not None:
            unknown = [layer for layer in grad_layers if layer not in layers]
            if unknown:
                raise ConfigError(
                    f"grad_layers names {unknown}, which snapshot {s} does not have; "
                    f"its layers are {list(layers)}"
                )
            layers = {layer: layers[layer] for layer in grad_layers}
        columns += [torch.log(loss + _TINY)[:, None], probs.gather(1, yt[:, None])]
        columns.append(probs.sort(dim=1, descending=True).values[:, :k])
        names += [f"s{s}/log_loss", f"s{s}/true_class_confidence"] + [f"s{s}/top{j}" for j in range(k)]
        if layers:
            norms = _per_example_grad_norms(model, xt, yt, layers, int(batch_size))
            columns.append(torch.log(norms + _TINY))
            names += [f"s{s}/log_grad_norm/{layer or '<root>'}" for layer in layers]
    return torch.cat(columns, dim=1).numpy(), names


def _known_split(truth: np.ndarray, known_fraction: float, rng: np.random.Generator) -> np.ndarray:
    """A bool mask of the examples whose membership the attacker knows: ``known_fraction`` of each class."""
    known = np.zeros(truth.size, dtype=bool)
    for value, kind in ((True, "members"), (False, "non-members")):
        where = np.flatnonzero(truth == value)
        count = round(known_fraction * where.size)
        if not 1 <= count <= where.size - 1:
            raise ValidationError(
                f"{_ATTACK}: known_fraction={known_fraction} of {where.size} {kind} leaves {count} known and "
                f"{where.size - count} held out; both must be at least 1 (give more {kind})"
            )
        known[rng.permutation(where)[:count]] = True
    return known


def nasr_attack(
    observed: ObserverView | Sequence[ObserverView],
    x: ArrayLike | torch.Tensor,
    y: ArrayLike | torch.Tensor,
    is_member: ArrayLike,
    *,
    rng: np.random.Generator,
    known_fraction: float = 0.5,
    top_k: int = 3,
    grad_layers: Sequence[str] | None = None,
    hidden: int = 32,
    steps: int = 300,
    lr: float = 0.01,
    weight_decay: float = 1e-3,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
) -> AttackScores:
    """Nasr et al. 2019's supervised white-box MIA against what the observer saw; the held-out report.

    ``observed`` is one view (the global model as a :class:`ModelView`) or a sequence of views (the
    snapshots one observer saw: ModelViews, or delta UpdateViews of one client's uploads, see
    :func:`snapshot_model`); any :class:`SealedView` raises :class:`NoPlaintextView`. ``x`` ``(n, ...)``,
    ``y`` ``(n,)``, ``is_member`` ``(n,)`` are the candidates and the truth. ``rng`` draws which
    ``known_fraction`` of the members and of the non-members the attacker knows, and seeds the attack
    classifier (``hidden`` units, 0 = logistic regression; ``steps``, ``lr``, ``weight_decay`` as in
    :func:`fit_binary_classifier`). The report covers the held-out examples only (``indices`` are their
    positions); its threshold is the classifier's own (logit 0, probability 1/2), and ``precision`` is
    PPFL Table 2's MIA figure (chance = the fraction of members held out, 1/2 for balanced candidates).
    The snapshots' logits and per-example gradients are computed on ``device``
    (:func:`~fedveil.models.device.resolve_device`) with a copy of each snapshot moved there.
    """
    where = resolve_device(device)
    views = [observed] if isinstance(observed, (ModelView, UpdateView, SealedView)) else list(observed)
    if not views:
        raise ValidationError(f"{_ATTACK}: no observer view given")
    models = [copy.deepcopy(snapshot_model(view)).to(where) for view in views]
    if not 0.0 < known_fraction < 1.0:
        raise ConfigError(f"known_fraction must lie strictly between 0 and 1, got {known_fraction!r}")
    features, names = nasr_features(models, x, y, top_k=top_k, grad_layers=grad_layers, batch_size=batch_size)
    truth = as_binary_labels(is_member, features.shape[0], name="is_member")
    known = _known_split(truth, known_fraction, rng)
    classifier = fit_binary_classifier(
        features[known],
        truth[known],
        seed=int(rng.integers(2**31 - 1)),
        hidden=hidden,
        steps=steps,
        lr=lr,
        weight_decay=weight_decay,
    )
    held_out = np.flatnonzero(~known)
    return score_attack(
        "nasr_whitebox",
        classifier.decision_function(features[held_out]),
        truth[held_out],
        threshold=0.0,
        indices=held_out,
        details={
            "snapshots": len(models),
            "features": len(names),
            "known_members": int(truth[known].sum()),
            "known_nonmembers": int((~truth[known]).sum()),
            "classifier": f"mlp({hidden})" if hidden else "logistic_regression",
        },
    )
