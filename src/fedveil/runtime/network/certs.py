"""The PKI of the networked runtime: a private CA, the server's certificate, device certificates,
one-time enrolment tokens and revocation (docs/deployment.md).

A PKI directory made by :func:`init_pki` holds

- ``ca.crt`` / ``ca.key`` (0600): a self-signed ECDSA P-256 CA that may sign leaf certificates only;
- ``server.crt`` / ``server.key`` (0600): the server's certificate (``serverAuth``), whose subject
  alternative names are the hosts devices dial;
- ``revoked.json``: ``{"serials": [hex, ...], "names": [device, ...]}``, read on every check, so a
  revocation applies to the next connection without restarting the server;
- ``tokens.json`` (0600): ``{device: {"salt", "hash", "used", "created"}}``; only a salted SHA-256
  of each enrolment secret is stored, never the secret;
- ``issued.json``: a log ``[{"name", "serial", "not_after"}, ...]`` of the device certificates issued.

A device gets its certificate either from the operator (:func:`issue_device`, ``fedveil certs
device NAME``) or by enrolling: the operator hands it a one-time token (:func:`create_token`), the
device makes a key and a CSR (:func:`make_csr`), and the server checks the token
(:func:`redeem_token`) and signs the CSR for the name the token is bound to (:func:`sign_csr`).

Device certificates carry ``CN = name`` and ``extendedKeyUsage = clientAuth``; the server maps a
TLS peer to a device by that CN and refuses revoked ones (:func:`is_revoked`). Every file is
written atomically (temporary file in the same directory, fsync, rename), private keys with mode
0600, and the read-modify-write of the JSON files is serialised by a lock (a thread lock, plus an
``flock`` on ``.lock`` in the PKI directory where the platform has one), so the CLI may revoke or
create tokens while a server redeems them.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import hmac
import ipaddress
import json
import os
import re
import secrets
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedveil.core.atomic import atomic_write
from fedveil.errors import ConfigError, FedveilError

try:  # POSIX: serialise the JSON read-modify-writes across processes too.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "CA_COMMON_NAME",
    "DEFAULT_HOSTS",
    "SERVER_COMMON_NAME",
    "DeviceCredentials",
    "EnrolmentError",
    "PkiPaths",
    "certificate_identity",
    "check_device_name",
    "create_token",
    "init_pki",
    "is_revoked",
    "issue_device",
    "issued_devices",
    "make_csr",
    "redeem_token",
    "revocations",
    "revoke",
    "server_credentials",
    "sign_csr",
    "token_summary",
]

DEFAULT_HOSTS: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")
"""Names the server certificate is valid for unless ``init_pki`` is given others."""

CA_COMMON_NAME = "fedveil CA"
SERVER_COMMON_NAME = "fedveil server"

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")
_HOST_RE = re.compile(
    r"(\*\.)?[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*\.?"
)
_MAX_DAYS = 36500
_MAX_TOKEN_CHARS = 512
_MAX_CSR_BYTES = 64 * 1024
_CLOCK_SKEW = dt.timedelta(minutes=5)
_ACCEPTED_CURVES = (ec.SECP256R1, ec.SECP384R1)
_LOCK = threading.RLock()


class EnrolmentError(FedveilError):
    """An enrolment request the PKI refuses: bad, used or unknown token, or an invalid CSR.

    Messages name the device and the reason, never the token or its secret.
    """


# --------------------------------------------------------------------------------------- paths


@dataclass(frozen=True)
class PkiPaths:
    """The files of a PKI directory made by :func:`init_pki`."""

    root: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    revoked: Path
    tokens: Path
    issued: Path

    @classmethod
    def of(cls, root: str | Path) -> PkiPaths:
        """The paths of the PKI directory ``root`` (no I/O)."""
        r = Path(root)
        return cls(
            root=r,
            ca_cert=r / "ca.crt",
            ca_key=r / "ca.key",
            server_cert=r / "server.crt",
            server_key=r / "server.key",
            revoked=r / "revoked.json",
            tokens=r / "tokens.json",
            issued=r / "issued.json",
        )

    def files(self) -> tuple[Path, ...]:
        """Every file :func:`init_pki` writes, in the order it writes them."""
        return (
            self.ca_cert,
            self.ca_key,
            self.server_cert,
            self.server_key,
            self.revoked,
            self.tokens,
            self.issued,
        )


# --------------------------------------------------------------------------------- file helpers


def _write_json(path: Path, doc: Any, *, mode: int = 0o644) -> None:
    atomic_write(path, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8"), mode=mode)


def _read_json(path: Path, default: Any) -> Any:
    """The JSON document in ``path``, ``default`` if the file is missing; ConfigError if unreadable."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return default
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}; check its permissions") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); restore it from a backup") from None
    if not isinstance(doc, type(default)):
        raise ConfigError(
            f"{path} holds a JSON {type(doc).__name__}, expected a {type(default).__name__}; restore it"
        )
    return doc


