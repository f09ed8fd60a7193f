"""The Likelihood Ratio Attack (LiRA) of Carlini et al. 2022.

Carlini, Chien, Nasr, Song, Terzis and Tramèr, "Membership Inference Attacks From First Principles"
(IEEE S&P 2022), Algorithm 1 (online) and its offline variant. The attacker trains ``N`` shadow models,
each on a random half of the attacker's population, so that every example is IN (trained on) about half
of them and OUT of the rest; here each example is IN exactly ``floor(N / 2)`` of them (the assignment of
the authors' code). For a model ``f`` and an example ``(x, y)`` the statistic is the logit-scaled
confidence

    phi = log(p_y / (1 - p_y)),   p = softmax(f(x)),

computed stably from the logits ``z`` as ``z_y - logsumexp_{j != y} z_j``. Per example (and per query,
when augmented copies are queried) the attack fits Gaussians to the shadow models' phis and scores the
target model's phi:

- online: ``N(mu_in, s_in^2)`` to the IN phis and ``N(mu_out, s_out^2)`` to the OUT phis; the score is
  the log likelihood ratio ``log N(phi; mu_in, s_in^2) - log N(phi; mu_out, s_out^2)``, averaged over
  queries; its own threshold is 0 (the ratio 1);
- offline: only the OUT Gaussian, a one-sided test: the score is ``log Pr[Z <= phi]``, ``Z ~
  N(mu_out, s_out^2)`` (``log(1 - Pr[Z > phi])``), averaged over queries; it has no threshold of its own.

With few shadow models the per-example variances are poor estimates; the paper then uses one global
variance per distribution (``global_variance=True``: the residuals of all examples pooled, each example
keeping its own mean). Queries are augmentation-free by default (the example itself); the paper's
augmented queries (mirrors, shifts) are passed as ``augmentations``.

The shadow loop (:func:`shadow_phis`: random halves, training, measuring, caching) and the reports
(:func:`lira_reports`) take any statistic of any candidates; :mod:`fedveil.attacks.lira_metric` uses
them for users of an embedding network.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from numpy.typing import ArrayLike
from torch import nn
from tqdm import tqdm

from fedveil.attacks.scores import (
    FPR_TARGETS,
    AttackScores,
    JsonScalar,
    as_binary_labels,
    as_examples,
    check_labels_fit,
    model_logits,
    score_attack,
)
from fedveil.attacks.views import ObserverView, require_model_view
from fedveil.core.atomic import atomic_write
from fedveil.errors import ConfigError, ValidationError

__all__ = [
    "PhiFn",
    "SubsetTrainFn",
    "TrainFn",
    "check_lira_settings",
    "lira_attack",
    "lira_reports",
    "lira_scores",
    "lira_variants",
    "logit_confidence",
    "logit_margin",
    "shadow_phis",
]

TrainFn = Callable[[torch.Tensor, torch.Tensor, int], nn.Module]
PhiFn = Callable[[nn.Module], np.ndarray]
"""A model's attack statistic per candidate, ``(n,)`` or ``(n, q)`` (``q`` queries per candidate)."""
SubsetTrainFn = Callable[[np.ndarray, int], nn.Module]
"""``train_subset(inside, seed)``: a shadow trained on the candidates where ``inside`` ``(n,)`` holds."""
Augmentation = Callable[[torch.Tensor], torch.Tensor]

_MIN_STD = 1e-6
_GLOBAL_VARIANCE_BELOW = 64


def logit_confidence(
    model: nn.Module, x: ArrayLike | torch.Tensor, y: ArrayLike | torch.Tensor, *, batch_size: int = 1024
) -> np.ndarray:
    """LiRA's ``phi = z_y - logsumexp_{j != y} z_j = log(p_y / (1 - p_y))`` per example, ``(n,)``."""
    xt, yt = as_examples(x, y)
    return logit_margin(model_logits(model, xt, batch_size=batch_size), yt)


