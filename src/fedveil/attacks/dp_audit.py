"""Canary audits of fedveil's DP mechanisms: an empirical epsilon lower bound beside the accountant's.

Each audit runs the *real* mechanism once on ``m`` canaries whose inclusion is a fair coin
(:func:`fedveil.privacy.audit.draw_inclusion`), scores every canary on what the release shows, guesses
the top ``k_plus`` IN and the bottom ``k_minus`` OUT, and turns the number of correct guesses into the
one-run lower bound of Steinke, Nasr and Jagielski (NeurIPS 2023; :mod:`fedveil.privacy.audit`). The
canaries are white-box on the release, as in that paper's gradient-canary setting: each canary owns one
direction (a "Dirac" canary: one coordinate of the model), and its score is the release's projection on
that direction.

- ``gaussian``: client-level DP-FedAvg on the FedAvg engine's hooks ([PoliFL] Alg. 3): every canary is a
  client of the round whose update is ``canary_scale * S`` along its own coordinate when IN and zero when
  OUT (neighbouring relation: one client's update replaced by the zero update, L2 sensitivity ``S`` of the
  sum, the same dominating pair as add/remove); the update goes through
  :class:`~fedveil.protocols.fedavg.ClipAndNoise` (clip to ``S``, Gaussian share ``sigma / sqrt(m)`` per
  client, ``sigma = z S`` on the sum) and the engine's :func:`~fedveil.protocols.fedavg.fedavg_aggregate`.
  The observer sees the released model (the aggregate), as the accountant's claim is about it. Claimed:
  the Gaussian mechanism with noise multiplier ``z``, ``rounds`` times (:mod:`fedveil.privacy.accounting`).
- ``polifl``: [PoliFL]'s central noise, :class:`~fedveil.protocols.polifl.DPAggregate` (the server clips
  every update to ``S`` and adds ``N(0, sigma^2)`` to the sum), with the same canary clients; claimed:
  the group's epsilon of :class:`~fedveil.privacy.groups.GroupLedger` (every canary in every round).
- ``fdml``: [FDML] Alg. 2, :func:`~fedveil.enclave.dp.private_derivatives` (drop, clip, Laplace noise) on
  one derivative row per canary: the canary sample's derivative is ``+canary_scale T u`` when IN and its
  replacement's ``-canary_scale T u`` when OUT (neighbouring relation of Alg. 2: one sample replaced),
  ``u`` the first axis (``strict``, L1 clipping) or the all-ones vector (``paper``, per-coordinate
  clipping). Claimed: the strict per-round epsilon of the mode run for a block of one vector
  (:func:`~fedveil.enclave.dp.strict_round_epsilon`), composed over ``rounds`` (PLD); the report adds Thm
  V.1's ``paper_epsilon``, which per-coordinate clipping in ``d > 1`` dimensions does not meet.

**Deliberately broken runs** (``broken``) pass a wrong calibration to the same code path, through
:class:`Miscalibration` and nothing else: ``noise`` divides the noise scale handed to the mechanism by
:data:`NOISE_BREAK_FACTOR`; ``clip`` hands it :data:`UNCLIPPED_BOUND` as the clip bound, so clipping
never binds. The claimed epsilon stays the honest one; the audit's lower bound then exceeds it, which
shows the audit can see such bugs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from fedveil.enclave.dp import (
    check_mode,
    paper_round_epsilon,
    private_derivatives,
    strict_round_epsilon,
)
from fedveil.errors import ConfigError
from fedveil.privacy.accounting import GaussianRelease, PureEpsilonRelease, check_positive, epsilon_of
from fedveil.privacy.audit import (
    METHOD,
    draw_inclusion,
    guess_outcome,
    max_auditable_epsilon,
    one_run_epsilon_lower_bound,
)
from fedveil.privacy.groups import GroupLedger
from fedveil.privacy.names import AUDITED, BROKEN
from fedveil.protocols.fedavg import ClipAndNoise, FitResult, fedavg_aggregate
from fedveil.protocols.polifl import DPAggregate

__all__ = [
    "AUDITED",
    "BROKEN",
    "NOISE_BREAK_FACTOR",
    "UNCLIPPED_BOUND",
    "AuditReport",
    "Miscalibration",
    "audit_mechanism",
]

NOISE_BREAK_FACTOR = 10.0
"""``broken="noise"`` hands the mechanism a noise scale this many times too small."""

UNCLIPPED_BOUND = 1e300
"""``broken="clip"`` hands the mechanism this clip bound: finite, so it passes validation, and larger
than any update, so clipping never binds."""


@dataclass(frozen=True)
class Miscalibration:
    """The seam of a deliberately broken audit run, and its only one: what the audit hands the real
    mechanism instead of the honest calibration (``noise_factor`` multiplies the noise scale,
    ``clip_bound`` replaces the clip bound). Used for the audit's calibration only."""

    noise_factor: float = 1.0
    clip_bound: float | None = None

    @classmethod
    def of(cls, broken: str | None) -> Miscalibration:
        """The miscalibration named ``broken`` (``None``: the honest mechanism)."""
        if broken is None:
            return cls()
        if broken == "noise":
            return cls(noise_factor=1.0 / NOISE_BREAK_FACTOR)
        if broken == "clip":
            return cls(clip_bound=UNCLIPPED_BOUND)
        raise ConfigError(f"broken {broken!r} is not one of {', '.join(BROKEN)} (or none for the honest run)")

    def clip(self, honest: float) -> float:
        """The clip bound handed to the mechanism."""
        return honest if self.clip_bound is None else self.clip_bound


