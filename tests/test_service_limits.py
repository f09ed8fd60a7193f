"""The PoliFL service's limits under hostile applications and careless administrators, through FastAPI's
test client: one wall-clock budget per job that its calls into the server count against, submissions
bounded per application, host functions misused by a program, hostile JSON (NaN, infinity, deep, huge,
wrong types) answered 4xx and never 5xx, streamed oversize bodies, ids that are not whole numbers, and
sign-in throttling with its unlock."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedveil.errors import ConfigError
from fedveil.service import auth, db
from fedveil.service.app import ServiceSettings, SubmissionLimits, create_app
from fedveil.service.demo import CASCADED, LOCAL, seed_demo
from fedveil.service.jobs import Population

POPULATION = Population("mpu", 8)
PASSWORD = "a long enough password"
LOOPING = """
def main(model, groups, rounds):
    while True:
        try:
            model = release(run_fl(model, [groups[0]["name"]], rounds))
        except Exception:
            pass
"""


def _job(**overrides: Any) -> dict[str, Any]:
    job: dict[str, Any] = {
        "name": "engagement",
        "global_program": CASCADED,
        "local_program": LOCAL,
        "model": "engagement",
        "hyper": {"rounds": 2, "clients_per_round": 3, "hidden": 8, "lr": 0.5},
        "groups": [{"name": "gr1", "noise": 5.0}, {"name": "gr2", "noise": 5.0}],
    }
    job.update(overrides)
    return job


def _app(folder: Path, **overrides: Any) -> tuple[Any, str]:
    values: dict[str, Any] = {"run_jobs": False, "program_seconds": 3.0, **overrides}
    app = create_app(
        ServiceSettings(db=str(folder / "s.db"), folder=folder, population=POPULATION, tls=False, **values)
    )
    return app, seed_demo(app.state.engine)


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _events(app: Any, action: str) -> list[str]:
    with app.state.engine.connect() as conn:
        return [r.detail for r in conn.execute(sa.select(db.audit).where(db.audit.c.action == action))]


@pytest.fixture(scope="module")
def checking(tmp_path_factory: pytest.TempPathFactory):
    """A service that checks jobs but does not run them, with generous submission limits."""
    app, token = _app(tmp_path_factory.mktemp("checking"), submissions_per_minute=10_000)
    with TestClient(app) as client:
        yield client, token, app


# ---------------------------------------------------------------------------------- one budget per job


def test_a_looping_global_program_fails_within_its_budget_while_the_service_answers(tmp_path: Path) -> None:
    budget = 3.0
    app, token = _app(tmp_path, check_seconds=budget)
    answer: dict[str, Any] = {}
    with TestClient(app) as client:

        def submit() -> None:
            started = time.monotonic()
            answer["response"] = client.post(
                "/api/v1/jobs", json=_job(global_program=LOOPING), headers=_auth(token)
            )
            answer["seconds"] = time.monotonic() - started

        worker = threading.Thread(target=submit)
        worker.start()
        waits = []
        give_up = time.monotonic() + budget + 30
        while worker.is_alive() and time.monotonic() < give_up:
            started = time.monotonic()
            assert client.get("/api/v1/groups", headers=_auth(token)).status_code == 200
            waits.append(time.monotonic() - started)
            worker.join(0.2)
        assert not worker.is_alive(), "the submission was not answered within its budget"
        r = answer["response"]
        assert r.status_code == 422, r.text
        assert answer["seconds"] < budget + 5
        assert "took longer than its 3.0 s" in r.json()["detail"] and "deadline" in r.json()["detail"]
        assert len(waits) >= 3 and max(waits) < 2.0
        status = client.get(f"/api/v1/jobs/{r.json()['job']}", headers=_auth(token)).json()
    assert status["status"] == "failed" and "deadline" in status["outcome"]["reason"]
    assert any(f"job {r.json()['job']}:" in d and "deadline" in d for d in _events(app, "program failed"))


def test_a_call_into_the_server_that_outlasts_the_check_does_not_hold_the_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedveil.experiments.polifl import runner as polifl

    build = polifl.build_task

    def slow(*args: Any) -> Any:
        time.sleep(5.0)  # a step of the check that cannot be interrupted (an accountant's long composition)
        return build(*args)

    app, token = _app(tmp_path, check_seconds=1.0, jobs_per_application=1)
    monkeypatch.setattr(polifl, "build_task", slow)
    with TestClient(app) as client:
        started = time.monotonic()
        r = client.post("/api/v1/jobs", json=_job(), headers=_auth(token))
        assert time.monotonic() - started < 1.0 + 2.0 + 1.5
        assert r.status_code == 422 and "a call into the server ran past the deadline" in r.json()["detail"]
        assert (
            client.get(f"/api/v1/jobs/{r.json()['job']}", headers=_auth(token)).json()["status"] == "failed"
        )
        # the application's slot stays taken until the lingering call has ended
        assert client.post("/api/v1/jobs", json=_job(), headers=_auth(token)).status_code == 429
        monkeypatch.undo()
        give_up = time.monotonic() + 20
        nowhere = _job(groups=[{"name": "nope"}])
        while (r := client.post("/api/v1/jobs", json=nowhere, headers=_auth(token))).status_code == 429:
            assert time.monotonic() < give_up
            time.sleep(0.5)
        assert r.status_code == 404 and "no group 'nope'" in r.json()["detail"]


def test_a_job_whose_run_outlasts_its_budget_fails_with_an_audit_event(tmp_path: Path) -> None:
    app, token = _app(tmp_path, run_jobs=True, job_seconds=10.0, check_seconds=10.0)
    job = _job(groups=[{"name": "gr2"}], hyper={"rounds": 5000, "clients_per_round": 2, "hidden": 8})
    with TestClient(app) as client:
        r = client.post("/api/v1/jobs", json=job, headers=_auth(token))
        assert r.status_code == 202, r.text
        started = time.monotonic()
        while time.monotonic() - started < 60:
            status = client.get(f"/api/v1/jobs/{r.json()['id']}", headers=_auth(token)).json()
            if status["status"] not in ("queued", "running"):
                break
            time.sleep(0.2)
    assert status["status"] == "failed", status
    assert time.monotonic() - started < 10.0 + 5
    assert "time budget of 10.0 s" in status["outcome"]["error"]
    assert status["progress"]["round"] < 5000
    assert any("time budget of 10.0 s" in d for d in _events(app, "job failed"))


# ---------------------------------------------------------------------------------- submissions per app


def test_an_application_with_too_many_jobs_at_once_gets_429(tmp_path: Path) -> None:
    app, token = _app(tmp_path, jobs_per_application=1)
    other = auth.issue_token(app.state.engine, auth.create_application(app.state.engine, "other-app"))
    with TestClient(app) as client:
        first = client.post("/api/v1/jobs", json=_job(), headers=_auth(token))
        assert first.status_code == 202 and first.json()["status"] == "queued"  # jobs are not run here
        second = client.post("/api/v1/jobs", json=_job(), headers=_auth(token))
        assert second.status_code == 429
        assert int(second.headers["retry-after"]) >= 1 and "at most 1 jobs" in second.json()["detail"]
        # another application is not held back by this one
        assert client.post("/api/v1/jobs", json=_job(), headers=_auth(other)).status_code == 403
        assert (
            client.post(f"/api/v1/jobs/{first.json()['id']}/cancel", headers=_auth(token)).status_code == 200
        )
        assert client.post("/api/v1/jobs", json=_job(), headers=_auth(token)).status_code == 202


def test_an_application_submitting_too_often_gets_429_until_the_minute_passes(tmp_path: Path) -> None:
    app, token = _app(tmp_path, submissions_per_minute=3)
    nowhere = _job(groups=[{"name": "nope"}])
    with TestClient(app) as client:
        assert [
            client.post("/api/v1/jobs", json=nowhere, headers=_auth(token)).status_code for _ in range(3)
        ] == [404] * 3
        r = client.post("/api/v1/jobs", json=nowhere, headers=_auth(token))
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 60
    now = [0.0]
    limits = SubmissionLimits(concurrent=10, per_minute=2, busy_seconds=5.0, clock=lambda: now[0])
    for _ in range(2):
        assert limits.enter(7, lambda: 0) is None
        limits.leave(7)
    now[0] = 45.0
    assert limits.enter(7, lambda: 0) == pytest.approx(15.0)
    assert limits.enter(8, lambda: 0) is None  # per application
    now[0] = 60.5
    assert limits.enter(7, lambda: 0) is None
    one = SubmissionLimits(concurrent=1, per_minute=9, busy_seconds=5.0)
    assert one.enter(1, lambda: 1) == 5.0  # a job queued or running
    assert one.enter(2, lambda: 0) is None
    assert one.enter(2, lambda: 0) == 5.0  # a job being checked
    one.leave(2)
    assert one.enter(2, lambda: 0) is None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("job_seconds", 0),
        ("check_seconds", float("nan")),
        ("jobs_per_application", 0),
        ("sign_in_failures", True),
    ],
)
def test_limits_out_of_range_are_refused_with_their_name(tmp_path: Path, name: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=name):
        ServiceSettings(db=str(tmp_path / "s.db"), folder=tmp_path, **{name: value})


# ---------------------------------------------------------------------------------- host functions misused

MISUSE = """
def main(model, groups, rounds):
    name = groups[0]["name"]
    calls = [
        [lambda: run_fl(1, 2, 3), "run_fl's model must be"],
        [lambda: run_fl(model, name, rounds), "must be a list of group names"],
        [lambda: run_fl(model, [name], rounds, speed=2), "run_fl(model, names, rounds) called wrongly"],
        [lambda: run_fl(model), "run_fl(model, names, rounds) called wrongly"],
        [lambda: run_fl(model, [name], 10**9), "must be an integer from 1 to 4 (the job's rounds"],
        [lambda: release("x"), "release's model must be"],
        [lambda: epsilon([1]), "name one of this job's groups"],
        [lambda: epsilon("nope"), "name one of this job's groups"],
        [lambda: enforce_dp_budget(model, eps="x"), "bound 'x' must be a finite number"],
        [lambda: check_privacy_budget(model, 1.0, 2.0), "called wrongly"],
    ]
    for call, expected in calls:
        try:
            call()
            return "not refused"
        except ValueError as exc:
            if expected not in str(exc):
                return str(exc)
    for g in groups:
        model = release(run_fl(model, [g["name"]], rounds))
    return model
