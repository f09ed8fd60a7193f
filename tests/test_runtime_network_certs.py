"""The networked runtime's PKI: CA, server and device certificates, tokens, revocation, mTLS handshakes."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import ssl
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedveil.errors import ConfigError, FedveilError
from fedveil.runtime.network import certs
from fedveil.runtime.network.certs import EnrolmentError


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    root = tmp_path / "pki"
    certs.init_pki(root)
    return root


def _cert(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ------------------------------------------------------------------------------------- init


def test_init_makes_the_files_with_private_keys_0600(tmp_path: Path) -> None:
    paths = certs.init_pki(tmp_path / "pki")
    assert paths == certs.PkiPaths.of(tmp_path / "pki")
    for f in (paths.ca_cert, paths.ca_key, paths.server_cert, paths.server_key, paths.revoked, paths.tokens):
        assert f.is_file(), f
    if os.name == "posix":
        assert _mode(paths.ca_key) == 0o600
        assert _mode(paths.server_key) == 0o600
        assert _mode(paths.tokens) == 0o600
    assert json.loads(paths.revoked.read_text()) == {"serials": [], "names": []}
    assert json.loads(paths.tokens.read_text()) == {}
    assert certs.issued_devices(paths.root) == []
    assert not list(paths.root.glob("*.tmp")), "atomic writes leave no temporary files"
    key = serialization.load_pem_private_key(paths.ca_key.read_bytes(), password=None)
    assert key.key_size == 256  # P-256, unencrypted PKCS8
    assert b"BEGIN PRIVATE KEY" in paths.ca_key.read_bytes()


def test_paths_of_does_no_io(tmp_path: Path) -> None:
    paths = certs.PkiPaths.of(tmp_path / "nowhere")
    assert paths.ca_key == tmp_path / "nowhere" / "ca.key"
    assert paths.tokens.name == "tokens.json"
    assert not (tmp_path / "nowhere").exists()


def test_init_refuses_an_existing_pki_without_force(pki: Path) -> None:
    before = (pki / "ca.crt").read_bytes()
    with pytest.raises(ConfigError, match="force"):
        certs.init_pki(pki)
    assert (pki / "ca.crt").read_bytes() == before
    certs.init_pki(pki, force=True)
    assert (pki / "ca.crt").read_bytes() != before


def test_init_rejects_bad_hosts_and_days(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="bad host"):
        certs.init_pki(tmp_path / "a", ["bad host"])
    with pytest.raises(ConfigError, match="no server hosts"):
        certs.init_pki(tmp_path / "b", [])
    with pytest.raises(ConfigError, match="days=0"):
        certs.init_pki(tmp_path / "c", days=0)
    assert not (tmp_path / "a").exists()


def test_ca_is_a_constrained_self_signed_ca(pki: Path) -> None:
    ca = _cert((pki / "ca.crt").read_bytes())
    assert ca.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "fedveil CA"
    ca.verify_directly_issued_by(ca)
    bc = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    ku = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.key_cert_sign and ku.crl_sign and not ku.digital_signature


def test_server_cert_verifies_against_the_ca_with_the_hosts_as_sans(pki: Path) -> None:
    ca = _cert((pki / "ca.crt").read_bytes())
    server = _cert((pki / "server.crt").read_bytes())
    server.verify_directly_issued_by(ca)
    assert server.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "fedveil server"
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    assert ipaddress.ip_address("::1") in san.get_values_for_type(x509.IPAddress)
    assert list(server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH
    ]


def test_server_cert_for_custom_hosts(tmp_path: Path) -> None:
    certs.init_pki(tmp_path, ["fl.example.org", "10.0.0.5", "[fd00::7]", "fl.example.org"])
    san = _cert((tmp_path / "server.crt").read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert san.value.get_values_for_type(x509.DNSName) == ["fl.example.org"]
    assert san.value.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.0.0.5"),
        ipaddress.ip_address("fd00::7"),
    ]


def test_certificates_pass_cryptographys_webpki_verifier(pki: Path) -> None:
    verification = pytest.importorskip("cryptography.x509.verification")
    ca = _cert((pki / "ca.crt").read_bytes())
    store = verification.Store([ca])
    server = _cert((pki / "server.crt").read_bytes())
    builder = verification.PolicyBuilder().store(store)
    builder.build_server_verifier(x509.DNSName("localhost")).verify(server, [])
    builder.build_server_verifier(x509.IPAddress(ipaddress.ip_address("127.0.0.1"))).verify(server, [])
    with pytest.raises(verification.VerificationError):
        builder.build_server_verifier(x509.DNSName("elsewhere.example")).verify(server, [])
    if hasattr(builder, "build_client_verifier"):
        device = _cert(certs.issue_device(pki, "dev1").cert_pem)
        builder.build_client_verifier().verify(device, [])


def test_server_credentials(pki: Path, tmp_path: Path) -> None:
    key, cert, ca = certs.server_credentials(pki)
    assert b"PRIVATE KEY" in key
    assert cert == (pki / "server.crt").read_bytes()
    assert ca == (pki / "ca.crt").read_bytes()
    with pytest.raises(ConfigError, match=r"server private key .*server\.key is missing.*fedveil certs init"):
        certs.server_credentials(tmp_path / "empty")


# ----------------------------------------------------------------------------------- devices


def test_device_cert_has_the_name_client_auth_and_the_cas_signature(pki: Path) -> None:
    creds = certs.issue_device(pki, "phone-7")
    assert creds.name == "phone-7"
    assert creds.ca_pem == (pki / "ca.crt").read_bytes()
    cert = _cert(creds.cert_pem)
    cert.verify_directly_issued_by(_cert(creds.ca_pem))
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "phone-7"
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH
    ]
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["phone-7"]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    key = serialization.load_pem_private_key(creds.key_pem, password=None)
    assert key.public_key() == cert.public_key()
    assert certs.certificate_identity(creds.cert_pem) == ("phone-7", format(cert.serial_number, "x"))
    other = _cert(certs.issue_device(pki, "phone-7").cert_pem)
    assert other.serial_number != cert.serial_number
    log = certs.issued_devices(pki)
    assert [(d["name"], d["serial"], d["revoked"]) for d in log] == [
        ("phone-7", format(cert.serial_number, "x"), None),
        ("phone-7", format(other.serial_number, "x"), None),
    ]
    assert log[0]["not_after"].startswith(str(cert.not_valid_after_utc.year))


def test_issue_device_needs_a_pki(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fedveil certs init"):
        certs.issue_device(tmp_path, "dev1")


def test_device_credentials_round_trip(pki: Path, tmp_path: Path) -> None:
    creds = certs.issue_device(pki, "dev1")
    out = tmp_path / "creds" / "dev1"
    creds.write(out)
    assert sorted(p.name for p in out.iterdir()) == ["ca.crt", "device.crt", "device.key"]
    if os.name == "posix":
        assert _mode(out / "device.key") == 0o600
    assert certs.DeviceCredentials.read(out) == creds


def test_device_credentials_read_names_the_missing_file(pki: Path, tmp_path: Path) -> None:
    out = tmp_path / "dev1"
    certs.issue_device(pki, "dev1").write(out)
    (out / "device.key").unlink()
    with pytest.raises(ConfigError, match=r"device\.key is missing"):
        certs.DeviceCredentials.read(out)
    with pytest.raises(ConfigError, match=r"device\.crt is missing"):
        certs.DeviceCredentials.read(tmp_path / "nothing")


def test_device_credentials_read_refuses_a_key_of_another_cert(pki: Path, tmp_path: Path) -> None:
    a, b = certs.issue_device(pki, "a"), certs.issue_device(pki, "b")
    certs.DeviceCredentials("a", a.cert_pem, b.key_pem, a.ca_pem).write(tmp_path)
    with pytest.raises(ConfigError, match="is not the key of"):
        certs.DeviceCredentials.read(tmp_path)


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "x" * 65, ".hidden", "-flag", "a b", "é", None])
def test_check_device_name_rejects(bad: Any) -> None:
    with pytest.raises(ConfigError, match="device name"):
        certs.check_device_name(bad)


@pytest.mark.parametrize("good", ["a", "dev-1", "A.b_c", "_x", "x" * 64, "0"])
def test_check_device_name_accepts(good: str) -> None:
    assert certs.check_device_name(good) == good


# -------------------------------------------------------------------------------- revocation


def test_revoke_by_name_covers_every_certificate_of_the_device(pki: Path) -> None:
    a1, a2 = certs.issue_device(pki, "alice"), certs.issue_device(pki, "alice")
    bob = certs.issue_device(pki, "bob")
    assert certs.is_revoked(pki, a1.cert_pem) is None
    what = certs.revoke(pki, "alice")
    assert "alice" in what
    for c in (a1, a2):
        assert certs.is_revoked(pki, c.cert_pem) == "device 'alice' revoked"
    assert certs.is_revoked(pki, bob.cert_pem) is None
    assert certs.revocations(pki) == {"serials": [], "names": ["alice"]}
    with pytest.raises(ConfigError, match="revoked"):
        certs.issue_device(pki, "alice")
    with pytest.raises(ConfigError, match="revoked"):
        certs.create_token(pki, "alice")


def test_revoke_by_serial_covers_only_that_certificate(pki: Path) -> None:
    c1, c2 = certs.issue_device(pki, "carol"), certs.issue_device(pki, "carol")
    _, serial = certs.certificate_identity(c1.cert_pem)
    certs.revoke(pki, serial.upper())
    reason = certs.is_revoked(pki, c1.cert_pem)
    assert reason is not None and serial in reason and "carol" in reason
    assert certs.is_revoked(pki, c2.cert_pem) is None
    _, serial2 = certs.certificate_identity(c2.cert_pem)
    certs.revoke(pki, f"serial:0x{serial2}")
    assert certs.is_revoked(pki, c2.cert_pem) is not None
    assert [d["revoked"] is not None for d in certs.issued_devices(pki)] == [True, True]
    assert certs.revocations(pki)["names"] == []


def test_revoke_an_unknown_long_serial_and_an_unknown_name(pki: Path) -> None:
    certs.revoke(pki, "00:ab:cd:ef:01:23:45:67:89")
    certs.revoke(pki, "not-yet-issued")
    assert certs.revocations(pki) == {"serials": ["abcdef0123456789"], "names": ["not-yet-issued"]}
    with pytest.raises(ConfigError, match="device name"):
        certs.revoke(pki, "../etc")


def test_revocation_list_is_read_on_every_check_and_fails_closed(pki: Path) -> None:
    creds = certs.issue_device(pki, "dev1")
    (pki / "revoked.json").write_text(json.dumps({"serials": [], "names": ["dev1"]}))
    assert certs.is_revoked(pki, creds.cert_pem) == "device 'dev1' revoked"
    (pki / "revoked.json").write_text("{not json")
    reason = certs.is_revoked(pki, creds.cert_pem)
    assert reason is not None and "unreadable" in reason


# ------------------------------------------------------------------------------------ tokens


def test_token_redeems_once(pki: Path) -> None:
    token = certs.create_token(pki, "dev.1")
    name, _, secret = token.rpartition(".")
    assert name == "dev.1" and len(secret) >= 40
    assert certs.redeem_token(pki, token) == "dev.1"
    with pytest.raises(EnrolmentError, match="already used") as info:
        certs.redeem_token(pki, token)
    assert secret not in str(info.value)
    stored = json.loads((pki / "tokens.json").read_text())
    assert stored["dev.1"]["used"] is True
    assert certs.token_summary(pki) == [
        {"name": "dev.1", "used": True, "created": stored["dev.1"]["created"]}
    ]


def test_tokens_json_holds_no_secret(pki: Path) -> None:
    token = certs.create_token(pki, "dev1")
    secret = token.split(".", 1)[1]
    text = (pki / "tokens.json").read_text()
    assert secret not in text and token not in text
    entry = json.loads(text)["dev1"]
    assert set(entry) == {"salt", "hash", "used", "created"}
    assert len(bytes.fromhex(entry["salt"])) == 16 and entry["used"] is False


def test_wrong_secret_fails_without_revealing_it(pki: Path) -> None:
    token = certs.create_token(pki, "dev1")
    wrong = "dev1." + "A" * 43
    with pytest.raises(EnrolmentError, match="does not match") as info:
        certs.redeem_token(pki, wrong)
    assert "A" * 43 not in str(info.value) and token.split(".")[1] not in str(info.value)
    assert certs.redeem_token(pki, token) == "dev1", "a wrong guess does not use the token up"


@pytest.mark.parametrize(
    "bad", ["", "nodot-secret-Zq9", ".secret-Zq9", "dev1.", "../x.secret-Zq9", "a/b.secret-Zq9", "x" * 600]
)
def test_malformed_token_fails_without_revealing_it(pki: Path, bad: str) -> None:
    certs.create_token(pki, "dev1")
    with pytest.raises(EnrolmentError, match="malformed") as info:
        certs.redeem_token(pki, bad)
    if bad:
        assert bad not in str(info.value)
        assert "secret-Zq9" not in str(info.value)


def test_unknown_device_token_fails(pki: Path) -> None:
    with pytest.raises(EnrolmentError, match="no enrolment token for device 'ghost'") as info:
        certs.redeem_token(pki, "ghost.s3cr3t-value")
    assert "s3cr3t-value" not in str(info.value)


def test_a_new_token_replaces_the_old_one(pki: Path) -> None:
    old = certs.create_token(pki, "dev1")
    new = certs.create_token(pki, "dev1")
    with pytest.raises(EnrolmentError, match="does not match"):
        certs.redeem_token(pki, old)
    assert certs.redeem_token(pki, new) == "dev1"


def test_revoking_a_name_cancels_its_token(pki: Path) -> None:
    token = certs.create_token(pki, "dev1")
    certs.revoke(pki, "dev1")
    with pytest.raises(EnrolmentError):
        certs.redeem_token(pki, token)


def test_concurrent_redeems_succeed_exactly_once(pki: Path) -> None:
    token = certs.create_token(pki, "dev1")
    results: list[str] = []
    barrier = threading.Barrier(8)

    def attempt() -> None:
        barrier.wait(timeout=5)
        try:
            results.append(certs.redeem_token(pki, token))
        except EnrolmentError:
            results.append("refused")

    threads = [threading.Thread(target=attempt) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(results) == ["dev1"] + ["refused"] * 7


# -------------------------------------------------------------------------------------- CSRs


def test_make_csr_and_sign_for_the_tokens_name(pki: Path) -> None:
    key_pem, csr_pem = certs.make_csr("impostor")
    assert x509.load_pem_x509_csr(csr_pem).subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == (
        "impostor"
    )
    cert_pem = certs.sign_csr(pki, csr_pem, "dev1")
    cert = _cert(cert_pem)
    cert.verify_directly_issued_by(_cert((pki / "ca.crt").read_bytes()))
    assert certs.certificate_identity(cert_pem)[0] == "dev1", "the CSR's subject is ignored"
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    ) == ["dev1"]
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH
    ]
    assert serialization.load_pem_private_key(key_pem, password=None).public_key() == cert.public_key()
    assert [d["name"] for d in certs.issued_devices(pki)] == ["dev1"]


def test_sign_csr_rejects_a_tampered_signature(pki: Path) -> None:
    _, csr_pem = certs.make_csr("dev1")
    der = bytearray(x509.load_pem_x509_csr(csr_pem).public_bytes(serialization.Encoding.DER))
    der[-1] ^= 0x01  # last byte of the ECDSA signature's s
    tampered = x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM)
    with pytest.raises(EnrolmentError, match="invalid signature"):
        certs.sign_csr(pki, tampered, "dev1")
    with pytest.raises(EnrolmentError, match="cannot be parsed"):
        certs.sign_csr(pki, b"-----BEGIN CERTIFICATE REQUEST-----\ngarbage\n", "dev1")
    assert certs.issued_devices(pki) == []


def test_sign_csr_rejects_non_ecdsa_keys_and_revoked_names(pki: Path) -> None:
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dev1")]))
        .sign(rsa_key, hashes.SHA256())
    )
    with pytest.raises(EnrolmentError, match="ECDSA"):
        certs.sign_csr(pki, csr.public_bytes(serialization.Encoding.PEM), "dev1")
    certs.revoke(pki, "gone")
    with pytest.raises(EnrolmentError, match="revoked"):
        certs.sign_csr(pki, certs.make_csr("gone")[1], "gone")


def test_errors_are_fedveil_errors() -> None:
    assert issubclass(EnrolmentError, FedveilError)


# ------------------------------------------------------------------------ a real TLS handshake


def _handshake(
    server_pki: Path, device_dir: Path, server_hostname: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One mutual-TLS connection on loopback; returns what the server and the client saw."""
    _, _, ca = certs.server_credentials(server_pki)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(server_pki / "server.crt", server_pki / "server.key")
    server_ctx.load_verify_locations(cadata=ca.decode())
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED by default
    client_ctx.load_verify_locations(cafile=device_dir / "ca.crt")
    client_ctx.load_cert_chain(device_dir / "device.crt", device_dir / "device.key")

    seen: dict[str, Any] = {}
    got: dict[str, Any] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(2)

        def serve() -> None:
            try:
                conn, _ = listener.accept()
                conn.settimeout(2)
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    peer = tls.getpeercert()
                    cn = dict(attr for rdn in peer["subject"] for attr in rdn)["commonName"]
                    seen["cn"] = cn
                    tls.sendall(f"hello {cn}".encode())
            except (OSError, ssl.SSLError) as exc:
                seen["error"] = exc

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            with (
                socket.create_connection(listener.getsockname(), timeout=2) as raw,
                client_ctx.wrap_socket(raw, server_hostname=server_hostname) as tls,
            ):
                got["data"] = tls.recv(100)
        except (OSError, ssl.SSLError) as exc:
            got["error"] = exc
        thread.join(timeout=5)
        assert not thread.is_alive()
    return seen, got