@dataclass(frozen=True)
class AuditReport:
    """One audit: the accountant's ``accountant_epsilon`` (an upper bound, at ``delta``) beside the
    ``empirical_epsilon_lower`` bound that holds with probability ``confidence`` for the implementation
    run (``broken``: the deliberately broken one), from ``correct_guesses`` of ``guesses`` on
    ``canaries`` canaries; ``max_auditable_epsilon`` is what all guesses correct would show."""

    mechanism: str
    broken: str | None
    accountant_epsilon: float
    delta: float
    empirical_epsilon_lower: float
    confidence: float
    canaries: int
    guesses: int
    correct_guesses: int
    max_auditable_epsilon: float
    rounds: int
    seed: int
    method: str
    settings: dict[str, Any]

    @property
    def exceeds_claim(self) -> bool:
        """True when the lower bound is above the accountant's epsilon: the implementation (or its
        accounting) is not as private as claimed, at the stated confidence."""
        return self.empirical_epsilon_lower > self.accountant_epsilon

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe fields, with ``exceeds_claim``."""
        return {**asdict(self), "exceeds_claim": self.exceeds_claim}


def _canary_clients(included: np.ndarray, scale: float) -> np.ndarray:
    """``(m, m)`` float32 updates: canary ``i``'s is ``scale`` along coordinate ``i`` when IN, else zero."""
    return np.diag(np.where(included, scale, 0.0)).astype(np.float32)


def _gaussian_scores(
    included: np.ndarray,
    rng: np.random.Generator,
    *,
    z: float,
    clip_norm: float,
    scale: float,
    rounds: int,
    miscal: Miscalibration,
) -> np.ndarray:
    m = included.size
    transform = ClipAndNoise(miscal.clip(clip_norm), z * clip_norm / math.sqrt(m) * miscal.noise_factor, 1)
    updates = _canary_clients(included, scale * clip_norm)
    client_rngs = rng.spawn(m)  # one private stream per client, as in a seeded simulation
    current = np.zeros(m, dtype=np.float32)
    scores = np.zeros(m)
    for rnd in range(1, rounds + 1):
        results = {
            f"c{i:06d}": FitResult(
                current + transform(torch.from_numpy(updates[i]), client_rngs[i]).numpy(), 1
            )
            for i in range(m)
        }
        new = fedavg_aggregate(rnd, results, current)
        scores += (new.astype(np.float64) - current) * m  # the released sum, projected on each canary's axis
        current = new
    return scores


def _polifl_scores(
    included: np.ndarray,
    rng: np.random.Generator,
    *,
    z: float,
    clip_norm: float,
    scale: float,
    rounds: int,
    miscal: Miscalibration,
) -> np.ndarray:
    m = included.size
    aggregate = DPAggregate(
        clip_norm=miscal.clip(clip_norm), noise_std=z * clip_norm * miscal.noise_factor, rng=rng
    )
    updates = _canary_clients(included, scale * clip_norm)
    current = np.zeros(m, dtype=np.float32)
    scores = np.zeros(m)
    for rnd in range(1, rounds + 1):
        results = {f"c{i:06d}": FitResult(current + updates[i], 1) for i in range(m)}
        new = aggregate(rnd, results, current)
        scores += (new.astype(np.float64) - current) * m
        current = new
    return scores


def _fdml_direction(mode: str, dim: int) -> np.ndarray:
    if mode == "strict":
        return np.eye(dim)[0]
    return np.ones(dim)


def _fdml_scores(
    included: np.ndarray,
    rng: np.random.Generator,
    *,
    mode: str,
    bound_T: float,
    noise_b: float,
    drop_rate: float,
    dim: int,
    scale: float,
    rounds: int,
    miscal: Miscalibration,
) -> np.ndarray:
    u = _fdml_direction(mode, dim)
    signs = np.where(included, 1.0, -1.0)
    embeddings = signs[:, None] * (scale * bound_T) * u[None, :]
    labels = np.zeros(included.size, dtype=np.int64)
    scores = np.zeros(included.size)
    for _ in range(rounds):
        released, _ = private_derivatives(
            embeddings,
            labels,
            lambda emb, lab: emb,  # the canary sample's derivative, crafted white-box
            drop_rate=drop_rate,
            mode=mode,
            bound_T=miscal.clip(bound_T),
            noise_b=noise_b * miscal.noise_factor,
            rng=rng,
        )
        scores += released @ u
    return scores