def _read_file(path: Path, what: str, fix: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} is missing; {fix}") from None
    except OSError as exc:
        raise ConfigError(
            f"cannot read {what} {path}: {exc.strerror or exc}; check its permissions"
        ) from None


@contextlib.contextmanager
def _locked(paths: PkiPaths) -> Iterator[None]:
    """Serialise read-modify-writes of the PKI's JSON files (threads, and processes via ``flock``)."""
    with _LOCK:
        if fcntl is None:  # pragma: no cover - Windows
            yield
            return
        fd = os.open(paths.root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _not_after(cert: x509.Certificate) -> dt.datetime:
    """``cert``'s expiry as an aware UTC datetime (cryptography < 42 has only the naive attribute)."""
    value = getattr(cert, "not_valid_after_utc", None)
    if value is None:  # pragma: no cover - cryptography < 42
        value = cert.not_valid_after.replace(tzinfo=dt.timezone.utc)
    return value


def _serial_hex(serial: int) -> str:
    return format(serial, "x")


def _check_days(days: int) -> int:
    if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= _MAX_DAYS:
        raise ConfigError(
            f"days={days!r} is not a validity period; pass a whole number of days in 1..{_MAX_DAYS}"
        )
    return days


def _private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cn(name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])


# ------------------------------------------------------------------------------------- names


