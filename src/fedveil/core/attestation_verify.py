"""The client's side of enclave attestation and its end of the secure channel.

A client trusts the enclave only after three checks on its quote, in this order, each with its own
error (FDML Sec. V-A: "the participants will attest the integrity of the TEE at the beginning"):

1. the quote's signature verifies against the platform public key the client has pinned
   (:class:`QuoteSignatureError`);
2. the measurement in the quote equals the one the client is configured to expect
   (:class:`MeasurementMismatchError`);
3. the report data equals ``SHA-256(enclave public key | the client's own fresh nonce)``, so the quote
   is fresh and vouches for the very key the session is keyed with (:class:`NonceMismatchError`).

Until all three pass, :class:`EnclaveClientSession` refuses to seal anything.

Simulated quote (integers big-endian)::

    b"FVQ1" | u32 len(body) | body | Ed25519 signature (64) over body
    body = canonical JSON {"format": "fedveil-simulated-quote/1", "measurement": HEX,
                           "report_data": HEX, "simulated": true}

A DCAP quote from real SGX hardware replaces this with Intel's quote format and certificate chain:
another :class:`QuoteVerifier` that returns the same :class:`QuoteBody` (MRENCLAVE as the
measurement, the first 32 bytes of REPORTDATA as the report data, ``simulated=False``); checks 2 and
3 stay as they are (``docs/tee.md``).

Server hello (what the host returns for a client hello)::

    b"FVS1" | enclave X25519 public key (32) | quote
"""

from __future__ import annotations

import hmac
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedveil.enclave.attestation import ClientHello, report_data_for
from fedveil.enclave.channel import (
    DERIVATIVES,
    EMBEDDINGS,
    GRADIENT,
    MODEL,
    NONCE_BYTES,
    PUBLIC_KEY_BYTES,
    UPDATE,
    SecureChannel,
    WritableBuffer,
    check_client_id,
    client_channel,
    decode_array,
    public_bytes,
)
from fedveil.errors import FedveilError, ValidationError

QUOTE_MAGIC = b"FVQ1"
QUOTE_FORMAT = "fedveil-simulated-quote/1"
SERVER_HELLO_MAGIC = b"FVS1"
SIGNATURE_BYTES = 64
MEASUREMENT_BYTES = 32
_U32 = struct.Struct(">I")
_BODY_KEYS = ["format", "measurement", "report_data", "simulated"]


class AttestationError(FedveilError):
    """The enclave could not be attested; the client sends it nothing."""


class QuoteFormatError(AttestationError):
    """The quote or server hello is not well formed."""


class QuoteSignatureError(AttestationError):
    """The quote is not signed by the pinned platform key."""


class MeasurementMismatchError(AttestationError):
    """The quote vouches for different enclave code or configuration than the client expects."""


class NonceMismatchError(AttestationError):
    """The quote does not bind this session's fresh nonce and the offered enclave key."""


class SessionStateError(FedveilError):
    """A session used out of order: sealing before attestation, or a second handshake."""


