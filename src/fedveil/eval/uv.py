"""User-verification evaluation of FedUV Sec. 6.3, Fig. 2 and Table 3.

Every method scores an input ``x`` against a user ``u`` with a cosine in [-1, 1] (FedUV: the Eq. 5 score
``(1/c) v_u^T sigma(W g(x))``; softmax and FedAwS: ``cos(g(x), w_u)``), so one score range serves all.
The three evaluations of Table 3 (:data:`UV_EVALUATIONS`) pair each user's *genuine* examples with
*impostor* examples of other users:

- ``train``: genuine = the user's training examples; impostors = every other seen user's training examples;
- ``test_known``: genuine = the user's test examples; impostors = every other seen user's test examples;
- ``test_unknown``: genuine = the user's test examples; impostors = the examples of the writers who took
  no part in training (one each in MNIST-UV). A user who was not in training has no trained codeword,
  so unseen users can only be impostors.

Users send the server histograms of their scores (:func:`score_histogram`), never the scores themselves;
the pooled ROC is built from the summed counts (:func:`roc_from_histograms`): a vertex per non-empty bin,
accepting every score in that bin and above, i.e. the empirical ROC of the scores rounded down to their
bin's lower edge. With the default 4,000 bins (width 5e-4) this differs from the ROC of the raw scores
only among scores closer than a bin. AUC is computed exactly from the integer counts, TPR at a target
FPR with the convention of :func:`fedveil.eval.verification.tpr_at_fpr` (the best vertex whose FPR does
not exceed the target). Each user's warm-up threshold (Alg. 2) gives one more number: the pooled TPR and
FPR of the per-user accept decisions ``score >= tau_u``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from numpy.typing import ArrayLike

from fedveil.errors import ConfigError, ValidationError
from fedveil.eval.plots import method_colours, save_png
from fedveil.eval.verification import DEFAULT_FPR_TARGETS, Roc

__all__ = [
    "DEFAULT_BINS",
    "SCORE_RANGE",
    "UV_EVALUATIONS",
    "UvEvaluation",
    "evaluate_histograms",
    "histogram_edges",
    "plot_uv_rocs",
    "roc_from_histograms",
    "score_histogram",
    "uv_roc_figure",
]

SCORE_RANGE: tuple[float, float] = (-1.0, 1.0)
"""Every verification score is a cosine."""

DEFAULT_BINS = 4000
"""Histogram bins over :data:`SCORE_RANGE` (width 5e-4)."""

UV_EVALUATIONS: dict[str, tuple[str, str]] = {
    "train": ("train", "train"),
    "test_known": ("test", "test"),
    "test_unknown": ("test", "unseen"),
}
"""Table 3's dataset types: name -> (split of the genuine examples, probe set of the impostors)."""


def _check_bins(bins: object) -> int:
    if isinstance(bins, bool) or not isinstance(bins, (int, np.integer)) or not 1 <= bins <= 1 << 16:
        raise ConfigError(f"bins must be an integer in [1, 65536], got {bins!r}")
    return int(bins)


def histogram_edges(bins: int) -> np.ndarray:
    """The ``bins + 1`` equally spaced edges of :data:`SCORE_RANGE`, ascending (float64)."""
    return np.linspace(SCORE_RANGE[0], SCORE_RANGE[1], _check_bins(bins) + 1)


def score_histogram(scores: ArrayLike, bins: int = DEFAULT_BINS) -> np.ndarray:
    """Counts ``(bins,)`` int64 of ``scores`` in equal bins of [-1, 1].

    Each bin is closed below, the last one closed above too (up to the rounding of
    ``(score + 1) / 2 * bins``). Scores a rounding error outside the range are clipped into it; NaN or a
    score further than 1e-4 outside is a :class:`ValidationError`.
    """
    n = _check_bins(bins)
    arr = np.asarray(scores, dtype=np.float64).ravel()
    if not np.isfinite(arr).all():
        raise ValidationError(f"scores must be finite; {int(np.sum(~np.isfinite(arr)))} are not")
    lo, hi = SCORE_RANGE
    if arr.size and (arr.min() < lo - 1e-4 or arr.max() > hi + 1e-4):
        raise ValidationError(
            f"scores must be cosines in [{lo}, {hi}], found values in [{arr.min()}, {arr.max()}]"
        )
    index = np.floor((np.clip(arr, lo, hi) - lo) / (hi - lo) * n).astype(np.int64)
    return np.bincount(np.minimum(index, n - 1), minlength=n).astype(np.int64)


