"""The enclave's untrusted host as the protocols see it: what the FDML and PPFL servers call.

A protocol reaches its clients through a :class:`~fedveil.core.communicator.Communicator` and its
enclave through the host it is given, without knowing which runtime made either.
:class:`fedveil.runtime.enclave_host.EnclaveHost` (the enclave in its own process, or in-process for
tests) is the host every runner passes; these typing protocols name the part of it each server uses, so
that the protocols layer never imports the runtime layer above it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from fedveil.enclave.aggregate import DEFAULT_MAX_UPLOAD_NORM
from fedveil.enclave.layerwise import ParamSpec

__all__ = ["AggregateRelease", "AggregateStream", "LayerAggregate", "LayerwiseEnclave"]

Buffer = bytes | bytearray | memoryview


class AggregateRelease(Protocol):
    """FDML step 9's outcome as the host sees it: the released Eq. 2 ``gradient`` (``None`` if no
    gradient was accepted), the clients ``accepted`` and ``rejected`` (with the reason)."""

    @property
    def gradient(self) -> np.ndarray | None: ...

    @property
    def accepted(self) -> list[str]: ...

    @property
    def rejected(self) -> dict[str, str]: ...


class AggregateStream(Protocol):
    """FDML step 9 fed one sealed gradient record at a time as the replies arrive (``clients`` lists
    the records added, in order); :meth:`finish` releases the aggregate, :meth:`abort` releases
    nothing."""

    clients: list[str]

    def add(self, cid: str, record: Buffer, num_samples: int) -> None:
        """Feed client ``cid``'s sealed gradient ``record`` (of ``num_samples`` samples)."""
        ...

    def finish(self) -> AggregateRelease:
        """Send the last request and release the aggregate of every record added."""
        ...

    def abort(self) -> None:
        """Gather the outstanding replies and release nothing."""
        ...


class LayerAggregate(Protocol):
    """A PPFL round's averaging inside the enclave: the clients whose updates were ``accepted``, those
    ``rejected`` (with the reason), and the clients' mean training ``loss`` (``None`` if none was
    accepted)."""

    @property
    def accepted(self) -> list[str]: ...

    @property
    def rejected(self) -> dict[str, str]: ...

    @property
    def loss(self) -> float | None: ...


class LayerwiseEnclave(Protocol):
    """What PPFL's server (:class:`~fedveil.protocols.ppfl.PpflServer`) asks of its enclave's host:
    attested sessions with the devices, and each stage's layers begun, broadcast sealed, averaged,
    released, sealed for a checkpoint and unsealed from one, all inside the enclave."""

    def open_session(self, client_hello: bytes) -> bytes:
        """Relay a device's hello; return the server hello (session key + quote) for it to verify."""
        ...

    def layer_begin(
        self, stage: int, specs: Sequence[ParamSpec], seed: int, initial: np.ndarray | None = None
    ) -> int:
        """Start training ``stage``'s layers (from ``seed``, or the public ``initial`` values); returns
        their number of values."""
        ...

    def layer_broadcast(
        self, rnd: int, stage: int, clients: Sequence[str], *, kept: bool = False
    ) -> dict[str, bytes]:
        """The stage's layers sealed to each of ``clients`` for round ``rnd``."""
        ...

    def layer_aggregate(
        self,
        rnd: int,
        stage: int,
        sealed: Mapping[str, bytes],
        num_samples: Mapping[str, int],
        *,
        weighted: bool = False,
        max_norm: float = DEFAULT_MAX_UPLOAD_NORM,
    ) -> LayerAggregate:
        """Average the clients' ``sealed`` updates into the stage's layers inside the enclave."""
        ...

    def layer_release(self, stage: int, *, keep: int = 0) -> np.ndarray:
        """The stage's trained values, released to the REE (all but the last ``keep``)."""
        ...

    def layer_seal(self, stage: int, rnd: int, secret: bytes) -> bytes:
        """The stage's state after round ``rnd``, sealed under the host's ``secret``."""
        ...

    def layer_unseal(self, stage: int, rnd: int, secret: bytes, sealed: bytes) -> int:
        """Restore the stage's state after round ``rnd`` from ``sealed``; returns its number of values."""
        ...
