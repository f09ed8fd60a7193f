"""FDML's privacy over a whole training: per-round events for both accountings, noise calibration for a
whole-training target, and the per-run :class:`PrivacyLedger` whose report goes to ``metrics.jsonl``.

One FDML round that releases derivatives (Alg. 2, :mod:`fedveil.enclave.dp`) is, for a protected
training sample of user ``B``, a :class:`~fedveil.privacy.accounting.PureEpsilonRelease`: pure
``epsilon_round``-DP when ``B`` is selected, no release about the sample otherwise. ``B`` is
selected with probability ``q`` = :func:`fdml_participation_rate`, independently across rounds.
Two accountings are kept side by side (docs/privacy.md):

- ``paper``: ``epsilon_round`` from Thm V.1 exactly, as the paper states it, composed over rounds;
- ``strict``: ``epsilon_round`` from the strict analysis of what one participant receives in a round
  (:func:`fedveil.enclave.dp.strict_round_epsilon`), composed over rounds.

Composition uses the PLD accountant on the grid ``epsilon_round`` itself, which is exact for these
events (the privacy loss takes values in multiples of ``epsilon_round``).
"""

from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Sequence
from typing import Any

from fedveil.enclave.dp import (
    MODES,
    check_bound,
    check_drop_rate,
    check_mode,
    check_noise_scale,
    paper_noise_scale,
    paper_round_epsilon,
    strict_noise_scale,
    strict_round_epsilon,
)
from fedveil.errors import ConfigError
from fedveil.privacy.accounting import (
    Accountant,
    PureEpsilonRelease,
    bisect_decreasing,
    check_count,
    check_delta,
    check_epsilon,
    check_sampling_rate,
    pld_epsilon,
    pld_of,
)
from fedveil.privacy.names import DEFAULT_DELTA

__all__ = [
    "ACCOUNTINGS",
    "MAX_ROUNDS",
    "PrivacyLedger",
    "calibrate_fdml_noise",
    "composed_epsilon",
    "fdml_ledger",
    "fdml_participation_rate",
    "fdml_privacy_summary",
    "paper_round_event",
    "strict_round_event",
]

ACCOUNTINGS = MODES
#: The most rounds :meth:`PrivacyLedger.affordable_rounds` searches by default (one PLD of 10^6
#: rounds takes about 0.2 s; the cost grows with the number of rounds).
MAX_ROUNDS = 10**6


def fdml_participation_rate(*, num_addressed: int, group_sizes: Sequence[int]) -> float:
    """Per-round probability that a given user is selected under FDML's selection (Sec. VII-B,
    ``select_group_cohort``): a group (phone model) with probability ``1/G``, then ``num_addressed``
    (= ``num_required * k``, Alg. 3 line 2) of its ``n_g`` users uniformly without replacement, so a
    user of group ``g`` is selected with probability ``(1/G) min(1, m / n_g)``. Returns the largest
    over groups, the rate of the worst-placed user. With equal groups it is ``m / users``."""
    m = check_count(num_addressed, "num_addressed")
    sizes = list(group_sizes)
    if not sizes:
        raise ConfigError("group_sizes is empty: give the number of users in each group (phone model)")
    for n in sizes:
        check_count(n, "group size")
    return max(min(1.0, m / n) for n in sizes) / len(sizes)


def paper_round_event(
    *, bound_T: float, noise_b: float, drop_rate: float, participation_rate: float
) -> PureEpsilonRelease:
    """One round at Thm V.1's per-round epsilon ``ln[(1 - r) e^(2T/b) + r]``, reached with
    probability ``participation_rate``."""
    eps = paper_round_epsilon(bound_T, noise_b, drop_rate)
    return PureEpsilonRelease(eps, check_sampling_rate(participation_rate, "participation rate"))