def check_device_name(name: str) -> str:
    """Return ``name`` if it is a valid device name, else raise :class:`~fedveil.errors.ConfigError`.

    A device name is 1 to 64 characters of ``[A-Za-z0-9._-]`` not starting with ``.`` or ``-``, so it
    is safe as a file name, a certificate CN and a DNS SAN.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(
            f"device name {name!r} is not allowed; use 1 to 64 characters of letters, digits, '.', '_' "
            "and '-', not starting with '.' or '-'"
        )
    return name


def _check_hosts(hosts: Sequence[str]) -> list[x509.GeneralName]:
    if isinstance(hosts, str):
        hosts = [hosts]
    sans: list[x509.GeneralName] = []
    seen: set[str] = set()
    for host in hosts:
        if not isinstance(host, str):
            raise ConfigError(f"server host {host!r} is not a string; pass host names or IP addresses")
        h = host.strip()
        if h.startswith("[") and h.endswith("]"):
            h = h[1:-1]
        if not h:
            raise ConfigError(f"server host {host!r} is empty; pass a host name or an IP address")
        try:
            ip = ipaddress.ip_address(h)
        except ValueError:
            if len(h) > 253 or not _HOST_RE.fullmatch(h):
                raise ConfigError(
                    f"server host {host!r} is neither an IP address nor a DNS name; pass e.g. "
                    "'server.example.org' or '10.0.0.5'"
                ) from None
            key = h.lower()
            general: x509.GeneralName = x509.DNSName(h)
        else:
            key = str(ip)
            general = x509.IPAddress(ip)
        if key not in seen:
            seen.add(key)
            sans.append(general)
    if not sans:
        raise ConfigError("no server hosts given; pass at least one host name or IP address devices dial")
    return sans


# ------------------------------------------------------------------------------------ the CA


def _load_ca(paths: PkiPaths) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    fix = f"{paths.root} is not a fedveil PKI directory; run `fedveil certs init {paths.root}`"
    cert_pem = _read_file(paths.ca_cert, "CA certificate", fix)
    key_pem = _read_file(paths.ca_key, "CA private key", fix)
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"the CA in {paths.root} cannot be loaded ({exc}); restore it or re-create it with "
            f"`fedveil certs init {paths.root} --force` (this invalidates every certificate)"
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(
            f"{paths.ca_key} is not an ECDSA key; re-create the PKI with `fedveil certs init --force`"
        )
    return cert, key


def _sign_leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    sans: list[x509.GeneralName],
    usage: x509.ObjectIdentifier,
    days: int,
) -> x509.Certificate:
    """A leaf certificate for ``public_key`` signed by the CA, valid ``days`` (not beyond the CA)."""
    now = _now()
    not_after = min(now + dt.timedelta(days=days), _not_after(ca_cert))
    if not_after <= now:
        raise ConfigError(
            f"the CA certificate expired on {_not_after(ca_cert).isoformat()}; make a new PKI with "
            "`fedveil certs init DIR --force` and re-issue every certificate"
        )
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )


def init_pki(
    root: str | Path, hosts: Sequence[str] = DEFAULT_HOSTS, *, days: int = 825, force: bool = False
) -> PkiPaths:
    """Create a PKI in ``root``: a CA, the server's certificate for ``hosts``, and empty lists.

    ``hosts`` are the names and IP addresses devices dial (DNS and IP subject alternative names).
    An existing PKI in ``root`` is refused unless ``force`` (which replaces the CA, so every
    certificate issued before stops being accepted, and empties the token, revocation and issue
    lists). The CA and server certificates are valid for ``days``.
    """
    days = _check_days(days)
    sans = _check_hosts(hosts)
    paths = PkiPaths.of(root)
    if paths.root.exists() and not paths.root.is_dir():
        raise ConfigError(f"PKI directory {paths.root} is a file; pass a directory path")
    existing = [p.name for p in paths.files() if p.exists()]
    if existing and not force:
        raise ConfigError(
            f"{paths.root} already holds a PKI ({', '.join(existing)}); pass force=True (--force) to replace "
            "it, which invalidates every certificate it issued"
        )
    paths.root.mkdir(mode=0o700, parents=True, exist_ok=True)

    now = _now()
    ca_key = _new_key()
    ca_name = _cn(CA_COMMON_NAME)
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = _new_key()
    server_cert = _sign_leaf(
        ca_cert,
        ca_key,
        _cn(SERVER_COMMON_NAME),
        server_key.public_key(),
        sans,
        ExtendedKeyUsageOID.SERVER_AUTH,
        days,
    )
    with _locked(paths):
        atomic_write(paths.ca_key, _private_pem(ca_key), mode=0o600)
        atomic_write(paths.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM))
        atomic_write(paths.server_key, _private_pem(server_key), mode=0o600)
        atomic_write(paths.server_cert, server_cert.public_bytes(serialization.Encoding.PEM))
        _write_json(paths.revoked, {"serials": [], "names": []})
        _write_json(paths.tokens, {}, mode=0o600)
        _write_json(paths.issued, [])
    return paths


def server_credentials(root: str | Path) -> tuple[bytes, bytes, bytes]:
    """``(server_key_pem, server_cert_pem, ca_pem)`` of the PKI in ``root``, for the gRPC server."""
    paths = PkiPaths.of(root)
    fix = f"is {paths.root} the PKI directory? Run `fedveil certs init {paths.root}` to make one"
    key = _read_file(paths.server_key, "server private key", fix)
    cert = _read_file(paths.server_cert, "server certificate", fix)
    ca = _read_file(paths.ca_cert, "CA certificate", fix)
    return key, cert, ca


# ------------------------------------------------------------------------------------ devices


@dataclass(frozen=True)
class DeviceCredentials:
    """What a device agent needs on disk: its certificate and key, and the CA that signed the server's."""

    name: str
    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes

    CERT_FILE = "device.crt"
    KEY_FILE = "device.key"
    CA_FILE = "ca.crt"

    def write(self, directory: str | Path) -> None:
        """Write ``device.crt``, ``device.key`` (0600) and ``ca.crt`` into ``directory`` (made if needed)."""
        d = Path(directory)
        if d.exists() and not d.is_dir():
            raise ConfigError(f"credentials directory {d} is a file; pass a directory path")
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write(d / self.KEY_FILE, self.key_pem, mode=0o600)
        atomic_write(d / self.CERT_FILE, self.cert_pem)
        atomic_write(d / self.CA_FILE, self.ca_pem)

    @classmethod
    def read(cls, directory: str | Path) -> DeviceCredentials:
        """Read credentials written by :meth:`write`; the name is the certificate's CN.

        Raises :class:`~fedveil.errors.ConfigError` naming a missing file, or when the key does not
        belong to the certificate.
        """
        d = Path(directory)
        fix = f"issue credentials with `fedveil certs device NAME --out {d}` or enrol the device with a token"
        cert_pem = _read_file(d / cls.CERT_FILE, "device certificate", fix)
        key_pem = _read_file(d / cls.KEY_FILE, "device private key", fix)
        ca_pem = _read_file(d / cls.CA_FILE, "CA certificate", fix)
        name, _ = certificate_identity(cert_pem)
        try:
            key = serialization.load_pem_private_key(key_pem, password=None)
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"{d / cls.KEY_FILE} is not an unencrypted PEM private key ({exc}); re-issue it"
            ) from None
        cert = x509.load_pem_x509_certificate(cert_pem)
        pub = serialization.PublicFormat.SubjectPublicKeyInfo
        if key.public_key().public_bytes(serialization.Encoding.DER, pub) != cert.public_key().public_bytes(
            serialization.Encoding.DER, pub
        ):
            raise ConfigError(
                f"{d / cls.KEY_FILE} is not the key of {d / cls.CERT_FILE} (device {name!r}); re-issue both"
            )
        try:
            x509.load_pem_x509_certificate(ca_pem)
        except ValueError as exc:
            raise ConfigError(
                f"{d / cls.CA_FILE} is not a PEM certificate ({exc}); copy the PKI's ca.crt"
            ) from None
        return cls(name=name, cert_pem=cert_pem, key_pem=key_pem, ca_pem=ca_pem)


