"""Secrets of the service: application tokens, administrator passwords, dashboard sessions and CSRF tokens.

- **Application tokens** (PoliFL Sec. 4.2's "Application Token") look like ``fvt.KEYID.SECRET``: ``KEYID``
  (12 hex digits) finds the row, ``SECRET`` (32 random bytes, base64url) is the secret. Only a random salt
  and ``HMAC-SHA256(salt, SECRET)`` are stored; the token is shown once, when it is made. A token is
  checked by recomputing the digest and comparing with :func:`hmac.compare_digest` (constant time); an
  unknown key id costs the same digest against a dummy row, so timing says nothing about the secret.
  Revoked tokens stop working at once.
- **Administrator passwords**: scrypt (``n = 2**14, r = 8, p = 1``) with a random salt.
- **Sign-in throttling** (:class:`SignInThrottle`, after OWASP's authentication guidance): failed
  sign-ins are counted per account name and per client address over a window; past the limit, further
  attempts are refused (429) for a back-off period without checking the password, the same whether the
  account exists or not. A successful sign-in clears the account's count. The counts live in the
  service's memory: restarting the service unlocks everyone.
- **Sessions**: a random cookie (``HttpOnly``, ``SameSite=Strict``, ``Secure`` over TLS) whose SHA-256 is
  stored with an expiry; each session has its own CSRF token, which every form carries in a hidden field
  and every state-changing request must echo (compared in constant time).

Nothing here logs a secret.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import re
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fedveil.errors import ConfigError
from fedveil.service import db

__all__ = [
    "SESSION_HOURS",
    "Session",
    "SignInThrottle",
    "check_admin",
    "create_admin",
    "create_application",
    "end_session",
    "issue_token",
    "revoke_token",
    "session_of",
    "start_session",
    "verify_token",
]

SESSION_HOURS = 8
_TOKEN_RE = re.compile(r"fvt\.([0-9a-f]{12})\.([A-Za-z0-9_-]{43})")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._-]{0,99}")
_DUMMY_SALT = secrets.token_hex(16)


def _digest(salt: str, secret: str) -> str:
    return hmac.new(bytes.fromhex(salt), secret.encode(), hashlib.sha256).hexdigest()


def _scrypt(salt: str, password: str) -> str:
    return hashlib.scrypt(password.encode(), salt=bytes.fromhex(salt), n=2**14, r=8, p=1, dklen=32).hex()


def check_name(name: str, what: str) -> str:
    """A name for an application, administrator or group: 1-100 letters, digits, space, ``._-``."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(
            f"{what} name {name!r} must be 1-100 characters of letters, digits, space, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def create_application(engine: Engine, name: str) -> int:
    """A new application; returns its id (a clear error if the name is taken)."""
    check_name(name, "application")
    with engine.begin() as conn:
        if conn.execute(sa.select(db.applications.c.id).where(db.applications.c.name == name)).first():
            raise ConfigError(f"an application named {name!r} exists already")
        return int(
            conn.execute(
                db.applications.insert().values(name=name, created_at=db.now())
            ).inserted_primary_key[0]
        )


def issue_token(engine: Engine, application_id: int) -> str:
    """A new token for the application: returned once, stored only as salt + digest."""
    key_id = secrets.token_hex(6)
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")
    salt = secrets.token_hex(16)
    with engine.begin() as conn:
        if not conn.execute(
            sa.select(db.applications.c.id).where(db.applications.c.id == application_id)
        ).first():
            raise ConfigError(f"there is no application with id {application_id}")
        conn.execute(
            db.tokens.insert().values(
                application_id=application_id,
                key_id=key_id,
                salt=salt,
                digest=_digest(salt, secret),
                created_at=db.now(),
            )
        )
    return f"fvt.{key_id}.{secret}"


def verify_token(engine: Engine, token: str | None) -> int | None:
    """The application id of a valid, unrevoked ``token``; ``None`` otherwise (never says why)."""
    match = _TOKEN_RE.fullmatch(token or "")
    key_id, secret = match.groups() if match else ("", "")
    row = None
    if match:
        with engine.connect() as conn:
            row = conn.execute(sa.select(db.tokens).where(db.tokens.c.key_id == key_id)).mappings().first()
    salt, stored = (row["salt"], row["digest"]) if row else (_DUMMY_SALT, "0" * 64)
    ok = hmac.compare_digest(_digest(salt, secret), stored)
    if not ok or row is None or row["revoked_at"] is not None:
        return None
    return int(row["application_id"])


def revoke_token(engine: Engine, key_id: str) -> bool:
    """Revoke the token with ``key_id``; False if there is none (or it was revoked already)."""
    with engine.begin() as conn:
        result = conn.execute(
            db.tokens.update()
            .where(db.tokens.c.key_id == key_id, db.tokens.c.revoked_at.is_(None))
            .values(revoked_at=db.now())
        )
        return bool(result.rowcount)


