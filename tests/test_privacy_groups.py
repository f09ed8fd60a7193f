"""Per-group accounting of PoliFL's DP-FedAvg (fedveil.privacy.groups): a group's epsilon is the
composition of the rounds its population took part in, cascaded stages charge only their own group, and
the look-ahead finds the most rounds a budget allows (checked by brute force)."""

from __future__ import annotations

import math

import pytest

from fedveil.errors import ConfigError
from fedveil.privacy.accounting import GaussianRelease, epsilon_of
from fedveil.privacy.groups import GroupLedger, Segment, noise_multiplier


def test_a_group_spends_the_composition_of_its_rounds() -> None:
    ledger = GroupLedger(["a", "b"], delta=1e-5)
    ledger.record(["a"], z=1.2, q=0.1, rounds=30)
    ledger.record(["a"], z=1.2, q=0.1, rounds=20)
    assert ledger.segments("a") == [Segment(1.2, 0.1, 50)]
    assert ledger.epsilon("a") == pytest.approx(epsilon_of([GaussianRelease(1.2, 0.1, 50)], 1e-5))
    assert ledger.epsilon("b") == 0.0 and ledger.rounds("b") == 0


def test_cascaded_charges_each_group_its_stage_and_combined_charges_both() -> None:
    cascaded = GroupLedger(["g1", "g2"], delta=1e-5)
    cascaded.record(["g1"], z=2.0, q=0.2, rounds=40)
    cascaded.record(["g2"], z=1.0, q=0.2, rounds=40)
    combined = GroupLedger(["g1", "g2"], delta=1e-5)
    combined.record(["g1", "g2"], z=2.0, q=0.1, rounds=80)
    assert cascaded.epsilon("g1") < cascaded.epsilon("g2")
    assert combined.epsilon("g1") == combined.epsilon("g2")
    assert combined.epsilon("g2") < cascaded.epsilon("g2")


def test_rounds_without_noise_have_no_finite_epsilon() -> None:
    ledger = GroupLedger(["a"], delta=1e-5)
    ledger.record(["a"], z=None, q=0.5)
    assert ledger.epsilon("a") == math.inf and ledger.rounds("a") == 1


def test_affordable_rounds_is_the_most_within_budget() -> None:
    ledger = GroupLedger(["a"], delta=1e-5)
    ledger.record(["a"], z=2.0, q=0.2, rounds=5)
    n = ledger.affordable_rounds("a", z=2.0, q=0.2, budget=2.0, limit=300)
    assert 0 < n < 300
    assert ledger.epsilon("a", extra=Segment(2.0, 0.2, n)) <= 2.0
    assert ledger.epsilon("a", extra=Segment(2.0, 0.2, n + 1)) > 2.0
    assert ledger.affordable_rounds("a", z=2.0, q=0.2, budget=0.01, limit=10) == 0
    assert ledger.affordable_rounds("a", z=50.0, q=0.2, budget=2.0, limit=10) == 10


def test_tiny_noise_falls_back_to_rdp_and_state_round_trips() -> None:
    ledger = GroupLedger(["a", "b"], delta=1e-5)
    ledger.record(["a"], z=noise_multiplier(0.01, 15.0), q=0.1, rounds=3)
    report = ledger.report()
    assert report["a"]["method"] == "rdp" and report["a"]["epsilon"] > 1e3
    again = GroupLedger(["a", "b"], delta=1e-5)
    again.restore(ledger.state())
    assert again.report() == report


def test_bad_input_is_named() -> None:
    with pytest.raises(ConfigError, match="distinct group names"):
        GroupLedger(["a", "a"], delta=1e-5)
    ledger = GroupLedger(["a"], delta=1e-5)
    with pytest.raises(ConfigError, match="no group 'x'"):
        ledger.record(["x"], z=1.0, q=0.1)
    with pytest.raises(ConfigError, match="clip norm"):
        noise_multiplier(1.0, 0.0)