def _counts(name: str, values: ArrayLike) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValidationError(f"{name} must be a non-empty 1-D integer array, got {arr.dtype} {arr.shape}")
    if arr.min() < 0:
        raise ValidationError(f"{name} must be non-negative, found {int(arr.min())}")
    if arr.sum() == 0:
        raise ValidationError(f"{name} are all zero: at least one score is needed")
    return arr.astype(np.int64)


@dataclass(frozen=True, eq=False)
class _CumulativeCounts:
    thresholds: np.ndarray
    genuine: np.ndarray
    impostor: np.ndarray
    n_genuine: int
    n_impostor: int


def _cumulative(genuine_counts: ArrayLike, impostor_counts: ArrayLike) -> _CumulativeCounts:
    gen = _counts("genuine_counts", genuine_counts)
    imp = _counts("impostor_counts", impostor_counts)
    if gen.shape != imp.shape:
        raise ValidationError(f"genuine_counts {gen.shape} and impostor_counts {imp.shape} differ in length")
    lower = histogram_edges(gen.size)[:-1]
    top_down = np.arange(gen.size - 1, -1, -1)
    keep = top_down[(gen[top_down] + imp[top_down]) > 0]
    zero = np.zeros(1, dtype=np.int64)
    return _CumulativeCounts(
        thresholds=np.concatenate([[np.inf], lower[keep]]),
        genuine=np.concatenate([zero, np.cumsum(gen[keep])]),
        impostor=np.concatenate([zero, np.cumsum(imp[keep])]),
        n_genuine=int(gen.sum()),
        n_impostor=int(imp.sum()),
    )


def roc_from_histograms(genuine_counts: ArrayLike, impostor_counts: ArrayLike) -> Roc:
    """The pooled empirical ROC of histogrammed scores (higher is genuine).

    ``genuine_counts`` and ``impostor_counts`` are ``(bins,)`` counts over :func:`histogram_edges`.
    Vertex 0 is ``(0, 0)`` at threshold ``+inf``; then one vertex per non-empty bin, from the top bin
    down, whose threshold is the bin's lower edge (accept ``score >= edge``); the last is ``(1, 1)``.
    """
    c = _cumulative(genuine_counts, impostor_counts)
    return Roc(fpr=c.impostor / c.n_impostor, tpr=c.genuine / c.n_genuine, thresholds=c.thresholds)


@dataclass(frozen=True, eq=False)
class UvEvaluation:
    """One Table 3 cell and its Fig. 2 curve: pooled over ``users`` reference users.

    ``auc`` (exact from the counts), ``tpr_at_fpr`` one per ``fpr_targets``; ``warmup_tpr`` and
    ``warmup_fpr`` are the rates of the users' own accept decisions at their warm-up thresholds;
    ``genuine`` / ``impostor`` count the scores.
    """

    roc: Roc
    auc: float
    fpr_targets: tuple[float, ...]
    tpr_at_fpr: tuple[float, ...]
    warmup_tpr: float
    warmup_fpr: float
    genuine: int
    impostor: int
    users: int

    def summary(self) -> dict[str, float | int]:
        """Scalars as a JSON-ready dict (``tpr@fpr=<target>`` keys)."""
        out: dict[str, float | int] = {
            "auc": self.auc,
            "warmup_tpr": self.warmup_tpr,
            "warmup_fpr": self.warmup_fpr,
            "genuine": self.genuine,
            "impostor": self.impostor,
            "users": self.users,
        }
        for target, tpr in zip(self.fpr_targets, self.tpr_at_fpr, strict=True):
            out[f"tpr@fpr={target:g}"] = tpr
        return out


