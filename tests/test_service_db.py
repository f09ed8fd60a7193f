"""The service's database and secrets: migrations from an empty file, schema equal to the query tables,
a newer database refused, tokens and passwords stored only hashed, sessions, and names that look like SQL
injection stored verbatim or refused, never executed."""

from __future__ import annotations

import sqlite3
import string
from pathlib import Path

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from fedveil.errors import ConfigError
from fedveil.service import auth, db


@pytest.fixture()
def engine(tmp_path: Path) -> sa.Engine:
    e = db.connect(tmp_path / "t.db")
    db.migrate(e)
    return e


def test_migrations_build_exactly_the_query_tables(tmp_path: Path) -> None:
    e = db.connect(tmp_path / "fresh.db")
    assert db.version_of(e) == 0
    assert db.migrate(e) == len(db.MIGRATIONS)
    assert db.migrate(e) == len(db.MIGRATIONS)  # idempotent
    inspector = sa.inspect(e)
    for table in db.metadata.sorted_tables:
        have = {c["name"]: type(c["type"]).__name__ for c in inspector.get_columns(table.name)}
        want = {c.name: type(c.type.as_generic()).__name__ for c in table.columns}
        assert set(have) == set(want), table.name
    assert set(inspector.get_table_names()) == {t.name for t in db.metadata.sorted_tables}


def test_a_later_migration_applies_once_in_order_and_a_newer_database_is_refused(tmp_path: Path) -> None:
    e = db.connect(tmp_path / "m.db")
    db.migrate(e)
    applied: list[int] = []

    def v2(conn: sa.Connection) -> None:
        applied.append(2)
        conn.execute(sa.text("ALTER TABLE groups ADD COLUMN description TEXT"))

    assert db.migrate(e, [*db.MIGRATIONS, v2]) == 2
    assert db.migrate(e, [*db.MIGRATIONS, v2]) == 2
    assert applied == [2]
    assert "description" in {c["name"] for c in sa.inspect(e).get_columns("groups")}
    with pytest.raises(ConfigError, match="schema version 2, newer than this fedveil"):
        db.migrate(e)


def test_a_failed_migration_leaves_the_previous_version(tmp_path: Path) -> None:
    e = db.connect(tmp_path / "f.db")
    db.migrate(e)

    def broken(conn: sa.Connection) -> None:
        conn.execute(sa.text("CREATE TABLE half (x INTEGER)"))
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        db.migrate(e, [*db.MIGRATIONS, broken])
    assert db.version_of(e) == len(db.MIGRATIONS)
    assert "half" not in sa.inspect(e).get_table_names()


def test_bad_database_arguments_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        db.connect(tmp_path)
    with pytest.raises(ConfigError, match="mysql"):
        db.connect("mysql://x")


def test_tokens_verify_revoke_and_are_stored_hashed(engine: sa.Engine, tmp_path: Path) -> None:
    app = auth.create_application(engine, "app")
    token = auth.issue_token(engine, app)
    assert auth.verify_token(engine, token) == app
    assert auth.verify_token(engine, None) is None
    assert auth.verify_token(engine, token + "x") is None
    key_id, secret = token.split(".")[1:]
    with sqlite3.connect(tmp_path / "t.db") as conn:
        (row,) = conn.execute("SELECT key_id, salt, digest FROM tokens").fetchall()
    assert row[0] == key_id and secret not in "".join(row)
    assert auth.revoke_token(engine, key_id)
    assert not auth.revoke_token(engine, key_id)
    assert auth.verify_token(engine, token) is None
    with pytest.raises(ConfigError, match="no application with id 99"):
        auth.issue_token(engine, 99)


@settings(max_examples=60, deadline=None)
@given(position=st.integers(0, 42), char=st.sampled_from(string.ascii_letters + string.digits + "-_"))
def test_no_changed_secret_verifies(
    tmp_path_factory: pytest.TempPathFactory, position: int, char: str
) -> None:
    e = _shared_engine(tmp_path_factory)
    token = _shared_token(e)
    head, secret = token.rsplit(".", 1)
    changed = secret[:position] + char + secret[position + 1 :]
    assert (auth.verify_token(e, f"{head}.{changed}") is not None) == (changed == secret)


_cache: dict[str, object] = {}


def _shared_engine(factory: pytest.TempPathFactory) -> sa.Engine:
    if "engine" not in _cache:
        e = db.connect(factory.mktemp("hyp") / "h.db")
        db.migrate(e)
        _cache["engine"] = e
    return _cache["engine"]  # type: ignore[return-value]


def _shared_token(e: sa.Engine) -> str:
    if "token" not in _cache:
        _cache["token"] = auth.issue_token(e, auth.create_application(e, "hyp"))
    return _cache["token"]  # type: ignore[return-value]


def test_admin_passwords_and_sessions(engine: sa.Engine) -> None:
    with pytest.raises(ConfigError, match="at least 12"):
        auth.create_admin(engine, "root", "short")
    admin = auth.create_admin(engine, "root", "a long enough password")
    with pytest.raises(ConfigError, match="exists already"):
        auth.create_admin(engine, "root", "another long password")
    assert auth.check_admin(engine, "root", "a long enough password") == admin
    assert auth.check_admin(engine, "root", "a long enough passwort") is None
    assert auth.check_admin(engine, "nobody", "a long enough password") is None
    cookie = auth.start_session(engine, admin)
    s = auth.session_of(engine, cookie)
    assert s is not None and s.admin == "root" and auth.csrf_ok(s, s.csrf)
    assert not auth.csrf_ok(s, "") and not auth.csrf_ok(s, None) and not auth.csrf_ok(s, s.csrf[:-1])
    assert auth.session_of(engine, cookie + "x") is None
    auth.end_session(engine, cookie)
    assert auth.session_of(engine, cookie) is None


@pytest.mark.parametrize(
    "name", ["x'); DROP TABLE applications; --", 'a" OR 1=1 --', "", "x" * 101, "../etc"]
)
def test_names_outside_the_alphabet_are_refused_not_executed(engine: sa.Engine, name: str) -> None:
    with pytest.raises(ConfigError, match="must be 1-100 characters"):
        auth.create_application(engine, name)
    assert sa.inspect(engine).has_table("applications")


def test_injection_shaped_text_is_stored_verbatim(engine: sa.Engine) -> None:
    app = auth.create_application(engine, "app")
    text = 'get_data(data_type="x\'); DROP TABLE policies; --").runFL.return'
    with engine.begin() as conn:
        gid = conn.execute(db.groups.insert().values(name="g", created_at=db.now())).inserted_primary_key[0]
        conn.execute(
            db.policies.insert().values(
                application_id=app, group_id=gid, text=text, version=1, updated_at=db.now()
            )
        )
    with engine.connect() as conn:
        assert conn.execute(sa.select(db.policies.c.text)).scalar() == text
        assert sa.inspect(conn).has_table("policies")
