"""Gradient inversion on [FDML]'s uncovered view: the difference of two consecutive global models.

Every device selected in a round receives the global embedding network, and the server holds it, so an
observer of two consecutive rounds has ``w_{t+1} - w_t``. [FDML] updates the network from the round's
un-noised gradients (Eq. 2, the sample-weighted mean of the devices' gradients, aggregated in the
enclave; no DP covers it), so the difference is a function of one aggregated gradient of the round's
cohort: the triplet loss of Alg. 1 over every embedding of the round, back-propagated through the
embedding network. :func:`fdml_round_difference` plays one such round with the protocol's own parts
(Alg. 1 :func:`~fedveil.enclave.triplet.loss_and_derivatives`, the devices' written-out backward pass
:meth:`~fedveil.models.touchauth.TouchAuthNet.group_gradients`, Eq. 2
:func:`~fedveil.enclave.aggregate.aggregate_gradients`) and one optimiser step:

- ``"sgd"``: ``w_{t+1} - w_t = -lr g``, the FL-traditional / SGD case: the difference *is* the aggregated
  gradient up to ``-lr``;
- ``"adam"``: what fedveil's FDML server runs (Adam, as [FDML]'s Table I recipe). In the first round Adam's
  step is ``-lr g / (|g| + eps)``: for every coordinate far above ``eps = 1e-8`` only the *sign* of the
  gradient survives; in later rounds the step is ``m_hat / (sqrt(v_hat) + eps)``, invariant to a positive
  rescaling of each coordinate's gradient history, so no observer of the models alone recovers the
  gradient's magnitudes. This attack inverts neither: on an Adam view it matches the dummy gradient to
  the step's direction as if it were a gradient (for round 1, the gradient's sign pattern).

:func:`invert_model_difference` is DLG (Zhu, Liu and Han, NeurIPS 2019) with the cross-entropy replaced by
Alg. 1's triplet loss through its torch reference
(:func:`~fedveil.experiments.fdml.triplet_reference.reference_loss`) and Inverting Gradients' distance
(Geiping et al., NeurIPS 2020: ``1 - cosine``, which needs neither the step's ``lr`` nor Eq. 2's
weights): dummy touch windows ``x'`` (``(N, 1, 30, 10)``, on the encoding's ``[0, 1]`` box) minimise
``1 - cos(grad_W L(f(x')), -(w_{t+1} - w_t))``. The triplet structure is not a secret of the protocol:
Alg. 1 labels every embedding by the device that uploaded it, and the number of devices and the samples
per device are the round's public settings, so the labels are known up to a renaming, to which the loss is
invariant.

:func:`fdml_inversion_table` attacks rounds of 1, 2 and 4 SYNTHETIC TouchAuth users, starting from the
attacker's prior (the population's mean window, jittered), and scores each reconstruction with
:func:`~fedveil.attacks.inversion.evaluate_inversion` (MSE after the Hungarian matching), plus the cosine
of each matched pair. Controls: the same optimisation against a round of other users (the targets were not
in it), scored against the targets; and the prior itself, the guess that needs no difference.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.func import functional_call

from fedveil.attacks.image_metrics import reconstruction_metrics
from fedveil.attacks.inversion import InversionResult, cosine_distance, evaluate_inversion
from fedveil.attacks.views import ObserverView, UpdateView, require_update_view
from fedveil.core.atomic import atomic_write
from fedveil.data.touchauth import TouchAuthConfig, generate_touchauth
from fedveil.enclave.aggregate import aggregate_gradients
from fedveil.enclave.triplet import loss_and_derivatives
from fedveil.errors import ConfigError, ValidationError
from fedveil.experiments.fdml.triplet_reference import reference_loss
from fedveil.models.device import resolve_device
from fedveil.models.touchauth import EVENT_DIM, EVENTS_PER_SAMPLE, TouchAuthNet

__all__ = [
    "ATTACK",
    "device_labels",
    "fdml_inversion_table",
    "fdml_round_difference",
    "invert_model_difference",
    "matched_cosines",
]

ATTACK = "FDML model-difference inversion"
SAMPLE_SHAPE = (1, EVENTS_PER_SAMPLE, EVENT_DIM)
Optimizer = Literal["sgd", "adam"]


def fdml_round_difference(
    net: TouchAuthNet,
    samples: Sequence[np.ndarray],
    *,
    margin: float = 1.0,
    strategy: str = "batch-all",
    optimizer: Optimizer = "sgd",
    lr: float = 3e-3,
    observer: str = "a device selected in rounds t and t+1: w_{t+1} - w_t",
) -> UpdateView:
    """One FDML round (Fig. 2, steps 4-9) of ``samples``, one ``(n_k, 30, 10)`` array of touch windows per
    device, on ``net``, and the model difference it leaves: Alg. 1 with ``margin`` and ``strategy`` on the
    round's embeddings labelled by device, each device's gradient of its derivatives, Eq. 2 (weights
    ``n_k``), then one ``optimizer`` step at ``lr`` (module docstring). Returns the difference as a
    ``kind="delta"`` view (``lr``, one step) whose model is a copy of ``net`` at ``w_t``; ``net`` is not
    changed."""
    blocks = [np.asarray(b, dtype=np.float32) for b in samples]
    if not blocks or any(b.ndim != 3 or b.shape[0] < 1 or b.shape[1:] != SAMPLE_SHAPE[1:] for b in blocks):
        shapes = [b.shape for b in blocks]
        raise ValidationError(f"samples have shapes {shapes}: expected one (windows >= 1, 30, 10) per device")
    if optimizer not in ("sgd", "adam"):
        raise ConfigError(f"optimizer {optimizer!r}: expected 'sgd' or 'adam'")
    model = copy.deepcopy(net).float()
    x = torch.from_numpy(np.concatenate(blocks)).unsqueeze(1)
    trace = model.trace(x)
    labels = device_labels([b.shape[0] for b in blocks])
    derivatives = torch.as_tensor(
        loss_and_derivatives(trace.out.numpy(), labels, margin=margin, strategy=strategy).derivatives,
        dtype=torch.float32,
    )
    grads, counts = {}, {}
    for k in range(len(blocks)):
        rows = torch.from_numpy(np.flatnonzero(labels == k))
        grads[f"device-{k}"] = model.group_gradients(trace, rows, derivatives[rows], 1)[0].numpy()
        counts[f"device-{k}"] = int(rows.numel())
    g = aggregate_gradients(grads, counts)
    before = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    w = before.clone().requires_grad_(True)
    opt = torch.optim.SGD([w], lr=lr) if optimizer == "sgd" else torch.optim.Adam([w], lr=lr)
    w.grad = torch.from_numpy(np.asarray(g, np.float32).copy())
    opt.step()
    delta = (w.detach() - before).split([p.numel() for p in model.parameters()])
    update = {
        name: d.view(p.shape).clone() for (name, p), d in zip(model.named_parameters(), delta, strict=True)
    }
    return UpdateView(
        observer=observer,
        kind="delta",
        update=update,
        model=model,
        num_samples=int(x.shape[0]),
        lr=lr,
        local_steps=1,
    )


def device_labels(windows_per_device: Sequence[int]) -> np.ndarray:
    """Alg. 1's labels of a round: device ``k``'s index repeated for each of its windows, ``(N,)``."""
    return np.repeat(np.arange(len(windows_per_device)), np.asarray(windows_per_device, dtype=np.int64))


def invert_model_difference(
    view: ObserverView,
    labels: np.ndarray,
    *,
    margin: float = 1.0,
    strategy: str = "batch-all",
    iterations: int = 300,
    lr: float = 0.05,
    seed: int = 0,
    restarts: int = 1,
    prior: torch.Tensor | None = None,
    jitter: float = 0.05,
    device: str | torch.device = "cpu",
) -> InversionResult:
    """Reconstruct the round's windows from a model-difference ``view`` (module docstring).

    ``labels`` ``(N,)``: the round's triplet structure (the device of each embedding). Adam at ``lr`` on
    the dummy windows for ``iterations`` steps, the windows clamped to ``[0, 1]`` after each; ``restarts``
    fresh uniform draws from a generator seeded with ``seed`` (with a ``prior`` guess ``(30, 10)`` of a
    window: that guess plus uniform noise of half-width ``jitter``, which separates the dummies), the
    iterate of least objective kept. The matching runs in float64 on ``device``
    (:func:`~fedveil.models.device.resolve_device`) with copies of the view's parameters and observed
    difference moved there (the dummies are drawn on the host, as on the CPU, then moved; the labels'
    triplets are enumerated on the host); the reconstruction comes back to host memory. A sealed
    view raises :class:`~fedveil.attacks.views.NoPlaintextView`; a zero difference (no active triplet:
    nothing to match) raises :class:`ValidationError`."""
    uv = require_update_view(view, ATTACK)
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ConfigError(f"iterations must be a positive integer, got {iterations!r}")
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 1:
        raise ConfigError(f"restarts must be a positive integer, got {restarts!r}")
    where = resolve_device(device)
    observed_all = uv.as_gradient()
    names = [n for n, _ in uv.model.named_parameters() if n in observed_all]
    observed = [observed_all[n].double().to(where) for n in names]
    if all(not bool(o.any()) for o in observed):
        raise ValidationError(
            f"{ATTACK}: the difference seen by {uv.observer!r} is zero everywhere (no active triplet in the "
            "round): there is nothing to invert"
        )
    params = {
        n: p.detach().double().to(where).requires_grad_(n in observed_all)
        for n, p in uv.model.named_parameters()
    }
    wrt = [params[n] for n in names]
    y = torch.as_tensor(np.asarray(labels))
    gen = torch.Generator().manual_seed(seed)
    best_loss, best_x, best_losses, best_start = math.inf, None, [], None
    evaluations = 0
    start = time.perf_counter()
    for _ in range(restarts):
        x = torch.rand((y.shape[0], *SAMPLE_SHAPE), generator=gen, dtype=torch.float64)
        if prior is not None:
            x = (prior.double().expand_as(x) + jitter * (2 * x - 1)).clamp(0.0, 1.0)
        x = x.to(where).requires_grad_(True)
        drawn = x.detach().clone()
        opt = torch.optim.Adam([x], lr=lr)
        losses: list[float] = []
        for _ in range(iterations):
            loss = reference_loss(
                functional_call(uv.model, params, (x,)), y, margin=margin, strategy=strategy
            )
            if not loss.requires_grad:  # no active triplet among the dummies: cosine undefined, redraw
                losses.append(1.0)
                break
            dummy = torch.autograd.grad(loss, wrt, create_graph=True)
            objective = cosine_distance(dummy, observed)
            evaluations += 1
            value = float(objective.detach())
            losses.append(value)
            if value < best_loss:
                best_loss, best_x, best_losses, best_start = value, x.detach().clone(), losses, drawn
            opt.zero_grad()
            x.grad = torch.autograd.grad(objective, x)[0]
            opt.step()
            with torch.no_grad():
                x.clamp_(0.0, 1.0)
    if best_x is None or best_start is None:
        raise ValidationError(f"{ATTACK}: no dummy draw had an active triplet; nothing to report")
    return InversionResult(
        attack=ATTACK,
        images=best_x.float().cpu(),
        labels=y.to(torch.int64),
        history=[(0, best_start.float().cpu()), (iterations, best_x.float().cpu())],
        losses=best_losses,
        final_loss=best_loss,
        seconds=time.perf_counter() - start,
        iterations=iterations,
        restarts=restarts,
        evaluations=evaluations,
        label_source="given",
    )


def matched_cosines(
    originals: torch.Tensor, reconstructed: torch.Tensor, permutation: Sequence[int]
) -> list[float]:
    """The cosine of each original window ``(N, 1, 30, 10)`` with its reconstruction under
    ``permutation`` (``reconstructed[permutation[i]]`` is paired with ``originals[i]``)."""
    a = originals.double().flatten(1)
    b = reconstructed.double()[torch.as_tensor(list(permutation))].flatten(1)
    return [float(v) for v in torch.nn.functional.cosine_similarity(a, b, dim=1)]


def _score(result: InversionResult, originals: torch.Tensor) -> dict[str, Any]:
    """MSE (after the Hungarian matching) and matched cosines of ``result`` against ``originals``."""
    metrics = evaluate_inversion(result, originals)
    cosines = matched_cosines(originals, result.images, metrics["permutation"])
    return {
        "mse_mean": metrics["mse_mean"],
        "mse": metrics["mse"],
        "cosine_mean": float(np.mean(cosines)),
        "cosine": cosines,
        "final_objective": result.final_loss,
        "seconds": result.seconds,
    }


def _guess_score(guess: torch.Tensor, originals: torch.Tensor) -> dict[str, Any]:
    """MSE and matched cosines of a fixed guess ``(N, 1, 30, 10)`` against ``originals``."""
    metrics = reconstruction_metrics(originals, guess)
    cosines = matched_cosines(originals, guess, metrics["permutation"])
    return {"mse_mean": metrics["mse_mean"], "cosine_mean": float(np.mean(cosines))}


def fdml_inversion_table(
    *,
    cohorts: Sequence[int] = (1, 2, 4),
    windows: int = 2,
    optimizers: Sequence[Optimizer] = ("sgd", "adam"),
    prior_users: int = 16,
    iterations: int = 400,
    attack_lr: float = 0.01,
    lr: float = 3e-3,
    margin: float = 1.0,
    seed: int = 0,
    out: Path | None = None,
    device: str = "auto",
) -> dict[str, Any]:
    """The model-difference inversion table (module docstring): for each cohort size ``K`` of ``cohorts``,
    a round of ``K`` SYNTHETIC TouchAuth users with ``windows`` windows each on the initial network
    (seeded by ``seed``), its difference after each of ``optimizers`` at ``lr``, attacked with
    ``iterations`` Adam steps at ``attack_lr`` from the prior (the mean window of ``prior_users`` further
    users, 8 windows each: what an attacker guesses without the difference). Beside each: the control
    (the same attack on a round of ``K`` other users, scored against the targets) and the prior's own
    error. The rounds are played in host memory with the protocol's own parts (the enclave's are numpy);
    every matching runs on ``device`` (:func:`invert_model_difference`; resolved before anything is
    drawn). Returns (and writes to ``out/fdml_inversion.json``) one entry per cohort and optimizer, and
    the device."""
    if not cohorts or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in cohorts):
        raise ConfigError(f"cohorts {cohorts!r} must be positive integers")
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 2:
        raise ConfigError(f"windows {windows!r}: a device needs >= 2 windows for a positive pair")
    where = resolve_device(device)
    largest = max(cohorts)
    population = generate_touchauth(
        TouchAuthConfig(
            seed=seed, train_users_per_model=(2 * largest + prior_users,), test_users_per_model=(1,)
        )
    )
    ids = population.train_user_ids()
    rng = np.random.default_rng([seed, 11])
    prior_windows = np.concatenate([population.sample_training(u, 8, rng) for u in ids[2 * largest :]])
    prior = torch.from_numpy(prior_windows.mean(axis=0))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        net = TouchAuthNet()
    table: dict[str, Any] = {}
    for k in cohorts:
        targets = [population.sample_training(u, windows, rng) for u in ids[:k]]
        others = [population.sample_training(u, windows, rng) for u in ids[largest : largest + k]]
        originals = torch.from_numpy(np.concatenate(targets)).unsqueeze(1)
        labels = device_labels([windows] * k)
        for optimizer in optimizers:
            view = fdml_round_difference(net, targets, margin=margin, optimizer=optimizer, lr=lr)
            norm = float(torch.sqrt(sum(d.double().pow(2).sum() for d in view.update.values())))
            entry: dict[str, Any] = {"difference_norm": norm}
            if norm == 0.0:
                entry["attack"] = None
                entry["note"] = "the difference is zero: a round of one device has no triplet (no negative)"
            else:
                invert = functools.partial(
                    invert_model_difference,
                    labels=labels,
                    margin=margin,
                    iterations=iterations,
                    lr=attack_lr,
                    seed=seed,
                    prior=prior,
                    device=where,
                )
                result = invert(view)
                other_round = fdml_round_difference(net, others, margin=margin, optimizer=optimizer, lr=lr)
                control = invert(other_round)
                entry["attack"] = _score(result, originals)
                entry["control/other-round"] = _score(control, originals)
            entry["baseline/prior-mean-window"] = _guess_score(prior.expand_as(originals).clone(), originals)
            table[f"K={k}/{optimizer}"] = entry
    summary = {
        "run": {
            "data": "SYNTHETIC TouchAuth",
            "cohorts": list(cohorts),
            "windows_per_device": windows,
            "optimizers": list(optimizers),
            "model_lr": lr,
            "margin": margin,
            "network": "TouchAuthNet at its seeded initialisation (round 1)",
            "iterations": iterations,
            "attack_lr": attack_lr,
            "prior_users": prior_users,
            "seed": seed,
            "device": str(where),
            "observer": "any device selected in two consecutive rounds, or the server: w_{t+1} - w_t",
        },
        "rounds": table,
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(
            out / "fdml_inversion.json", (json.dumps(summary, indent=2, sort_keys=True) + "\n").encode()
        )
    return summary
