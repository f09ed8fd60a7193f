"""The ``Communicator`` interface between protocol round logic and a runtime.

A protocol (``fedveil.protocols.*``) talks to its clients only through this interface, so the same
round code runs in the in-process simulation, over a network, or on a cluster (docs/architecture.md). A
reply that does not come, comes late, or fails validation is a *dropout*:
it is left out of the returned mapping and recorded with its reason, never raised.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

ClientId = str
Message = Any
"""A message is any frozen dataclass registered with :func:`fedveil.core.messages.message`."""

Validator = Callable[[ClientId, Message], None]
"""Protocol-level check of one decoded reply; raises :class:`fedveil.errors.ValidationError`."""

Fold = Callable[[ClientId, Message], Message]
"""What a request keeps of one accepted reply: called once per valid reply, right after ``validate``,
with the reply; its return value takes the reply's place in the request's result (e.g. the reply without
its weights, once the weights went into a running sum). A :class:`fedveil.errors.ValidationError` it
raises makes the reply a dropout; it must then have changed nothing (check before accumulating)."""


@dataclass(frozen=True)
class Deferred:
    """A reply whose last step a simulated client pool leaves until the runtime takes the reply up:
    ``build()`` returns the reply (a message, ``bytes`` or the exception the client raised). The
    simulation runtime takes replies up one by one, each right before it is metered and validated, so
    a server that acts on each valid reply as it comes (FDML's step 9 stream) works while later clients
    are still finishing theirs, as on a real network, where every device seals its own upload."""

    build: Callable[[], object]


@dataclass(frozen=True)
class Dropout:
    """One reply that did not count: who, in which phase, and why (``failed``, ``late``, or the
    validation error's message)."""

    client: ClientId
    phase: str
    reason: str


@dataclass(frozen=True)
class DeviceTiming:
    """One device's share of one request (PoliFL Sec. 5's metering): bytes each way, and where time is
    real, TTD (server send -> device receipt), TTE (time on the device), TTR (device send -> server
    receipt) and TTP (server processing of the reply), in seconds; ``None`` where a runtime has no such
    clock."""

    client: ClientId
    phase: str
    bytes_down: int
    bytes_up: int
    ttd: float | None = None
    tte: float | None = None
    ttr: float | None = None
    ttp: float | None = None


@dataclass
class CommStats:
    """Counters a runtime keeps; protocols difference them to report a round.

    ``bytes_down`` counts server -> client bytes, ``bytes_up`` client -> server bytes, each message
    counted once per recipient/sender exactly as its encoded length; ``bytes_down_coded`` counts the
    server -> client bytes encoded, each distinct message once (a broadcast is encoded once for all its
    recipients). ``sim_seconds`` is the
    runtime's clock (virtual in simulation, wall time on a network). ``timings`` holds one
    :class:`DeviceTiming` per reply received by a runtime with real clocks; the caller drains it
    (``copy()`` leaves it out, so snapshots stay cheap over long runs).
    """

    bytes_down: int = 0
    bytes_up: int = 0
    messages_down: int = 0
    messages_up: int = 0
    sim_seconds: float = 0.0
    dropouts: list[Dropout] = field(default_factory=list)
    timings: list[DeviceTiming] = field(default_factory=list)
    bytes_down_coded: int = 0

    def copy(self) -> CommStats:
        """A snapshot that later traffic does not change (without ``timings``)."""
        return dataclasses.replace(self, dropouts=list(self.dropouts), timings=[])


class Communicator(Protocol):
    """What a protocol may do with its clients."""

    def available(self) -> Sequence[ClientId]:
        """The clients registered and reachable now (FDML Fig. 2, step 1)."""
        ...

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
        """Send ``msgs[c]`` to each client ``c`` and gather replies.

        Returns as soon as ``min_replies`` valid replies have arrived (the earliest ones), or when
        ``timeout`` seconds have passed, with whatever valid replies arrived by then. Replies of the
        wrong type, that fail decoding or ``validate``, or that arrive after the return are dropouts.
        With ``fold``, each valid reply is handed to it as the runtime accepts it, and the result holds
        what ``fold`` returned instead of the reply, so the runtime holds no reply once it is folded
        (the order of the calls is the runtime's: arrival order on a network, the addressed
        order in the simulation). Only replies that count reach ``fold``: never an invalid one, nor one
        the result then leaves out.
        """
        ...

    def stats(self) -> CommStats:
        """The runtime's counters so far."""
        ...