"""


def test_host_function_misuse_reaches_the_program_which_may_handle_it(checking) -> None:
    client, token, _ = checking
    r = client.post("/api/v1/jobs", json=_job(global_program=MISUSE), headers=_auth(token))
    assert r.status_code == 202, r.text


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        ("run_fl(1, 2, 3)", "run_fl's model must be"),
        ("release('x')", "release's model must be"),
        ("epsilon([1])", "name one of this job's groups"),
        ("run_fl(model, ['gr1'], rounds, speed=2)", "unexpected keyword argument 'speed'"),
    ],
)
def test_unhandled_host_function_misuse_fails_the_job_with_an_audit_event(
    checking, call: str, expected: str
) -> None:
    client, token, app = checking
    program = f"def main(model, groups, rounds):\n    return release({call})\n"
    r = client.post("/api/v1/jobs", json=_job(global_program=program), headers=_auth(token))
    assert r.status_code == 422, r.text
    assert "HostError" in r.json()["detail"] and expected in r.json()["detail"]
    status = client.get(f"/api/v1/jobs/{r.json()['job']}", headers=_auth(token)).json()
    assert status["status"] == "failed"
    assert any(f"job {r.json()['job']}:" in d and expected in d for d in _events(app, "program failed"))


def test_a_server_failure_while_checking_a_job_fails_the_job_not_the_service(
    checking, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedveil.experiments.polifl import runner as polifl

    def exhausted(*_: Any) -> None:
        raise MemoryError("Unable to allocate 655. TiB")

    client, token, app = checking
    monkeypatch.setattr(polifl._Host, "_plan", exhausted)
    r = client.post("/api/v1/jobs", json=_job(), headers=_auth(token))
    assert r.status_code == 422 and "failed on the server's side (MemoryError)" in r.json()["detail"]
    assert client.get(f"/api/v1/jobs/{r.json()['job']}", headers=_auth(token)).json()["status"] == "failed"
    assert any(f"job {r.json()['job']}:" in d for d in _events(app, "program failed"))


# ---------------------------------------------------------------------------------- hostile JSON


def _post_raw(client: TestClient, path: str, body: bytes, headers: dict[str, str]) -> Any:
    return client.post(path, content=body, headers={**headers, "content-type": "application/json"})


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
@pytest.mark.parametrize("field", ["noise", "lr", "rounds"])
def test_nan_and_infinity_are_refused_with_a_json_422(checking, raw: str, field: str) -> None:
    client, token, _ = checking
    job = _job(groups=[{"name": "gr1", "noise": "@noise@"}], hyper={"lr": "@lr@", "rounds": "@rounds@"})
    values = {"noise": "1.0", "lr": "0.5", "rounds": "2", field: raw}
    body = json.dumps(job)
    for name, value in values.items():
        body = body.replace(f'"@{name}@"', value)
    r = _post_raw(client, "/api/v1/jobs", body.encode(), _auth(token))
    assert r.status_code == 422, r.text
    detail = json.loads(r.text, parse_constant=lambda c: pytest.fail(f"{c} in the answer"))["detail"]
    assert detail[0]["loc"][-1] == field and set(detail[0]) == {"loc", "msg", "type"}


def _hostile() -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(min_value=-(10**30), max_value=10**30),
        st.booleans(),
        st.none(),
        st.text(max_size=30),
        st.just("x" * 100_000),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=12,
    )


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    where=st.sampled_from(
        [
            "name",
            "global_program",
            "local_program",
            "model",
            "hyper",
            "groups",
            "extra",
            "whole",
            "group0",
            "noise",
            "rounds",
            "lr",
        ]
    ),
    value=_hostile(),
    depth=st.integers(min_value=1, max_value=200_000),
)
def test_hostile_json_on_the_job_api_is_never_a_5xx(checking, where: str, value: Any, depth: int) -> None:
    client, token, _ = checking
    job = _job(groups=[{"name": "nope"}])  # a job that gets through is refused at once (no such group)
    if where == "whole":
        job = value
    elif where == "group0":
        job["groups"] = [value]
    elif where in ("noise",):
        job["groups"][0]["noise"] = value
    elif where in ("rounds", "lr"):
        job["hyper"][where] = value
    else:
        job[where] = value
    body = json.dumps(job).encode()
    for path, payload in (
        ("/api/v1/jobs", body),
        ("/api/v1/jobs", _nested(depth)),
        ("/api/v1/jobs/1/cancel", body),
        ("/api/v1/jobs/1/resume", body),
    ):
        r = _post_raw(client, path, payload, _auth(token))
        assert r.status_code < 500, (path, r.text[:300])
        if r.status_code == 422:
            json.loads(r.text, parse_constant=lambda c: pytest.fail(f"{c} in the answer"))


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    value=_hostile(),
    path=st.sampled_from(
        [
            "/admin/login",
            "/admin/applications",
            "/admin/groups",
            "/admin/policies",
            "/admin/policies/1",
            "/admin/devices/assign",
            "/admin/devices/1",
            "/admin/tokens/abc/revoke",
            "/admin/logout",
        ]
    ),
)
def test_hostile_json_on_the_admin_pages_is_never_a_5xx(checking, value: Any, path: str) -> None:
    client, _, _ = checking
    r = _post_raw(client, path, json.dumps(value).encode(), {})
    assert r.status_code < 500, (path, r.text[:300])


# ---------------------------------------------------------------------------------- bodies and ids


def test_a_streamed_body_over_the_limit_is_413(checking) -> None:
    client, token, _ = checking

    def chunks(total: int):
        yield b'{"name": "'
        for _ in range(total // 65536):
            yield b"x" * 65536
        yield b'"}'

    r = client.post(
        "/api/v1/jobs", content=chunks(2 << 20), headers={**_auth(token), "content-type": "application/json"}
    )
    assert r.status_code == 413 and "larger than 1048576 bytes" in r.json()["detail"]
    assert "content-length" not in {k.lower() for k in r.request.headers}
    small = json.dumps(_job(groups=[{"name": "nope"}])).encode()
    r = client.post(
        "/api/v1/jobs",
        content=iter([small[:100], small[100:]]),
        headers={**_auth(token), "content-type": "application/json"},
    )
    assert r.status_code == 404 and "no group 'nope'" in r.json()["detail"]


@pytest.mark.parametrize("job_id", ["1.0", "1e0", "+1", "0x1", "1.5", " 1"])
def test_ids_are_whole_numbers_in_digits(checking, job_id: str) -> None:
    client, token, _ = checking
    r = client.post("/api/v1/jobs", json=_job(groups=[{"name": "nope"}]), headers=_auth(token))
    assert r.status_code == 404 and r.json()["job"] >= 1
    real = r.json()["job"]
    assert client.get(f"/api/v1/jobs/{real}", headers=_auth(token)).status_code == 200
    spelled = job_id.replace("1", str(real), 1) if job_id != "1.5" else f"{real}.5"
    for method, path in (
        ("GET", f"/api/v1/jobs/{spelled}"),
        ("GET", f"/api/v1/jobs/{spelled}/model"),
        ("POST", f"/api/v1/jobs/{spelled}/cancel"),
        ("POST", f"/api/v1/jobs/{spelled}/resume"),
        ("GET", f"/admin/policies/{spelled}"),
        ("POST", f"/admin/policies/{spelled}"),
        ("POST", f"/admin/policies/{spelled}/delete"),
        ("POST", f"/admin/devices/{spelled}"),
        ("POST", f"/admin/applications/{spelled}/token"),
    ):
        r = client.request(method, path, headers=_auth(token))
        assert r.status_code in (404, 422), (method, path, r.status_code)


# ---------------------------------------------------------------------------------- sign-in throttling


def _csrf(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def _sign_in(client: TestClient, name: str, password: str) -> Any:
    page = client.get("/admin/login")
    return client.post("/admin/login", data={"csrf": _csrf(page.text), "name": name, "password": password})


def test_sign_in_is_throttled_per_account_and_address_and_a_restart_unlocks(tmp_path: Path) -> None:
    app, _ = _app(tmp_path, sign_in_failures=3, sign_in_address_failures=10, sign_in_lockout=600.0)
    auth.create_admin(app.state.engine, "root", PASSWORD)
    with TestClient(app, follow_redirects=False) as client:
        # a success clears the account's failures
        for _ in range(2):
            assert _sign_in(client, "root", "wrong").status_code == 200
        assert _sign_in(client, "root", PASSWORD).status_code == 303
        for _ in range(3):
            r = _sign_in(client, "root", "wrong")
            assert r.status_code == 200 and "Wrong name or password." in r.text
        locked = _sign_in(client, "root", PASSWORD)  # even the right password: not checked now
        assert locked.status_code == 429 and "Too many failed sign-ins" in locked.text
        assert 540 <= int(locked.headers["retry-after"]) <= 600
        # an account that does not exist is answered exactly alike
        for _ in range(3):
            assert _sign_in(client, "ghost", "wrong").status_code == 200
        ghost = _sign_in(client, "ghost", "wrong")
        assert ghost.status_code == 429
        assert _csrf_free(ghost.text) == _csrf_free(locked.text)
        # per address: failures over many names (root 5, ghost 3, these 2) lock the address for every name
        for i in range(2):
            assert _sign_in(client, f"guess{i}", "wrong").status_code == 200
        assert _sign_in(client, "fresh", "wrong").status_code == 429
    assert any("from testclient" in d for d in _events(app, "sign-in locked"))
    # the operator's unlock: restart the service
    restarted = create_app(
        ServiceSettings(
            db=str(tmp_path / "s.db"), folder=tmp_path, population=POPULATION, tls=False, run_jobs=False
        )
    )
    with TestClient(restarted, follow_redirects=False) as client:
        assert _sign_in(client, "root", PASSWORD).status_code == 303


def _csrf_free(html: str) -> str:
    return re.sub(r'name="csrf" value="[^"]+"', "", html)


def test_a_lock_ends_after_its_back_off_and_memory_stays_bounded() -> None:
    now = [0.0]
    throttle = auth.SignInThrottle(2, 100, 60.0, keys=50, clock=lambda: now[0])
    assert throttle.failed("root", "10.0.0.1") is False
    assert throttle.failed("root", "10.0.0.1") is True
    assert throttle.retry_after("root", "10.0.0.2") == pytest.approx(60.0)
    now[0] = 30.0
    assert throttle.retry_after("root", "10.0.0.2") == pytest.approx(30.0)
    now[0] = 60.0
    assert throttle.retry_after("root", "10.0.0.2") is None
    for i in range(500):
        throttle.failed(f"made-up-{i}", f"10.1.{i // 250}.{i % 250}")
    assert len(throttle._failures) <= 50


def test_fedveil_serve_takes_the_limits_as_flags_and_refuses_bad_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedveil.cli import main
    from fedveil.service import serve

    seen: list[Any] = []
    monkeypatch.setattr(serve, "serve", seen.append)
    flags = ["--job-seconds", "120", "--check-seconds", "5", "--jobs-per-application", "2"]
    flags += ["--submissions-per-minute", "7", "--max-body-bytes", "4096", "--sign-in-failures", "3"]
    flags += ["--sign-in-address-failures", "9", "--sign-in-lockout", "60"]
    main(["serve", "--data", str(tmp_path), *flags])
    options = seen[0]
    assert (options.job_seconds, options.check_seconds, options.jobs_per_application) == (120.0, 5.0, 2)
    assert (options.submissions_per_minute, options.max_body_bytes) == (7, 4096)
    assert (options.sign_in_failures, options.sign_in_address_failures, options.sign_in_lockout) == (
        3,
        9,
        60.0,
    )
    monkeypatch.undo()
    assert main(["serve", "--data", str(tmp_path), "--job-seconds", "0", "--insecure"]) == 2
    assert "job_seconds 0.0 must be a number of seconds > 0" in capsys.readouterr().err
    assert not (tmp_path / "fedveil.db").exists()  # refused before anything started