def strict_round_event(
    *,
    mode: str,
    bound_T: float,
    noise_b: float,
    drop_rate: float,
    participation_rate: float,
    vectors_received: int,
    dim: int | None = None,
    protected_samples: int = 1,
) -> PureEpsilonRelease:
    """One round under the strict analysis of the mechanism actually run (``mode``: ``strict`` = L1
    clipping per vector, ``paper`` = per-coordinate clipping, which needs ``dim``): pure epsilon
    :func:`fedveil.enclave.dp.strict_round_epsilon`, reached with probability ``participation_rate``."""
    eps = strict_round_epsilon(
        mode=mode,
        bound_T=bound_T,
        noise_b=noise_b,
        drop_rate=drop_rate,
        vectors_received=vectors_received,
        dim=dim,
        protected_samples=protected_samples,
    )
    return PureEpsilonRelease(eps, check_sampling_rate(participation_rate, "participation rate"))


def composed_epsilon(event: PureEpsilonRelease, rounds: int, delta: float) -> float:
    """Epsilon at ``delta`` of ``rounds`` independent repetitions of ``event`` (PLD, exact grid)."""
    return Accountant("pld").compose(event, check_count(rounds, "rounds")).epsilon(delta)


def calibrate_fdml_noise(
    target_epsilon: float,
    delta: float,
    *,
    accounting: str,
    rounds: int,
    participation_rate: float,
    drop_rate: float,
    bound_T: float,
    mode: str = "strict",
    vectors_received: int = 8,
    dim: int | None = None,
    protected_samples: int = 1,
    rtol: float = 1e-4,
) -> float:
    """Smallest Laplace scale ``b`` (to relative tolerance ``rtol``) at which ``rounds`` FDML rounds are
    (``target_epsilon``, ``delta``)-DP under ``accounting`` (``paper``: Thm V.1's per-round epsilon
    composed; ``strict``: the strict per-round epsilon of the ``mode`` mechanism composed), by
    bisection; its composed epsilon never exceeds the target."""
    check_epsilon(target_epsilon, "target epsilon")
    check_delta(delta)
    check_count(rounds, "rounds")
    q = check_sampling_rate(participation_rate, "participation rate")
    check_bound(bound_T)
    check_drop_rate(drop_rate)
    if accounting not in ACCOUNTINGS:
        raise ConfigError(f"accounting {accounting!r} is not one of {', '.join(ACCOUNTINGS)}")
    check_mode(mode)

    def per_round(b: float) -> PureEpsilonRelease:
        if accounting == "paper":
            return paper_round_event(bound_T=bound_T, noise_b=b, drop_rate=drop_rate, participation_rate=q)
        return strict_round_event(
            mode=mode,
            bound_T=bound_T,
            noise_b=b,
            drop_rate=drop_rate,
            participation_rate=q,
            vectors_received=vectors_received,
            dim=dim,
            protected_samples=protected_samples,
        )

    if accounting == "paper":
        start = paper_noise_scale(target_epsilon, bound_T, drop_rate)
    else:
        start = strict_noise_scale(
            target_epsilon,
            mode=mode,
            bound_T=bound_T,
            drop_rate=drop_rate,
            vectors_received=vectors_received,
            dim=dim,
            protected_samples=protected_samples,
        )
    return bisect_decreasing(
        lambda b: composed_epsilon(per_round(b), rounds, delta),
        target_epsilon,
        start=start,
        rtol=rtol,
        what="Laplace scale b",
    )