def evaluate_histograms(
    genuine_counts: ArrayLike,
    impostor_counts: ArrayLike,
    *,
    genuine_accepted: int,
    impostor_accepted: int,
    users: int,
    fpr_targets: Sequence[float] = DEFAULT_FPR_TARGETS,
) -> UvEvaluation:
    """ROC, AUC and TPR at ``fpr_targets`` of summed score histograms, and the warm-up operating point.

    ``genuine_accepted`` / ``impostor_accepted`` are the summed counts of scores at or above each user's
    own threshold; they may not exceed the totals of the histograms.
    """
    c = _cumulative(genuine_counts, impostor_counts)
    targets = np.asarray(fpr_targets, dtype=np.float64)
    if targets.ndim != 1 or not ((targets >= 0) & (targets <= 1)).all():
        raise ConfigError(f"fpr_targets must be numbers in [0, 1], got {list(fpr_targets)!r}")
    if not 0 <= genuine_accepted <= c.n_genuine or not 0 <= impostor_accepted <= c.n_impostor:
        raise ValidationError(
            f"accepted counts ({genuine_accepted}, {impostor_accepted}) must lie within the totals "
            f"({c.n_genuine}, {c.n_impostor})"
        )
    d_imp = np.diff(c.impostor)
    heights = c.genuine[:-1] + c.genuine[1:]
    auc = int(np.dot(d_imp, heights)) / (2 * c.n_genuine * c.n_impostor)
    fpr = c.impostor / c.n_impostor
    idx = np.searchsorted(fpr, targets, side="right") - 1
    return UvEvaluation(
        roc=Roc(fpr=fpr, tpr=c.genuine / c.n_genuine, thresholds=c.thresholds),
        auc=auc,
        fpr_targets=tuple(float(t) for t in targets),
        tpr_at_fpr=tuple(float(t) for t in c.genuine[idx] / c.n_genuine),
        warmup_tpr=genuine_accepted / c.n_genuine,
        warmup_fpr=impostor_accepted / c.n_impostor,
        genuine=c.n_genuine,
        impostor=c.n_impostor,
        users=int(users),
    )


_PANEL_TITLES = {
    "train": "training data",
    "test_known": "test (known users)",
    "test_unknown": "test (unknown)",
}


def plot_uv_rocs(
    curves: Mapping[str, Mapping[str, Roc]],
    path: str | Path,
    *,
    title: str = "ROC",
    dpi: int = 120,
    colours: Mapping[str, str] | None = None,
) -> Path:
    """Fig. 2 for one run (:func:`uv_roc_figure`), written as a PNG at ``path`` (must end in ``.png``;
    parent folders are created); returns its path."""
    if Path(path).suffix.lower() != ".png":
        raise ConfigError(f"path must end in .png, got {str(path)!r}")
    return save_png(uv_roc_figure(curves, title=title, colours=colours), path, dpi=dpi)


def uv_roc_figure(
    curves: Mapping[str, Mapping[str, Roc]], *, title: str = "ROC", colours: Mapping[str, str] | None = None
) -> Figure:
    """Fig. 2 for one run: a panel per evaluation (``curves[evaluation][method] -> Roc``), every method
    in every panel in its ``colours`` entry (default: :func:`~fedveil.eval.plots.method_colours` of the
    methods in order), FPR on a log axis (vertices at FPR 0 cannot be drawn there and are left out)."""
    if not curves or any(not methods for methods in curves.values()):
        raise ConfigError("curves must map at least one evaluation to at least one method's Roc")
    for evaluation, methods in curves.items():
        for name, roc in methods.items():
            if not isinstance(roc, Roc):
                raise ConfigError(f"curves[{evaluation!r}][{name!r}] must be a Roc, got {type(roc).__name__}")
    if colours is None:
        colours = method_colours(name for methods in curves.values() for name in methods)
    fig = Figure(figsize=(4.2 * len(curves), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(curves), squeeze=False)[0]
    smallest = min(
        (float(r.fpr[r.fpr > 0].min()) for m in curves.values() for r in m.values() if (r.fpr > 0).any()),
        default=1e-3,
    )
    for ax, (evaluation, methods) in zip(axes, curves.items(), strict=True):
        for name, roc in methods.items():
            keep = roc.fpr > 0
            ax.plot(roc.fpr[keep], roc.tpr[keep], color=colours.get(name), label=f"{name} ({roc.auc():.3f})")
        ax.set_xscale("log")
        ax.set_xlim(min(smallest, 1e-2), 1.0)
        ax.set_ylim(0.0, 1.01)
        ax.set_xlabel("false positive rate (log scale)")
        ax.set_ylabel("true positive rate")
        ax.set_title(_PANEL_TITLES.get(evaluation, evaluation))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize="small", title="method (AUC)")
    fig.suptitle(title)
    return fig
