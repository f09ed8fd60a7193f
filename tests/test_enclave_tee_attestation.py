"""Attestation: the simulated platform's quotes and the client's three checks (signature, measurement,
nonce), each refused with its own error."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np
import pytest

from fedveil.core.attestation_verify import (
    EnclaveClientSession,
    MeasurementMismatchError,
    NonceMismatchError,
    QuoteBody,
    QuoteFormatError,
    QuoteSignatureError,
    ServerHello,
    SessionStateError,
    SimulatedQuoteVerifier,
    encode_quote,
    split_quote,
)
from fedveil.enclave.attestation import ClientHello, ReportError, make_report, report_data_for
from fedveil.enclave.measure import EnclaveConfig, measure_enclave
from fedveil.errors import CodecError, ValidationError
from fedveil.runtime.enclave_host import EnclaveHost
from fedveil.runtime.quoting import SimulatedPlatform

CONFIG = EnclaveConfig(memory_limit_bytes=8 * 2**20)


@pytest.fixture(scope="module")
def platform() -> SimulatedPlatform:
    return SimulatedPlatform.generate()


@pytest.fixture(scope="module")
def host(platform: SimulatedPlatform) -> EnclaveHost:
    with EnclaveHost.start(CONFIG, platform=platform, boundary="inprocess") as h:
        yield h


def _session(platform: SimulatedPlatform, client_id: str = "alice", **kwargs: bytes) -> EnclaveClientSession:
    verifier = SimulatedQuoteVerifier(kwargs.get("platform_key", platform.public_key))
    expected = kwargs.get("measurement", measure_enclave(CONFIG).digest)
    return EnclaveClientSession(client_id, verifier=verifier, expected_measurement=expected)


def test_a_genuine_quote_is_accepted_and_says_simulated(
    platform: SimulatedPlatform, host: EnclaveHost
) -> None:
    session = _session(platform)
    body = session.establish(host.open_session(session.hello()))
    assert session.established
    assert body.simulated is True
    assert body.measurement == measure_enclave(CONFIG).digest == host.measurement
    record = session.seal_embeddings(0, np.ones((2, 4), np.float32))
    assert isinstance(record, bytearray)  # sealed in place behind its header


def test_the_quote_body_is_canonical_json_signed_by_the_platform(
    platform: SimulatedPlatform, host: EnclaveHost
) -> None:
    session = _session(platform)
    client_hello = session.hello()
    hello = ServerHello.decode(host.open_session(client_hello))
    body, _ = split_quote(hello.quote)
    nonce = ClientHello.decode(client_hello).nonce
    assert json.loads(body) == {
        "format": "fedveil-simulated-quote/1",
        "measurement": measure_enclave(CONFIG).hex,
        "report_data": report_data_for(hello.enclave_public, nonce).hex(),
        "simulated": True,
    }
    assert QuoteBody.decode(body).encode() == body


def test_wrong_measurement_is_refused(platform: SimulatedPlatform, host: EnclaveHost) -> None:
    other = measure_enclave(EnclaveConfig(memory_limit_bytes=CONFIG.memory_limit_bytes, margin=0.5)).digest
    session = _session(platform, measurement=other)
    with pytest.raises(MeasurementMismatchError, match="different enclave code or configuration"):
        session.establish(host.open_session(session.hello()))
    assert not session.established
    with pytest.raises(SessionStateError, match="refuses to send"):
        session.seal_embeddings(0, np.ones((2, 4), np.float32))


def test_wrong_platform_key_is_refused(platform: SimulatedPlatform, host: EnclaveHost) -> None:
    session = _session(platform, platform_key=SimulatedPlatform.generate().public_key)
    with pytest.raises(QuoteSignatureError, match="pinned platform key"):
        session.establish(host.open_session(session.hello()))
    with pytest.raises(SessionStateError):
        session.seal_gradient(0, np.ones(3, np.float32))


def test_a_quote_from_another_platform_is_refused(platform: SimulatedPlatform) -> None:
    rogue = SimulatedPlatform.generate()
    with EnclaveHost.start(CONFIG, platform=rogue, boundary="inprocess") as rogue_host:
        session = _session(platform)
        with pytest.raises(QuoteSignatureError):
            session.establish(rogue_host.open_session(session.hello()))


def test_a_replayed_quote_fails_the_nonce_check(platform: SimulatedPlatform, host: EnclaveHost) -> None:
    first = _session(platform)
    old_reply = host.open_session(first.hello())
    first.establish(old_reply)
    second = _session(platform)
    second.hello()
    with pytest.raises(NonceMismatchError, match="stale or replayed"):
        second.establish(old_reply)
    assert not second.established


def test_a_substituted_enclave_key_fails_the_nonce_check(
    platform: SimulatedPlatform, host: EnclaveHost
) -> None:
    session = _session(platform)
    genuine = ServerHello.decode(host.open_session(session.hello()))
    swapped = ServerHello(os.urandom(32), genuine.quote).encode()
    with pytest.raises(NonceMismatchError):
        session.establish(swapped)


def test_the_enclave_refuses_a_reused_nonce(platform: SimulatedPlatform, host: EnclaveHost) -> None:
    session = _session(platform, "bob")
    hello = session.hello()
    host.open_session(hello)
    with pytest.raises(ValidationError, match="already seen: a replayed hello"):
        host.open_session(hello)


def test_tampered_quotes_are_refused(platform: SimulatedPlatform, host: EnclaveHost) -> None:
    def forge(tamper: Callable[[ServerHello], bytes]) -> tuple[EnclaveClientSession, bytes]:
        session = _session(platform)
        reply = ServerHello.decode(host.open_session(session.hello()))
        return session, tamper(reply)

    def other_measurement(reply: ServerHello) -> bytes:
        body, signature = split_quote(reply.quote)
        fake = json.loads(body)
        fake["measurement"] = "00" * 32
        forged = json.dumps(fake, sort_keys=True, separators=(",", ":")).encode()
        return ServerHello(reply.enclave_public, encode_quote(forged, signature)).encode()

    def flipped_signature(reply: ServerHello) -> bytes:
        flipped = bytearray(reply.quote)
        flipped[-1] ^= 1
        return ServerHello(reply.enclave_public, bytes(flipped)).encode()

    for tamper in (other_measurement, flipped_signature):
        session, forged = forge(tamper)
        with pytest.raises(QuoteSignatureError):
            session.establish(forged)
    for bad in (b"", b"FVS1", b"XXXX" + bytes(40), b"FVS1" + bytes(32) + b"FVQ1" + bytes(10)):
        session, _ = forge(ServerHello.encode)
        with pytest.raises(QuoteFormatError):
            session.establish(bad)


def test_a_failed_attestation_ends_the_session(platform: SimulatedPlatform, host: EnclaveHost) -> None:
    session = _session(platform)
    genuine = host.open_session(session.hello())
    with pytest.raises(NonceMismatchError):
        session.establish(ServerHello(os.urandom(32), ServerHello.decode(genuine).quote).encode())
    with pytest.raises(SessionStateError, match="already failed on this session \\(NonceMismatchError\\)"):
        session.establish(genuine)
    assert not session.established


def test_a_quote_that_does_not_claim_simulation_is_refused() -> None:
    platform = SimulatedPlatform.generate()
    key = platform._signing_key
    body = QuoteBody(bytes(32), bytes(32), simulated=False).encode()
    with pytest.raises(QuoteFormatError, match="simulated: true"):
        SimulatedQuoteVerifier(platform.public_key).verify(encode_quote(body, key.sign(body)))


def test_the_platform_quotes_only_reports_macd_by_the_launched_enclave(
    platform: SimulatedPlatform, host: EnclaveHost
) -> None:
    launch_id = host._launch.launch_id
    forged = make_report(os.urandom(32), report_data_for(os.urandom(32), os.urandom(32)))
    with pytest.raises(ReportError, match="not produced by the launched enclave"):
        platform.quote(launch_id, forged)
    with pytest.raises(ReportError, match="no enclave with launch id"):
        platform.quote("unknown", forged)
    with pytest.raises(ReportError, match="is not a 68-byte"):
        platform.quote(launch_id, b"FVP1")


def test_session_state_is_enforced(platform: SimulatedPlatform, host: EnclaveHost) -> None:
    session = _session(platform)
    with pytest.raises(SessionStateError, match="call hello"):
        session.establish(b"")
    reply = host.open_session(session.hello())
    with pytest.raises(SessionStateError, match="already called"):
        session.hello()
    session.establish(reply)
    with pytest.raises(SessionStateError, match="already established"):
        session.establish(reply)
    with pytest.raises(SessionStateError, match="already called"):
        session.hello()
    with pytest.raises(ValidationError, match=r"\(n, d\)"):
        session.seal_embeddings(0, np.ones(3, np.float32))


def test_client_hellos_are_strictly_parsed() -> None:
    hello = ClientHello("ünï", os.urandom(32), os.urandom(32))
    assert ClientHello.decode(hello.encode()) == hello
    data = hello.encode()
    for bad in (data[:-1], data + b"x", b"XXXX" + data[4:], data[:40]):
        with pytest.raises(CodecError):
            ClientHello.decode(bad)
    with pytest.raises(CodecError, match="256"):
        ClientHello("x" * 300, os.urandom(32), os.urandom(32))


def test_platform_keys_can_be_pinned_from_a_seed() -> None:
    seed = bytes(range(32))
    assert (
        SimulatedPlatform.from_private_bytes(seed).public_key
        == SimulatedPlatform.from_private_bytes(seed).public_key
    )
    with pytest.raises(ValueError, match="32"):
        SimulatedPlatform.from_private_bytes(b"short")