class PrivacyLedger:
    """The privacy spent by one FDML run, round by round, in both accountings.

    ``paper`` and ``strict`` are the per-round events (:func:`paper_round_event`,
    :func:`strict_round_event`) that :meth:`record_round` adds unless told otherwise; ``guard``
    (``"paper"`` or ``"strict"``, normally the run's DP mode) is the accounting that
    :meth:`would_exceed` and :meth:`affordable_rounds` check; ``delta`` is the reported delta.

    Cost: each accounting keeps the PLD of the rounds recorded so far and composes one round into it
    per :meth:`record_round` (a convolution with a three-point distribution on the exact grid), so
    :meth:`report` is exact at every round for well under a millisecond per accounting. Only a
    round recorded with a non-default event makes it fall back to composing from scratch (a few
    milliseconds, cached). :meth:`would_exceed` composes the next round(s) into the same PLD, and
    :meth:`record_round` reuses that composition, so checking before every round costs about as much
    as reporting.
    """

    def __init__(
        self,
        *,
        paper: PureEpsilonRelease,
        strict: PureEpsilonRelease,
        guard: str = "strict",
        delta: float = DEFAULT_DELTA,
    ) -> None:
        for name, event in (("paper", paper), ("strict", strict)):
            _check_round_event(name, event)
        if guard not in ACCOUNTINGS:
            raise ConfigError(f"guard {guard!r} is not one of {', '.join(ACCOUNTINGS)}")
        self._default = {"paper": paper, "strict": strict}
        self._unit_pld = {name: pld_of(event) for name, event in self._default.items()}
        self.guard = guard
        self.delta = check_delta(delta)
        self._counts: dict[str, Counter[PureEpsilonRelease]] = {"paper": Counter(), "strict": Counter()}
        self._running: dict[str, Any] = {"paper": None, "strict": None}
        self._rounds = 0
        self._eps_cache: dict[tuple[Any, ...], float] = {}
        self._budget_cache: dict[tuple[float, float, int], int] = {}
        self._lookahead: dict[tuple[str, int, int], Any] = {}

    @property
    def rounds(self) -> int:
        """Rounds recorded so far."""
        return self._rounds

    def record_round(
        self, *, paper: PureEpsilonRelease | None = None, strict: PureEpsilonRelease | None = None
    ) -> None:
        """Record one round that released derivatives (by default the constructor's events)."""
        events = {"paper": paper or self._default["paper"], "strict": strict or self._default["strict"]}
        for name, event in events.items():
            _check_round_event(name, event)
        for name, event in events.items():
            self._counts[name][event] += 1
            if not self._uniform(name):
                self._running[name] = None
            else:
                self._running[name] = self._ahead(name, 1)
        self._rounds += 1
        self._lookahead.clear()

    def restore(self, rounds: int) -> None:
        """Record ``rounds`` default rounds at once (a resumed run's durable spend log), composing
        each accounting's PLD by self-composition rather than round by round."""
        if isinstance(rounds, bool) or not isinstance(rounds, numbers.Integral) or rounds < 0:
            raise ConfigError(f"rounds {rounds!r} must be an integer >= 0")
        if rounds == 0:
            return
        for name in ACCOUNTINGS:
            if self._uniform(name):
                self._running[name] = self._ahead(name, int(rounds))
            self._counts[name][self._default[name]] += int(rounds)
        self._rounds += int(rounds)
        self._lookahead.clear()

    def _ahead(self, accounting: str, extra: int) -> Any:
        """PLD of the recorded rounds plus ``extra`` default rounds (recorded rounds all default)."""
        key = (accounting, self._rounds, extra)
        if key not in self._lookahead:
            unit = self._unit_pld[accounting]
            step = unit if extra == 1 else unit.self_compose(extra)
            running = self._running[accounting]
            self._lookahead[key] = step if running is None else running.compose(step)
        return self._lookahead[key]

    def _uniform(self, accounting: str) -> bool:
        return set(self._counts[accounting]) <= {self._default[accounting]}

    def epsilon(self, accounting: str, *, rounds: int | None = None, delta: float | None = None) -> float:
        """Composed epsilon at ``delta`` (default: the ledger's) of ``accounting`` after the recorded
        rounds, or after ``rounds`` >= recorded ones, the extra ones repeating the default event."""
        if accounting not in ACCOUNTINGS:
            raise ConfigError(f"accounting {accounting!r} is not one of {', '.join(ACCOUNTINGS)}")
        d = self.delta if delta is None else check_delta(delta)
        if rounds is None:
            rounds = self._rounds
        elif isinstance(rounds, bool) or not isinstance(rounds, numbers.Integral) or rounds < self._rounds:
            raise ConfigError(f"rounds {rounds!r} must be an integer >= the {self._rounds} recorded")
        if rounds == 0:
            return 0.0
        if rounds == self._rounds and self._running[accounting] is not None:
            key: tuple[Any, ...] = (accounting, d, rounds)
            if key not in self._eps_cache:
                self._eps_cache[key] = pld_epsilon(self._running[accounting], d)
            return self._eps_cache[key]
        counts = Counter(self._counts[accounting])
        counts[self._default[accounting]] += int(rounds) - self._rounds
        key = (accounting, d, frozenset(counts.items()))
        if key not in self._eps_cache:
            acc = Accountant("pld")
            for event, times in counts.items():
                acc.compose(event, times)
            self._eps_cache[key] = acc.epsilon(d)
        return self._eps_cache[key]

    def report(self) -> dict[str, Any]:
        """The metrics.jsonl fields: ``round`` (rounds recorded), ``dp_guard``, ``delta``,
        ``participation_rate``, the per-round epsilons of the default events
        (``epsilon_round_paper``, ``epsilon_round_strict``), the paper's per-round epsilon composed by
        basic composition (``epsilon_total_paper_basic``: the plain sum, delta = 0, no sampling) and
        by PLD (``epsilon_total_paper_composed``), and the strict one by PLD
        (``epsilon_total_strict``)."""
        return {
            "round": self._rounds,
            "dp_guard": self.guard,
            "delta": self.delta,
            "participation_rate": self._default[self.guard].sampling_rate,
            "epsilon_round_paper": self._default["paper"].epsilon,
            "epsilon_round_strict": self._default["strict"].epsilon,
            "epsilon_total_paper_basic": sum(e.epsilon * n for e, n in self._counts["paper"].items()),
            "epsilon_total_paper_composed": self.epsilon("paper"),
            "epsilon_total_strict": self.epsilon("strict"),
        }

    def affordable_rounds(
        self, target_epsilon: float, delta: float | None = None, *, limit: int = MAX_ROUNDS
    ) -> int:
        """The most rounds (at most ``limit``) of the default ``guard`` event whose composed epsilon at
        ``delta`` stays within ``target_epsilon``; 0 if not even one. Use it before a run starts:
        ``affordable_rounds(target, limit=planned) < planned`` means the run cannot finish within the
        target. A search over round counts: a second or two for ``limit`` = 10^6."""
        target = check_epsilon(target_epsilon, "target epsilon")
        d = self.delta if delta is None else check_delta(delta)
        cap = check_count(limit, "limit")
        key = (target, d, cap)
        if key not in self._budget_cache:
            event = self._default[self.guard]

            def within(n: int) -> bool:
                return composed_epsilon(event, n, d) <= target

            lo, hi = 0, 1
            while hi < cap and within(hi):
                lo, hi = hi, min(2 * hi, cap)
            if hi == cap and within(hi):
                lo = cap
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if within(mid):
                    lo = mid
                else:
                    hi = mid
            self._budget_cache[key] = lo
        return self._budget_cache[key]

    def would_exceed(self, target_epsilon: float, delta: float | None = None, extra_rounds: int = 1) -> bool:
        """Whether ``extra_rounds`` more rounds (of the default events) would take the ``guard``
        accounting's composed epsilon at ``delta`` above ``target_epsilon``: call it before a round,
        and stop if True."""
        target = check_epsilon(target_epsilon, "target epsilon")
        extra = check_count(extra_rounds, "extra_rounds")
        d = self.delta if delta is None else check_delta(delta)
        if self._uniform(self.guard):
            return pld_epsilon(self._ahead(self.guard, extra), d) > target
        return self.epsilon(self.guard, rounds=self._rounds + extra, delta=d) > target


