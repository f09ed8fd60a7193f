"""What every membership / property inference attack reports, and the pieces those attacks share.

:class:`AttackScores` summarises attack scores (higher = more likely a *positive*: a member of the
training set for membership inference, an update from a batch with the property for property inference)
against the truth, in the figures the literature reports:

- ROC AUC as the Mann-Whitney statistic ``P(s_pos > s_neg) + 1/2 P(s_pos = s_neg)`` (PPFL,
  [PPFL], Table 2 reports it for property inference), with two standard errors: DeLong
  et al. (1988)'s estimate from placement values, and the exact standard error under the null hypothesis
  that the scores carry no information (the permutation distribution of the Mann-Whitney U, ties
  corrected), against which "AUC ~ 0.5" is judged;
- balanced accuracy, precision (PPFL Table 2 reports membership inference as precision, 0.5 = guessing
  on a balanced evaluation set) and recall at a stated threshold: the attack's own threshold when it has
  one (``threshold_source="attack"``), else the threshold maximising balanced accuracy on these very scores
  (``"best_balanced_accuracy"``, an optimistic oracle choice), or none (``"none"``: AUC-based figures only);
- TPR at low FPR (1e-3 and 1e-2) as Carlini et al. 2022 ("Membership Inference Attacks From First
  Principles", Sec. III) argue membership inference should be judged, read off the empirical ROC as the
  largest TPR whose FPR does not exceed the target; with fewer than ``1 / target`` negatives that FPR
  cannot be resolved and the value is ``None`` (``min_resolvable_fpr`` = 1 / number of negatives).

The empirical ROC is :func:`fedveil.eval.verification.roc_curve`. Shared helpers: :func:`eval_mode`,
:func:`model_logits` (batched, under ``torch.no_grad()``), input validation, and
:func:`fit_binary_classifier`, the small seeded attack classifier (logistic regression or a one-hidden-layer
MLP in torch) used by the Nasr and Melis attacks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from numpy.typing import ArrayLike
from torch import nn

from fedveil.errors import ConfigError, ValidationError
from fedveil.eval.verification import Roc, roc_auc
from fedveil.eval.verification import roc_curve as _verification_roc
from fedveil.eval.verification import tpr_at_fpr as _verification_tpr_at_fpr
from fedveil.models.device import module_device

__all__ = [
    "FPR_TARGETS",
    "AttackScores",
    "BinaryClassifier",
    "ThresholdSource",
    "as_binary_labels",
    "as_examples",
    "auc_null_std_error",
    "auc_std_error",
    "check_labels_fit",
    "eval_mode",
    "fit_binary_classifier",
    "model_logits",
    "plot_attack_roc",
    "roc_curve",
    "score_attack",
]

FPR_TARGETS: tuple[float, ...] = (1e-3, 1e-2)

ThresholdSource = Literal["attack", "best_balanced_accuracy", "none"]

JsonScalar = str | int | float | bool | None


def _frozen(array: np.ndarray) -> np.ndarray:
    out = np.array(array, copy=True)
    out.setflags(write=False)
    return out


def _as_scores(values: ArrayLike) -> np.ndarray:
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"scores must be numbers, got {type(values).__name__}: {exc}") from None
    if array.ndim != 1 or array.size == 0:
        raise ValidationError(f"scores must be a non-empty 1-D array, got shape {array.shape}")
    bad = ~np.isfinite(array)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValidationError(f"scores must be finite, got {array[i]} at index {i}")
    return array


def as_binary_labels(labels: ArrayLike, n: int, *, name: str = "labels") -> np.ndarray:
    """``labels`` as a ``(n,)`` bool array with both classes present, else :class:`ValidationError`.

    Accepts bools or the integers 0 / 1 (True / 1 = positive: a member, or a batch with the property).
    """
    array = np.asarray(labels)
    if array.ndim != 1 or array.shape[0] != n:
        raise ValidationError(f"{name} must be a 1-D array of {n} truth values, got shape {array.shape}")
    if array.dtype != np.bool_:
        if not np.issubdtype(array.dtype, np.number) or not np.isin(array, (0, 1)).all():
            raise ValidationError(f"{name} must hold bools or 0/1, got values {np.unique(array)[:5]}")
        array = array.astype(bool)
    positives = int(array.sum())
    if positives in (0, n):
        only = "positives (members / with the property)" if positives else "negatives"
        raise ValidationError(
            f"{name} has only {only} ({n} of {n}); an attack is scored against both classes, "
            "give at least one of each"
        )
    return array


def as_examples(
    x: ArrayLike | torch.Tensor, y: ArrayLike | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Classifier inputs ``x`` ``(n, ...)`` as float32 and labels ``y`` ``(n,)`` as int64 tensors, checked.

    ``x`` stays where it is (candidates already on a model's device are scored there without a copy); ``y``
    comes to host memory, where :func:`model_logits` returns the logits every statistic is computed from."""
    try:
        xt = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
        yt = y if isinstance(y, torch.Tensor) else torch.as_tensor(np.asarray(y))
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValidationError(f"x and y must be numeric arrays or tensors: {exc}") from None
    if xt.ndim < 2 or xt.shape[0] == 0:
        raise ValidationError(
            f"x must be a non-empty batch of inputs of shape (n, ...), got {tuple(xt.shape)}"
        )
    if xt.is_complex() or xt.dtype == torch.bool:
        raise ValidationError(f"x must hold real numbers, got dtype {xt.dtype}")
    xt = xt.detach().to(torch.float32)
    if not torch.isfinite(xt).all():
        raise ValidationError("x has NaN or inf entries; inputs must be finite")
    if yt.ndim != 1 or yt.shape[0] != xt.shape[0]:
        raise ValidationError(
            f"y must be a 1-D array of {xt.shape[0]} class labels (one per row of x), got {tuple(yt.shape)}"
        )
    if yt.is_floating_point() or yt.is_complex() or yt.dtype == torch.bool:
        raise ValidationError(f"y must hold integer class labels, got dtype {yt.dtype}")
    yt = yt.detach().to("cpu", torch.int64)
    if (yt < 0).any():
        raise ValidationError(f"y must hold class labels >= 0, got {int(yt.min())}")
    return xt, yt


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put ``model`` (every submodule) in eval mode for the block, then restore each module's own flag."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in flags:
            module.training = training


