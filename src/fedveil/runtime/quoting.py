"""The simulated SGX platform: it launches and measures enclaves and signs their quotes.

On real hardware two trusted parties outside the application enclave do this: the CPU, which
measures an enclave's pages as they are loaded (MRENCLAVE) and MACs its REPORTs, and Intel's quoting
enclave, which turns a REPORT into a quote signed with an attestation key rooted at Intel. fedveil
has no SGX, so :class:`SimulatedPlatform` plays both parts and says so: every quote carries
``simulated: true``. It holds the Ed25519 quoting key, which neither the enclave package nor the
host code ever receives; clients pin its public key (:attr:`SimulatedPlatform.public_key`).

In this emulation the platform object lives in the host's OS process, so a host that reads its own
memory could take the key: keeping the key out of the host's reach is exactly what hardware adds
(``docs/tee.md``, threat model).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedveil.core.atomic import atomic_write
from fedveil.core.attestation_verify import QuoteBody, encode_quote
from fedveil.enclave.attestation import REPORT_KEY_BYTES, ReportError, open_report
from fedveil.enclave.channel import unpack_frame
from fedveil.enclave.measure import EnclaveConfig, measure_enclave
from fedveil.enclave.service import launch_frame
from fedveil.errors import ConfigError, ValidationError

Request = Callable[[bytes], bytes]
"""Sends one request frame to an enclave and returns its reply frame (a transport's ``request``)."""


@dataclass(frozen=True)
class Launch:
    """One launched enclave: the platform's handle for it and the measurement it took at launch."""

    launch_id: str
    measurement: bytes


class SimulatedPlatform:
    """Emulated CPU + quoting enclave with an Ed25519 quoting key (module docstring)."""

    def __init__(self, signing_key: Ed25519PrivateKey) -> None:
        self._signing_key = signing_key
        self._launches: dict[str, tuple[bytes, bytes]] = {}

    @classmethod
    def generate(cls) -> SimulatedPlatform:
        """A platform with a fresh quoting key."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, seed: bytes) -> SimulatedPlatform:
        """A platform whose quoting key is the raw 32-byte Ed25519 private key ``seed`` (a fixed
        deployment whose public key clients have pinned)."""
        if len(seed) != 32:
            raise ConfigError(f"Ed25519 private key of {len(seed)} bytes, expected 32")
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(seed)))

    @property
    def public_key(self) -> bytes:
        """The raw 32-byte Ed25519 public key clients pin."""
        return self._signing_key.public_key().public_bytes_raw()

    def launch(self, request: Request, config: EnclaveConfig) -> Launch:
        """Measure the installed enclave code with ``config`` and launch the fresh enclave behind
        ``request`` with a new report key (the CPU's EINIT)."""
        measurement = measure_enclave(config).digest
        report_key = os.urandom(REPORT_KEY_BYTES)
        header, _ = unpack_frame(request(launch_frame(config, report_key)))
        if header.get("ok") is not True:
            raise ValidationError(f"the enclave refused its launch: {header.get('message')}")
        launch_id = os.urandom(16).hex()
        self._launches[launch_id] = (measurement, report_key)
        return Launch(launch_id, measurement)

    def quote(self, launch_id: str, report: bytes) -> bytes:
        """Turn a REPORT of the enclave ``launch_id`` into a signed simulated quote.

        The REPORT's MAC must verify with that launch's report key, so only the launched enclave can
        obtain a quote, and the quote carries the measurement taken at launch, not a claimed one.
        """
        if launch_id not in self._launches:
            raise ReportError(f"no enclave with launch id {launch_id!r} was launched on this platform")
        measurement, report_key = self._launches[launch_id]
        body = QuoteBody(measurement, open_report(report_key, report), simulated=True).encode()
        return encode_quote(body, self._signing_key.sign(body))


PLATFORM_KEY = "platform.key"
PLATFORM_PUB = "platform.pub"


def platform_for(pki: str | Path) -> SimulatedPlatform:
    """The emulated quoting platform of this deployment: loaded from ``pki/platform.key``, or made
    there on first use (with ``platform.pub`` beside it for the devices)."""
    root = Path(pki)
    key = root / PLATFORM_KEY
    if key.exists():
        return SimulatedPlatform.from_private_bytes(key.read_bytes())
    seed = os.urandom(32)
    platform = SimulatedPlatform.from_private_bytes(seed)
    atomic_write(key, seed, mode=0o600)
    (root / PLATFORM_PUB).write_bytes(platform.public_key)
    return platform