def _refuse_revoked_name(paths: PkiPaths, name: str, error: type[FedveilError]) -> None:
    if name in _load_revoked(paths)["names"]:
        raise error(
            f"device {name!r} is revoked; give the device a new name (revocation by name is permanent)"
        )


def _log_issued(paths: PkiPaths, name: str, cert: x509.Certificate) -> None:
    with _locked(paths):
        log = _read_json(paths.issued, [])
        log.append(
            {
                "name": name,
                "serial": _serial_hex(cert.serial_number),
                "not_after": _not_after(cert).isoformat(),
            }
        )
        _write_json(paths.issued, log)


def issue_device(root: str | Path, name: str, *, days: int = 825) -> DeviceCredentials:
    """A new key and a CA-signed client certificate (``CN = SAN = name``, ``clientAuth``) for device ``name``.

    The certificate is valid for ``days``, but not beyond the CA. Nothing secret is kept in the
    PKI; the returned credentials are what the device needs (:meth:`DeviceCredentials.write`).
    """
    check_device_name(name)
    days = _check_days(days)
    paths = PkiPaths.of(root)
    ca_cert, ca_key = _load_ca(paths)
    _refuse_revoked_name(paths, name, ConfigError)
    key = _new_key()
    cert = _sign_leaf(
        ca_cert,
        ca_key,
        _cn(name),
        key.public_key(),
        [x509.DNSName(name)],
        ExtendedKeyUsageOID.CLIENT_AUTH,
        days,
    )
    _log_issued(paths, name, cert)
    return DeviceCredentials(
        name=name,
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=_private_pem(key),
        ca_pem=ca_cert.public_bytes(serialization.Encoding.PEM),
    )