def model_logits(model: nn.Module, x: torch.Tensor, *, batch_size: int = 1024) -> torch.Tensor:
    """``model(x)`` as ``(n, classes)`` float32 logits on the CPU, in batches, eval mode, no autograd."""
    if not isinstance(model, nn.Module):
        raise ValidationError(f"model must be a torch.nn.Module classifier, got {type(model).__name__}")
    size = _positive_int("batch_size", batch_size)
    device = module_device(model)
    out = []
    with torch.no_grad(), eval_mode(model):
        for start in range(0, x.shape[0], size):
            out.append(model(x[start : start + size].to(device)).float().cpu())
    logits = torch.cat(out)
    if logits.ndim != 2 or logits.shape[0] != x.shape[0]:
        raise ValidationError(
            f"the model must map (n, ...) inputs to (n, classes) logits, got {tuple(logits.shape)} "
            f"for {x.shape[0]} inputs"
        )
    return logits


def check_labels_fit(logits: torch.Tensor, y: torch.Tensor) -> None:
    """:class:`ValidationError` unless every label indexes a column of ``logits``."""
    if int(y.max()) >= logits.shape[1]:
        raise ValidationError(
            f"y has class label {int(y.max())}, but the model outputs only {logits.shape[1]} classes"
        )


def auc_std_error(scores: ArrayLike, labels: ArrayLike) -> float | None:
    """DeLong et al. (1988) standard error of the Mann-Whitney AUC, from placement values.

    With ``V10_i`` the fraction of negatives that positive ``i`` beats (ties 1/2) and ``V01_j`` the fraction
    of positives that beat negative ``j``, ``Var(AUC) = s^2(V10) / m + s^2(V01) / n`` (sample variances,
    ``m`` positives, ``n`` negatives). ``None`` with fewer than two positives or two negatives.
    """
    s = _as_scores(scores)
    truth = as_binary_labels(labels, s.size)
    pos, neg = np.sort(s[truth]), np.sort(s[~truth])
    if pos.size < 2 or neg.size < 2:
        return None
    v10 = (np.searchsorted(neg, pos, "left") + np.searchsorted(neg, pos, "right")) / (2.0 * neg.size)
    v01 = 1.0 - (np.searchsorted(pos, neg, "left") + np.searchsorted(pos, neg, "right")) / (2.0 * pos.size)
    return float(np.sqrt(v10.var(ddof=1) / pos.size + v01.var(ddof=1) / neg.size))


