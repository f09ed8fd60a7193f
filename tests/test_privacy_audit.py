"""The one-run audit (Steinke, Nasr and Jagielski, NeurIPS 2023): its bound against a brute-force
reference and known values, and the audits of fedveil's mechanisms: under the accountant's epsilon as
implemented, above it when deliberately broken."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedveil.attacks.dp_audit import NOISE_BREAK_FACTOR, Miscalibration, audit_mechanism
from fedveil.cli import main
from fedveil.errors import ConfigError
from fedveil.privacy.audit import (
    draw_inclusion,
    guess_outcome,
    max_auditable_epsilon,
    one_run_epsilon_lower_bound,
    one_run_p_value,
)
from fedveil.privacy.names import AUDITED, BROKEN


def brute_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """The main theorem's bound written out term by term with exact binomial coefficients."""
    q = math.exp(eps) / (1 + math.exp(eps))

    def f(t: int) -> float:  # P[Binomial(r, q) >= t]
        return sum(math.comb(r, j) * q**j * (1 - q) ** (r - j) for j in range(max(t, 0), r + 1))

    alpha = max(((f(v - i) - f(v)) / i for i in range(1, m + 1)), default=0.0)
    return min(f(v) + 2 * m * delta * alpha, 1.0)


@pytest.mark.parametrize(
    ("m", "r", "v", "eps", "delta"),
    [(10, 6, 5, 0.7, 0.0), (30, 20, 17, 1.3, 1e-3), (50, 12, 12, 2.5, 1e-2), (8, 8, 0, 0.1, 1e-2)],
)
def test_p_value_matches_brute_force(m: int, r: int, v: int, eps: float, delta: float) -> None:
    got = one_run_p_value(canaries=m, guesses=r, correct=v, epsilon=eps, delta=delta)
    assert got == pytest.approx(brute_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(("r", "confidence"), [(10, 0.95), (100, 0.95), (400, 0.99)])
def test_all_correct_reaches_the_known_maximum(r: int, confidence: float) -> None:
    # delta = 0: P[Binomial(r, q) = r] = q^r = beta at q = beta^(1/r), so epsilon = logit(beta^(1/r))
    q = (1 - confidence) ** (1 / r)
    expected = math.log(q / (1 - q))
    got = max_auditable_epsilon(canaries=2 * r, guesses=r, delta=0.0, confidence=confidence)
    assert got == pytest.approx(expected, abs=1e-9)
    # the delta term can only lower the bound
    assert max_auditable_epsilon(canaries=2 * r, guesses=r, delta=1e-3, confidence=confidence) <= got


def test_lower_bound_sits_on_the_rejected_side() -> None:
    eps = one_run_epsilon_lower_bound(canaries=1000, guesses=100, correct=90, delta=1e-5, confidence=0.95)
    assert eps > 0
    assert one_run_p_value(canaries=1000, guesses=100, correct=90, epsilon=eps, delta=1e-5) < 0.05
    assert one_run_p_value(canaries=1000, guesses=100, correct=90, epsilon=eps + 1e-6, delta=1e-5) >= 0.05


@settings(max_examples=60, deadline=None)
@given(r=st.integers(1, 200), data=st.data())
def test_bound_is_monotone_in_correct_guesses(r: int, data: st.DataObject) -> None:
    v1 = data.draw(st.integers(0, r))
    v2 = data.draw(st.integers(v1, r))
    kw = {"canaries": 2 * r, "guesses": r, "delta": 1e-5, "confidence": 0.95}
    assert one_run_epsilon_lower_bound(correct=v1, **kw) <= one_run_epsilon_lower_bound(correct=v2, **kw)


@settings(max_examples=60, deadline=None)
@given(r=st.integers(1, 300), data=st.data())
def test_guessing_no_better_than_chance_shows_nothing(r: int, data: st.DataObject) -> None:
    v = data.draw(st.integers(0, r // 2))
    assert one_run_epsilon_lower_bound(canaries=r, guesses=r, correct=v, delta=1e-5, confidence=0.95) == 0.0


def test_random_scores_give_zero_at_the_stated_confidence() -> None:
    rng = np.random.default_rng(7)
    zeros = 0
    for _ in range(40):
        included = draw_inclusion(1000, rng)
        outcome = guess_outcome(rng.normal(size=1000), included, k_plus=50, k_minus=50)
        eps = one_run_epsilon_lower_bound(
            canaries=1000, guesses=outcome.guesses, correct=outcome.correct, delta=1e-5, confidence=0.95
        )
        zeros += eps == 0.0
    assert zeros >= 34  # a false positive has probability < 5% each


def test_guess_outcome_counts_top_in_and_bottom_out() -> None:
    scores = np.array([0.9, 0.1, 0.5, 0.8, 0.2, 0.3])
    included = np.array([True, False, True, False, True, False])
    # top 2 (0.9 -> IN right, 0.8 -> IN wrong), bottom 2 (0.1 -> OUT right, 0.2 -> OUT wrong)
    assert guess_outcome(scores, included, k_plus=2, k_minus=2).correct == 2
    assert guess_outcome(scores, included, k_plus=1, k_minus=0).correct == 1
    with pytest.raises(ConfigError, match="exceeds the 6 canaries"):
        guess_outcome(scores, included, k_plus=4, k_minus=3)


def test_bad_settings_name_the_value() -> None:
    with pytest.raises(ConfigError, match=r"confidence 1\.5"):
        one_run_epsilon_lower_bound(canaries=10, guesses=4, correct=4, delta=0.0, confidence=1.5)
    with pytest.raises(ConfigError, match=r"correct guesses \(5\) <= guesses \(4\)"):
        one_run_p_value(canaries=10, guesses=4, correct=5, epsilon=1.0, delta=0.0)
    with pytest.raises(ConfigError, match="broken 'bias'"):
        Miscalibration.of("bias")
    with pytest.raises(ConfigError, match="mechanism 'laplace'"):
        audit_mechanism("laplace")


@pytest.mark.parametrize("mechanism", AUDITED)
def test_honest_mechanism_stays_under_the_accountant(mechanism: str) -> None:
    for seed in (0, 1):
        report = audit_mechanism(mechanism, seed=seed)
        assert 0 < report.empirical_epsilon_lower <= report.accountant_epsilon
        assert not report.exceeds_claim


@pytest.mark.parametrize("mechanism", AUDITED)
@pytest.mark.parametrize("broken", BROKEN)
def test_broken_mechanism_exceeds_the_claim(mechanism: str, broken: str) -> None:
    honest = audit_mechanism(mechanism)
    report = audit_mechanism(mechanism, broken=broken)
    assert report.accountant_epsilon == honest.accountant_epsilon  # the claim stays the honest one
    assert report.empirical_epsilon_lower > report.accountant_epsilon
    assert report.exceeds_claim and report.broken == broken


def test_miscalibration_is_the_only_difference() -> None:
    assert Miscalibration.of(None) == Miscalibration()
    assert Miscalibration.of("noise").noise_factor == 1 / NOISE_BREAK_FACTOR
    assert Miscalibration.of("clip").clip(1.0) > 1e100 and Miscalibration.of(None).clip(1.0) == 1.0


def test_fdml_paper_clipping_breaks_thm_v1_but_not_the_strict_analysis() -> None:
    report = audit_mechanism("fdml", fdml_mode="paper", dim=8)
    assert report.settings["paper_epsilon"] < report.empirical_epsilon_lower <= report.accountant_epsilon


def test_fdml_drop_amplification_is_audited_with_its_claim() -> None:
    plain = audit_mechanism("fdml")
    dropped = audit_mechanism("fdml", drop_rate=0.5)
    assert dropped.accountant_epsilon < plain.accountant_epsilon
    assert dropped.empirical_epsilon_lower <= dropped.accountant_epsilon


def test_audit_is_seeded() -> None:
    assert audit_mechanism("polifl", seed=3) == audit_mechanism("polifl", seed=3)


def test_cli_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["privacy", "audit", "--mechanism", "gaussian", "--canaries", "400", "--k-plus", "20"]
    assert main([*argv, "--k-minus", "20", "--broken", "noise", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = {"mechanism", "accountant_epsilon", "delta", "empirical_epsilon_lower", "confidence", "method"}
    assert expected <= set(out)
    assert out["method"].startswith("one-run") and out["canaries"] == 400 and out["guesses"] == 40
    assert out["broken"] == "noise" and out["exceeds_claim"] is True
    assert main(["privacy", "audit", "--mechanism", "fdml", "--fdml-mode", "paper"]) == 0
    text = capsys.readouterr().out
    assert "lower bound" in text and "Thm V.1" in text