def audit_mechanism(
    mechanism: str,
    *,
    canaries: int = 1000,
    k_plus: int = 50,
    k_minus: int = 50,
    confidence: float = 0.95,
    delta: float = 1e-5,
    rounds: int = 1,
    noise_multiplier: float = 2.0,
    clip_norm: float = 1.0,
    fdml_mode: str = "strict",
    bound_T: float = 1.0,
    noise_b: float = 1.0,
    drop_rate: float = 0.0,
    dim: int = 8,
    canary_scale: float = 10.0,
    broken: str | None = None,
    seed: int = 0,
) -> AuditReport:
    """Audit ``mechanism`` (one of :data:`AUDITED`, module docstring) on ``canaries`` canaries over
    ``rounds`` releases, guessing ``k_plus`` IN and ``k_minus`` OUT; ``broken`` (one of :data:`BROKEN`)
    audits the deliberately miscalibrated mechanism. ``noise_multiplier`` ``z`` and ``clip_norm`` ``S``
    set ``gaussian`` and ``polifl``; ``fdml_mode``, ``bound_T``, ``noise_b``, ``drop_rate`` and ``dim``
    set ``fdml``. Canary updates are ``canary_scale`` times the clip bound. ``seed`` fixes the coins and
    the noise."""
    if mechanism not in AUDITED:
        raise ConfigError(f"mechanism {mechanism!r} is not one of {', '.join(AUDITED)}")
    miscal = Miscalibration.of(broken)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ConfigError(f"rounds {rounds!r} must be an integer >= 1")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed {seed!r} must be an integer >= 0")
    check_positive(canary_scale, "canary_scale")
    if canary_scale <= 1:
        raise ConfigError(f"canary_scale {canary_scale!r} must exceed 1, so that honest clipping binds")
    coins, noise = np.random.SeedSequence(seed).spawn(2)
    included = draw_inclusion(canaries, np.random.default_rng(coins))
    rng = np.random.default_rng(noise)
    settings: dict[str, Any]
    if mechanism in ("gaussian", "polifl"):
        z = check_positive(noise_multiplier, "noise multiplier z")
        S = check_positive(clip_norm, "clip norm S")
        settings = {"noise_multiplier": z, "clip_norm": S, "canary_scale": canary_scale}
        if mechanism == "gaussian":
            claimed = epsilon_of([GaussianRelease(z, 1.0, rounds)], delta)
            scores = _gaussian_scores(
                included, rng, z=z, clip_norm=S, scale=canary_scale, rounds=rounds, miscal=miscal
            )
        else:
            ledger = GroupLedger(["canaries"], delta=delta)
            ledger.record(["canaries"], z=z, q=1.0, rounds=rounds)
            claimed = ledger.epsilon("canaries")
            scores = _polifl_scores(
                included, rng, z=z, clip_norm=S, scale=canary_scale, rounds=rounds, miscal=miscal
            )
    else:
        mode = check_mode(fdml_mode)
        round_eps = strict_round_epsilon(
            mode=mode, bound_T=bound_T, noise_b=noise_b, drop_rate=drop_rate, vectors_received=1, dim=dim
        )
        claimed = epsilon_of([PureEpsilonRelease(round_eps, 1.0, rounds)], delta)
        paper = epsilon_of(
            [PureEpsilonRelease(paper_round_epsilon(bound_T, noise_b, drop_rate), 1.0, rounds)], delta
        )
        settings = {
            "mode": mode,
            "bound_T": bound_T,
            "noise_b": noise_b,
            "drop_rate": drop_rate,
            "dim": dim,
            "canary_scale": canary_scale,
            "paper_epsilon": paper,
        }
        scores = _fdml_scores(
            included,
            rng,
            mode=mode,
            bound_T=bound_T,
            noise_b=noise_b,
            drop_rate=drop_rate,
            dim=dim,
            scale=canary_scale,
            rounds=rounds,
            miscal=miscal,
        )
    outcome = guess_outcome(scores, included, k_plus=k_plus, k_minus=k_minus)
    lower = one_run_epsilon_lower_bound(
        canaries=canaries,
        guesses=outcome.guesses,
        correct=outcome.correct,
        delta=delta,
        confidence=confidence,
    )
    ceiling = max_auditable_epsilon(
        canaries=canaries, guesses=outcome.guesses, delta=delta, confidence=confidence
    )
    return AuditReport(
        mechanism=mechanism,
        broken=broken,
        accountant_epsilon=float(claimed),
        delta=float(delta),
        empirical_epsilon_lower=lower,
        confidence=float(confidence),
        canaries=int(canaries),
        guesses=outcome.guesses,
        correct_guesses=outcome.correct,
        max_auditable_epsilon=ceiling,
        rounds=rounds,
        seed=seed,
        method=METHOD,
        settings=settings,
    )
