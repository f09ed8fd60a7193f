"""Pieces shared by the round protocols: reports, selection, validation and client-side helpers."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from fedveil.core.communicator import ClientId, CommStats
from fedveil.errors import ConfigError, ValidationError


class ClientData(Protocol):
    """What a simulated device population offers its clients (e.g. ``TouchAuthPopulation``)."""

    def train_user_ids(self, phone_model: str | None = None) -> list[str]: ...

    def sample_training(self, user_id: str, n: int, rng: np.random.Generator) -> np.ndarray: ...


@dataclass
class RoundReport:
    """What happened in one round: one line of ``metrics.jsonl``.

    ``applied`` is False when the round ended without a model update (Strategy-AS abandoned it, too
    few gradients arrived, or every attempt failed to gather embeddings). Byte counts and seconds
    are this round's (all attempts), ``sim_seconds`` on the runtime's clock.
    """

    round: int
    applied: bool
    loss: float | None
    attempts: int
    participants: int
    gradients: int
    dropouts: dict[str, int] = field(default_factory=dict)
    bytes_up: int = 0
    bytes_down: int = 0
    sim_seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """A flat JSON-ready dict."""
        out: dict[str, object] = {
            "round": self.round,
            "applied": self.applied,
            "loss": self.loss,
            "attempts": self.attempts,
            "participants": self.participants,
            "gradients": self.gradients,
            "dropouts": sum(self.dropouts.values()),
            "dropouts_by_phase": dict(self.dropouts),
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "sim_seconds": self.sim_seconds,
        }
        out.update(self.extra)
        return out


def fill_traffic(report: RoundReport, before: CommStats, after: CommStats) -> RoundReport:
    """Set the report's byte, dropout and clock fields from two runtime snapshots."""
    report.bytes_up = after.bytes_up - before.bytes_up
    report.bytes_down = after.bytes_down - before.bytes_down
    report.sim_seconds = after.sim_seconds - before.sim_seconds
    for d in after.dropouts[len(before.dropouts) :]:
        report.dropouts[d.phase] = report.dropouts.get(d.phase, 0) + 1
    return report


def select_group_cohort(
    groups: Mapping[str, Sequence[ClientId]], size: int, rng: np.random.Generator
) -> tuple[str, list[ClientId]]:
    """FDML Sec. VII-B selection: draw a group (phone model) with equal probability, then ``size``
    of its clients uniformly without replacement (all of them when the group is smaller)."""
    names = sorted(groups)
    if not names:
        raise ConfigError("no registered clients to select from")
    name = names[int(rng.integers(len(names)))]
    members = list(groups[name])
    take = min(size, len(members))
    picked = rng.choice(len(members), size=take, replace=False)
    return name, [members[i] for i in sorted(picked)]


def connected_members(members: Sequence[ClientId], available: Iterable[ClientId]) -> list[ClientId]:
    """The ``members`` that are ``available`` (connected now: ``Communicator.available()``), in member
    order. A simulation's clients are always available, so there selection is what it was over
    ``members``."""
    now = set(available)
    return [c for c in members if c in now]


def connected_groups(
    groups: Mapping[str, Sequence[ClientId]], available: Iterable[ClientId]
) -> dict[str, list[ClientId]]:
    """The members of ``groups`` that are ``available`` (:func:`connected_members` of each group); groups
    with none left are dropped."""
    now = set(available)
    kept = {name: connected_members(members, now) for name, members in groups.items()}
    return {name: members for name, members in kept.items() if members}


def expect(condition: bool, what: str) -> None:
    """Raise :class:`ValidationError` with ``what`` unless ``condition`` holds."""
    if not condition:
        raise ValidationError(what)


def client_rng(seed: int, index: int) -> np.random.Generator:
    """The private random stream of client number ``index`` in a seeded simulation."""
    return np.random.default_rng([seed, index])


def pool_rng_states(pool: Any, ids: Iterable[str] | None = None) -> dict[str, Any]:
    """The generator states of a client pool's clients (``ids``, default all): what a checkpoint or a
    runtime that moves clients between processes must carry. A pool either reports them
    (``rng_states()``, e.g. one sharded over Ray actors) or keeps one generator per client in ``rngs``;
    a pool with neither has none to carry."""
    if hasattr(pool, "rng_states"):
        states = pool.rng_states()
    else:
        states = {c: g.bit_generator.state for c, g in (getattr(pool, "rngs", None) or {}).items()}
    return states if ids is None else {c: states[c] for c in ids if c in states}


def restore_pool_rngs(pool: Any, states: Mapping[str, Any]) -> None:
    """Set a pool's clients' generators to ``states`` (from :func:`pool_rng_states`)."""
    if hasattr(pool, "set_rng_states"):
        pool.set_rng_states(states)
        return
    for cid, state in states.items():
        pool.rngs[cid].bit_generator.state = state


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """A writable float32 tensor copy of a (possibly read-only, decoded) array."""
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