def make_csr(name: str) -> tuple[bytes, bytes]:
    """A new P-256 key and a certificate signing request for it with ``CN = name``: ``(key_pem, csr_pem)``."""
    check_device_name(name)
    key = _new_key()
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(_cn(name))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _private_pem(key), csr.public_bytes(serialization.Encoding.PEM)


def check_csr(csr_pem: bytes, name: str = "device") -> ec.EllipticCurvePublicKey:
    """The public key of a well-formed, correctly self-signed CSR (PEM) for an ECDSA P-256 or P-384
    key; :class:`EnrolmentError` otherwise. The enrolment server checks this before it spends a token."""
    if not isinstance(csr_pem, (bytes, bytearray)) or len(csr_pem) > _MAX_CSR_BYTES:
        raise EnrolmentError(
            f"the certificate signing request for device {name!r} is not PEM bytes of at most "
            f"{_MAX_CSR_BYTES} bytes"
        )
    try:
        csr = x509.load_pem_x509_csr(bytes(csr_pem))
        valid = csr.is_signature_valid
        public_key = csr.public_key()
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm) as exc:
        raise EnrolmentError(
            f"the certificate signing request for device {name!r} cannot be parsed ({exc}); "
            "make it with make_csr"
        ) from None
    if not valid:
        raise EnrolmentError(
            f"the certificate signing request for device {name!r} has an invalid signature; make a new one"
        )
    if not isinstance(public_key, ec.EllipticCurvePublicKey) or not isinstance(
        public_key.curve, _ACCEPTED_CURVES
    ):
        kind = getattr(getattr(public_key, "curve", None), "name", type(public_key).__name__)
        raise EnrolmentError(
            f"the certificate signing request for device {name!r} has a {kind} key; use an ECDSA P-256 key"
        )
    return public_key


def sign_csr(root: str | Path, csr_pem: bytes, name: str, *, days: int = 825) -> bytes:
    """Sign a device's CSR as a client certificate for ``name``; returns the certificate PEM.

    ``name`` is the device the enrolment token was bound to: the CSR's own subject and extensions
    are ignored. The CSR must be PEM, self-signed correctly (proof that the requester holds the
    key) and for an ECDSA P-256 or P-384 key; otherwise :class:`EnrolmentError`.
    """
    check_device_name(name)
    days = _check_days(days)
    paths = PkiPaths.of(root)
    public_key = check_csr(csr_pem, name)
    ca_cert, ca_key = _load_ca(paths)
    _refuse_revoked_name(paths, name, EnrolmentError)
    cert = _sign_leaf(
        ca_cert, ca_key, _cn(name), public_key, [x509.DNSName(name)], ExtendedKeyUsageOID.CLIENT_AUTH, days
    )
    _log_issued(paths, name, cert)
    return cert.public_bytes(serialization.Encoding.PEM)


def issued_devices(root: str | Path) -> list[dict[str, Any]]:
    """The device certificates issued by the PKI in ``root``, oldest first.

    Each is ``{"name", "serial", "not_after", "revoked"}``, where ``revoked`` is ``None`` or the
    reason :func:`is_revoked` would give.
    """
    paths = PkiPaths.of(root)
    if not paths.ca_cert.exists():
        raise ConfigError(
            f"{paths.root} is not a fedveil PKI directory; run `fedveil certs init {paths.root}`"
        )
    revoked = _load_revoked(paths)
    out = []
    for entry in _read_json(paths.issued, []):
        if not isinstance(entry, dict):
            continue
        name, serial = str(entry.get("name", "")), str(entry.get("serial", ""))
        out.append(
            {
                "name": name,
                "serial": serial,
                "not_after": entry.get("not_after"),
                "revoked": _revocation_reason(revoked, name, serial),
            }
        )
    return out


def certificate_identity(cert_pem: bytes) -> tuple[str, str]:
    """``(common name, serial as lower-case hex)`` of a PEM certificate."""
    try:
        cert = x509.load_pem_x509_certificate(bytes(cert_pem))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"not a PEM certificate ({exc}); pass the bytes of a .crt file") from None
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names:
        raise ConfigError(
            f"certificate serial {_serial_hex(cert.serial_number)} has no common name; "
            "issue device certificates with `fedveil certs`"
        )
    cn = names[0].value
    return (cn.decode("utf-8", "replace") if isinstance(cn, bytes) else cn), _serial_hex(cert.serial_number)


