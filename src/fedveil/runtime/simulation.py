"""In-process simulation runtime: a virtual clock, seeded faults, every message through the codec.

Clients are Python objects in this process. A round that waits for replies does not sleep: each
selected client's reply latency is *sampled* and its failure is *drawn* (FDML Sec. VI-A: Case A, a
client fails to upload its embeddings; Case B, it fails to upload its gradients), so a 15,000-round
experiment costs only its compute, and the runtime reports simulated seconds beside real ones.

Every message crosses :mod:`fedveil.core.codec` in both directions and its encoded length is
metered. A broadcast (the same message object sent to many clients) is encoded and decoded once
and metered once per recipient: messages are immutable and decode to read-only arrays, so sharing
the decoded copy is indistinguishable from decoding it per client.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from fedveil.core import codec
from fedveil.core.communicator import ClientId, CommStats, Deferred, Dropout, Fold, Message, Validator
from fedveil.errors import CodecError, ConfigError, ValidationError

log = logging.getLogger(__name__)

__all__ = ["LATENCY_KINDS", "ClientPool", "LatencyModel", "PhaseFaults", "SimulationRuntime"]

LATENCY_KINDS = ("constant", "exponential", "lognormal", "uniform")


@dataclass(frozen=True)
class LatencyModel:
    """Distribution of one reply's round-trip latency in seconds.

    ``constant``: always ``mean``. ``exponential``: mean ``mean``. ``lognormal``: median ``mean``
    and log-space standard deviation ``spread``. ``uniform``: on ``[mean - spread, mean + spread]``.
    """

    kind: str = "lognormal"
    mean: float = 0.5
    spread: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in LATENCY_KINDS:
            raise ConfigError(f"latency kind {self.kind!r} is not one of {', '.join(LATENCY_KINDS)}")
        if not (math.isfinite(self.mean) and self.mean >= 0):
            raise ConfigError(f"latency mean {self.mean!r} must be a finite number >= 0 seconds")
        if not (math.isfinite(self.spread) and self.spread >= 0):
            raise ConfigError(f"latency spread {self.spread!r} must be a finite number >= 0")
        if self.kind == "uniform" and self.spread > self.mean:
            raise ConfigError(
                f"uniform latency spread {self.spread} exceeds mean {self.mean}: latencies would be negative"
            )

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` latencies in seconds (a constant latency draws nothing from ``rng``)."""
        if self.kind == "constant":
            return np.full(size, self.mean)
        if self.kind == "exponential":
            return rng.exponential(self.mean, size) if self.mean > 0 else np.zeros(size)
        if self.kind == "uniform":
            return rng.uniform(self.mean - self.spread, self.mean + self.spread, size)
        if self.mean == 0:
            return np.zeros(size)
        return np.exp(rng.normal(math.log(self.mean), self.spread, size))


@dataclass(frozen=True)
class PhaseFaults:
    """Faults of one phase: each addressed client independently fails to reply with ``fail_prob``
    (it never answers), and a reply that does come arrives after a latency drawn from ``latency``.
    A phase without failures and with a constant latency draws nothing from the runtime's generator,
    so adding such a phase (e.g. attestation) leaves every other phase's draws unchanged."""

    fail_prob: float = 0.0
    latency: LatencyModel = field(default_factory=LatencyModel)

    def __post_init__(self) -> None:
        if not (0.0 <= self.fail_prob <= 1.0):
            raise ConfigError(f"fail_prob {self.fail_prob!r} must be a probability in [0, 1]")


class ClientPool(Protocol):
    """The client side of a simulation: many clients' message handlers.

    ``handle_batch`` receives the decoded messages for several clients of one phase and returns,
    per client, its reply (a message, or raw ``bytes`` for a client that speaks the wire directly),
    the exception it raised, or a :class:`Deferred` reply. A pool may compute the clients' work
    together (one forward pass for the cohort), behind a test that shows the result equals the
    client-by-client path.
    """

    def client_ids(self) -> Sequence[ClientId]: ...

    def handle_batch(
        self, msgs: Mapping[ClientId, Message]
    ) -> dict[ClientId, Message | bytes | Exception | Deferred]: ...