def auc_null_std_error(scores: ArrayLike, labels: ArrayLike) -> float:
    """Exact standard error of the AUC when the labels are independent of the scores (the null).

    Under the permutation null the Mann-Whitney ``U`` (ties counted 1/2) has variance
    ``m n / 12 * ((N + 1) - sum_t (t^3 - t) / (N (N - 1)))`` with ``N = m + n`` and ``t`` the sizes of the
    groups of tied scores (the tie-corrected variance of the rank-sum test); ``AUC = U / (m n)``.
    """
    s = _as_scores(scores)
    truth = as_binary_labels(labels, s.size)
    m, n = int(truth.sum()), int((~truth).sum())
    total = m + n
    ties = np.unique(s, return_counts=True)[1].astype(np.float64)
    correction = float(np.sum(ties**3 - ties)) / (total * (total - 1))
    var_u = m * n / 12.0 * ((total + 1) - correction)
    return float(np.sqrt(max(var_u, 0.0)) / (m * n))


def roc_curve(scores: ArrayLike, labels: ArrayLike) -> Roc:
    """The empirical ROC of attack ``scores`` ``(n,)`` (higher = positive) against bool ``labels`` ``(n,)``.

    Vertex ``i`` predicts positive every score ``>= thresholds[i]``; see
    :func:`fedveil.eval.verification.roc_curve` (positives are its "genuine" scores).
    """
    s = _as_scores(scores)
    truth = as_binary_labels(labels, s.size)
    return _verification_roc(s[truth], s[~truth], higher_is_genuine=True)


def _best_balanced_threshold(roc: Roc, n_pos: int, n_neg: int) -> float:
    """The vertex threshold maximising balanced accuracy (compared exactly as integers; the highest wins)."""
    tp = np.rint(roc.tpr * n_pos).astype(np.int64)
    fp = np.rint(roc.fpr * n_neg).astype(np.int64)
    # 2 * BA * n_pos * n_neg = TP * n_neg + TN * n_pos; vertex 0 (threshold +inf) predicts nothing.
    twice_scaled = tp[1:] * n_neg + (n_neg - fp[1:]) * n_pos
    return float(roc.thresholds[1 + int(np.argmax(twice_scaled))])


@dataclass(frozen=True, eq=False)
class AttackScores:
    """An attack's scores against the truth, and the figures reported from them (see the module doc).

    ``scores`` ``(n,)`` (higher = more likely positive), ``labels`` ``(n,)`` bool (True = member / has the
    property) and ``indices`` ``(n,)`` (the positions of these examples in the caller's arrays) are read-only.
    Threshold figures predict positive when ``score >= threshold``; they are ``None`` when
    ``threshold_source == "none"`` (``precision`` also when nothing is predicted positive). ``tpr_at_fpr``
    maps each target FPR to the TPR or ``None`` when ``target < min_resolvable_fpr``.
    ``chance_precision`` is the fraction of positives: what a guessing attack's precision is (0.5 on the
    balanced sets of PPFL Table 2). ``details`` holds attack-specific settings (JSON scalars).
    """

    attack: str
    scores: np.ndarray
    labels: np.ndarray
    indices: np.ndarray
    auc: float
    auc_std_error: float | None
    auc_null_std_error: float
    threshold: float | None
    threshold_source: ThresholdSource
    balanced_accuracy: float | None
    precision: float | None
    recall: float | None
    true_positives: int | None
    false_positives: int | None
    true_negatives: int | None
    false_negatives: int | None
    tpr_at_fpr: Mapping[float, float | None]
    min_resolvable_fpr: float
    details: Mapping[str, JsonScalar] = field(default_factory=dict)

    @property
    def num_positives(self) -> int:
        """How many evaluated examples are positives (members / batches with the property)."""
        return int(self.labels.sum())

    @property
    def num_negatives(self) -> int:
        """How many evaluated examples are negatives."""
        return int(self.labels.size - self.labels.sum())

    @property
    def chance_precision(self) -> float:
        """The precision of an attack that guesses: the fraction of positives among the evaluated."""
        return self.num_positives / self.labels.size

    def roc(self) -> Roc:
        """The empirical ROC of these scores (:func:`roc_curve`)."""
        return roc_curve(self.scores, self.labels)

    def as_dict(self) -> dict[str, object]:
        """The figures as a JSON-ready dict (``tpr_at_fpr`` keyed by ``"%g"`` of the target FPR)."""
        return {
            "attack": self.attack,
            "auc": self.auc,
            "auc_std_error": self.auc_std_error,
            "auc_null_std_error": self.auc_null_std_error,
            "threshold": self.threshold,
            "threshold_source": self.threshold_source,
            "balanced_accuracy": self.balanced_accuracy,
            "precision": self.precision,
            "chance_precision": self.chance_precision,
            "recall": self.recall,
            "num_positives": self.num_positives,
            "num_negatives": self.num_negatives,
            "true_positives": self.true_positives,
            "false_positives": self.false_positives,
            "true_negatives": self.true_negatives,
            "false_negatives": self.false_negatives,
            "tpr_at_fpr": {f"{target:g}": tpr for target, tpr in self.tpr_at_fpr.items()},
            "min_resolvable_fpr": self.min_resolvable_fpr,
            "details": dict(self.details),
        }