@pytest.mark.parametrize("server_hostname", ["127.0.0.1", "localhost"])
def test_tls_handshake_accepts_a_ca_signed_device(pki: Path, tmp_path: Path, server_hostname: str) -> None:
    certs.issue_device(pki, "dev1").write(tmp_path / "dev1")
    seen, got = _handshake(pki, tmp_path / "dev1", server_hostname)
    assert seen == {"cn": "dev1"}
    assert got == {"data": b"hello dev1"}


def test_tls_handshake_refuses_a_device_of_another_ca(pki: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    certs.init_pki(other)
    foreign = certs.issue_device(other, "dev1")
    # The device trusts the real server's CA, but its own certificate comes from another CA.
    certs.DeviceCredentials("dev1", foreign.cert_pem, foreign.key_pem, (pki / "ca.crt").read_bytes()).write(
        tmp_path / "foreign"
    )
    seen, got = _handshake(pki, tmp_path / "foreign", "127.0.0.1")
    assert "cn" not in seen
    assert isinstance(seen.get("error"), ssl.SSLError)
    assert "certificate" in str(seen["error"]).lower()
    assert "data" not in got or got["data"] == b""


def test_tls_client_refuses_a_server_of_another_ca(pki: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    certs.init_pki(other)
    certs.issue_device(other, "dev1").write(tmp_path / "dev1")  # trusts the other CA only
    seen, got = _handshake(pki, tmp_path / "dev1", "127.0.0.1")
    assert "cn" not in seen
    assert isinstance(got.get("error"), ssl.SSLCertVerificationError)