def logit_margin(logits: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """``z_y - logsumexp_{j != y} z_j`` per row of ``logits`` ``(n, classes)`` for labels ``y`` ``(n,)``
    int64, in float64 in host memory: the logit-scaled confidence ``log(p_y / (1 - p_y))`` of
    ``p = softmax(z)``."""
    logits, y = logits.double().cpu(), y.cpu()
    check_labels_fit(logits, y)
    if logits.shape[1] < 2:
        raise ValidationError(f"LiRA needs a classifier with at least 2 classes, got {logits.shape[1]}")
    true_logit = logits.gather(1, y[:, None]).squeeze(1)
    others = logits.scatter(1, y[:, None], float("-inf"))
    return (true_logit - torch.logsumexp(others, dim=1)).numpy()


def _gaussian_fit(
    phis: np.ndarray, mask: np.ndarray, global_variance: bool, which: str
) -> tuple[np.ndarray, np.ndarray]:
    """Means and standard deviations ``(n, q)`` of ``phis`` ``(S, n, q)`` over the shadows where ``mask``."""
    weight = mask[:, :, None].astype(np.float64)
    count = weight.sum(axis=0)
    needed = 1 if global_variance else 2
    if (count < needed).any():
        i = int(np.argmax(count[:, 0] < needed))
        raise ValidationError(
            f"LiRA: example {i} is {which} in {int(count[i, 0])} shadow models; at least {needed} are needed "
            f"to fit its {which} Gaussian{'' if global_variance else ' with a per-example variance'}"
        )
    mean = (phis * weight).sum(axis=0) / count
    squares = (((phis - mean[None]) ** 2) * weight).sum(axis=0)
    if global_variance:
        dof = count.sum(axis=0) - count.shape[0]
        if (dof < 1).any():
            raise ValidationError(
                f"LiRA: every example is {which} in only one shadow model; no variance can be estimated"
            )
        var = np.broadcast_to(squares.sum(axis=0) / dof, mean.shape)
    else:
        var = squares / (count - 1)
    return mean, np.maximum(np.sqrt(var), _MIN_STD)


def _log_normal_pdf(value: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    return -0.5 * ((value - mean) / std) ** 2 - np.log(std) - 0.5 * np.log(2.0 * np.pi)


def _fingerprint(x: torch.Tensor, y: torch.Tensor, queries: int) -> str:
    """SHA-256 of the population and the number of queries: what a cached shadow's phis depend on."""
    digest = hashlib.sha256(np.ascontiguousarray(x.cpu().numpy()).tobytes())
    digest.update(np.ascontiguousarray(y.cpu().numpy()).tobytes())
    digest.update(str(queries).encode())
    return digest.hexdigest()


def _cached_phi(
    cache: Path | None, s: int, inside: np.ndarray, seed: int, fingerprint: str
) -> np.ndarray | None:
    """Shadow ``s``'s phis from ``cache``, if an earlier run saved them for the same half, seed and
    population; ``None`` when there is no file (or no cache)."""
    path = None if cache is None else cache / f"shadow{s}.npz"
    if path is None or not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as saved:
        same = (
            str(saved["fingerprint"]) == fingerprint
            and int(saved["seed"]) == seed
            and np.array_equal(saved["inside"], inside)
        )
        if not same:
            raise ConfigError(
                f"{path} holds shadow {s} of another LiRA run (population, rng or queries differ); "
                f"use another cache folder or delete {path.parent}"
            )
        return np.array(saved["phi"])


def lira_scores(
    target_phi: ArrayLike,
    shadow_phi: ArrayLike,
    shadow_in: ArrayLike,
    *,
    online: bool = True,
    global_variance: bool = False,
) -> np.ndarray:
    """LiRA scores ``(n,)`` (higher = member) from the phis of the target and of the shadow models.

    ``target_phi`` is ``(n,)`` or ``(n, q)`` (``q`` queries per example), ``shadow_phi`` ``(S, n)`` or
    ``(S, n, q)`` and ``shadow_in`` ``(S, n)`` bool: whether shadow ``s`` was trained on example ``i``.
    Online: the mean over queries of ``log N(phi; mu_in, s_in^2) - log N(phi; mu_out, s_out^2)``. Offline:
    the mean over queries of ``log Phi((phi - mu_out) / s_out)``. Standard deviations use the unbiased
    variance (per example, or pooled over examples with ``global_variance``), floored at 1e-6.
    """
    target = np.asarray(target_phi, dtype=np.float64)
    shadows = np.asarray(shadow_phi, dtype=np.float64)
    inside = np.asarray(shadow_in)
    if target.ndim == 1:
        target = target[:, None]
    if shadows.ndim == 2:
        shadows = shadows[:, :, None]
    if target.ndim != 2 or shadows.ndim != 3 or shadows.shape[1:] != target.shape:
        raise ValidationError(
            f"LiRA: shadow_phi {shadows.shape} must be (S, n, q) for target_phi {target.shape} (n, q)"
        )
    if inside.shape != shadows.shape[:2] or inside.dtype != np.bool_:
        raise ValidationError(
            f"LiRA: shadow_in must be a bool array of shape {shadows.shape[:2]}, "
            f"got {inside.dtype} of shape {inside.shape}"
        )
    if not (np.isfinite(target).all() and np.isfinite(shadows).all()):
        raise ValidationError("LiRA: the phis have NaN or inf entries (a model output saturated or diverged)")
    mu_out, sd_out = _gaussian_fit(shadows, ~inside, global_variance, "OUT")
    if online:
        mu_in, sd_in = _gaussian_fit(shadows, inside, global_variance, "IN")
        ratio = _log_normal_pdf(target, mu_in, sd_in) - _log_normal_pdf(target, mu_out, sd_out)
        return ratio.mean(axis=1)
    z = torch.from_numpy((target - mu_out) / sd_out)
    return torch.special.log_ndtr(z).numpy().mean(axis=1)


def lira_attack(
    target: ObserverView,
    x: ArrayLike | torch.Tensor,
    y: ArrayLike | torch.Tensor,
    is_member: ArrayLike,
    train_fn: TrainFn,
    *,
    rng: np.random.Generator,
    num_shadow: int = 16,
    online: bool = True,
    global_variance: bool | None = None,
    augmentations: Sequence[Augmentation] | None = None,
    batch_size: int = 1024,
) -> AttackScores:
    """Run LiRA against the model in ``target`` (a :class:`ModelView`) and score it against the truth.

    ``x`` ``(n, ...)``, ``y`` ``(n,)`` are the attacker's population (the candidates; the target's members
    are among them) and ``is_member`` ``(n,)`` the truth, used only for the report. ``train_fn(x, y, seed)``
    trains and returns one shadow model the way the target was trained; it is called ``num_shadow`` times
    with the random halves drawn from ``rng`` (and a seed drawn from ``rng``). ``global_variance=None``
    uses a global variance below 64 shadow models and per-example variances from 64 on.
    ``augmentations`` are the query transforms (``None``: the example itself only). Online needs
    ``num_shadow >= 4`` (two IN and two OUT models per example), offline ``>= 3``. A sealed view raises
    :class:`NoPlaintextView`.
    """
    variant = "online" if online else "offline"
    return lira_variants(
        target,
        x,
        y,
        is_member,
        train_fn,
        rng=rng,
        num_shadow=num_shadow,
        variants=(variant,),
        global_variance=global_variance,
        augmentations=augmentations,
        batch_size=batch_size,
    )[variant]


def check_lira_settings(num_shadow: object, variants: Sequence[str]) -> None:
    """Raise :class:`ConfigError` unless ``variants`` are among ``"online"``, ``"offline"`` and
    ``num_shadow`` is an integer large enough for them (online: two IN and two OUT models per example, so
    ``>= 4``; offline ``>= 3``)."""
    unknown = [v for v in variants if v not in ("online", "offline")]
    if unknown or not variants:
        raise ConfigError(f"LiRA variants {list(variants)!r} must be among online, offline")
    least = 4 if "online" in variants else 3
    if isinstance(num_shadow, bool) or not isinstance(num_shadow, (int, np.integer)) or num_shadow < least:
        kind = "online" if "online" in variants else "offline"
        raise ConfigError(
            f"num_shadow must be an integer >= {least} for {kind} LiRA "
            f"(at least two {'IN and two ' if kind == 'online' else ''}OUT models per example), "
            f"got {num_shadow!r}"
        )


def shadow_phis(
    n: int,
    phi: PhiFn,
    train_subset: SubsetTrainFn,
    *,
    rng: np.random.Generator,
    num_shadow: int,
    fingerprint: str = "",
    cache: Path | None = None,
    progress: bool = False,
    what: str = "example",
) -> tuple[np.ndarray, np.ndarray]:
    """Train ``num_shadow`` shadow models on random halves of ``n`` candidates and measure each.

    Each candidate is IN exactly ``floor(num_shadow / 2)`` shadows (the halves and one seed per shadow are
    drawn from ``rng``); ``train_subset(inside, seed)`` trains a shadow on the candidates where the bool
    mask ``inside`` ``(n,)`` holds, and ``phi(model)`` returns its statistic ``(n,)`` or ``(n, q)``. Returns
    ``(shadow_phi (S, n, q), shadow_in (S, n))``. With a ``cache`` folder, each shadow's phis are written
    to ``cache/shadow<s>.npz`` (with its IN mask, its seed and ``fingerprint``, which must identify the
    candidates and the statistic) as soon as it is trained, and a rerun drawing the same halves from the
    same ``rng`` reads them instead of training again; a file that does not match is refused. ``what``
    names a candidate in errors (an example, a user); ``progress`` shows a bar over the shadows.
    """
    shadows = int(num_shadow)
    shadow_in = rng.uniform(size=(shadows, n)).argsort(axis=0) < shadows // 2
    seeds = rng.integers(2**31 - 1, size=shadows)
    measured = []
    for s in tqdm(range(shadows), desc="LiRA shadow models", disable=not progress):
        if not shadow_in[s].any():
            raise ValidationError(f"LiRA: shadow model {s} drew no training {what}; give more candidates")
        saved = _cached_phi(cache, s, shadow_in[s], int(seeds[s]), fingerprint)
        if saved is not None:
            measured.append(saved)
            continue
        model = train_subset(shadow_in[s], int(seeds[s]))
        if not isinstance(model, nn.Module):
            raise ValidationError(
                f"LiRA: the shadow trainer must return a torch.nn.Module, got {type(model).__name__}"
            )
        values = np.asarray(phi(model), dtype=np.float64)
        measured.append(values[:, None] if values.ndim == 1 else values)
        if cache is not None:
            cache.mkdir(parents=True, exist_ok=True)
            buf = io.BytesIO()
            np.savez(buf, phi=measured[-1], inside=shadow_in[s], seed=seeds[s], fingerprint=fingerprint)
            atomic_write(cache / f"shadow{s}.npz", buf.getvalue())
    return np.stack(measured), shadow_in


def lira_reports(
    target_phi: ArrayLike,
    shadow_phi: np.ndarray,
    shadow_in: np.ndarray,
    is_member: np.ndarray,
    *,
    variants: Sequence[str] = ("online", "offline"),
    global_variance: bool | None = None,
    name: str = "lira",
    fpr_targets: Sequence[float] = FPR_TARGETS,
    details: Mapping[str, JsonScalar] | None = None,
) -> dict[str, AttackScores]:
    """``{variant: report}``: :func:`lira_scores` of ``target_phi`` against the shadows, scored against
    ``is_member`` (the online test at its own threshold 0, the offline one threshold-free).
    ``global_variance=None`` pools the variance below 64 shadow models (:func:`lira_attack`)."""
    shadows = shadow_phi.shape[0]
    pooled = bool(shadows < _GLOBAL_VARIANCE_BELOW) if global_variance is None else bool(global_variance)
    reports = {}
    for variant in variants:
        online = variant == "online"
        scores = lira_scores(target_phi, shadow_phi, shadow_in, online=online, global_variance=pooled)
        reports[variant] = score_attack(
            f"{name}_{variant}",
            scores,
            is_member,
            threshold=0.0 if online else None,
            fpr_targets=fpr_targets,
            details={"num_shadow": shadows, "global_variance": pooled, **(details or {})},
        )
    return reports


def lira_variants(
    target: ObserverView,
    x: ArrayLike | torch.Tensor,
    y: ArrayLike | torch.Tensor,
    is_member: ArrayLike,
    train_fn: TrainFn,
    *,
    rng: np.random.Generator,
    num_shadow: int = 16,
    variants: Sequence[str] = ("online", "offline"),
    global_variance: bool | None = None,
    augmentations: Sequence[Augmentation] | None = None,
    batch_size: int = 1024,
    cache: Path | None = None,
    progress: bool = False,
) -> dict[str, AttackScores]:
    """:func:`lira_attack` for several ``variants`` (``"online"``, ``"offline"``) from one set of shadow
    models (the offline test uses the OUT models the online one trains anyway): ``{variant: report}``.

    With a ``cache`` folder, each shadow model's phis are written to ``cache/shadow<s>.npz`` (with its IN
    mask, its seed and a fingerprint of the population) as soon as it is trained, and a rerun drawing the
    same halves from the same ``rng`` reads them instead of training again: a long attack resumes where it
    was cut off. A file that does not match (another population, rng or number of queries) is refused.
    ``progress`` shows a bar over the shadow models."""
    view = require_model_view(target, "LiRA")
    xt, yt = as_examples(x, y)
    truth = as_binary_labels(is_member, xt.shape[0], name="is_member")
    if not callable(train_fn):
        raise ConfigError(f"train_fn must be callable as train_fn(x, y, seed) -> nn.Module, got {train_fn!r}")
    check_lira_settings(num_shadow, variants)
    queries = list(augmentations) if augmentations is not None else [lambda batch: batch]
    if not queries or not all(callable(q) for q in queries):
        raise ConfigError("augmentations must be a non-empty sequence of callables x -> x (or None)")

    def phis(model: nn.Module) -> np.ndarray:
        columns = []
        for query in queries:
            queried = query(xt)
            if not isinstance(queried, torch.Tensor) or queried.shape != xt.shape:
                raise ValidationError(
                    f"LiRA: an augmentation must return a tensor of shape {tuple(xt.shape)}"
                )
            columns.append(logit_confidence(model, queried, yt, batch_size=batch_size))
        return np.stack(columns, axis=1)

    def train_subset(inside: np.ndarray, seed: int) -> nn.Module:
        return train_fn(xt[inside], yt[inside], seed)

    shadow_phi, shadow_in = shadow_phis(
        xt.shape[0],
        phis,
        train_subset,
        rng=rng,
        num_shadow=int(num_shadow),
        fingerprint=_fingerprint(xt, yt, len(queries)),
        cache=cache,
        progress=progress,
    )
    return lira_reports(
        phis(view.model),
        shadow_phi,
        shadow_in,
        truth,
        variants=variants,
        global_variance=global_variance,
        details={"queries": len(queries), "augmented": augmentations is not None},
    )