def score_attack(
    attack: str,
    scores: ArrayLike,
    labels: ArrayLike,
    *,
    threshold: float | None = None,
    choose_threshold: bool = True,
    indices: ArrayLike | None = None,
    fpr_targets: Sequence[float] = FPR_TARGETS,
    details: Mapping[str, JsonScalar] | None = None,
) -> AttackScores:
    """Build the :class:`AttackScores` report of ``scores`` ``(n,)`` against ``labels`` ``(n,)``.

    ``threshold`` is the attack's own decision threshold (positive when ``score >= threshold``). Without one,
    ``choose_threshold=True`` takes the threshold maximising balanced accuracy on these scores (an oracle
    choice, reported as such) and ``choose_threshold=False`` reports no threshold figures. ``indices``
    defaults to ``0..n-1``; ``fpr_targets`` are FPRs in (0, 1].
    """
    s = _as_scores(scores)
    truth = as_binary_labels(labels, s.size)
    index = np.arange(s.size) if indices is None else np.asarray(indices)
    if index.shape != s.shape or not np.issubdtype(index.dtype, np.integer):
        raise ValidationError(f"indices must be {s.size} integer positions, got shape {index.shape}")
    targets = [float(t) for t in fpr_targets]
    if any(not (0.0 < t <= 1.0) for t in targets):
        raise ConfigError(f"fpr_targets must lie in (0, 1], got {targets}")
    if threshold is not None and not np.isfinite(threshold):
        raise ConfigError(f"threshold must be a finite number, got {threshold!r}")
    pos, neg = s[truth], s[~truth]
    n_pos, n_neg = int(pos.size), int(neg.size)
    min_fpr = 1.0 / n_neg
    resolvable = [t for t in targets if min_fpr <= t * (1.0 + 1e-9)]
    tprs = _verification_tpr_at_fpr(pos, neg, resolvable).tolist() if resolvable else []
    tpr_map: dict[float, float | None] = dict.fromkeys(targets)
    tpr_map.update(zip(resolvable, tprs, strict=True))

    source: ThresholdSource = "attack"
    if threshold is None:
        source = "best_balanced_accuracy" if choose_threshold else "none"
        if choose_threshold:
            threshold = _best_balanced_threshold(_verification_roc(pos, neg), n_pos, n_neg)
    counts: dict[str, int | None] = dict.fromkeys(("tp", "fp", "tn", "fn"))
    balanced = precision = recall = None
    if threshold is not None:
        threshold = float(threshold)
        tp, fp = int((pos >= threshold).sum()), int((neg >= threshold).sum())
        counts = {"tp": tp, "fp": fp, "tn": n_neg - fp, "fn": n_pos - tp}
        recall = tp / n_pos
        balanced = (recall + (n_neg - fp) / n_neg) / 2.0
        precision = tp / (tp + fp) if tp + fp else None
    return AttackScores(
        attack=attack,
        scores=_frozen(s),
        labels=_frozen(truth),
        indices=_frozen(index.astype(np.int64)),
        auc=roc_auc(pos, neg, higher_is_genuine=True),
        auc_std_error=auc_std_error(s, truth),
        auc_null_std_error=auc_null_std_error(s, truth),
        threshold=threshold,
        threshold_source=source,
        balanced_accuracy=balanced,
        precision=precision,
        recall=recall,
        true_positives=counts["tp"],
        false_positives=counts["fp"],
        true_negatives=counts["tn"],
        false_negatives=counts["fn"],
        tpr_at_fpr=tpr_map,
        min_resolvable_fpr=min_fpr,
        details=dict(details or {}),
    )


