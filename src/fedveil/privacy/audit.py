"""Empirical privacy auditing: an epsilon LOWER bound from canaries, beside the accountant's UPPER bound.

One-run auditing of Steinke, Nasr and Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS
2023). ``m`` canaries are each included in the mechanism's input independently with probability 1/2
(:func:`draw_inclusion`); after a single run of the mechanism the auditor scores every canary, guesses the
``k_plus`` highest-scoring canaries IN and the ``k_minus`` lowest OUT, and abstains on the rest
(:func:`guess_outcome`). If the mechanism is ``(epsilon, delta)``-DP with respect to each canary, their
main theorem (Thm. 3 of the arXiv version, 2305.08846) bounds the number ``W`` of correct guesses among
the ``r = k_plus + k_minus`` guesses:

    P[W >= v] <= f(v) + 2 m delta max_{i = 1..v} (f(v - i) - f(v)) / i,
    f(v) = P[Binomial(r, e^eps / (1 + e^eps)) >= v],

(:func:`one_run_p_value`; ``f(v - i) - f(v) = P[v - i <= Binomial < v]``, and ``i > v`` adds nothing
larger). Observing ``v`` correct guesses therefore rejects "``(epsilon, delta)``-DP" at confidence
``1 - beta`` whenever that p-value is below ``beta``; :func:`one_run_epsilon_lower_bound` returns the
largest such epsilon (bisection on epsilon, as in the paper's Appendix D; it keeps the returned value on
the rejected side).

What the bound means: with probability at least ``confidence`` over the canaries' coins and the
mechanism's randomness, the mechanism *as implemented* is not ``(epsilon', delta)``-DP for any
``epsilon' <`` the returned value. It is a lower bound, never an upper bound: a small value does not
certify privacy (the attack may be weak, and the bound can never exceed what ``r`` guesses can show,
:func:`max_auditable_epsilon`); a value above the accountant's epsilon shows that the implementation or
its accounting is wrong. The number of guesses must be fixed before the scores are seen: choosing the
``k`` that gives the largest bound afterwards would void the confidence.

The mechanisms audited with it (FedAvg's ``ClipAndNoise``, FDML Alg. 2, PoliFL's central noise) are in
:mod:`fedveil.attacks.dp_audit`, a layer above the protocols they call.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
from scipy import special, stats

from fedveil.errors import ConfigError

__all__ = [
    "GuessOutcome",
    "draw_inclusion",
    "guess_outcome",
    "max_auditable_epsilon",
    "one_run_epsilon_lower_bound",
    "one_run_p_value",
]

METHOD = "one-run (Steinke, Nasr and Jagielski, NeurIPS 2023)"
"""How the lower bound is obtained, as reports name it."""

_BISECTION_STEPS = 60


def _count(value: int, name: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ConfigError(f"{name} {value!r} must be an integer >= {low}")
    return int(value)


def _check_confidence(confidence: float) -> float:
    ok = isinstance(confidence, numbers.Real) and not isinstance(confidence, bool)
    if not (ok and 0 < confidence < 1):
        raise ConfigError(f"confidence {confidence!r} must lie strictly between 0 and 1, e.g. 0.95")
    return float(confidence)


def _check_delta(delta: float) -> float:
    ok = isinstance(delta, numbers.Real) and not isinstance(delta, bool)
    if not (ok and 0 <= delta <= 1):
        raise ConfigError(f"delta {delta!r} must lie in [0, 1] (0 for pure epsilon-DP)")
    return float(delta)


def _check_counts(canaries: int, guesses: int, correct: int) -> tuple[int, int, int]:
    m = _count(canaries, "canaries", 1)
    r = _count(guesses, "guesses")
    v = _count(correct, "correct guesses")
    if not v <= r <= m:
        raise ConfigError(
            f"need correct guesses ({v}) <= guesses ({r}) <= canaries ({m}): the auditor guesses at most "
            "once per canary"
        )
    return m, r, v


def one_run_p_value(*, canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """The probability bound of Steinke, Nasr and Jagielski's main theorem (module docstring): for a
    mechanism that is ``(epsilon, delta)``-DP with respect to each of ``canaries`` canaries, the
    probability that ``guesses`` guesses contain ``correct`` or more correct ones is at most this value
    (capped at 1)."""
    m, r, v = _check_counts(canaries, guesses, correct)
    d = _check_delta(delta)
    if not (isinstance(epsilon, numbers.Real) and math.isfinite(epsilon) and epsilon >= 0):
        raise ConfigError(f"epsilon {epsilon!r} must be a finite number >= 0")
    q = float(special.expit(epsilon))  # e^eps / (1 + e^eps): the accuracy of eps-DP randomized response
    tail = float(stats.binom.sf(v - 1, r, q))  # f(v) = P[Binomial(r, q) >= v]
    if d == 0 or v == 0:
        return min(tail, 1.0)
    below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)  # P[Bin = v-1], P[Bin = v-2], ..., P[Bin = 0]
    alpha = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))  # max_i P[v - i <= Bin < v] / i
    return min(tail + 2 * m * d * alpha, 1.0)


def one_run_epsilon_lower_bound(
    *, canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95
) -> float:
    """The largest epsilon that ``correct`` correct guesses out of ``guesses`` (on ``canaries`` canaries)
    reject at ``confidence``: the mechanism is not ``(epsilon, delta)``-DP for any smaller epsilon, with
    probability at least ``confidence`` (module docstring). ``0`` when nothing is rejected."""
    m, r, v = _check_counts(canaries, guesses, correct)
    beta = 1 - _check_confidence(confidence)
    d = _check_delta(delta)

    def rejected(eps: float) -> bool:
        return one_run_p_value(canaries=m, guesses=r, correct=v, epsilon=eps, delta=d) < beta

    if not rejected(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while rejected(high):
        low, high = high, 2 * high
    for _ in range(_BISECTION_STEPS):
        mid = (low + high) / 2
        if rejected(mid):
            low = mid
        else:
            high = mid
    return low


def max_auditable_epsilon(*, canaries: int, guesses: int, delta: float, confidence: float = 0.95) -> float:
    """The lower bound when every one of ``guesses`` guesses is correct: the most any audit with these
    settings can show (about ``ln(r / ln(1 / beta))`` for ``delta = 0``)."""
    return one_run_epsilon_lower_bound(
        canaries=canaries, guesses=guesses, correct=guesses, delta=delta, confidence=confidence
    )


def draw_inclusion(canaries: int, rng: np.random.Generator) -> np.ndarray:
    """The canaries' coins: ``(canaries,)`` bool, each True (IN) independently with probability 1/2."""
    return rng.random(_count(canaries, "canaries", 1)) < 0.5


