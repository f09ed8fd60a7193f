"""What travels on a device agent's stream: envelope messages around the protocols' codec bytes.

One gRPC call per agent, ``/fedveil.Device/Connect``, bidirectional and dialled by the agent (a device
behind NAT can always dial out). Every gRPC message on it is one envelope encoded by
:mod:`fedveil.core.codec`; a protocol message travels inside an envelope as its own codec bytes
(``payload``), so the server decodes it with the same strict checks as in simulation. gRPC carries raw
bytes (no protobuf code generation): the serialisers are identity functions. No pickle anywhere.

Agent -> server: :class:`AgentHello` first, then :class:`AgentReply` and :class:`Heartbeat` frames.
Server -> agent: :class:`Welcome` (or :class:`Goodbye` with the refusal) first, then
:class:`ServerRequest` frames, and :class:`Goodbye` when training ends.

Enrolment is a separate unary call, ``/fedveil.Enrol/Enrol`` (:class:`EnrolRequest` ->
:class:`EnrolReply`), served on a port that asks for no client certificate.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedveil.core.messages import message

PROTOCOL_VERSION = 1
CONNECT_METHOD = "/fedveil.Device/Connect"
ENROL_METHOD = "/fedveil.Enrol/Enrol"
ENVELOPE_OVERHEAD = 4096
"""Bytes an envelope may add around a payload (header JSON and alignment), for size limits."""


@message("net.hello")
@dataclass(frozen=True)
class AgentHello:
    """An agent's first frame: the device id it claims (must equal its certificate's CN under mutual
    TLS) and the wire version it speaks."""

    device: str
    version: int


@message("net.welcome")
@dataclass(frozen=True)
class Welcome:
    """The server accepted the device: send heartbeats every ``heartbeat_seconds``; payloads above
    ``max_message_bytes`` are refused."""

    device: str
    heartbeat_seconds: float
    max_message_bytes: int


@message("net.goodbye")
@dataclass(frozen=True)
class Goodbye:
    """The server closes the stream: a refusal (``final`` false: the reason says what is wrong) or the
    end of training (``final`` true: the agent may exit)."""

    reason: str
    final: bool


@message("net.request")
@dataclass(frozen=True)
class ServerRequest:
    """One protocol message for the device: ``payload`` is its codec bytes; ``deadline_seconds`` the
    time the server waits; ``sent_at`` the server's wall clock (``time.time()``) when it was queued.
    A message sent to many devices (a broadcast) is one envelope with one ``request_id``: the server
    matches a reply by the stream it came on *and* the id, so a device can answer only what it was sent."""

    request_id: int
    phase: str
    deadline_seconds: float
    sent_at: float
    payload: bytes


@message("net.reply")
@dataclass(frozen=True)
class AgentReply:
    """The device's answer to ``request_id``: the reply's codec bytes, or ``error`` (the handler's
    refusal, e.g. a failed attestation) with an empty payload. ``received_at`` / ``sent_at`` are the
    agent's wall clock when the request arrived and when this reply left (TTE = their difference)."""

    request_id: int
    received_at: float
    sent_at: float
    payload: bytes
    error: str = ""


@message("net.heartbeat")
@dataclass(frozen=True)
class Heartbeat:
    """The agent is alive (its wall clock when sent)."""

    sent_at: float


@message("net.enrol_request")
@dataclass(frozen=True)
class EnrolRequest:
    """A device without a certificate asks for one: its one-time enrolment token and a PKCS#10
    certificate signing request (PEM) for the key it generated and keeps."""

    token: str
    csr: bytes


@message("net.enrol_reply")
@dataclass(frozen=True)
class EnrolReply:
    """The certificate issued for the token's device name, and the CA certificate to pin (PEM)."""

    device: str
    certificate: bytes
    ca_certificate: bytes
