"""Per-group privacy accounting for PoliFL's client-level DP-FedAvg (Sec. 2.4
and 6; McMahan et al. 2018, "Learning differentially private recurrent language models").

**Mechanism.** A DP round sums the cohort's clipped updates ``sum_i Clip(L_i - G, S)`` and adds Gaussian
noise of standard deviation ``sigma`` to the sum (centrally on the server, or as ``m`` shares of standard
deviation ``sigma / sqrt(m)`` added on the devices, PoliFL Alg. 3, whose sum has the same law), then
divides by the cohort size: PoliFL Eq. 1. **Neighbouring relation:** two populations that differ in one
user's whole data (add/remove one user), so the L2 sensitivity of the sum is ``S``; the noise multiplier
is ``z = sigma / S``. **Sampling:** each round draws ``m`` of the ``N`` users a stage trains on,
uniformly without replacement; it is accounted as Poisson sampling with rate ``q = m / N``, as McMahan
et al. do (a standard approximation, not a proof for fixed-size sampling). **Composition** over rounds
with dp-accounting (PLD by default, RDP on request; :mod:`fedveil.privacy.accounting`) at the stated
``delta``.

**Per group.** A user's epsilon counts only the rounds whose population includes the user's group: a
cascaded run (train group 1, release, fine-tune on group 2) charges group 1 for stage 1 only; the
fine-tuning is post-processing of group 1's released model. A combined run charges every group for every
round at the combined population's ``q``. :class:`GroupLedger` keeps, per group, the distinct
``(z, q)`` segments with their round counts, so the whole-training epsilon is one composition per
segment however long the training.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedveil.errors import ConfigError
from fedveil.privacy.accounting import (
    GaussianRelease,
    check_count,
    check_delta,
    check_positive,
    check_sampling_rate,
    epsilon_of,
)

__all__ = ["PLD_MIN_Z", "GroupLedger", "Segment", "noise_multiplier"]

PLD_MIN_Z = 0.3
"""Below this noise multiplier the PLD accountant's grid grows too large; RDP is used instead."""


def noise_multiplier(noise_std: float, clip_norm: float) -> float:
    """``z = sigma / S`` (module docstring): the Gaussian noise on the round's sum of clipped updates in
    units of its L2 sensitivity."""
    check_positive(noise_std, "noise standard deviation sigma")
    check_positive(clip_norm, "clip norm S")
    return noise_std / clip_norm


@dataclass(frozen=True)
class Segment:
    """``rounds`` DP rounds with noise multiplier ``z`` and sampling rate ``q``."""

    z: float
    q: float
    rounds: int

    def release(self) -> GaussianRelease:
        """The composed event of the segment."""
        return GaussianRelease(self.z, self.q, self.rounds)


class GroupLedger:
    """What each group has spent (module docstring), at ``delta`` with ``method`` (``pld`` or ``rdp``)."""

    def __init__(self, groups: Sequence[str], *, delta: float, method: str = "pld") -> None:
        if not groups or len(set(groups)) != len(groups):
            raise ConfigError(f"a ledger needs distinct group names, not {list(groups)!r}")
        self.delta = check_delta(delta)
        if method not in ("pld", "rdp"):
            raise ConfigError(f"accounting method {method!r} is not one of pld, rdp")
        self.method = method
        self._segments: dict[str, dict[tuple[float, float], int]] = {g: {} for g in groups}
        self._plain: dict[str, int] = {g: 0 for g in groups}
        self._cache: dict[tuple[str, tuple[Any, ...]], float] = {}

    @property
    def groups(self) -> list[str]:
        """The groups, in the order given."""
        return list(self._segments)

    def _group(self, group: str) -> dict[tuple[float, float], int]:
        if group not in self._segments:
            raise ConfigError(f"no group {group!r} in this ledger (groups: {', '.join(self._segments)})")
        return self._segments[group]

    def record(self, groups: Sequence[str], *, z: float | None, q: float, rounds: int = 1) -> None:
        """``rounds`` rounds on a population made of ``groups``, sampled at rate ``q``, with noise
        multiplier ``z`` (``None``: no noise, so no finite epsilon for those groups)."""
        check_sampling_rate(q)
        check_count(rounds, "rounds")
        for g in groups:
            seg = self._group(g)
            if z is None:
                self._plain[g] += rounds
                continue
            check_positive(z, "noise multiplier z")
            seg[(z, q)] = seg.get((z, q), 0) + rounds

    def segments(self, group: str) -> list[Segment]:
        """The group's segments."""
        return [Segment(z, q, n) for (z, q), n in self._group(group).items()]

    def rounds(self, group: str) -> int:
        """Rounds the group took part in (noised or not)."""
        return sum(self._group(group).values()) + self._plain[group]

    def epsilon(self, group: str, *, extra: Segment | None = None) -> float:
        """The group's whole-training epsilon at :attr:`delta` (``inf`` after a round without noise,
        ``0`` before any round); ``extra`` adds rounds not yet run (for a look-ahead)."""
        if self._plain[group]:
            return math.inf
        segs = self.segments(group) + ([extra] if extra is not None else [])
        if not segs:
            return 0.0
        key = (group, tuple(sorted((s.z, s.q, s.rounds) for s in segs)))
        if key not in self._cache:
            method = self.method_for(segs)
            self._cache[key] = float(epsilon_of([s.release() for s in segs], self.delta, method=method))
        return self._cache[key]

    def method_for(self, segs: Sequence[Segment]) -> str:
        """The accountant used for ``segs``: :attr:`method`, except that PLD falls back to RDP (a valid,
        looser upper bound) below :data:`PLD_MIN_Z`, where the PLD's grid would need gigabytes."""
        if self.method == "pld" and any(s.z < PLD_MIN_Z for s in segs):
            return "rdp"
        return self.method

    def affordable_rounds(self, group: str, *, z: float, q: float, budget: float, limit: int) -> int:
        """The most further rounds (at most ``limit``) at ``(z, q)`` that keep the group's epsilon within
        ``budget``: where PoliFL's low-privacy runs "had to be stopped ... to keep the epsilon guarantee
        valid" (Sec. 6.2-6.3). Bisection on the round count (epsilon grows with rounds)."""
        check_count(limit, "limit")
        if self.epsilon(group) > budget:
            return 0
        if self.epsilon(group, extra=Segment(z, q, limit)) <= budget:
            return limit
        lo, hi = 0, limit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.epsilon(group, extra=Segment(z, q, mid)) <= budget:
                lo = mid
            else:
                hi = mid
        return lo

    def report(self) -> dict[str, dict[str, Any]]:
        """Per group: rounds, epsilon at delta, and the segments."""
        return {
            g: {
                "rounds": self.rounds(g),
                "epsilon": self.epsilon(g),
                "delta": self.delta,
                "method": self.method_for(self.segments(g)),
                "segments": [{"z": s.z, "q": s.q, "rounds": s.rounds} for s in self.segments(g)],
            }
            for g in self._segments
        }

    def state(self) -> dict[str, Any]:
        """JSON-safe state for a resumed run."""
        return {
            "segments": {g: [[z, q, n] for (z, q), n in seg.items()] for g, seg in self._segments.items()},
            "plain": dict(self._plain),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state` saved."""
        for g, segs in state["segments"].items():
            self._group(g).update({(float(z), float(q)): int(n) for z, q, n in segs})
        for g, n in state["plain"].items():
            self._group(g)
            self._plain[g] = int(n)
        self._cache.clear()