class SimulationRuntime:
    """A :class:`~fedveil.core.communicator.Communicator` over in-process clients.

    ``faults`` maps a phase name (e.g. ``"embed"``, ``"grad"``) to its :class:`PhaseFaults`; phases
    not listed have no failures and the ``default`` latency. ``max_message_bytes`` bounds every
    reply: a larger one is a dropout before it is parsed.
    """

    def __init__(
        self,
        pool: ClientPool,
        *,
        rng: np.random.Generator,
        faults: Mapping[str, PhaseFaults] | None = None,
        default: PhaseFaults | None = None,
        max_message_bytes: int = 64 * 2**20,
        tap: Callable[[str, bytes], None] | None = None,
    ) -> None:
        if max_message_bytes <= 0:
            raise ConfigError(f"max_message_bytes {max_message_bytes!r} must be positive")
        self.pool = pool
        self.rng = rng
        self.faults = dict(faults or {})
        self.default = default or PhaseFaults(latency=LatencyModel("constant", 0.0, 0.0))
        self.max_message_bytes = max_message_bytes
        self.tap = tap
        self._stats = CommStats()
        self._clients = tuple(pool.client_ids())

    def available(self) -> Sequence[ClientId]:
        """Every client of the pool: simulated clients stay registered."""
        return self._clients

    def stats(self) -> CommStats:
        """Counters so far (the live object; call ``.copy()`` for a snapshot)."""
        return self._stats

    def _deliver_down(self, msgs: Mapping[ClientId, Message]) -> dict[ClientId, Message]:
        """Encode, meter and decode every outgoing message; broadcasts are coded once."""
        decoded: dict[ClientId, Message] = {}
        cache: dict[int, tuple[int, Message]] = {}
        for cid, msg in msgs.items():
            key = id(msg)
            if key not in cache:
                data = codec.encode(msg)
                if self.tap is not None:
                    self.tap("to_client", data)
                cache[key] = (len(data), codec.decode(data, expected=type(msg)))
                self._stats.bytes_down_coded += len(data)
            size, copy = cache[key]
            self._stats.bytes_down += size
            self._stats.messages_down += 1
            decoded[cid] = copy
        return decoded

    def _receive_up(
        self,
        cid: ClientId,
        reply: Message | bytes | Exception | Deferred,
        expected: type | tuple[type, ...],
        validate: Validator | None,
    ) -> Message:
        """Meter, decode and validate one reply; raises ``CodecError``/``ValidationError``."""
        if isinstance(reply, Deferred):
            reply = reply.build()
        if isinstance(reply, Exception):
            raise ValidationError(f"client raised {type(reply).__name__}: {reply}")
        data = reply if isinstance(reply, (bytes, bytearray, memoryview)) else codec.encode(reply)
        if self.tap is not None:
            self.tap("from_client", bytes(data))
        self._stats.bytes_up += len(data)
        self._stats.messages_up += 1
        if len(data) > self.max_message_bytes:
            raise ValidationError(
                f"reply of {len(data)} bytes exceeds the limit of {self.max_message_bytes} bytes"
            )
        msg = codec.decode(data, max_bytes=self.max_message_bytes, expected=expected)
        if validate is not None:
            validate(cid, msg)
        return msg

    def _drop(self, cid: ClientId, phase: str, reason: str) -> None:
        self._stats.dropouts.append(Dropout(cid, phase, reason))
        log.info("dropout: client %s in phase %s: %s", cid, phase, reason)

    async def request(
        self,
        msgs: Mapping[ClientId, Message],
        *,
        phase: str,
        min_replies: int,
        timeout: float,
        expected: type | tuple[type, ...],
        validate: Validator | None = None,
        fold: Fold | None = None,
    ) -> dict[ClientId, Message]:
        """Deliver ``msgs`` and gather the earliest ``min_replies`` valid replies within ``timeout``.

        Clients whose reply would arrive after the return are not asked to compute it (their work
        would be thrown away); clients whose reply fails validation make room for the next arrival.
        The virtual clock advances to the arrival of the last reply used, or by ``timeout``. Replies are
        validated in arrival order; ``fold`` takes each batch of arrivals (one batch when every addressed
        client is needed) in the order the clients were addressed, so what it sums does not depend on the
        sampled latencies.
        """
        if min_replies < 0:
            raise ConfigError(f"min_replies {min_replies} must be >= 0")
        targets = list(msgs)
        known = set(self._clients)
        unknown = [c for c in targets if c not in known]
        if unknown:
            raise ConfigError(f"request to unknown clients {unknown[:5]}")
        faults = self.faults.get(phase, self.default)
        down = self._deliver_down(msgs)
        n = len(targets)
        failed = self.rng.random(n) < faults.fail_prob if faults.fail_prob > 0 else np.zeros(n, dtype=bool)
        latency = faults.latency.sample(self.rng, n)
        order = np.argsort(latency, kind="stable")
        queue: list[int] = []
        for i in order:
            cid = targets[i]
            if failed[i]:
                self._drop(cid, phase, "failed: no reply")
            elif latency[i] > timeout:
                self._drop(cid, phase, f"late: reply after {latency[i]:.3f} s > timeout {timeout} s")
            else:
                queue.append(int(i))
        replies: dict[ClientId, Message] = {}
        last_arrival = 0.0
        pos = 0
        while pos < len(queue) and len(replies) < min_replies:
            take = queue[pos : pos + (min_replies - len(replies))]
            pos += len(take)
            batch = {targets[i]: down[targets[i]] for i in take}
            results = self.pool.handle_batch(batch)
            arrived: dict[int, float] = {}
            for i in take:
                cid = targets[i]
                try:
                    replies[cid] = self._receive_up(cid, results[cid], expected, validate)
                    arrived[i] = float(latency[i])
                except (CodecError, ValidationError) as exc:
                    self._drop(cid, phase, f"invalid reply: {exc}")
            del results
            for i in sorted(arrived):
                cid = targets[i]
                if fold is not None:
                    try:
                        replies[cid] = fold(cid, replies[cid])
                    except ValidationError as exc:
                        del replies[cid]
                        self._drop(cid, phase, f"invalid reply: {exc}")
                        continue
                last_arrival = max(last_arrival, arrived[i])
        for i in queue[pos:]:
            self._drop(targets[i], phase, "late: round moved on without this reply")
        reached = len(replies) >= min_replies
        self._stats.sim_seconds += last_arrival if reached else timeout
        return replies
