"""Privacy accounting: published known answers, a brute-force reference, calibration, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedveil.errors import ConfigError, FedveilError
from fedveil.privacy.accounting import (
    TF_PRIVACY_RDP_ORDERS,
    Accountant,
    GaussianRelease,
    LaplaceRelease,
    PureEpsilonRelease,
    UnsupportedMechanismError,
    bisect_decreasing,
    calibrate_noise,
    epsilon_of,
    pld_epsilon,
    pld_of,
)


def brute_force_pure_epsilon(eps: float, q: float, rounds: int, delta: float) -> float:
    """Epsilon of ``rounds`` releases that are eps-DP with probability q, by enumerating the privacy
    loss ``eps * (K+ - K-)`` of the randomized-response dominating pair (no discretisation)."""
    tail = math.exp(-eps)
    step = np.array([q * tail / (1 + tail), 1 - q, q / (1 + tail)])
    pmf = np.array([1.0])
    for _ in range(rounds):
        pmf = np.convolve(pmf, step)
    losses = eps * np.arange(-rounds, rounds + 1)

    def delta_at(e: float) -> float:
        above = losses > e
        return float(np.sum(pmf[above] * -np.expm1(e - losses[above])))

    lo, hi = 0.0, eps * rounds
    if delta_at(0.0) <= delta:
        return 0.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if delta_at(mid) <= delta else (mid, hi)
    return hi


# TF-Privacy, tensorflow_privacy/privacy/analysis/compute_dp_sgd_privacy_test.py (Test0-Test2):
# (n, batch_size, noise_multiplier, epochs, delta, expected_eps, expected_order); steps =
# ceil(epochs * n / batch_size), q = batch_size / n, orders of compute_dp_sgd_privacy_lib.
TF_PRIVACY_CASES = [
    (60000, 150, 1.3, 15, 1e-5, 0.7242234026109595),
    (100000, 100, 1.0, 30, 1e-7, 1.4154988495444845),
    (100000000, 1024, 0.1, 10, 1e-7, 5907982.31138195),
]


@pytest.mark.parametrize(("n", "batch", "noise", "epochs", "delta", "expected"), TF_PRIVACY_CASES)
def test_rdp_reproduces_tf_privacy_compute_dp_sgd_privacy(n, batch, noise, epochs, delta, expected):
    steps = math.ceil(epochs * n / batch)
    acc = Accountant("rdp", rdp_orders=TF_PRIVACY_RDP_ORDERS)
    acc.compose(GaussianRelease(noise, batch / n, steps))
    assert acc.epsilon(delta) == pytest.approx(expected, rel=1e-9)


def test_tf_privacy_case0_needs_only_order_19():
    # The optimal order of the published 0.7242234026109595 is 19 (TF-Privacy's expected_order).
    acc = Accountant("rdp", rdp_orders=[19.0]).compose(GaussianRelease(1.3, 0.0025, 6000))
    assert acc.epsilon(1e-5) == pytest.approx(0.7242234026109595, rel=1e-9)


def test_pld_reproduces_dp_accounting_poisson_subsampled_laplace():
    # dp_accounting/pld/pld_privacy_accountant_test.py, test_poisson_subsampled_laplace: q = 0.2,
    # Laplace parameter 0.5, composed 1 + 2 times -> epsilon 2.46964 at delta 1e-14.
    acc = Accountant("pld")
    acc.compose(LaplaceRelease(1.0, 0.5, 0.2), 1)
    acc.compose(LaplaceRelease(1.0, 0.5, 0.2), 2)
    assert acc.epsilon(1e-14) == pytest.approx(2.46964, abs=1e-3)
    assert acc.delta(2.46964) == pytest.approx(1e-14, abs=1e-6)
    assert Accountant().compose(LaplaceRelease(1.0, 0.5, 0.2, count=3)).epsilon(1e-14) == acc.epsilon(1e-14)


def test_pld_reproduces_dp_accounting_poisson_subsampled_gaussian():
    # dp_accounting/pld/pld_privacy_accountant_test.py, test_poisson_subsampled_gaussian.
    acc = Accountant("pld", value_discretization_interval=1e-3).compose(GaussianRelease(0.5, 0.2), 3)
    assert acc.delta(1.0) == pytest.approx(0.15594, abs=1e-3)
    assert acc.epsilon(0.15594) == pytest.approx(1.0, abs=1e-3)


def test_laplace_sensitivity_and_scale_enter_as_their_ratio():
    a = Accountant().compose(LaplaceRelease(2.0, 4.0, 0.3, 5)).epsilon(1e-6)
    b = Accountant().compose(LaplaceRelease(1.0, 2.0, 0.3, 5)).epsilon(1e-6)
    assert a == pytest.approx(b, rel=1e-9)


def test_non_subsampled_laplace_is_pure_under_both_accountants():
    # k Laplace releases of noise multiplier z are (k / z, 0)-DP: PLD finds it (up to its grid), RDP's
    # conversion to (epsilon, delta) at finite orders is slightly looser.
    pld_eps = Accountant("pld").compose(LaplaceRelease(1.0, 2.0, count=4)).epsilon(1e-9)
    rdp_eps = Accountant("rdp").compose(LaplaceRelease(1.0, 2.0, count=4)).epsilon(1e-9)
    assert 1.9 < pld_eps <= 2.0 + 1e-3
    assert pld_eps <= rdp_eps <= 2.05


@settings(max_examples=25, deadline=None)
@given(
    eps=st.floats(0.05, 6.0),
    q=st.floats(0.01, 1.0),
    rounds=st.integers(1, 40),
    log_delta=st.floats(-9, -2),
)
def test_pure_epsilon_pld_matches_brute_force(eps, q, rounds, log_delta):
    delta = 10**log_delta
    got = Accountant().compose(PureEpsilonRelease(eps, q, rounds)).epsilon(delta)
    assert got == pytest.approx(brute_force_pure_epsilon(eps, q, rounds, delta), rel=1e-6, abs=1e-9)


def test_pure_epsilon_with_huge_per_round_epsilon_stays_an_upper_bound():
    # exp(-loss) underflows here; dp-accounting then answers a grid point above the exact value.
    exact = brute_force_pure_epsilon(65.56, 0.0593, 200, 1e-5)
    got = Accountant().compose(PureEpsilonRelease(65.56, 0.0593, 200)).epsilon(1e-5)
    assert exact <= got <= exact + 65.56


def test_single_pure_release_is_at_most_its_epsilon():
    acc = Accountant().compose(PureEpsilonRelease(1.5))
    assert acc.epsilon(1e-12) == pytest.approx(1.5, abs=1e-9)
    assert acc.delta(1.5) == pytest.approx(0.0, abs=1e-12)


def test_sampling_and_more_rounds_move_epsilon_the_right_way():
    base = epsilon_of([PureEpsilonRelease(1.0, 0.1, 100)], 1e-5)
    assert epsilon_of([PureEpsilonRelease(1.0, 0.2, 100)], 1e-5) > base
    assert epsilon_of([PureEpsilonRelease(1.0, 0.1, 200)], 1e-5) > base


def test_empty_accountant_and_cache_invalidation():
    acc = Accountant("rdp")
    assert acc.epsilon(1e-5) == 0.0
    assert acc.delta(1.0) == 0.0
    acc.compose(GaussianRelease(1.0, 0.01), 10)
    first = acc.epsilon(1e-5)
    acc.compose(GaussianRelease(1.0, 0.01), 10)
    assert acc.epsilon(1e-5) > first
    assert acc.events == {GaussianRelease(1.0, 0.01): 20}


def test_pld_of_composes_on_a_shared_grid():
    one = pld_of(LaplaceRelease(1.0, 1.0, 0.5), value_discretization_interval=1e-3)
    three = pld_of(LaplaceRelease(1.0, 1.0, 0.5, count=3), value_discretization_interval=1e-3)
    composed = one.compose(one).compose(one)
    assert pld_epsilon(composed, 1e-6) == pytest.approx(pld_epsilon(three, 1e-6), abs=1e-9)


def test_calibrate_gaussian_noise_recovers_tf_privacy_setting():
    z = calibrate_noise(
        0.7242234026109595,
        1e-5,
        mechanism="gaussian",
        sampling_rate=0.0025,
        steps=6000,
        method="rdp",
        rdp_orders=TF_PRIVACY_RDP_ORDERS,
        rtol=1e-4,
    )
    assert z == pytest.approx(1.3, rel=2e-4)
    assert z >= 1.3 * (1 - 1e-9)


def test_calibrate_laplace_scale_never_exceeds_target():
    kwargs = {"mechanism": "laplace", "sampling_rate": 0.2, "steps": 3, "sensitivity": 2.0}
    b = calibrate_noise(2.46964, 1e-14, **kwargs, value_discretization_interval=1e-3)
    assert b == pytest.approx(1.0, rel=5e-3)  # b / sensitivity = 0.5, dp-accounting's test case
    at = LaplaceRelease(2.0, b, 0.2, 3)
    below = LaplaceRelease(2.0, b * (1 - 3e-3), 0.2, 3)
    assert epsilon_of([at], 1e-14, value_discretization_interval=1e-3) <= 2.46964
    assert epsilon_of([below], 1e-14, value_discretization_interval=1e-3) > 2.46964


def test_bisect_decreasing_brackets_the_answer():
    x = bisect_decreasing(lambda v: 10.0 / v, 4.0, start=1.0, rtol=1e-6, what="x")
    assert 10.0 / x <= 4.0
    assert x == pytest.approx(2.5, rel=2e-6)
    assert bisect_decreasing(lambda v: 10.0 / v, 4.0, start=100.0, rtol=1e-6, what="x") == pytest.approx(
        2.5, rel=2e-6
    )
    with pytest.raises(ConfigError, match="no x up to"):
        bisect_decreasing(lambda v: 5.0, 4.0, start=1.0, rtol=1e-3, what="x", max_doublings=5)


def test_unsupported_combinations_name_the_alternative():
    with pytest.raises(UnsupportedMechanismError, match=r"subsampled Laplace.*0\.3.*pld"):
        Accountant("rdp").compose(LaplaceRelease(1.0, 1.0, 0.3))
    with pytest.raises(UnsupportedMechanismError, match=r"pure-epsilon.*pld"):
        Accountant("rdp").compose(PureEpsilonRelease(1.0))
    with pytest.raises(UnsupportedMechanismError, match="pld"):
        calibrate_noise(1.0, 1e-5, mechanism="laplace", sampling_rate=0.5, method="rdp")
    assert issubclass(UnsupportedMechanismError, FedveilError)
    assert Accountant("rdp").supports(LaplaceRelease(1.0, 1.0))
    assert not Accountant("rdp").supports(LaplaceRelease(1.0, 1.0, 0.5))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: GaussianRelease(0.0), "noise multiplier 0.0"),
        (lambda: GaussianRelease(-1.3), "noise multiplier -1.3"),
        (lambda: GaussianRelease(1.0, 0.0), r"sampling_rate 0.0 must be in \(0, 1\]"),
        (lambda: GaussianRelease(1.0, 1.5), "sampling_rate 1.5"),
        (lambda: GaussianRelease(1.0, math.nan), "sampling_rate nan"),
        (lambda: GaussianRelease(1.0, 0.5, 0), "count 0"),
        (lambda: GaussianRelease(1.0, 0.5, True), "count True"),
        (lambda: LaplaceRelease(1.0, 0.0), "Laplace scale b 0.0"),
        (lambda: LaplaceRelease(-1.0, 1.0), "sensitivity -1.0"),
        (lambda: PureEpsilonRelease(0.0), "epsilon 0.0 must be"),
        (lambda: PureEpsilonRelease(-2.0), "epsilon -2.0"),
        (lambda: PureEpsilonRelease(math.inf), "epsilon inf"),
        (lambda: Accountant("moments"), "accountant 'moments' is not one of pld, rdp"),
        (lambda: Accountant(value_discretization_interval=0.0), "value_discretization_interval 0.0"),
        (lambda: Accountant("rdp", rdp_orders=[0.5]), "rdp_orders"),
        (lambda: Accountant().epsilon(0.0), r"delta 0.0 must be in \(0, 1\)"),
        (lambda: Accountant().epsilon(1.0), "delta 1.0"),
        (lambda: Accountant().epsilon(-1e-5), "delta -1e-05"),
        (lambda: Accountant().delta(0.0), "epsilon 0.0"),
        (lambda: Accountant().compose(GaussianRelease(1.0), 0), "count 0"),
        (lambda: calibrate_noise(-1.0, 1e-5, mechanism="gaussian"), "target epsilon -1.0"),
        (lambda: calibrate_noise(1.0, 2.0, mechanism="gaussian"), "delta 2.0"),
        (lambda: calibrate_noise(1.0, 1e-5, mechanism="cauchy"), "mechanism 'cauchy'"),
        (lambda: calibrate_noise(1.0, 1e-5, mechanism="gaussian", sampling_rate=0), "sampling_rate 0"),
    ],
)
def test_bad_input_fails_before_anything_runs(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_the_kept_subsampled_gaussian_pld_does_not_change_later_answers() -> None:
    """The cached one-release PLD is composed, never changed: asking for more rounds, then fewer, gives
    what a fresh computation gives."""
    from fedveil.privacy.accounting import _subsampled_gaussian_pld

    asked = [epsilon_of([GaussianRelease(1.1, 0.2, n)], 1e-5) for n in (7, 3, 7)]
    _subsampled_gaussian_pld.cache_clear()
    fresh = [epsilon_of([GaussianRelease(1.1, 0.2, n)], 1e-5) for n in (7, 3)]
    assert asked == [fresh[0], fresh[1], fresh[0]]