# --------------------------------------------------------------------------------- revocation


def _load_revoked(paths: PkiPaths) -> dict[str, list[str]]:
    doc = _read_json(paths.revoked, {"serials": [], "names": []})
    serials, names = doc.get("serials", []), doc.get("names", [])
    if not isinstance(serials, list) or not isinstance(names, list):
        raise ConfigError(f"{paths.revoked} must hold lists 'serials' and 'names'; restore it")
    return {"serials": [str(s).lower() for s in serials], "names": [str(n) for n in names]}


def _revocation_reason(revoked: dict[str, list[str]], name: str, serial: str) -> str | None:
    if serial.lower() in revoked["serials"]:
        return f"certificate serial {serial} of device {name!r} revoked"
    if name in revoked["names"]:
        return f"device {name!r} revoked"
    return None


def _parse_serial(text: str) -> str | None:
    """``text`` as a lower-case hex serial without leading zeros (``0x`` and ``:`` allowed), or None."""
    s = text.strip().lower().replace(":", "")
    if s.startswith("0x"):
        s = s[2:]
    if not s or not re.fullmatch(r"[0-9a-f]+", s):
        return None
    return _serial_hex(int(s, 16))


def revoke(root: str | Path, name_or_serial: str) -> str:
    """Revoke a device (every certificate with its name, now and later) or one certificate by serial.

    ``name_or_serial`` is a device name or a serial in hex as ``fedveil certs list`` prints it; the
    prefixes ``name:`` and ``serial:`` force one reading. Without a prefix, a serial the PKI issued
    or a known device name is taken as such; otherwise a hex string of 16 or more digits is taken as
    a serial, anything else as a device name. Revoking a name also cancels its unused enrolment
    token. Returns what was revoked, in words. Takes effect on the next connection.
    """
    if not isinstance(name_or_serial, str) or not name_or_serial.strip():
        raise ConfigError(
            f"nothing to revoke in {name_or_serial!r}; pass a device name or a certificate serial"
        )
    paths = PkiPaths.of(root)
    if not paths.ca_cert.exists():
        raise ConfigError(
            f"{paths.root} is not a fedveil PKI directory; run `fedveil certs init {paths.root}`"
        )
    text = name_or_serial.strip()
    with _locked(paths):
        issued = [e for e in _read_json(paths.issued, []) if isinstance(e, dict)]
        by_serial = {str(e.get("serial", "")).lower(): str(e.get("name", "")) for e in issued}
        known_names = set(by_serial.values()) | set(_read_json(paths.tokens, {}))
        kind, value = "", ""
        if text.startswith("serial:"):
            serial = _parse_serial(text[len("serial:") :])
            if serial is None:
                raise ConfigError(
                    f"{text!r} is not a hex certificate serial; copy one from `fedveil certs list`"
                )
            kind, value = "serial", serial
        elif text.startswith("name:"):
            kind, value = "name", check_device_name(text[len("name:") :])
        else:
            serial = _parse_serial(text)
            if serial is not None and serial in by_serial:
                kind, value = "serial", serial
            elif text in known_names:
                kind, value = "name", text
            elif serial is not None and len(serial) >= 16:
                kind, value = "serial", serial
            else:
                kind, value = "name", check_device_name(text)
        revoked = _load_revoked(paths)
        if kind == "serial":
            if value not in revoked["serials"]:
                revoked["serials"].append(value)
            owner = by_serial.get(value)
            what = f"certificate serial {value}" + (f" of device {owner!r}" if owner else "")
        else:
            if value not in revoked["names"]:
                revoked["names"].append(value)
            tokens = _read_json(paths.tokens, {})
            if value in tokens:
                del tokens[value]
                _write_json(paths.tokens, tokens, mode=0o600)
            what = f"device {value!r} (all its certificates)"
        _write_json(paths.revoked, revoked)
    return what


