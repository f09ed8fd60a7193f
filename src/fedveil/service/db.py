"""The service's database: SQLAlchemy Core over SQLite by default (a file, no server), PostgreSQL through a
URL for deployments, with schema migrations from the first release on.

**Migrations.** :data:`MIGRATIONS` is the ordered list of schema changes; each is a function of a
connection that brings the schema from version ``i`` to ``i + 1``, and defines the tables *as they were
at that version* (never the current :data:`metadata`, which would make an old migration depend on today's
schema). :func:`migrate` applies the missing ones in one transaction each and records the version in
``schema_version``; a database newer than this code is refused. The query tables below (:data:`metadata`)
must equal the schema the migrations build: a test compares them column by column.

**What is stored.** Applications and their tokens (only a salt and a hash of the secret), administrators
(a scrypt hash of the password) and their sessions (a hash of the cookie), user groups, the policy each
application may use each group's data under (with a version number for concurrent edits), devices and
their group, jobs (request, status, progress, outcome) and an audit log. Text fields are bound as
parameters in every statement, never formatted into SQL.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from fedveil.errors import ConfigError

__all__ = [
    "MIGRATIONS",
    "admins",
    "applications",
    "audit",
    "connect",
    "devices",
    "groups",
    "jobs",
    "metadata",
    "migrate",
    "now",
    "policies",
    "schema_version",
    "sessions",
    "tokens",
]

metadata = sa.MetaData()


def _tables(md: sa.MetaData) -> dict[str, sa.Table]:
    """The tables of schema version 1 on ``md``."""
    t = {}
    t["schema_version"] = sa.Table("schema_version", md, sa.Column("version", sa.Integer, nullable=False))
    t["applications"] = sa.Table(
        "applications",
        md,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(200), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    t["tokens"] = sa.Table(
        "tokens",
        md,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("application_id", sa.Integer, sa.ForeignKey("applications.id"), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=False, unique=True),
        sa.Column("salt", sa.String(64), nullable=False),
        sa.Column("digest", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("revoked_at", sa.DateTime, nullable=True),
    )
    t["admins"] = sa.Table(
        "admins",
        md,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(200), nullable=False, unique=True),
        sa.Column("salt", sa.String(64), nullable=False),
        sa.Column("digest", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    t["sessions"] = sa.Table(
        "sessions",
        md,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("admin_id", sa.Integer, sa.ForeignKey("admins.id"), nullable=False),
        sa.Column("digest", sa.String(128), nullable=False, unique=True),
        sa.Column("csrf", sa.String(128), nullable=False),
        sa.Column("expires_at", sa.DateTime, nullable=False),
    )
    t["groups"] = sa.Table(
        "groups",
        md,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(200), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    t["policies"] = sa.Table(
        "policies",
        md,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("application_id", sa.Integer, sa.ForeignKey("applications.id"), nullable=False),
        sa.Column("group_id", sa.Integer, sa.ForeignKey("groups.id"), nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("updated_at", sa.DateTime, nullable=False),
        sa.UniqueConstraint("application_id", "group_id", name="one_policy_per_app_group"),
    )
    t["devices"] = sa.Table(
        "devices",
        md,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(200), nullable=False, unique=True),
        sa.Column("group_id", sa.Integer, sa.ForeignKey("groups.id"), nullable=True),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    t["jobs"] = sa.Table(
        "jobs",
        md,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("application_id", sa.Integer, sa.ForeignKey("applications.id"), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("request", sa.Text, nullable=False),
        sa.Column("plan", sa.Text, nullable=True),
        sa.Column("progress", sa.Text, nullable=True),
        sa.Column("outcome", sa.Text, nullable=True),
        sa.Column("cancel", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("updated_at", sa.DateTime, nullable=False),
    )
    t["audit"] = sa.Table(
        "audit",
        md,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("at", sa.DateTime, nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("action", sa.String(80), nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
    )
    return t


def _v1(conn: Connection) -> None:
    """Version 1: every table of the first release."""
    md = sa.MetaData()
    tables = _tables(md)
    md.create_all(conn, tables=[t for n, t in tables.items() if n != "schema_version"])


MIGRATIONS: list[Callable[[Connection], None]] = [_v1]
"""Schema changes in order; index ``i`` brings the schema from version ``i`` to ``i + 1``."""

_current = _tables(metadata)
schema_version = _current["schema_version"]
applications = _current["applications"]
tokens = _current["tokens"]
admins = _current["admins"]
sessions = _current["sessions"]
groups = _current["groups"]
policies = _current["policies"]
devices = _current["devices"]
jobs = _current["jobs"]
audit = _current["audit"]


def now() -> dt.datetime:
    """The service's clock: UTC, naive (stored as such in every backend), to the second."""
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None, microsecond=0)


def _url(db: str | Path) -> str:
    text = str(db)
    if "://" in text:
        if not text.startswith(("sqlite://", "postgresql://", "postgresql+")):
            raise ConfigError(f"database URL {text.split('://')[0]}://... is not sqlite:// or postgresql://")
        return text
    path = Path(text)
    if path.exists() and path.is_dir():
        raise ConfigError(f"database path {path} is a directory: give a file such as {path / 'fedveil.db'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def connect(db: str | Path) -> Engine:
    """An engine for ``db``: a file path (SQLite, created if absent, write-ahead log for concurrent
    readers) or a ``sqlite://`` / ``postgresql://`` URL."""
    url = _url(db)
    if url.startswith("sqlite"):
        engine = sa.create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @sa.event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):  # type: ignore[no-untyped-def]
            # the driver's own transaction handling would commit DDL at once; SQLAlchemy's BEGIN below
            # makes a migration's DDL and its version bump one transaction
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.close()

        @sa.event.listens_for(engine, "begin")
        def _begin(conn):  # type: ignore[no-untyped-def]
            conn.exec_driver_sql("BEGIN")

        return engine
    return sa.create_engine(url, pool_pre_ping=True)


def version_of(engine: Engine) -> int:
    """The schema version of the database (0: empty)."""
    with engine.connect() as conn:
        if not sa.inspect(conn).has_table("schema_version"):
            return 0
        row = conn.execute(sa.select(schema_version.c.version)).first()
        return int(row[0]) if row else 0


def migrate(engine: Engine, migrations: list[Callable[[Connection], None]] | None = None) -> int:
    """Apply the missing ``migrations`` (default :data:`MIGRATIONS`); returns the version reached. A
    database at a newer version than this code knows is refused."""
    steps = MIGRATIONS if migrations is None else migrations
    with engine.begin() as conn:
        if not sa.inspect(conn).has_table("schema_version"):
            schema_version.create(conn)
            conn.execute(schema_version.insert().values(version=0))
    have = version_of(engine)
    if have > len(steps):
        raise ConfigError(
            f"the database is at schema version {have}, newer than this fedveil ({len(steps)}): "
            "upgrade fedveil"
        )
    for i in range(have, len(steps)):
        with engine.begin() as conn:
            steps[i](conn)
            conn.execute(schema_version.update().values(version=i + 1))
    return len(steps)
