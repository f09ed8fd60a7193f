"""AttackScores: AUC as the Mann-Whitney statistic, its standard errors, thresholds, TPR at low FPR."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fedveil.attacks.scores import (
    AttackScores,
    auc_null_std_error,
    auc_std_error,
    eval_mode,
    fit_binary_classifier,
    model_logits,
    plot_attack_roc,
    roc_curve,
    score_attack,
)
from fedveil.errors import ConfigError, ValidationError


@st.composite
def scored_labels(draw: st.DrawFn, max_size: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """Integer-valued scores (so ties happen) and labels with both classes present."""
    n = draw(st.integers(2, max_size))
    scores = draw(st.lists(st.integers(-6, 6), min_size=n, max_size=n))
    labels = draw(st.lists(st.booleans(), min_size=n, max_size=n).filter(lambda v: 0 < sum(v) < len(v)))
    return np.array(scores, dtype=np.float64), np.array(labels)


def brute_force_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    pos, neg = scores[labels], scores[~labels]
    wins = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p in pos for q in neg)
    return wins / (pos.size * neg.size)


@settings(max_examples=60, deadline=None)
@given(scored_labels())
def test_auc_is_the_pairwise_mann_whitney_count(data: tuple[np.ndarray, np.ndarray]) -> None:
    scores, labels = data
    report = score_attack("t", scores, labels)
    assert report.auc == pytest.approx(brute_force_auc(scores, labels), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(scored_labels())
def test_negated_scores_give_one_minus_auc(data: tuple[np.ndarray, np.ndarray]) -> None:
    scores, labels = data
    assert score_attack("t", -scores, labels).auc == pytest.approx(
        1.0 - score_attack("t", scores, labels).auc
    )


@settings(max_examples=60, deadline=None)
@given(scored_labels(), st.sampled_from(["cube", "exp", "affine"]))
def test_strictly_increasing_transforms_change_nothing(
    data: tuple[np.ndarray, np.ndarray], name: str
) -> None:
    scores, labels = data
    transform = {"cube": lambda s: s**3, "exp": lambda s: np.exp(s / 3.0), "affine": lambda s: 2.5 * s - 7.0}
    a, b = score_attack("t", scores, labels), score_attack("t", transform[name](scores), labels)
    assert b.auc == a.auc
    assert b.auc_null_std_error == pytest.approx(a.auc_null_std_error)
    assert b.balanced_accuracy == a.balanced_accuracy
    assert b.precision == a.precision
    np.testing.assert_array_equal(a.roc().tpr, b.roc().tpr)
    np.testing.assert_array_equal(a.roc().fpr, b.roc().fpr)


@settings(max_examples=40, deadline=None)
@given(scored_labels(max_size=8))
def test_null_standard_error_is_the_exact_permutation_one(data: tuple[np.ndarray, np.ndarray]) -> None:
    scores, labels = data
    m = int(labels.sum())
    aucs = []
    for chosen in itertools.combinations(range(scores.size), m):
        permuted = np.zeros(scores.size, dtype=bool)
        permuted[list(chosen)] = True
        aucs.append(brute_force_auc(scores, permuted))
    assert auc_null_std_error(scores, labels) == pytest.approx(float(np.std(aucs)), abs=1e-12)


def test_null_standard_error_without_ties_is_the_textbook_formula() -> None:
    scores = np.arange(30, dtype=float)
    labels = np.arange(30) % 3 == 0
    m, n = 10, 20
    assert auc_null_std_error(scores, labels) == pytest.approx(math.sqrt((m + n + 1) / (12 * m * n)))


def test_delong_standard_error_from_placements() -> None:
    scores = np.array([0.9, 0.4, 0.7, 0.3, 0.8, 0.1, 0.4])
    labels = np.array([True, True, True, False, False, False, False])
    pos, neg = scores[labels], scores[~labels]
    v10 = np.array([np.mean([1.0 if p > q else 0.5 if p == q else 0.0 for q in neg]) for p in pos])
    v01 = np.array([np.mean([1.0 if p > q else 0.5 if p == q else 0.0 for p in pos]) for q in neg])
    expected = math.sqrt(v10.var(ddof=1) / pos.size + v01.var(ddof=1) / neg.size)
    assert auc_std_error(scores, labels) == pytest.approx(expected)
    assert auc_std_error(np.array([2.0, 1.0, 0.0]), np.array([True, True, False])) is None
    assert auc_std_error(np.array([3.0, 2.0, 1.0, 0.0]), np.array([True, True, False, False])) == 0.0


def test_figures_at_the_attacks_own_threshold() -> None:
    scores = np.array([0.9, 0.8, 0.3, 0.7, 0.2, 0.1])
    labels = np.array([1, 1, 1, 0, 0, 0])
    report = score_attack("t", scores, labels, threshold=0.5)
    assert report.threshold_source == "attack" and report.threshold == 0.5
    assert (report.true_positives, report.false_positives) == (2, 1)
    assert (report.true_negatives, report.false_negatives) == (2, 1)
    assert report.precision == pytest.approx(2 / 3)
    assert report.recall == pytest.approx(2 / 3)
    assert report.balanced_accuracy == pytest.approx(2 / 3)
    assert report.auc == pytest.approx(8 / 9)
    assert report.chance_precision == 0.5
    assert score_attack("t", scores, labels, threshold=5.0).precision is None


@settings(max_examples=60, deadline=None)
@given(scored_labels())
def test_chosen_threshold_maximises_balanced_accuracy(data: tuple[np.ndarray, np.ndarray]) -> None:
    scores, labels = data
    report = score_attack("t", scores, labels)
    assert report.threshold_source == "best_balanced_accuracy"
    assert report.threshold in set(scores.tolist())
    best = max(((scores[labels] >= t).mean() + (scores[~labels] < t).mean()) / 2 for t in np.unique(scores))
    assert report.balanced_accuracy == pytest.approx(best)


def test_no_threshold_reports_auc_figures_only() -> None:
    report = score_attack("t", [3.0, 2.0, 1.0], [True, False, False], choose_threshold=False)
    assert report.threshold_source == "none"
    assert report.threshold is None and report.precision is None and report.balanced_accuracy is None
    assert report.true_positives is None
    assert report.auc == 1.0


def test_tpr_at_low_fpr_is_read_off_the_roc_or_unresolvable() -> None:
    neg = np.arange(100, dtype=float)  # 100 negatives: FPR 0.01 resolvable, 0.001 not
    pos = np.array([150.0] * 3 + [97.5] * 2 + [10.0] * 5)
    scores = np.concatenate([pos, neg])
    labels = np.r_[np.ones(10, bool), np.zeros(100, bool)]
    report = score_attack("t", scores, labels)
    assert report.min_resolvable_fpr == pytest.approx(0.01)
    assert report.tpr_at_fpr[1e-3] is None
    # FPR <= 0.01 allows one negative (99) above the threshold: the three at 150, not those at 97.5.
    assert report.tpr_at_fpr[1e-2] == pytest.approx(0.3)
    small = score_attack("t", scores[:60], labels[:60])
    assert small.min_resolvable_fpr == pytest.approx(1 / 50)
    assert small.tpr_at_fpr == {1e-3: None, 1e-2: None}
    wide = score_attack("t", scores, labels, fpr_targets=(0.05,))
    assert wide.tpr_at_fpr[0.05] == pytest.approx(0.5)


def test_report_is_json_ready() -> None:
    report = score_attack("t", [0.2, 0.9, 0.4], [False, True, True], details={"k": 3})
    payload = json.loads(json.dumps(report.as_dict()))
    assert payload["attack"] == "t"
    assert payload["num_positives"] == 2 and payload["num_negatives"] == 1
    assert payload["tpr_at_fpr"] == {"0.001": None, "0.01": None}
    assert payload["details"] == {"k": 3}
    assert isinstance(report, AttackScores)
    assert not report.scores.flags.writeable


def test_roc_curve_matches_the_report() -> None:
    roc = roc_curve([0.9, 0.1, 0.5, 0.5], [True, False, True, False])
    np.testing.assert_allclose(roc.fpr, [0.0, 0.0, 0.5, 1.0])
    np.testing.assert_allclose(roc.tpr, [0.0, 0.5, 1.0, 1.0])
    assert roc.auc() == pytest.approx(0.875)


@pytest.mark.parametrize(
    ("scores", "labels", "error"),
    [
        ([0.1, 0.2, 0.3], [True, True, True], ValidationError),
        ([0.1, 0.2, 0.3], [0, 0, 0], ValidationError),
        ([0.1, 0.2, 0.3], [True, False], ValidationError),
        ([0.1, float("nan"), 0.3], [True, False, True], ValidationError),
        ([0.1, 0.2, 0.3], [0, 1, 2], ValidationError),
        ([], [], ValidationError),
    ],
)
def test_bad_scores_and_labels_are_rejected(scores: list, labels: list, error: type[Exception]) -> None:
    with pytest.raises(error):
        score_attack("t", scores, labels)


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(ConfigError, match="threshold"):
        score_attack("t", [0.1, 0.2], [True, False], threshold=float("inf"))
    with pytest.raises(ConfigError, match="fpr_targets"):
        score_attack("t", [0.1, 0.2], [True, False], fpr_targets=(0.0,))
    with pytest.raises(ValidationError, match="indices"):
        score_attack("t", [0.1, 0.2], [True, False], indices=[0])


def test_log_log_roc_plot(tmp_path) -> None:
    rng = np.random.default_rng(0)
    labels = np.arange(400) < 200
    report = score_attack("t", rng.normal(size=400) + labels, labels)
    out = plot_attack_roc({"shifted": report}, tmp_path / "plots" / "roc.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ConfigError, match=r"\.png"):
        plot_attack_roc({"shifted": report}, tmp_path / "roc.pdf")
    with pytest.raises(ConfigError, match="empty"):
        plot_attack_roc({}, tmp_path / "roc.png")


def test_classifier_learns_a_separable_problem_reproducibly_without_touching_global_rng() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 5))
    y = x[:, 0] - 2 * x[:, 3] > 0
    state = torch.get_rng_state()
    for hidden in (0, 16):
        a = fit_binary_classifier(x, y, seed=7, hidden=hidden)
        b = fit_binary_classifier(x, y, seed=7, hidden=hidden)
        logits = a.decision_function(x)
        np.testing.assert_array_equal(logits, b.decision_function(x))
        assert ((logits > 0) == y).mean() > 0.95
    assert torch.equal(state, torch.get_rng_state())
    with pytest.raises(ValidationError, match="shape"):
        a.decision_function(x[:, :3])
    with pytest.raises(ConfigError, match="hidden"):
        fit_binary_classifier(x, y, seed=0, hidden=-1)


def test_eval_mode_restores_each_modules_flag_and_logits_are_batched() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    model[1].eval()
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == [True, True, False, True]
    x = torch.randn(10, 4)
    with torch.no_grad():
        expected = model.eval()(x)
    model.train()
    torch.testing.assert_close(model_logits(model, x, batch_size=3), expected)
    assert model.training