@dataclass(frozen=True)
class GuessOutcome:
    """The auditor's guesses: ``guesses = k_plus + k_minus`` of them, ``correct`` right."""

    guesses: int
    correct: int


def guess_outcome(scores: np.ndarray, included: np.ndarray, *, k_plus: int, k_minus: int) -> GuessOutcome:
    """Guess the ``k_plus`` canaries with the highest ``scores`` IN and the ``k_minus`` lowest OUT
    (ties broken by canary index, which carries no information) and count the correct guesses against
    ``included`` (the coins of :func:`draw_inclusion`)."""
    s = np.asarray(scores, dtype=np.float64)
    inc = np.asarray(included)
    if s.ndim != 1 or inc.shape != s.shape or inc.dtype != np.bool_:
        raise ConfigError(
            f"scores {s.shape} and included {inc.shape} {inc.dtype} must be 1-D of the same length, "
            "included bool"
        )
    if not np.all(np.isfinite(s)):
        raise ConfigError("scores contain NaN or inf: the mechanism's release is not finite")
    kp, km = _count(k_plus, "k_plus"), _count(k_minus, "k_minus")
    if kp + km > s.size:
        raise ConfigError(f"k_plus + k_minus = {kp + km} exceeds the {s.size} canaries: guess fewer")
    order = np.argsort(s, kind="stable")
    guessed_out = order[:km]
    guessed_in = order[s.size - kp :] if kp else order[:0]
    correct = int(inc[guessed_in].sum()) + int((~inc[guessed_out]).sum())
    return GuessOutcome(kp + km, correct)