def revocations(root: str | Path) -> dict[str, list[str]]:
    """The PKI's revocation list: ``{"serials": [hex, ...], "names": [device, ...]}``."""
    return _load_revoked(PkiPaths.of(root))


def is_revoked(root: str | Path, cert_pem: bytes) -> str | None:
    """``None`` if the certificate is not revoked, else the reason.

    Reads ``revoked.json`` on every call, so a revocation applies to the next connection. Fails
    closed: an unreadable revocation list is a reason to refuse.
    """
    name, serial = certificate_identity(cert_pem)
    paths = PkiPaths.of(root)
    try:
        revoked = _load_revoked(paths)
    except ConfigError as exc:
        return f"revocation list unreadable, refusing every device: {exc}"
    return _revocation_reason(revoked, name, serial)


# ------------------------------------------------------------------------------------- tokens


def _token_hash(salt: bytes, secret: str) -> str:
    return hashlib.sha256(salt + secret.encode("utf-8")).hexdigest()


def create_token(root: str | Path, name: str) -> str:
    """A one-time enrolment token ``NAME.SECRET`` for device ``name``; shown once, stored salted and hashed.

    Replaces any earlier token of the same name (used or not), so a lost token is re-issued simply
    by creating a new one.
    """
    check_device_name(name)
    paths = PkiPaths.of(root)
    _load_ca(paths)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_bytes(16)
    with _locked(paths):
        _refuse_revoked_name(paths, name, ConfigError)
        tokens = _read_json(paths.tokens, {})
        tokens[name] = {
            "salt": salt.hex(),
            "hash": _token_hash(salt, secret),
            "used": False,
            "created": _now().isoformat(timespec="seconds"),
        }
        _write_json(paths.tokens, tokens, mode=0o600)
    return f"{name}.{secret}"


def redeem_token(root: str | Path, token: str) -> str:
    """Check a one-time enrolment token and mark it used; returns the device name it is bound to.

    Raises :class:`EnrolmentError` for a malformed, unknown, wrong, already used or revoked token;
    the message never contains the token or its secret.
    """
    malformed = EnrolmentError(
        "malformed enrolment token; expected DEVICE.SECRET as printed by `fedveil certs token DEVICE`"
    )
    if not isinstance(token, str) or not token or len(token) > _MAX_TOKEN_CHARS:
        raise malformed
    name, dot, secret = token.strip().rpartition(".")
    if not dot or not secret or not _NAME_RE.fullmatch(name):
        raise malformed
    paths = PkiPaths.of(root)
    with _locked(paths):
        tokens = _read_json(paths.tokens, {})
        entry = tokens.get(name)
        if not isinstance(entry, dict):
            raise EnrolmentError(
                f"no enrolment token for device {name!r}; create one with `fedveil certs token {name}`"
            )
        try:
            salt = bytes.fromhex(entry["salt"])
            stored = str(entry["hash"])
        except (KeyError, TypeError, ValueError):
            raise EnrolmentError(
                f"the stored enrolment token for device {name!r} is damaged; create a new one with "
                f"`fedveil certs token {name}`"
            ) from None
        if not hmac.compare_digest(_token_hash(salt, secret).encode(), stored.encode()):
            raise EnrolmentError(f"enrolment token for device {name!r} does not match")
        if entry.get("used"):
            raise EnrolmentError(
                f"enrolment token for device {name!r} was already used; create a new one with "
                f"`fedveil certs token {name}`"
            )
        _refuse_revoked_name(paths, name, EnrolmentError)
        entry["used"] = True
        entry["used_at"] = _now().isoformat(timespec="seconds")
        _write_json(paths.tokens, tokens, mode=0o600)
    return name


def token_summary(root: str | Path) -> list[dict[str, Any]]:
    """``[{"name", "used", "created"}, ...]`` of the PKI's enrolment tokens (never secrets or hashes)."""
    paths = PkiPaths.of(root)
    tokens = _read_json(paths.tokens, {})
    return [
        {"name": name, "used": bool(e.get("used")), "created": e.get("created")}
        for name, e in sorted(tokens.items())
        if isinstance(e, dict)
    ]