@dataclass(frozen=True)
class QuoteBody:
    """What a verified quote says: the enclave ``measurement`` (32 bytes), its ``report_data``
    (32 bytes) and whether the platform is ``simulated``."""

    measurement: bytes
    report_data: bytes
    simulated: bool

    def encode(self) -> bytes:
        """The canonical JSON body (module docstring) that the platform signs."""
        fields = {
            "format": QUOTE_FORMAT,
            "measurement": self.measurement.hex(),
            "report_data": self.report_data.hex(),
            "simulated": self.simulated,
        }
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("ascii")

    @classmethod
    def decode(cls, body: bytes) -> QuoteBody:
        """Parse a body; :class:`QuoteFormatError` names what is wrong."""
        try:
            fields = json.loads(body.decode("ascii"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise QuoteFormatError(f"quote body is not ASCII JSON: {exc}") from exc
        if not isinstance(fields, dict) or sorted(fields) != _BODY_KEYS:
            raise QuoteFormatError(f"quote body must have exactly the keys {_BODY_KEYS}")
        if fields["format"] != QUOTE_FORMAT:
            raise QuoteFormatError(f"quote format {fields['format']!r}, expected {QUOTE_FORMAT!r}")
        if type(fields["simulated"]) is not bool:
            raise QuoteFormatError(f"quote field simulated is {fields['simulated']!r}, expected a bool")
        values = {}
        for key in ("measurement", "report_data"):
            try:
                values[key] = bytes.fromhex(fields[key]) if isinstance(fields[key], str) else b""
            except ValueError:
                values[key] = b""
            if len(values[key]) != 32:
                raise QuoteFormatError(f"quote field {key} must be 64 hex characters")
        return cls(values["measurement"], values["report_data"], fields["simulated"])


def encode_quote(body: bytes, signature: bytes) -> bytes:
    """Assemble a simulated quote from a body and its Ed25519 signature."""
    return QUOTE_MAGIC + _U32.pack(len(body)) + body + signature


def split_quote(quote: bytes) -> tuple[bytes, bytes]:
    """The (body, signature) of a simulated quote; :class:`QuoteFormatError` if malformed."""
    raw = bytes(quote)
    if len(raw) < 8 + SIGNATURE_BYTES or raw[:4] != QUOTE_MAGIC:
        raise QuoteFormatError(f"quote of {len(raw)} bytes does not start with {QUOTE_MAGIC!r}")
    (n,) = _U32.unpack_from(raw, 4)
    if len(raw) != 8 + n + SIGNATURE_BYTES:
        raise QuoteFormatError(f"quote of {len(raw)} bytes, its body length says {8 + n + SIGNATURE_BYTES}")
    return raw[8 : 8 + n], raw[8 + n :]


class QuoteVerifier(Protocol):
    """Checks a quote's origin (signature, certificate chain) and returns what it says."""

    def verify(self, quote: bytes) -> QuoteBody:
        """The quote's contents if its signature verifies; else raise :class:`AttestationError`."""
        ...


class SimulatedQuoteVerifier:
    """Verifies simulated quotes against a pinned Ed25519 platform public key (raw 32 bytes)."""

    def __init__(self, platform_public_key: bytes) -> None:
        if len(platform_public_key) != 32:
            raise AttestationError(f"platform public key of {len(platform_public_key)} bytes, expected 32")
        self.platform_public_key = bytes(platform_public_key)
        self._key = Ed25519PublicKey.from_public_bytes(self.platform_public_key)

    def verify(self, quote: bytes) -> QuoteBody:
        """Check 1 (module docstring), then parse the signed body, which must say ``simulated``."""
        body, signature = split_quote(quote)
        try:
            self._key.verify(signature, body)
        except InvalidSignature as exc:
            raise QuoteSignatureError(
                "quote signature does not verify against the pinned platform key "
                f"{self.platform_public_key.hex()[:16]}...: not issued by the trusted platform"
            ) from exc
        parsed = QuoteBody.decode(body)
        if not parsed.simulated:
            raise QuoteFormatError("a simulated platform's quote must say simulated: true")
        return parsed


def verify_attestation(
    quote: bytes,
    *,
    verifier: QuoteVerifier,
    expected_measurement: bytes,
    enclave_public: bytes,
    nonce: bytes,
) -> QuoteBody:
    """The three checks of the module docstring, in order; returns the verified body."""
    body = verifier.verify(quote)
    if not hmac.compare_digest(body.measurement, bytes(expected_measurement)):
        raise MeasurementMismatchError(
            f"enclave measurement {body.measurement.hex()} is not the expected "
            f"{bytes(expected_measurement).hex()}: different enclave code or configuration"
        )
    if not hmac.compare_digest(body.report_data, report_data_for(enclave_public, nonce)):
        raise NonceMismatchError(
            "quote report data is not SHA-256(enclave key | this session's nonce): a stale or replayed "
            "quote, or an enclave key the quote does not vouch for"
        )
    return body


@dataclass(frozen=True)
class ServerHello:
    """The host's answer to a client hello: the enclave's session public key and its quote."""

    enclave_public: bytes
    quote: bytes

    def encode(self) -> bytes:
        """``b"FVS1" | enclave public key | quote``."""
        return SERVER_HELLO_MAGIC + self.enclave_public + self.quote

    @classmethod
    def decode(cls, data: bytes) -> ServerHello:
        """Parse a server hello; :class:`QuoteFormatError` if malformed."""
        raw = bytes(data)
        if len(raw) <= 4 + PUBLIC_KEY_BYTES or raw[:4] != SERVER_HELLO_MAGIC:
            raise QuoteFormatError(
                f"server hello of {len(raw)} bytes does not start with {SERVER_HELLO_MAGIC!r}"
            )
        return cls(raw[4 : 4 + PUBLIC_KEY_BYTES], raw[4 + PUBLIC_KEY_BYTES :])


class EnclaveClientSession:
    """A client's attested, encrypted session with the enclave (one per handshake).

    ``hello()`` makes a fresh X25519 key and 32-byte nonce (from the OS CSPRNG: key material never
    comes from a seeded generator) and returns the client hello; ``establish(server_hello)`` runs the
    three checks and derives the channel. Then ``seal_embeddings`` / ``seal_gradient`` encrypt to the
    enclave and ``open_derivatives`` decrypts what the enclave sealed to this client. A session is
    used for one handshake: a failed attestation ends it, and to re-attest, make a new one.
    """

    def __init__(self, client_id: str, *, verifier: QuoteVerifier, expected_measurement: bytes) -> None:
        self.client_id = check_client_id(client_id)
        self.verifier = verifier
        if len(expected_measurement) != MEASUREMENT_BYTES:
            raise AttestationError(
                f"expected measurement of {len(expected_measurement)} bytes, need {MEASUREMENT_BYTES}"
            )
        self.expected_measurement = bytes(expected_measurement)
        self.quote: QuoteBody | None = None
        self._key: X25519PrivateKey | None = None
        self._nonce = b""
        self._failed = ""
        self._channel: SecureChannel | None = None

    @property
    def established(self) -> bool:
        """Whether attestation passed and the channel is keyed."""
        return self._channel is not None

    @property
    def used(self) -> bool:
        """Whether :meth:`hello` was called (a session serves one handshake)."""
        return bool(self._nonce)

    def renewed(self) -> EnclaveClientSession:
        """A new session with the same pinned verifier and measurement, for the next handshake (a
        re-registration attests a restarted enclave afresh)."""
        return EnclaveClientSession(
            self.client_id, verifier=self.verifier, expected_measurement=self.expected_measurement
        )

    def hello(self) -> bytes:
        """The client hello (fresh key and nonce); only one per session."""
        if self._nonce:
            raise SessionStateError(f"client {self.client_id!r}: hello() was already called on this session")
        self._key = X25519PrivateKey.generate()
        self._nonce = os.urandom(NONCE_BYTES)
        return ClientHello(self.client_id, public_bytes(self._key), self._nonce).encode()

    def establish(self, server_hello: bytes) -> QuoteBody:
        """Verify the enclave's quote (signature, measurement, nonce) and key the channel."""
        if self._channel is not None:
            raise SessionStateError(f"client {self.client_id!r}: the session is already established")
        if self._failed:
            raise SessionStateError(
                f"client {self.client_id!r}: attestation already failed on this session ({self._failed}); "
                "start a new session"
            )
        if self._key is None:
            raise SessionStateError(f"client {self.client_id!r}: call hello() before establish()")
        try:
            hello = ServerHello.decode(server_hello)
            body = verify_attestation(
                hello.quote,
                verifier=self.verifier,
                expected_measurement=self.expected_measurement,
                enclave_public=hello.enclave_public,
                nonce=self._nonce,
            )
        except AttestationError as exc:
            self._key = None
            self._failed = type(exc).__name__
            raise
        self._channel = client_channel(
            self._key, hello.enclave_public, client_id=self.client_id, nonce=self._nonce
        )
        self._key = None
        self.quote = body
        return body

    def _ready(self) -> SecureChannel:
        if self._channel is None:
            raise SessionStateError(
                f"client {self.client_id!r} refuses to send: the enclave is not attested on this session"
            )
        return self._channel

    def seal_embeddings(self, rnd: int, embeddings: np.ndarray, *, attempt: int = 0) -> bytearray:
        """Encrypt this round's float32 ``(n, d)`` embeddings to the enclave (FDML Fig. 2 step 4)."""
        array = np.asarray(embeddings, dtype=np.float32)
        if array.ndim != 2:
            raise ValidationError(f"embeddings must be (n, d), got shape {array.shape}")
        return self._ready().seal_array(EMBEDDINGS, rnd, attempt, array)

    def seal_gradient(
        self,
        rnd: int,
        gradient: np.ndarray | Sequence[np.ndarray],
        *,
        attempt: int = 0,
        out: WritableBuffer | None = None,
    ) -> bytearray | WritableBuffer:
        """Encrypt this round's flat float32 local gradient ``(P,)`` to the enclave (step 8). A list or
        tuple of 1-D float32 arrays is the gradient in consecutive pieces, sealed without joining them
        (the same record as their concatenation). With ``out`` (a writable buffer of the record's exact
        length, :func:`~fedveil.enclave.channel.sealed_vector_bytes`) the record is written there."""
        if isinstance(gradient, (list, tuple)):
            return self._ready().seal_pieces(GRADIENT, rnd, attempt, gradient, out=out)
        array = np.asarray(gradient, dtype=np.float32)
        if array.ndim != 1:
            raise ValidationError(f"gradient must be flat (P,), got shape {array.shape}")
        if out is not None:
            return self._ready().seal_pieces(GRADIENT, rnd, attempt, [array], out=out)
        return self._ready().seal_array(GRADIENT, rnd, attempt, array)

    def open_derivatives(self, rnd: int, record: bytes, *, attempt: int = 0) -> np.ndarray:
        """Decrypt the float32 ``(n, d)`` derivatives the enclave sealed to this client (step 6); a
        read-only array."""
        return decode_array(
            self._ready().open(record, kind=DERIVATIVES, rnd=rnd, attempt=attempt), dtype="<f4", ndim=2
        )

    def open_model(self, rnd: int, record: bytes) -> np.ndarray:
        """Decrypt the flat float32 parameters the enclave sealed to this client TEE for round ``rnd``
        (PPFL Alg. 2's input ``theta_l``; the layer index is bound by the round, :mod:`fedveil.enclave.
        layerwise`); a read-only array."""
        return decode_array(self._ready().open(record, kind=MODEL, rnd=rnd, attempt=0), dtype="<f4", ndim=1)

    def seal_update(self, rnd: int, values: np.ndarray) -> bytearray:
        """Encrypt this client TEE's flat float32 trained parameters (PPFL Alg. 2's output) to the
        enclave."""
        array = np.asarray(values, dtype=np.float32)
        if array.ndim != 1:
            raise ValidationError(f"update must be flat (P,), got shape {array.shape}")
        return self._ready().seal_array(UPDATE, rnd, 0, array)
