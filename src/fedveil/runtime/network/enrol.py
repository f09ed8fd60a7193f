"""Device enrolment: a one-time token and a fresh key pair exchanged for a device certificate.

The device makes its key locally (it never leaves the device), sends the token and a CSR to the
server's enrolment port over TLS (server-authenticated: the device pins the CA certificate it was
given with the token), and receives a certificate whose CN is the device name the token was made
for (``fedveil certs token NAME``). The server stores only a salted hash of the token and accepts it
once.
"""

from __future__ import annotations

import grpc
import grpc.aio
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fedveil.core import codec
from fedveil.errors import ConfigError
from fedveil.runtime.network import certs, wire


def token_device(token: str) -> str:
    """The device name a token was made for (``NAME.SECRET``)."""
    name, sep, secret = token.rpartition(".")
    if not sep or not name or not secret:
        raise ConfigError(
            "an enrolment token looks like NAME.SECRET (as `fedveil certs token NAME` prints it)"
        )
    return certs.check_device_name(name)


async def enrol(
    server: str, token: str, ca_pem: bytes, *, server_name: str | None = None, timeout: float = 15.0
) -> certs.DeviceCredentials:
    """Enrol at ``server`` (the enrolment port) and return the device's credentials."""
    name = token_device(token)
    key_pem, csr_pem = certs.make_csr(name)
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    creds = grpc.ssl_channel_credentials(root_certificates=ca_pem)
    async with grpc.aio.secure_channel(server, creds, options=options) as channel:
        call = channel.unary_unary(wire.ENROL_METHOD)
        try:
            raw = await call(codec.encode(wire.EnrolRequest(token, csr_pem)), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise ConfigError(f"enrolment at {server} failed: {exc.details()}") from None
    reply = codec.decode(raw, max_bytes=64 * 1024, expected=wire.EnrolReply)
    cert = x509.load_pem_x509_certificate(reply.certificate)
    ours = serialization.load_pem_private_key(key_pem, password=None).public_key()
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(*spki) != ours.public_bytes(*spki) or reply.device != name:
        raise ConfigError(
            f"the server at {server} returned a certificate that is not for this key and device"
        )
    return certs.DeviceCredentials(name, reply.certificate, key_pem, ca_pem)
