"""The attacks beside FDML's claims: a participant's step-6 derivatives (covered by Alg. 2) and the
released embedding model (not covered)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from fedveil.attacks.derivatives import DerivativeView, direction_score, dp_consistency, informed_score
from fedveil.attacks.mia_metric import metric_membership_attack
from fedveil.attacks.scores import score_attack
from fedveil.attacks.views import ModelView, SealedView
from fedveil.errors import ValidationError
from fedveil.experiments.attacks.fdml_views import fdml_derivative_table, fdml_membership_table


@pytest.fixture(scope="module")
def derivative_table() -> dict:
    """300 rounds of 4 participants x 4 embeddings, without DP and with Alg. 2 at epsilon 0.5 (SYNTHETIC)."""
    return fdml_derivative_table(trials=300, epsilons=(0.5,), seed=0)


def test_informed_participant_detects_the_target_without_dp(derivative_table: dict) -> None:
    row = derivative_table["settings"]["no-dp"]["informed"]
    assert row["auc"] > 0.5 + 6 * row["auc_null_std_error"]


def test_decoy_control_is_at_chance(derivative_table: dict) -> None:
    for entry in derivative_table["settings"].values():
        control = entry["control"]
        assert abs(control["auc"] - 0.5) < 3 * control["auc_null_std_error"]


@pytest.mark.parametrize("setting", ["paper/eps=0.5", "strict/eps=0.5"])
def test_alg2_bounds_the_attack_by_its_epsilon(derivative_table: dict, setting: str) -> None:
    entry = derivative_table["settings"][setting]
    assert entry["epsilon_claimed"] == pytest.approx(0.5)
    check = entry["informed"]["vs_claimed"]
    assert check["auc_within_bound"] and check["consistent"]
    assert entry["informed"]["auc"] < 0.5 + 3 * entry["informed"]["auc_null_std_error"]
    if setting.startswith("paper"):  # the strict analysis of the same release charges far more
        assert entry["epsilon_strict"] > 10 * entry["epsilon_claimed"]


def test_dp_consistency_flags_an_attack_that_beats_its_epsilon() -> None:
    labels = np.r_[np.ones(500, bool), np.zeros(500, bool)]
    perfect = score_attack("perfect", labels.astype(float), labels)
    check = dp_consistency(perfect, 0.5)
    assert not check["auc_within_bound"] and not check["consistent"]
    assert check["epsilon_lower"] > 0.5
    assert dp_consistency(perfect, 50.0)["auc_within_bound"]


def test_scores_on_a_hand_made_view() -> None:
    own = np.array([[0.0, 0.0], [2.0, 0.0]])
    view = DerivativeView("participant", own, np.array([[1.0, 0.0], [-1.0, 0.0]]))
    assert direction_score(view, np.array([1.0, 0.0])) == pytest.approx(2.0)
    assert informed_score(view, view.derivatives) == 0.0
    assert informed_score(view, np.zeros((2, 2))) == pytest.approx(-2.0)
    with pytest.raises(ValidationError):
        DerivativeView("participant", own, np.zeros((3, 2)))


class _Flatten(nn.Module):
    """An 'embedding network' that returns its input, flattened: the spread of a user is its samples'."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)


def test_metric_membership_separates_tight_members_and_calibration_removes_it() -> None:
    rng = np.random.default_rng(0)
    centres = rng.normal(0.0, 5.0, (40, 1, 6))
    spread = np.r_[np.full(20, 0.2), np.full(20, 1.0)][:, None, None]  # members sit tighter
    samples = centres + spread * rng.normal(size=(40, 10, 6))
    is_member = np.r_[np.ones(20, bool), np.zeros(20, bool)]
    view = ModelView("released", _Flatten())
    assert metric_membership_attack(view, samples, is_member).auc == 1.0
    # against itself as the reference every ratio is 1: nothing is left to separate
    assert metric_membership_attack(view, samples, is_member, reference=view).auc == 0.5
    with pytest.raises(ValidationError, match="no plaintext view"):
        metric_membership_attack(SealedView("eavesdropper", 10), samples, is_member)


def test_fdml_membership_table_reports_attacks_and_control(tmp_path) -> None:
    summary = fdml_membership_table(users=8, rounds=2, num_required=16, candidate_samples=10, out=tmp_path)
    assert summary["run"]["data"] == "SYNTHETIC TouchAuth"
    assert summary["run"]["members"] == summary["run"]["non_members"] == 8
    assert set(summary["attacks"]) == {"target/spread", "target/spread-calibrated", "control/initial-network"}
    assert (tmp_path / "fdml_membership.json").is_file()


def test_cli_fdml_attacks_print_their_tables(tmp_path, capsys) -> None:
    from fedveil.cli import main

    assert main(["attack", "fdml-derivatives", "--trials", "40", "--epsilons", "1", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["settings"]) == {"no-dp", "paper/eps=1", "strict/eps=1"}
    assert main(["attack", "fdml-membership", "--users", "8", "--rounds", "1", "--num-required", "16"]) == 0
    assert "control/initial-network" in capsys.readouterr().out
    assert main(["attack", "fdml-derivatives", "--epsilons", "one"]) != 0
    assert "--epsilons 'one': comma-separated numbers" in capsys.readouterr().err