def plot_attack_roc(
    reports: Mapping[str, AttackScores], path: str | Path, *, title: str = "Attack ROC", dpi: int = 120
) -> Path:
    """Draw the ROC curves of ``reports`` on log-log axes (as Carlini et al. 2022, Fig. 1) into a PNG,
    through :func:`fedveil.eval.plots.plot_roc` (vertices with FPR or TPR = 0 are left out)."""
    from fedveil.eval.plots import plot_roc

    if not reports:
        raise ConfigError("reports is empty; give at least one name -> AttackScores")
    for name, report in reports.items():
        if not isinstance(report, AttackScores):
            raise ConfigError(f"reports[{name!r}] must be an AttackScores, got {type(report).__name__}")
    curves = {name: report.roc() for name, report in reports.items()}
    return plot_roc(curves, path, title=title, log_fpr=True, log_tpr=True, dpi=_positive_int("dpi", dpi))


@dataclass(frozen=True, eq=False)
class BinaryClassifier:
    """A trained attack classifier: standardise features with ``mean`` / ``scale``, then ``network``."""

    mean: np.ndarray
    scale: np.ndarray
    network: nn.Module

    def decision_function(self, features: ArrayLike) -> np.ndarray:
        """Logits ``(n,)`` for ``features`` ``(n, d)``: > 0 predicts the positive class."""
        array = np.asarray(features, dtype=np.float64)
        if array.ndim != 2 or array.shape[1] != self.mean.size:
            raise ValidationError(
                f"features must have shape (n, {self.mean.size}), as in training, got {array.shape}"
            )
        z = torch.from_numpy(((array - self.mean) / self.scale).astype(np.float32))
        with torch.no_grad():
            return self.network(z).squeeze(1).double().numpy()


def fit_binary_classifier(
    features: ArrayLike,
    labels: ArrayLike,
    *,
    seed: int,
    hidden: int = 0,
    steps: int = 300,
    lr: float = 0.01,
    weight_decay: float = 1e-3,
) -> BinaryClassifier:
    """Fit the attack classifier of Nasr et al. 2019 / Melis et al. 2019 on ``features`` ``(n, d)``.

    Features are standardised (training mean and standard deviation; constant columns are left centred).
    ``hidden=0`` is logistic regression, ``hidden > 0`` an MLP with one ReLU hidden layer of that width. It
    minimises the mean binary cross-entropy plus ``weight_decay / 2 * ||W||^2`` (weights, not biases) by
    ``steps`` full-batch Adam steps at learning rate ``lr``. The initial weights come from ``seed`` (drawn
    in a forked RNG, so the global torch RNG is untouched); training is otherwise deterministic.
    """
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValidationError(f"features must be a non-empty (n, d) matrix, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValidationError("features have NaN or inf entries")
    truth = as_binary_labels(labels, x.shape[0])
    if isinstance(hidden, bool) or not isinstance(hidden, (int, np.integer)) or hidden < 0:
        raise ConfigError(f"hidden must be an integer >= 0 (0 = logistic regression), got {hidden!r}")
    num_steps = _positive_int("steps", steps)
    if not lr > 0:
        raise ConfigError(f"lr must be > 0, got {lr!r}")
    if not weight_decay >= 0:
        raise ConfigError(f"weight_decay must be >= 0, got {weight_decay!r}")
    mean = x.mean(axis=0)
    std = x.std(axis=0)
    scale = np.where(std > 1e-12, std, 1.0)
    z = torch.from_numpy(((x - mean) / scale).astype(np.float32))
    target = torch.from_numpy(truth.astype(np.float32))[:, None]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        if hidden:
            network: nn.Module = nn.Sequential(nn.Linear(x.shape[1], hidden), nn.ReLU(), nn.Linear(hidden, 1))
        else:
            network = nn.Linear(x.shape[1], 1)
    weights = [p for name, p in network.named_parameters() if name.endswith("weight")]
    optimiser = torch.optim.Adam(network.parameters(), lr=lr)
    loss_fn = nn.BCEWithLogitsLoss()
    for _ in range(num_steps):
        optimiser.zero_grad()
        loss = loss_fn(network(z), target)
        loss = loss + 0.5 * weight_decay * sum((w**2).sum() for w in weights)
        loss.backward()
        optimiser.step()
    network.eval()
    return BinaryClassifier(mean=_frozen(mean), scale=_frozen(scale), network=network)
