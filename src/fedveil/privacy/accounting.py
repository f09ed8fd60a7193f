"""Privacy accounting over `dp-accounting`: describe what was released, then ask for epsilon or delta.

Three immutable event types describe releases (the idea of dp-accounting's ``DpEvent``):

- :class:`LaplaceRelease`: ``f(D) + Lap(scale_b)`` per coordinate, ``f`` of L1 sensitivity
  ``sensitivity``, optionally on a Poisson sample of rate ``sampling_rate``; ``count`` times.
- :class:`GaussianRelease`: the (Poisson-subsampled) Gaussian mechanism with L2 sensitivity 1 and
  noise standard deviation ``noise_multiplier`` (DP-SGD's ``sigma / C``); ``count`` times.
- :class:`PureEpsilonRelease`: a release known only to be ``epsilon``-DP (pure), in which the
  protected record takes part with probability ``sampling_rate``, and whether it took part may be
  observed; ``count`` times. This is how a per-round bound such as FDML's Thm V.1 is composed.

:class:`Accountant` answers ``epsilon(delta)`` and ``delta(epsilon)`` for everything composed into it,
with privacy loss distributions (``"pld"``, dp-accounting's ``pld`` package) or Renyi DP (``"rdp"``,
``RdpAccountant``). Combinations an accountant cannot handle raise
:class:`UnsupportedMechanismError` naming the accountant that can; they are never approximated.

Neighbouring relation: Laplace and Gaussian events are accounted under add-or-remove-one, the
relation of dp-accounting's defaults and of TF-Privacy's published numbers (for the non-subsampled
Laplace the two relations coincide at the same sensitivity). A :class:`PureEpsilonRelease` is
relation-agnostic: it inherits whatever relation its ``epsilon`` was proved for.

:func:`calibrate_noise` finds, by bisection, the smallest noise (Gaussian noise multiplier or Laplace
scale ``b``) whose composed epsilon at ``delta`` does not exceed a target.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant

from fedveil.errors import ConfigError
from fedveil.privacy.names import ACCOUNTANTS, MECHANISMS

__all__ = [
    "DEFAULT_PLD_INTERVAL",
    "TF_PRIVACY_RDP_ORDERS",
    "Accountant",
    "GaussianRelease",
    "LaplaceRelease",
    "PureEpsilonRelease",
    "Release",
    "UnsupportedMechanismError",
    "calibrate_noise",
    "epsilon_of",
    "pld_delta",
    "pld_epsilon",
    "pld_of",
]

#: Default PLD grid: privacy losses are rounded up (pessimistically) to multiples of this.
DEFAULT_PLD_INTERVAL = 1e-4

#: The RDP orders of TF-Privacy's ``compute_dp_sgd_privacy_lib`` (its published test constants,
#: e.g. epsilon = 0.7242234026109595 at order 19, are computed over exactly these).
_TF_PRIVACY_LOW_ORDERS = (1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5)
TF_PRIVACY_RDP_ORDERS: tuple[float, ...] = (
    *_TF_PRIVACY_LOW_ORDERS,
    *map(float, range(5, 64)),
    128.0,
    256.0,
    512.0,
)


class UnsupportedMechanismError(ConfigError):
    """The chosen accountant cannot account for this release; the message names one that can."""


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_epsilon(value: float, name: str = "epsilon") -> float:
    """``value`` as a float if it is a finite epsilon > 0, else :class:`ConfigError`."""
    if not (_is_real(value) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} {value!r} must be a finite number > 0")
    return float(value)


def check_delta(value: float, name: str = "delta") -> float:
    """``value`` as a float if it lies in (0, 1), else :class:`ConfigError`."""
    if not (_is_real(value) and 0 < value < 1):
        raise ConfigError(f"{name} {value!r} must be in (0, 1), e.g. 1e-5 or 1 / (number of records)")
    return float(value)


def check_sampling_rate(value: float, name: str = "sampling_rate") -> float:
    """``value`` as a float if it lies in (0, 1], else :class:`ConfigError`."""
    if not (_is_real(value) and 0 < value <= 1):
        raise ConfigError(
            f"{name} {value!r} must be in (0, 1] (the probability that a record takes part; "
            "use 1.0 when every record is used)"
        )
    return float(value)


def check_positive(value: float, name: str) -> float:
    """``value`` as a float if it is finite and > 0 (a noise scale, a sensitivity), else ConfigError."""
    if not (_is_real(value) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} {value!r} must be a finite number > 0")
    return float(value)


def check_count(value: int, name: str = "count") -> int:
    """``value`` if it is an integer >= 1, else :class:`ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"{name} {value!r} must be an integer >= 1")
    return int(value)


@dataclass(frozen=True)
class LaplaceRelease:
    """``count`` releases of ``f(D) + Lap(scale_b)`` (i.i.d. per coordinate), ``f`` of L1 sensitivity
    ``sensitivity``, each computed on a Poisson sample of rate ``sampling_rate`` (Dwork & Roth Def.
    3.3; FDML Definition II.2 / Lemma II.1: pure epsilon = sensitivity / scale_b)."""

    sensitivity: float
    scale_b: float
    sampling_rate: float = 1.0
    count: int = 1

    def __post_init__(self) -> None:
        check_positive(self.sensitivity, "sensitivity")
        check_positive(self.scale_b, "Laplace scale b")
        check_sampling_rate(self.sampling_rate)
        check_count(self.count)

    @property
    def noise_multiplier(self) -> float:
        """``scale_b / sensitivity``: dp-accounting's Laplace ``noise_multiplier``."""
        return self.scale_b / self.sensitivity


@dataclass(frozen=True)
class GaussianRelease:
    """``count`` releases of the Gaussian mechanism with L2 sensitivity 1 and noise standard deviation
    ``noise_multiplier``, each on a Poisson sample of rate ``sampling_rate`` (DP-SGD, Abadi et al.)."""

    noise_multiplier: float
    sampling_rate: float = 1.0
    count: int = 1

    def __post_init__(self) -> None:
        check_positive(self.noise_multiplier, "noise multiplier")
        check_sampling_rate(self.sampling_rate)
        check_count(self.count)


@dataclass(frozen=True)
class PureEpsilonRelease:
    """``count`` independent releases, each ``epsilon``-DP (pure) for the protected record whenever the
    record takes part, which it does with probability ``sampling_rate`` independently per release.

    Accounted with the dominating pair of pure epsilon-DP (randomized response, Kairouz et al. 2015;
    dp-accounting ``from_privacy_parameters``), mixed with the identity for the releases the record
    does not take part in. The mixture is the PLD of the *disjoint union* of the two cases, i.e. it
    lets the adversary see whether the record took part; that only weakens the adversary's
    uncertainty, so the bound is valid whether participation is observed or not, and whether the
    sampling is Poisson or of fixed size, as long as each release's participation probability for
    the record is at most ``sampling_rate`` and releases draw independently.
    """

    epsilon: float
    sampling_rate: float = 1.0
    count: int = 1

    def __post_init__(self) -> None:
        check_epsilon(self.epsilon)
        check_sampling_rate(self.sampling_rate)
        check_count(self.count)


Release = LaplaceRelease | GaussianRelease | PureEpsilonRelease


def _unit(event: Release) -> Release:
    """The same release with ``count`` = 1 (used to merge repeated events)."""
    return dataclasses.replace(event, count=1)


def _pure_epsilon_pld(event: PureEpsilonRelease, interval: float) -> pld_lib.PrivacyLossDistribution:
    """PLD of one :class:`PureEpsilonRelease`: loss +eps w.p. q e^eps/(1+e^eps), -eps w.p.
    q/(1+e^eps), 0 w.p. 1-q; rounded up to the grid (exact when ``interval`` divides epsilon)."""
    eps, q = event.epsilon, event.sampling_rate
    tail = math.exp(-eps)
    pmf: dict[int, float] = {}
    up, down = (1, -1) if interval == eps else (math.ceil(eps / interval), math.ceil(-eps / interval))
    for key, prob in ((up, q / (1 + tail)), (down, q * tail / (1 + tail)), (0, 1 - q)):
        pmf[key] = pmf.get(key, 0.0) + prob
    return pld_lib.PrivacyLossDistribution.create_from_rounded_probability(pmf, 0.0, interval)


def _event_pld(event: Release, times: int, interval: float) -> pld_lib.PrivacyLossDistribution:
    """PLD of ``event`` (with count 1) composed ``times`` times."""
    if isinstance(event, PureEpsilonRelease):
        return _pure_epsilon_pld(event, interval).self_compose(times)
    if isinstance(event, LaplaceRelease):
        return pld_lib.from_laplace_mechanism(
            parameter=event.scale_b,
            sensitivity=event.sensitivity,
            value_discretization_interval=interval,
            sampling_prob=event.sampling_rate,
        ).self_compose(times)
    if event.sampling_rate == 1.0:
        return pld_lib.from_gaussian_mechanism(
            standard_deviation=event.noise_multiplier / math.sqrt(times),
            value_discretization_interval=interval,
        )
    return _subsampled_gaussian_pld(event.noise_multiplier, event.sampling_rate, interval).self_compose(times)


@functools.lru_cache(maxsize=8)
def _subsampled_gaussian_pld(z: float, q: float, interval: float) -> pld_lib.PrivacyLossDistribution:
    """One subsampled Gaussian release's PLD, kept for the next query: building it is most of the cost
    (seconds near z = 0.3), composing it is FFTs, and a run asks after every round with one more round."""
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=z, value_discretization_interval=interval, sampling_prob=q
    )


def pld_of(event: Release, value_discretization_interval: float | None = None) -> Any:
    """dp-accounting ``PrivacyLossDistribution`` of ``event`` (all ``event.count`` releases), on the grid
    ``value_discretization_interval`` (default: ``event.epsilon`` for a :class:`PureEpsilonRelease`,
    which is exact, else :data:`DEFAULT_PLD_INTERVAL`). PLDs on the same grid compose with
    ``.compose``; :func:`pld_epsilon` reads epsilon off one."""
    if value_discretization_interval is None:
        interval = event.epsilon if isinstance(event, PureEpsilonRelease) else DEFAULT_PLD_INTERVAL
    else:
        interval = check_positive(value_discretization_interval, "value_discretization_interval")
    return _event_pld(_unit(event), event.count, interval)


def pld_epsilon(pld: Any, delta: float) -> float:
    """Epsilon at ``delta`` of a dp-accounting PLD. Where ``exp(-loss)`` underflows (per-release
    epsilons in the hundreds), dp-accounting answers with a grid point above the exact value, or
    ``inf``; both are upper bounds, and its overflow warnings are silenced here."""
    check_delta(delta)
    with np.errstate(over="ignore", divide="ignore"):
        return float(pld.get_epsilon_for_delta(delta))


def pld_delta(pld: Any, epsilon: float) -> float:
    """Delta at ``epsilon`` of a dp-accounting PLD."""
    check_epsilon(epsilon)
    with np.errstate(over="ignore", divide="ignore"):
        return float(pld.get_delta_for_epsilon(epsilon))


def _rdp_event(event: Release) -> dp_accounting.DpEvent:
    """The dp-accounting event the RDP accountant composes (support checked by the caller)."""
    if isinstance(event, GaussianRelease):
        gaussian = dp_accounting.GaussianDpEvent(event.noise_multiplier)
        if event.sampling_rate == 1.0:
            return gaussian
        return dp_accounting.PoissonSampledDpEvent(event.sampling_rate, gaussian)
    assert isinstance(event, LaplaceRelease)
    return dp_accounting.LaplaceDpEvent(event.noise_multiplier)


class Accountant:
    """Composes releases and answers epsilon(delta) / delta(epsilon) with PLD or RDP.

    ``method="pld"`` supports every event type; ``value_discretization_interval`` is the PLD grid
    (default: the epsilon itself when every event is one repeated :class:`PureEpsilonRelease`, which
    is exact and cheap, else :data:`DEFAULT_PLD_INTERVAL`; rounding is pessimistic, so a coarser
    grid only overstates epsilon). ``method="rdp"`` supports the (subsampled) Gaussian and the
    non-subsampled Laplace, over ``rdp_orders`` (default: dp-accounting's; use
    :data:`TF_PRIVACY_RDP_ORDERS` to reproduce TF-Privacy). The composed PLD is built lazily and
    cached until the next :meth:`compose`.
    """

    def __init__(
        self,
        method: str = "pld",
        *,
        value_discretization_interval: float | None = None,
        rdp_orders: Sequence[float] | None = None,
    ) -> None:
        if method not in ACCOUNTANTS:
            raise ConfigError(f"accountant {method!r} is not one of {', '.join(ACCOUNTANTS)}")
        if value_discretization_interval is not None:
            check_positive(value_discretization_interval, "value_discretization_interval")
        if rdp_orders is not None and (not rdp_orders or min(rdp_orders) <= 1):
            raise ConfigError(f"rdp_orders {rdp_orders!r} must be a non-empty list of orders > 1")
        self.method = method
        self._interval = value_discretization_interval
        self._orders = tuple(rdp_orders) if rdp_orders is not None else None
        self._counts: dict[Release, int] = {}
        self._cache: Any = None

    @property
    def events(self) -> dict[Release, int]:
        """Every distinct release (with ``count`` = 1) and how many times it was composed."""
        return dict(self._counts)

    def unsupported_reason(self, event: Release) -> str | None:
        """Why this accountant cannot handle ``event`` (naming the alternative), or None if it can."""
        if not isinstance(event, LaplaceRelease | GaussianRelease | PureEpsilonRelease):
            return f"{event!r} is not a LaplaceRelease, GaussianRelease or PureEpsilonRelease"
        if self.method == "rdp":
            if isinstance(event, LaplaceRelease) and event.sampling_rate < 1:
                return (
                    f"the RDP accountant cannot account for the Poisson-subsampled Laplace mechanism "
                    f"(sampling rate {event.sampling_rate!r}); use the PLD accountant "
                    "(accountant 'pld', --accountant pld)"
                )
            if isinstance(event, PureEpsilonRelease):
                return (
                    f"the RDP accountant does not account for pure-epsilon releases (epsilon "
                    f"{event.epsilon!r}); use the PLD accountant (accountant 'pld', --accountant pld)"
                )
        return None

    def supports(self, event: Release) -> bool:
        """Whether :meth:`compose` would accept ``event``."""
        return self.unsupported_reason(event) is None

    def compose(self, event: Release, count: int = 1) -> Accountant:
        """Add ``count`` repetitions of ``event`` (each itself ``event.count`` releases); returns self.

        Raises :class:`UnsupportedMechanismError` before changing anything if the accountant cannot
        handle the event.
        """
        reason = self.unsupported_reason(event)
        if reason is not None:
            raise UnsupportedMechanismError(reason)
        check_count(count)
        unit = _unit(event)
        self._counts[unit] = self._counts.get(unit, 0) + event.count * count
        self._cache = None
        return self

    def _grid(self) -> float:
        if self._interval is not None:
            return self._interval
        pure = {e.epsilon for e in self._counts if isinstance(e, PureEpsilonRelease)}
        if len(pure) == 1 and all(isinstance(e, PureEpsilonRelease) for e in self._counts):
            return pure.pop()
        return DEFAULT_PLD_INTERVAL

    def _composed(self) -> Any:
        if self._cache is None:
            if self.method == "pld":
                interval = self._grid()
                total = pld_lib.identity(value_discretization_interval=interval)
                for event, times in self._counts.items():
                    total = total.compose(_event_pld(event, times, interval))
                self._cache = total
            else:
                rdp = rdp_privacy_accountant.RdpAccountant(self._orders)
                for event, times in self._counts.items():
                    rdp.compose(_rdp_event(event), times)
                self._cache = rdp
        return self._cache

    def epsilon(self, delta: float) -> float:
        """Smallest epsilon such that everything composed is (epsilon, ``delta``)-DP (0 if nothing)."""
        check_delta(delta)
        if not self._counts:
            return 0.0
        composed = self._composed()
        if self.method == "pld":
            return pld_epsilon(composed, delta)
        return float(composed.get_epsilon(delta))

    def delta(self, epsilon: float) -> float:
        """Smallest delta such that everything composed is (``epsilon``, delta)-DP (0 if nothing)."""
        check_epsilon(epsilon)
        if not self._counts:
            return 0.0
        composed = self._composed()
        if self.method == "pld":
            return pld_delta(composed, epsilon)
        return float(composed.get_delta(epsilon))


def epsilon_of(
    events: Sequence[Release],
    delta: float,
    *,
    method: str = "pld",
    value_discretization_interval: float | None = None,
    rdp_orders: Sequence[float] | None = None,
) -> float:
    """Epsilon at ``delta`` of all ``events`` composed (a one-call :class:`Accountant`)."""
    acc = Accountant(
        method, value_discretization_interval=value_discretization_interval, rdp_orders=rdp_orders
    )
    for event in events:
        acc.compose(event)
    return acc.epsilon(delta)


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    *,
    mechanism: str,
    sampling_rate: float = 1.0,
    steps: int = 1,
    sensitivity: float = 1.0,
    method: str = "pld",
    value_discretization_interval: float | None = None,
    rdp_orders: Sequence[float] | None = None,
    rtol: float = 1e-3,
) -> float:
    """Smallest noise, to relative tolerance ``rtol``, whose ``steps`` composed releases are
    (``target_epsilon``, ``delta``)-DP: the Gaussian noise multiplier (``mechanism="gaussian"``,
    L2 sensitivity 1) or the Laplace scale ``b`` (``mechanism="laplace"``, L1 sensitivity
    ``sensitivity``). Bisection on a log scale over a bracket found by doubling/halving; the
    returned value is the bracket's upper end, so its epsilon never exceeds the target.
    """
    check_epsilon(target_epsilon, "target epsilon")
    check_delta(delta)
    check_sampling_rate(sampling_rate)
    check_count(steps, "steps")
    check_positive(sensitivity, "sensitivity")
    if mechanism not in MECHANISMS:
        raise ConfigError(f"mechanism {mechanism!r} is not one of {', '.join(MECHANISMS)}")
    if not 0 < rtol < 1:
        raise ConfigError(f"rtol {rtol!r} must be in (0, 1)")

    def make(noise: float) -> Release:
        if mechanism == "gaussian":
            return GaussianRelease(noise, sampling_rate, steps)
        return LaplaceRelease(sensitivity, noise, sampling_rate, steps)

    probe = Accountant(method)
    reason = probe.unsupported_reason(make(1.0))
    if reason is not None:
        raise UnsupportedMechanismError(reason)

    def eps(noise: float) -> float:
        return epsilon_of(
            [make(noise)],
            delta,
            method=method,
            value_discretization_interval=value_discretization_interval,
            rdp_orders=rdp_orders,
        )

    return bisect_decreasing(eps, target_epsilon, start=sensitivity, rtol=rtol, what=f"{mechanism} noise")


def bisect_decreasing(
    func: Any, target: float, *, start: float, rtol: float, what: str, max_doublings: int = 80
) -> float:
    """Smallest ``x > 0`` (to relative tolerance ``rtol``) with ``func(x) <= target``, for ``func``
    non-increasing in ``x``; returns the upper end of the final bracket (so ``func(x) <= target``).
    Raises :class:`ConfigError` naming ``what`` if no ``x`` up to ``start * 2**max_doublings`` works."""
    hi = start
    doublings = 0
    while func(hi) > target:
        hi *= 2.0
        doublings += 1
        if doublings > max_doublings:
            raise ConfigError(
                f"no {what} up to {hi:.3g} reaches epsilon {target!r}; raise the target epsilon or delta"
            )
    lo = hi / 2.0
    halvings = 0
    while func(lo) <= target:
        hi, lo = lo, lo / 2.0
        halvings += 1
        if halvings > max_doublings:
            return hi
    while hi / lo - 1 > rtol:
        mid = math.sqrt(lo * hi)
        if func(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi
