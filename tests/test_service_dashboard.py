"""The administrators' dashboard through the test client: sign-in, CSRF on every form, policies parsed on
save with the parser's error in the page, concurrent edits refused rather than lost, tokens shown once,
devices moved between groups, and the security headers. (tests/test_service_browser.py drives the same
pages in headless Chromium.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from fedveil.privacy import policy
from fedveil.service import auth, db
from fedveil.service.app import ServiceSettings, create_app
from fedveil.service.jobs import Population

PASSWORD = "a long enough password"


@pytest.fixture()
def site(tmp_path: Path):
    settings = ServiceSettings(
        db=str(tmp_path / "d.db"), folder=tmp_path, population=Population("mpu", 6), tls=False, run_jobs=False
    )
    app = create_app(settings)
    auth.create_admin(app.state.engine, "root", PASSWORD)
    with TestClient(app, follow_redirects=False) as client:
        yield client, app.state.engine


def _csrf(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def _sign_in(client: TestClient) -> str:
    page = client.get("/admin/login")
    r = client.post("/admin/login", data={"csrf": _csrf(page.text), "name": "root", "password": PASSWORD})
    assert r.status_code == 303 and r.headers["location"] == "/admin"
    return _csrf(client.get("/admin").text)


def test_signing_in_needs_the_password_and_the_forms_token(site) -> None:
    client, _ = site
    assert client.get("/admin").headers["location"] == "/admin/login"
    page = client.get("/admin/login")
    assert "fv_login" in page.cookies
    assert client.post("/admin/login", data={"name": "root", "password": PASSWORD}).status_code == 403
    wrong = client.post("/admin/login", data={"csrf": _csrf(page.text), "name": "root", "password": "nope"})
    assert wrong.status_code == 200 and "Wrong name or password." in wrong.text
    csrf = _sign_in(client)
    html = client.get("/admin").text
    assert "signed in as root" in html
    r = client.post("/admin/logout", data={"csrf": csrf})
    assert r.status_code == 303
    assert client.get("/admin").headers["location"] == "/admin/login"


def test_every_form_needs_the_sessions_csrf_token(site) -> None:
    client, engine = site
    _sign_in(client)
    for path in (
        "/admin/groups",
        "/admin/applications",
        "/admin/policies",
        "/admin/devices/assign",
        "/admin/logout",
    ):
        assert client.post(path, data={"name": "g"}).status_code == 403, path
        assert client.post(path, data={"name": "g", "csrf": "forged"}).status_code == 403, path
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(db.groups)).scalar() == 0
    client.cookies.clear()
    assert client.post("/admin/groups", data={"name": "g", "csrf": "x"}).status_code == 401


def test_applications_tokens_groups_and_devices(site) -> None:
    client, engine = site
    csrf = _sign_in(client)
    page = client.post("/admin/applications", data={"csrf": csrf, "name": "weather"})
    token = re.search(r'<pre id="token">([^<]+)</pre>', page.text).group(1)
    assert auth.verify_token(engine, token) is not None
    assert token not in client.get("/admin").text  # shown once
    bad = client.post("/admin/applications", data={"csrf": csrf, "name": "<script>alert(1)</script>"})
    assert bad.status_code == 400 and "&lt;script&gt;" in bad.text and "<script>" not in bad.text
    for g in ("gr1", "gr2"):
        assert client.post("/admin/groups", data={"csrf": csrf, "name": g}).status_code == 303
    assert client.post("/admin/groups", data={"csrf": csrf, "name": "gr1"}).status_code == 400
    assert client.post("/admin/devices/assign", data={"csrf": csrf}).status_code == 303
    with engine.connect() as conn:
        counts = dict(
            conn.execute(
                sa.select(db.devices.c.group_id, sa.func.count()).group_by(db.devices.c.group_id)
            ).all()
        )
    assert sorted(counts.values()) == [3, 3]
    device = client.get("/admin/devices")
    assert device.status_code == 200 and device.text.count("<select") == 6
    r = client.post("/admin/devices/1", data={"csrf": csrf, "group": "gr2"})
    assert r.status_code == 303
    assert client.post("/admin/devices/1", data={"csrf": csrf, "group": "nope"}).status_code == 404
    key_id = token.split(".")[1]
    assert client.post(f"/admin/tokens/{key_id}/revoke", data={"csrf": csrf}).status_code == 303
    assert auth.verify_token(engine, token) is None


def test_policies_are_parsed_on_save_and_stale_edits_are_refused(site) -> None:
    client, engine = site
    csrf = _sign_in(client)
    client.post("/admin/applications", data={"csrf": csrf, "name": "weather"})
    client.post("/admin/groups", data={"csrf": csrf, "name": "gr1"})
    bad = client.post(
        "/admin/policies",
        data={"csrf": csrf, "application": "weather", "group": "gr1", "text": "get_data(.runFL"},
    )
    assert bad.status_code == 400 and "the policy does not parse" in bad.text
    assert 'value="get_data(.runFL"' in bad.text  # the text is kept for correction
    good = 'get_data(data_type="MPU").runFL.enforce_dp_budget(eps=5).return'
    ok = client.post(
        "/admin/policies", data={"csrf": csrf, "application": "weather", "group": "gr1", "text": good}
    )
    assert ok.status_code == 303
    twice = client.post(
        "/admin/policies", data={"csrf": csrf, "application": "weather", "group": "gr1", "text": good}
    )
    assert twice.status_code == 409
    with engine.connect() as conn:
        pid = conn.execute(sa.select(db.policies.c.id)).scalar()
    # two administrators open the same policy at version 1
    form = client.get(f"/admin/policies/{pid}").text
    assert 'name="version" value="1"' in form
    first = client.post(
        f"/admin/policies/{pid}", data={"csrf": csrf, "version": "1", "text": good.replace("5", "4")}
    )
    assert first.status_code == 303
    second = client.post(
        f"/admin/policies/{pid}", data={"csrf": csrf, "version": "1", "text": good.replace("5", "9")}
    )
    assert second.status_code == 409 and "someone saved this policy" in second.text
    with engine.connect() as conn:
        text, version = conn.execute(sa.select(db.policies.c.text, db.policies.c.version)).one()
    assert "eps=4" in text and version == 2
    unparsable = client.post(f"/admin/policies/{pid}", data={"csrf": csrf, "version": "2", "text": "runFL.."})
    assert unparsable.status_code == 400 and "does not parse" in unparsable.text
    assert client.post(f"/admin/policies/{pid}/delete", data={"csrf": csrf}).status_code == 303
    assert client.get(f"/admin/policies/{pid}").status_code == 404


def test_pages_carry_strict_security_headers(site) -> None:
    client, _ = site
    r = client.get("/admin/login")
    assert "script-src" not in r.headers["content-security-policy"]
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY"
    assert r.headers["x-content-type-options"] == "nosniff"
    assert "<script" not in r.text
    cookie = r.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie


def test_a_policy_over_the_parsers_limits_is_refused_on_save_naming_the_limit(site) -> None:
    client, engine = site
    csrf = _sign_in(client)
    client.post("/admin/applications", data={"csrf": csrf, "name": "weather"})
    client.post("/admin/groups", data={"csrf": csrf, "name": "gr1"})
    deep = "(" * 5000 + "get_data" + ")" * 5000
    wide = "+".join(f"c{i}" for i in range(policy.MAX_POLICY_NODES + 1))
    for text, limit in ((deep, f"limit of {policy.MAX_POLICY_DEPTH} levels"), (wide, "limit of")):
        r = client.post(
            "/admin/policies", data={"csrf": csrf, "application": "weather", "group": "gr1", "text": text}
        )
        assert r.status_code == 400 and limit in r.text
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(db.policies)).scalar() == 0
