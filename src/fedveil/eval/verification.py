"""Verification metrics: empirical ROC, AUC, EER, TPR@FPR, and FDML's Alg. 4 and Sec. VII-C accuracy.

FDML authenticates a user by the Euclidean distance between a fresh embedding
and the user's template: accept when ``distance <= threshold`` (Sec. VII-A), with the threshold chosen at
the equal-error point by Alg. 4, and reports the mean per-user accuracy of Sec. VII-C.

Score conventions. The generic metrics take *genuine* scores (same identity) and *impostor* scores
(different identity). With ``higher_is_genuine=True`` (similarities) a threshold ``t`` accepts ``s >= t``;
with ``higher_is_genuine=False`` (distances) it accepts ``s <= t``. Thresholds are always reported in the
units of the scores given.

Everything here is numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from fedveil.errors import ConfigError, ValidationError

__all__ = [
    "AccuracyReport",
    "EerResult",
    "Roc",
    "authentication_accuracy",
    "equal_error_rate",
    "roc_auc",
    "roc_curve",
    "select_threshold",
    "tpr_at_fpr",
]

DEFAULT_FPR_TARGETS: tuple[float, ...] = (1e-1, 1e-2, 1e-3)


def _frozen(array: np.ndarray) -> np.ndarray:
    out = np.array(array, dtype=np.float64, copy=True)
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class Roc:
    """An empirical ROC curve: vertices ``(fpr[i], tpr[i])`` reached by ``thresholds[i]``.

    All three arrays have shape ``(n_distinct_scores + 1,)`` and are read-only. Vertex 0 is ``(0, 0)``
    with the sentinel threshold ``+inf`` (similarities) or ``-inf`` (distances), which accepts nothing;
    vertex ``i >= 1`` has as threshold the ``i``-th distinct score, ordered from most to least
    genuine-looking; the last vertex is ``(1, 1)``. Both rates are non-decreasing, and every step moves at
    least one of them, because tied scores move together.
    """

    fpr: np.ndarray
    tpr: np.ndarray
    thresholds: np.ndarray

    def __post_init__(self) -> None:
        arrays = {name: _frozen(getattr(self, name)) for name in ("fpr", "tpr", "thresholds")}
        lengths = {name: a.shape for name, a in arrays.items()}
        if any(a.ndim != 1 for a in arrays.values()) or len(set(lengths.values())) != 1:
            raise ValidationError(f"Roc arrays must be 1-D of equal length, got shapes {lengths}")
        for name, a in arrays.items():
            object.__setattr__(self, name, a)

    def auc(self) -> float:
        """Trapezoidal area under the vertices (in floats; :func:`roc_auc` computes it from counts)."""
        return float(np.sum(np.diff(self.fpr) * (self.tpr[1:] + self.tpr[:-1])) / 2.0)


@dataclass(frozen=True)
class EerResult:
    """Equal error rate (a fraction in [0, 1]) and the threshold at which FPR = FNR = ``eer``."""

    eer: float
    threshold: float


@dataclass(frozen=True, eq=False)
class _RocCounts:
    """Integer cumulative counts behind a :class:`Roc`, so AUC and EER crossings are computed exactly."""

    thresholds: np.ndarray  # (m + 1,), sentinel first
    genuine_accepted: np.ndarray  # (m + 1,) int64, true accepts at each vertex
    impostor_accepted: np.ndarray  # (m + 1,) int64, false accepts at each vertex
    n_genuine: int
    n_impostor: int

    def roc(self) -> Roc:
        return Roc(
            fpr=self.impostor_accepted / self.n_impostor,
            tpr=self.genuine_accepted / self.n_genuine,
            thresholds=self.thresholds,
        )

    def auc(self) -> float:
        # Trapezoids with integer heights: sum(dI * (G_prev + G_cur)) / (2 nG nI), one rounding only.
        d_imp = np.diff(self.impostor_accepted)
        heights = self.genuine_accepted[:-1] + self.genuine_accepted[1:]
        numerator = int(np.dot(d_imp, heights))
        return numerator / (2 * self.n_genuine * self.n_impostor)

    def eer(self) -> EerResult:
        n_g, n_i = self.n_genuine, self.n_impostor
        # (FNR - FPR) * nG * nI as an exact integer; strictly decreasing from nG nI to -nG nI.
        gap = n_g * n_i - self.genuine_accepted * n_i - self.impostor_accepted * n_g
        k = int(np.argmax(gap <= 0))
        fpr = self.impostor_accepted / n_i
        if gap[k] == 0:
            return EerResult(eer=float(fpr[k]), threshold=float(self.thresholds[k]))
        alpha = float(gap[k - 1]) / float(gap[k - 1] - gap[k])
        eer = float(fpr[k - 1] + alpha * (fpr[k] - fpr[k - 1]))
        if k == 1:
            return EerResult(eer=eer, threshold=float(self.thresholds[1]))
        t0, t1 = float(self.thresholds[k - 1]), float(self.thresholds[k])
        return EerResult(eer=eer, threshold=t0 + alpha * (t1 - t0))

    def tpr_at(self, fprs: np.ndarray) -> np.ndarray:
        fpr = self.impostor_accepted / self.n_impostor
        idx = np.searchsorted(fpr, fprs, side="right") - 1
        return self.genuine_accepted[idx] / self.n_genuine


def _scores(name: str, values: ArrayLike) -> np.ndarray:
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"{name} must be numeric scores, got {type(values).__name__}: {exc}") from None
    if array.ndim != 1:
        raise ValidationError(f"{name} must be a 1-D array of scores, got shape {array.shape}")
    if array.size == 0:
        raise ValidationError(f"{name} is empty; at least one score is needed")
    bad = ~np.isfinite(array)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValidationError(f"{name} must be finite, got {array[i]} at index {i}")
    return array


def _roc_counts(genuine: ArrayLike, impostor: ArrayLike, higher_is_genuine: bool) -> _RocCounts:
    gen = _scores("genuine_scores", genuine)
    imp = _scores("impostor_scores", impostor)
    scores = np.concatenate([gen, imp])
    is_genuine = np.concatenate([np.ones(gen.size, np.int64), np.zeros(imp.size, np.int64)])
    order = np.argsort(scores, kind="stable")
    if higher_is_genuine:
        order = order[::-1]
    ranked = scores[order]
    # The last position of each run of tied scores: all tied scores are accepted together.
    ends = np.flatnonzero(np.append(ranked[1:] != ranked[:-1], True))
    genuine_cum = np.cumsum(is_genuine[order])[ends]
    impostor_cum = (ends + 1) - genuine_cum
    sentinel = np.inf if higher_is_genuine else -np.inf
    return _RocCounts(
        thresholds=np.concatenate([[sentinel], ranked[ends]]),
        genuine_accepted=np.concatenate([[0], genuine_cum]),
        impostor_accepted=np.concatenate([[0], impostor_cum]),
        n_genuine=int(gen.size),
        n_impostor=int(imp.size),
    )


def roc_curve(
    genuine_scores: ArrayLike, impostor_scores: ArrayLike, *, higher_is_genuine: bool = True
) -> Roc:
    """The exact empirical ROC over every distinct score used as a threshold.

    ``genuine_scores`` ``(n_g,)`` and ``impostor_scores`` ``(n_i,)`` are finite, non-empty 1-D arrays.
    Vertex ``i`` of the result is ``(FPR, TPR)`` when accepting every score at least as genuine-looking as
    ``thresholds[i]`` (``>=`` for similarities, ``<=`` for distances, i.e. ``higher_is_genuine=False``);
    tied scores cross a threshold together, so a tie between a genuine and an impostor score is one
    diagonal step. The curve starts at ``(0, 0)`` (sentinel threshold ``±inf``) and ends at ``(1, 1)``.
    """
    return _roc_counts(genuine_scores, impostor_scores, higher_is_genuine).roc()


def roc_auc(
    genuine_scores: ArrayLike, impostor_scores: ArrayLike, *, higher_is_genuine: bool = True
) -> float:
    """Trapezoidal area under :func:`roc_curve`, a fraction in [0, 1].

    It equals the Mann-Whitney statistic ``P(g beats i) + 0.5 P(g ties i)`` over all genuine/impostor
    pairs ("beats" = higher for similarities, lower for distances). Computed from integer counts with a
    single final division.
    """
    return _roc_counts(genuine_scores, impostor_scores, higher_is_genuine).auc()


def equal_error_rate(
    genuine_scores: ArrayLike, impostor_scores: ArrayLike, *, higher_is_genuine: bool = True
) -> EerResult:
    """Interpolated equal error rate on the empirical ROC of :func:`roc_curve`.

    ``FNR - FPR = 1 - TPR - FPR`` strictly decreases along the ROC vertices from 1 to -1. If it is 0 at a
    vertex, the EER is that vertex's FPR and the threshold its threshold. Otherwise the EER is where the
    straight segment between the two bracketing vertices meets ``FNR = FPR`` (linear interpolation by the
    same fraction ``alpha``), and the threshold is interpolated by that ``alpha`` between the two
    vertices' thresholds; when the lower bracketing vertex is the ``(0, 0)`` sentinel (infinite threshold),
    the threshold of the first real vertex is returned. All genuine scores strictly better than all
    impostor scores gives ``eer == 0`` at the worst genuine score.
    """
    return _roc_counts(genuine_scores, impostor_scores, higher_is_genuine).eer()


def _fpr_targets(fprs: Sequence[float]) -> np.ndarray:
    try:
        targets = np.asarray(fprs, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"fprs must be numbers in [0, 1], got {fprs!r}: {exc}") from None
    if targets.ndim != 1:
        raise ConfigError(f"fprs must be a 1-D sequence of numbers in [0, 1], got shape {targets.shape}")
    bad = ~((targets >= 0.0) & (targets <= 1.0))
    if bad.any():
        raise ConfigError(f"fprs must lie in [0, 1], got {targets[bad].tolist()}")
    return targets


def tpr_at_fpr(
    genuine_scores: ArrayLike,
    impostor_scores: ArrayLike,
    fprs: Sequence[float],
    *,
    higher_is_genuine: bool = True,
) -> np.ndarray:
    """TPR at each target FPR, ``(len(fprs),)``, read off the empirical ROC without interpolation.

    Convention (conservative): for target ``f`` the result is the largest TPR among ROC vertices whose FPR
    is ``<= f``, i.e. the best operating point a real threshold reaches without exceeding the target
    false-accept rate. With fewer than ``1 / f`` impostor scores this is the TPR at FPR 0. Targets must lie
    in [0, 1].
    """
    counts = _roc_counts(genuine_scores, impostor_scores, higher_is_genuine)
    return counts.tpr_at(_fpr_targets(fprs))


def _select_thresholds(d_self: np.ndarray, d_other: np.ndarray) -> np.ndarray:
    """Alg. 4 for a batch: ``d_self`` ``(b, n_self)``, ``d_other`` ``(b, n_other)`` -> ``(b,)`` thresholds."""
    n_self, n_other = d_self.shape[1], d_other.shape[1]
    distances = np.concatenate([d_self, d_other], axis=1)
    is_self = np.concatenate([np.ones(d_self.shape, np.int64), np.zeros(d_other.shape, np.int64)], axis=1)
    order = np.argsort(distances, axis=1, kind="stable")
    ranked = np.take_along_axis(distances, order, axis=1)
    self_accepted = np.cumsum(np.take_along_axis(is_self, order, axis=1), axis=1)
    other_accepted = np.arange(1, ranked.shape[1] + 1) - self_accepted
    # A midpoint candidate sits after position j when ranked[j] < ranked[j + 1]; accepting d <= midpoint
    # accepts positions 0..j. (FPR - FNR) * n_self * n_other as an exact integer:
    gap = other_accepted[:, :-1] * n_self - (n_self - self_accepted[:, :-1]) * n_other
    is_candidate = ranked[:, 1:] > ranked[:, :-1]
    cost = np.where(is_candidate, np.abs(gap), np.iinfo(np.int64).max)
    j = np.argmin(cost, axis=1)
    rows = np.arange(ranked.shape[0])
    lo, hi = ranked[rows, j], ranked[rows, j + 1]
    mid = lo + 0.5 * (hi - lo)
    # A midpoint that rounds up onto `hi` would also accept `hi`; `lo` classifies like the true midpoint.
    threshold = np.where(mid < hi, mid, lo)
    return np.where(is_candidate.any(axis=1), threshold, ranked[:, 0])


def _embedding_matrix(name: str, values: ArrayLike, ndim: int) -> np.ndarray:
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"{name} must be a numeric array, got {type(values).__name__}: {exc}") from None
    if array.ndim != ndim or 0 in array.shape:
        raise ValidationError(f"{name} must be a non-empty {ndim}-D array, got shape {array.shape}")
    if not np.isfinite(array).all():
        where = tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])
        raise ValidationError(f"{name} must be finite, got {array[where]} at index {where}")
    return array


def select_threshold(template: ArrayLike, self_embeddings: ArrayLike, other_embeddings: ArrayLike) -> float:
    """Alg. 4 of FDML: the distance threshold where FPR ≈ FNR.

    ``template`` is ``(d,)``, ``self_embeddings`` ``(n_self, d)`` (the positives) and ``other_embeddings``
    ``(n_other, d)`` (the negatives). Distances are Euclidean distances to the template and a sample is
    accepted when ``distance <= threshold``. The candidate thresholds are all distinct distances and the
    midpoints between consecutive distinct distances; the result minimises ``|FPR - FNR|`` (compared
    exactly, as integers), ties broken by the smallest minimising *midpoint*. Every distinct distance but the
    largest classifies like the midpoint just above it, and the largest (FPR = 1) never minimises, so the
    result is the midpoint of the first gap between distances at which ``|FPR - FNR|`` is minimal: when
    the classes separate, the middle of the gap between the farthest positive and the nearest negative.
    If all distances are equal the only candidate is that distance.
    """
    tmpl = _embedding_matrix("template", template, 1)
    own = _embedding_matrix("self_embeddings", self_embeddings, 2)
    other = _embedding_matrix("other_embeddings", other_embeddings, 2)
    if own.shape[1] != tmpl.shape[0] or other.shape[1] != tmpl.shape[0]:
        raise ValidationError(
            f"embedding dimensions differ: template {tmpl.shape}, self_embeddings {own.shape}, "
            f"other_embeddings {other.shape}; all must share the last dimension d"
        )
    d_self = np.linalg.norm(own - tmpl, axis=1)
    d_other = np.linalg.norm(other - tmpl, axis=1)
    return float(_select_thresholds(d_self[None, :], d_other[None, :])[0])


@dataclass(frozen=True, eq=False)
class AccuracyReport:
    """Result of :func:`authentication_accuracy` over ``U`` test users.

    ``accuracy`` is the paper's number as a fraction in [0, 1] (``accuracy_percent`` is the same in 0-100):
    the mean over users of ``per_user_accuracy`` ``(U,)``. ``thresholds`` ``(U,)`` are the Alg. 4 distance
    thresholds. ``roc``, ``auc``, ``eer`` and ``tpr_at_fpr`` (one per ``fpr_targets``) are pooled over
    all users with distances as scores (genuine: each user's evaluation embeddings to its own template;
    impostor: every other user's evaluation embeddings to that template).
    """

    accuracy: float
    per_user_accuracy: np.ndarray
    thresholds: np.ndarray
    roc: Roc
    auc: float
    eer: EerResult
    fpr_targets: tuple[float, ...]
    tpr_at_fpr: np.ndarray

    @property
    def accuracy_percent(self) -> float:
        """Mean per-user accuracy in percent (0-100), as FDML Sec. VIII reports it."""
        return 100.0 * self.accuracy

    def summary(self) -> dict[str, float]:
        """Scalar metrics as a JSON-ready dict (``tpr@fpr=<target>`` keys for the TPR targets)."""
        out = {
            "accuracy": self.accuracy,
            "accuracy_percent": self.accuracy_percent,
            "auc": self.auc,
            "eer": self.eer.eer,
            "eer_threshold": self.eer.threshold,
            "num_users": float(self.per_user_accuracy.size),
        }
        for target, tpr in zip(self.fpr_targets, self.tpr_at_fpr.tolist(), strict=True):
            out[f"tpr@fpr={target:g}"] = tpr
        return out


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _distances_to_templates(templates: np.ndarray, embeddings: np.ndarray) -> np.ndarray:
    """``(U, d)`` templates, ``(U, n, d)`` embeddings -> ``(U_templates, U_users, n)`` Euclidean distances."""
    n_users, n, dim = embeddings.shape
    chunk = max(1, 2_000_000 // (n_users * n * dim))
    out = np.empty((templates.shape[0], n_users, n))
    for start in range(0, templates.shape[0], chunk):
        block = templates[start : start + chunk, None, None, :]
        out[start : start + chunk] = np.linalg.norm(embeddings[None] - block, axis=-1)
    return out


def authentication_accuracy(
    embeddings: ArrayLike,
    rng: np.random.Generator,
    *,
    n_template: int = 20,
    n_threshold: int = 10,
    n_eval: int = 10,
    n_other: int = 10,
    fpr_targets: Sequence[float] = DEFAULT_FPR_TARGETS,
) -> AccuracyReport:
    """DML model accuracy of FDML Sec. VII-C on test-user embeddings.

    ``embeddings`` is ``(U, n_template + n_threshold + n_eval, d)`` (the paper: ``(U, 40, d)``). The split
    is fixed by position: for user ``u``, A = ``[:n_template]`` (its template is the mean of A),
    B = the next ``n_threshold`` and C = the last ``n_eval``. Its threshold is Alg. 4
    (:func:`select_threshold`) with self = u's B and other = the B of ``n_other`` users drawn from ``rng``;
    its accuracy is the fraction of correct decisions (accept ``distance <= threshold``) over u's C (should
    accept) and the C of another ``n_other`` users drawn from ``rng``, disjoint from the threshold users and
    from u (should reject): ``(correct accepts + correct rejects) / (n_eval * (1 + n_other))``. The model
    accuracy is the mean over users. Needs ``U >= 1 + 2 * n_other`` (21 in the paper).
    """
    sizes = {
        name: _positive_int(name, value)
        for name, value in (
            ("n_template", n_template),
            ("n_threshold", n_threshold),
            ("n_eval", n_eval),
            ("n_other", n_other),
        )
    }
    emb = _embedding_matrix("embeddings", embeddings, 3)
    per_user = sizes["n_template"] + sizes["n_threshold"] + sizes["n_eval"]
    if emb.shape[1] != per_user:
        raise ValidationError(
            f"embeddings must have n_template + n_threshold + n_eval = {per_user} samples per user "
            f"(axis 1), got shape {emb.shape}"
        )
    n_users, k = emb.shape[0], sizes["n_other"]
    if n_users < 1 + 2 * k:
        raise ValidationError(
            f"embeddings has {n_users} users; at least 1 + 2 * n_other = {1 + 2 * k} are needed "
            f"(the user, {k} threshold users and {k} disjoint evaluation users)"
        )
    targets = _fpr_targets(fpr_targets)

    nt, nb = sizes["n_template"], sizes["n_threshold"]
    part_b, part_c = emb[:, nt : nt + nb], emb[:, nt + nb :]
    templates = emb[:, :nt].mean(axis=1)

    keys = rng.random((n_users, n_users))
    np.fill_diagonal(keys, np.inf)
    drawn = np.argsort(keys, axis=1)[:, : 2 * k]
    threshold_users, eval_users = drawn[:, :k], drawn[:, k:]

    d_self_b = np.linalg.norm(part_b - templates[:, None, :], axis=-1)
    d_other_b = np.linalg.norm(part_b[threshold_users] - templates[:, None, None, :], axis=-1)
    thresholds = _select_thresholds(d_self_b, d_other_b.reshape(n_users, -1))

    d_c = _distances_to_templates(templates, part_c)
    users = np.arange(n_users)
    d_self_c = d_c[users, users]
    d_other_c = d_c[users[:, None], eval_users]
    correct_accepts = (d_self_c <= thresholds[:, None]).sum(axis=1)
    correct_rejects = (d_other_c > thresholds[:, None, None]).sum(axis=(1, 2))
    per_user_accuracy = (correct_accepts + correct_rejects) / (sizes["n_eval"] * (1 + k))

    impostor = d_c[~np.eye(n_users, dtype=bool)].ravel()
    counts = _roc_counts(d_self_c.ravel(), impostor, higher_is_genuine=False)
    return AccuracyReport(
        accuracy=float(per_user_accuracy.mean()),
        per_user_accuracy=_frozen(per_user_accuracy),
        thresholds=_frozen(thresholds),
        roc=counts.roc(),
        auc=counts.auc(),
        eer=counts.eer(),
        fpr_targets=tuple(float(t) for t in targets),
        tpr_at_fpr=_frozen(counts.tpr_at(targets)),
    )