def _check_round_event(name: str, event: object) -> None:
    if not isinstance(event, PureEpsilonRelease) or event.count != 1:
        raise ConfigError(f"{name} event {event!r} must be a PureEpsilonRelease with count 1")


def fdml_ledger(
    *,
    mode: str,
    bound_T: float,
    noise_b: float,
    drop_rate: float,
    participation_rate: float,
    vectors_received: int,
    dim: int | None = None,
    protected_samples: int = 1,
    delta: float = DEFAULT_DELTA,
) -> PrivacyLedger:
    """The ledger of an FDML run in DP ``mode`` (which is also its guard): paper events from Thm V.1,
    strict events from the strict analysis of the ``mode`` mechanism."""
    check_mode(mode)
    check_noise_scale(noise_b)
    paper = paper_round_event(
        bound_T=bound_T, noise_b=noise_b, drop_rate=drop_rate, participation_rate=participation_rate
    )
    strict = strict_round_event(
        mode=mode,
        bound_T=bound_T,
        noise_b=noise_b,
        drop_rate=drop_rate,
        participation_rate=participation_rate,
        vectors_received=vectors_received,
        dim=dim,
        protected_samples=protected_samples,
    )
    return PrivacyLedger(paper=paper, strict=strict, guard=mode, delta=delta)