def create_admin(engine: Engine, name: str, password: str) -> int:
    """A new administrator (password at least 12 characters); returns its id."""
    check_name(name, "administrator")
    if not isinstance(password, str) or len(password) < 12:
        raise ConfigError("an administrator password needs at least 12 characters")
    salt = secrets.token_hex(16)
    with engine.begin() as conn:
        if conn.execute(sa.select(db.admins.c.id).where(db.admins.c.name == name)).first():
            raise ConfigError(f"an administrator named {name!r} exists already")
        return int(
            conn.execute(
                db.admins.insert().values(
                    name=name, salt=salt, digest=_scrypt(salt, password), created_at=db.now()
                )
            ).inserted_primary_key[0]
        )


def check_admin(engine: Engine, name: str, password: str) -> int | None:
    """The administrator's id if ``password`` is right, else ``None`` (same work either way)."""
    with engine.connect() as conn:
        row = conn.execute(sa.select(db.admins).where(db.admins.c.name == name)).mappings().first()
    salt, stored = (row["salt"], row["digest"]) if row else (_DUMMY_SALT, "0" * 64)
    ok = hmac.compare_digest(_scrypt(salt, password), stored)
    return int(row["id"]) if ok and row is not None else None


class SignInThrottle:
    """Failed administrator sign-ins, per account and per client address (module docstring): an account
    name with ``per_account`` failures, or an address with ``per_address``, within ``lockout`` seconds
    is refused for ``lockout`` seconds from its last failure. At most ``keys`` names and addresses are
    remembered (the least recently failed are forgotten first), so a flood of made-up names cannot
    exhaust memory."""

    def __init__(
        self,
        per_account: int = 5,
        per_address: int = 20,
        lockout: float = 900.0,
        *,
        keys: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_account, self.per_address, self.lockout, self.keys, self.clock = (
            per_account,
            per_address,
            lockout,
            keys,
            clock,
        )
        self._lock = threading.Lock()
        self._failures: OrderedDict[tuple[str, str], deque[float]] = OrderedDict()

    def _limits(self, name: str, address: str) -> list[tuple[tuple[str, str], int]]:
        return [(("account", name[:100]), self.per_account), (("address", address), self.per_address)]

    def _recent(self, key: tuple[str, str], now: float) -> deque[float]:
        times = self._failures.get(key, deque())
        while times and times[0] <= now - self.lockout:
            times.popleft()
        return times

    def retry_after(self, name: str, address: str) -> float | None:
        """Seconds until ``name`` may try again from ``address``, or ``None`` if it may now."""
        with self._lock:
            now = self.clock()
            waits = [
                times[-1] + self.lockout - now
                for key, limit in self._limits(name, address)
                if len(times := self._recent(key, now)) >= limit
            ]
        return max(waits) if waits else None

    def failed(self, name: str, address: str) -> bool:
        """Count a failed sign-in; ``True`` if it locks the account or the address."""
        locked = False
        with self._lock:
            now = self.clock()
            for key, limit in self._limits(name, address):
                times = self._recent(key, now)
                times.append(now)
                self._failures[key] = times
                self._failures.move_to_end(key)
                locked |= len(times) == limit
            while len(self._failures) > self.keys:
                self._failures.popitem(last=False)
        return locked

    def succeeded(self, name: str) -> None:
        """A successful sign-in clears the account's failures (not its address's)."""
        with self._lock:
            self._failures.pop(("account", name[:100]), None)


@dataclass(frozen=True)
class Session:
    """A signed-in administrator: id, name and the session's CSRF token."""

    admin_id: int
    admin: str
    csrf: str


def start_session(engine: Engine, admin_id: int) -> str:
    """A new session cookie value for the administrator (stored as its SHA-256)."""
    cookie = secrets.token_urlsafe(32)
    with engine.begin() as conn:
        conn.execute(db.sessions.delete().where(db.sessions.c.expires_at < db.now()))
        conn.execute(
            db.sessions.insert().values(
                admin_id=admin_id,
                digest=hashlib.sha256(cookie.encode()).hexdigest(),
                csrf=secrets.token_urlsafe(32),
                expires_at=db.now() + dt.timedelta(hours=SESSION_HOURS),
            )
        )
    return cookie


def session_of(engine: Engine, cookie: str | None) -> Session | None:
    """The live session of a cookie, or ``None``."""
    if not cookie or len(cookie) > 100:
        return None
    digest = hashlib.sha256(cookie.encode()).hexdigest()
    with engine.connect() as conn:
        row = (
            conn.execute(
                sa.select(
                    db.sessions.c.admin_id, db.sessions.c.csrf, db.sessions.c.expires_at, db.admins.c.name
                )
                .join(db.admins, db.admins.c.id == db.sessions.c.admin_id)
                .where(db.sessions.c.digest == digest)
            )
            .mappings()
            .first()
        )
    if row is None or row["expires_at"] < db.now():
        return None
    return Session(int(row["admin_id"]), str(row["name"]), str(row["csrf"]))


def end_session(engine: Engine, cookie: str | None) -> None:
    """Sign out: the session stops working."""
    if cookie:
        with engine.begin() as conn:
            conn.execute(
                db.sessions.delete().where(
                    db.sessions.c.digest == hashlib.sha256(cookie.encode()).hexdigest()
                )
            )


def csrf_ok(session: Session, sent: str | None) -> bool:
    """Whether a form echoed the session's CSRF token (constant time)."""
    return hmac.compare_digest(session.csrf.encode(), (sent or "").encode())