def fdml_privacy_summary(
    *,
    bound_T: float,
    drop_rate: float,
    rounds: int,
    participation_rate: float,
    delta: float = DEFAULT_DELTA,
    vectors_received: int = 8,
    dim: int = 64,
    protected_samples: int = 1,
    round_epsilon: float | None = None,
    noise_b: float | None = None,
    target_epsilon: float | None = None,
    target_accounting: str = "strict",
) -> dict[str, Any]:
    """What ``rounds`` FDML rounds cost, from exactly one of: the paper's per-round epsilon
    ``round_epsilon`` (``b`` from Thm V.1, as the paper does), the Laplace scale ``noise_b``, or a
    whole-training ``target_epsilon`` at ``delta`` under ``target_accounting`` (``b`` by bisection).

    Returns ``noise_b`` and, at that ``b``: Thm V.1's per-round epsilon composed by basic composition
    and by PLD; the strict per-round and composed epsilon of the ``strict`` mechanism (L1 clipping);
    and the same for the ``paper`` mechanism (per-coordinate clipping, sensitivity ``2 T d n``)."""
    given = [
        name
        for name, v in (
            ("round_epsilon", round_epsilon),
            ("noise_b", noise_b),
            ("target_epsilon", target_epsilon),
        )
        if v is not None
    ]
    if len(given) != 1:
        raise ConfigError(
            f"give exactly one of round_epsilon, noise_b, target_epsilon (got {', '.join(given) or 'none'})"
        )
    check_bound(bound_T)
    check_drop_rate(drop_rate)
    check_count(rounds, "rounds")
    q = check_sampling_rate(participation_rate, "participation rate")
    check_delta(delta)
    if target_accounting not in ACCOUNTINGS:
        raise ConfigError(f"target accounting {target_accounting!r} is not one of {', '.join(ACCOUNTINGS)}")
    shape = {"vectors_received": vectors_received, "dim": dim, "protected_samples": protected_samples}
    for name, value in shape.items():
        check_count(value, name)
    if round_epsilon is not None:
        b = paper_noise_scale(round_epsilon, bound_T, drop_rate)
        calibrated = "noise_b from the paper's per-round epsilon (Thm V.1)"
    elif noise_b is not None:
        b = check_noise_scale(noise_b)
        calibrated = "nothing (noise_b given)"
    else:
        assert target_epsilon is not None
        b = calibrate_fdml_noise(
            target_epsilon,
            delta,
            accounting=target_accounting,
            rounds=rounds,
            participation_rate=q,
            drop_rate=drop_rate,
            bound_T=bound_T,
            **shape,
        )
        calibrated = f"noise_b from the whole-training target epsilon ({target_accounting} accounting)"
    paper = paper_round_event(bound_T=bound_T, noise_b=b, drop_rate=drop_rate, participation_rate=q)
    strict = {
        mode: strict_round_event(
            mode=mode, bound_T=bound_T, noise_b=b, drop_rate=drop_rate, participation_rate=q, **shape
        )
        for mode in MODES
    }
    return {
        "calibrated": calibrated,
        "bound_T": bound_T,
        "drop_rate": drop_rate,
        "noise_b": b,
        "rounds": rounds,
        "participation_rate": q,
        "delta": delta,
        **shape,
        "epsilon_round_paper": paper.epsilon,
        "epsilon_total_paper_basic": paper.epsilon * rounds,
        "epsilon_total_paper_composed": composed_epsilon(paper, rounds, delta),
        "epsilon_round_strict": strict["strict"].epsilon,
        "epsilon_total_strict": composed_epsilon(strict["strict"], rounds, delta),
        "epsilon_round_strict_paper_clipping": strict["paper"].epsilon,
        "epsilon_total_strict_paper_clipping": composed_epsilon(strict["paper"], rounds, delta),
    }
