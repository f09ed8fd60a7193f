"""The PoliFL service's Access Service API (003 Sec. 4.2) through FastAPI's test client, with the real job
runner: tokens, policy validation before anything runs, a job run to a released safetensors model, refusals
that name the policy, cancellation, restart recovery and abuse."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from safetensors.numpy import load as load_safetensors

from fedveil.models.behaviour import EngagementNet
from fedveil.service import auth, db
from fedveil.service.app import ServiceSettings, create_app
from fedveil.service.demo import CASCADED, LOCAL, seed_demo
from fedveil.service.jobs import Population

POPULATION = Population("mpu", 12)


def _job(**overrides: object) -> dict:
    job = {
        "name": "engagement",
        "global_program": CASCADED,
        "local_program": LOCAL,
        "model": "engagement",
        "hyper": {"rounds": 2, "clients_per_round": 3, "hidden": 8, "lr": 0.5},
        "groups": [{"name": "gr1", "noise": 5.0}, {"name": "gr2", "noise": 5.0}],
    }
    job.update(overrides)
    return job


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("service")
    settings = ServiceSettings(
        db=str(folder / "fedveil.db"), folder=folder, population=POPULATION, tls=False, program_seconds=3.0
    )
    app = create_app(settings)
    token = seed_demo(app.state.engine)
    other = auth.issue_token(app.state.engine, auth.create_application(app.state.engine, "other-app"))
    with TestClient(app) as client:
        yield client, token, other, app, folder


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _wait(
    client: TestClient, token: str, job_id: int, statuses: tuple[str, ...], timeout: float = 120.0
) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = client.get(f"/api/v1/jobs/{job_id}", headers=_auth(token)).json()
        if body["status"] in statuses:
            return body
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still {body['status']} after {timeout} s")


def test_bad_tokens_get_the_same_401_and_nothing_else(service) -> None:
    client, token, _, app, _ = service
    key_id = token.split(".")[1]
    wrong = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    revoked = auth.issue_token(app.state.engine, 1)
    assert auth.revoke_token(app.state.engine, revoked.split(".")[1])
    answers = [
        client.get("/api/v1/jobs"),
        client.get("/api/v1/jobs", headers={"Authorization": "Bearer"}),
        client.get("/api/v1/jobs", headers={"Authorization": f"Basic {token}"}),
        client.get("/api/v1/jobs", headers=_auth("fvt.not-a-token")),
        client.get("/api/v1/jobs", headers=_auth(wrong)),
        client.get("/api/v1/jobs", headers=_auth(revoked)),
        client.get("/api/v1/jobs", headers=_auth(f"fvt.{key_id}.{'x' * 43}")),
    ]
    for r in answers:
        assert r.status_code == 401
        assert r.json() == {"detail": "a valid application token is needed"}
        assert r.headers["www-authenticate"] == "Bearer"
    assert client.get("/api/v1/jobs", headers=_auth(token)).status_code == 200


def test_tokens_are_stored_only_as_salted_hashes(service) -> None:
    _, token, _, _, folder = service
    secret = token.split(".")[2]
    raw = b"".join(p.read_bytes() for p in folder.glob("fedveil.db*"))
    assert secret.encode() not in raw
    with sqlite3.connect(folder / "fedveil.db") as conn:
        rows = conn.execute("SELECT salt, digest FROM tokens").fetchall()
    assert len({salt for salt, _ in rows}) == len(rows)
    assert all(secret not in digest for _, digest in rows)


def test_groups_lists_the_applications_policies(service) -> None:
    client, token, other, _, _ = service
    groups = client.get("/api/v1/groups", headers=_auth(token)).json()
    assert [g["name"] for g in groups] == ["gr1", "gr2"]
    assert groups[0]["budget"] == 50.0 and groups[1]["budget"] is None
    assert sum(g["devices"] for g in groups) == POPULATION.size
    assert client.get("/api/v1/groups", headers=_auth(other)).json() == []


def test_a_job_runs_to_a_released_safetensors_model(service) -> None:
    client, token, other, _, _ = service
    r = client.post("/api/v1/jobs", json=_job(), headers=_auth(token))
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["status"] in ("queued", "running")
    plan = body["plan"]
    assert [s["groups"] for s in plan["stages"]] == [["gr1"], ["gr2"]]
    assert plan["rounds"] == 4 and plan["epsilon"]["gr1"] < 50
    done = _wait(client, token, body["id"], ("finished", "failed"))
    assert done["status"] == "finished", done
    out = done["outcome"]
    assert out["released"] is True and out["rounds"] == 4
    # the dry run predicted exactly what the run spent
    assert out["epsilon"] == pytest.approx(plan["epsilon"])
    assert done["progress"]["round"] == 4
    blob = client.get(f"/api/v1/jobs/{body['id']}/model", headers=_auth(token))
    assert blob.status_code == 200
    tensors = load_safetensors(blob.content)
    reference = EngagementNet(15, hidden=8).state_dict()
    assert set(tensors) == set(reference)
    assert all(tensors[k].shape == tuple(v.shape) for k, v in reference.items())
    assert all(np.isfinite(t).all() for t in tensors.values())
    # another application sees the job exactly as a job that does not exist
    for path in ("", "/model"):
        theirs = client.get(f"/api/v1/jobs/{body['id']}{path}", headers=_auth(other))
        missing = client.get(f"/api/v1/jobs/999999{path}", headers=_auth(other))
        assert theirs.status_code == missing.status_code == 404
        assert theirs.json()["detail"].replace(str(body["id"]), "N") == missing.json()["detail"].replace(
            "999999", "N"
        )
    listed = client.get("/api/v1/jobs", headers=_auth(token)).json()
    assert body["id"] in [j["id"] for j in listed]
    assert body["id"] not in [j["id"] for j in client.get("/api/v1/jobs", headers=_auth(other)).json()]


def test_a_program_the_policy_refuses_is_refused_before_it_runs(service) -> None:
    client, token, _, app, folder = service
    no_filter = 'def prepare(data):\n    return get_data(data, data_type="MPU")\n'
    r = client.post("/api/v1/jobs", json=_job(local_program=no_filter), headers=_auth(token))
    assert r.status_code == 403
    detail = r.json()["detail"]
    assert "group gr2" in detail and "filter(sensors=['loc', 'mic'])" in detail and "runFL" in detail
    job = r.json()["job"]
    status = client.get(f"/api/v1/jobs/{job}", headers=_auth(token)).json()
    assert status["status"] == "refused" and status["progress"] is None
    assert not (folder / "jobs" / str(job)).exists()
    # too little noise for gr1's budget: the release is refused in the dry run, naming the command
    r = client.post(
        "/api/v1/jobs",
        json=_job(groups=[{"name": "gr1", "noise": 0.5}], hyper={"rounds": 30, "hidden": 8}),
        headers=_auth(token),
    )
    assert r.status_code == 403
    assert (
        "enforce_dp_budget(eps=50" in r.json()["detail"]
        and "group gr1 has spent epsilon" in r.json()["detail"]
    )
    model = client.get(f"/api/v1/jobs/{r.json()['job']}/model", headers=_auth(token))
    assert model.status_code == 403 and "enforce_dp_budget" in model.json()["detail"]
    # a group the application has no policy for
    with app.state.engine.begin() as conn:
        conn.execute(db.groups.insert().values(name="gr3", created_at=db.now()))
    r = client.post("/api/v1/jobs", json=_job(groups=[{"name": "gr3"}]), headers=_auth(token))
    assert r.status_code == 403 and "no policy for group 'gr3'" in r.json()["detail"]
    r = client.post("/api/v1/jobs", json=_job(groups=[{"name": "nope"}]), headers=_auth(token))
    assert r.status_code == 404 and "no group 'nope'" in r.json()["detail"]


@pytest.mark.parametrize(
    ("program", "where"),
    [
        ("def main(model, groups, rounds):\n    return model.__class__.__subclasses__()\n", "global_program"),
        ("import os\ndef main(model, groups, rounds):\n    return os.system('true')\n", "global_program"),
        ("def main(model, groups, rounds):\n    return getattr(model, '_value')()\n", "global_program"),
        ("def prepare(data):\n    return data.__class__\n", "local_program"),
        ("def main(model, groups, rounds):\n    while True:\n        pass\n", "global_program"),
    ],
)
def test_sandbox_escapes_fail_the_job_and_leave_the_service_running(
    service, program: str, where: str
) -> None:
    client, token, _, app, _ = service
    job = _job(**{where: program})
    if where == "global_program":
        job["hyper"] = {"rounds": 1, "hidden": 8}
    started = time.monotonic()
    r = client.post("/api/v1/jobs", json=job, headers=_auth(token))
    assert r.status_code in (403, 422), r.text
    assert time.monotonic() - started < 90
    status = client.get(f"/api/v1/jobs/{r.json()['job']}", headers=_auth(token)).json()
    assert status["status"] == "failed" and status["progress"] is None
    with app.state.engine.connect() as conn:
        logged = [row.detail for row in conn.execute(sa.select(db.audit))]
    assert any(f"job {r.json()['job']}:" in d for d in logged)
    assert client.get("/api/v1/health").json()["status"] == "ok"


def test_abuse_oversize_malformed_and_injection_shaped_input(service) -> None:
    client, token, _, app, _ = service
    big = _job(global_program="#" * 60_000, local_program="#" * 60_000)
    big["name"] = "x"
    huge = json.dumps({**big, "pad": "y" * (1 << 20)})
    r = client.post(
        "/api/v1/jobs", content=huge, headers={**_auth(token), "content-type": "application/json"}
    )
    assert r.status_code == 413
    r = client.post(
        "/api/v1/jobs", content=b'{"name": "a",', headers={**_auth(token), "content-type": "application/json"}
    )
    assert r.status_code == 422
    r = client.post("/api/v1/jobs", json={**_job(), "hyper": {"rounds": "many"}}, headers=_auth(token))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "hyper", "rounds"]
    r = client.post("/api/v1/jobs", json={**_job(), "model": "resnet152"}, headers=_auth(token))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "model"]
    r = client.post("/api/v1/jobs", json={**_job(), "model": "lenet"}, headers=_auth(token))
    assert r.status_code == 422 and "allowed: engagement" in r.json()["detail"]
    injection = "x'); DROP TABLE jobs; --"
    r = client.post("/api/v1/jobs", json={**_job(), "name": injection}, headers=_auth(token))
    assert r.status_code == 422  # names are letters, digits, space and ._-
    program = f"# {injection}\n" + CASCADED
    r = client.post(
        "/api/v1/jobs", json=_job(global_program=program, groups=[{"name": "nope"}]), headers=_auth(token)
    )
    assert r.status_code == 404
    status = client.get(f"/api/v1/jobs/{r.json()['job']}", headers=_auth(token)).json()
    assert status["status"] == "refused"
    with app.state.engine.connect() as conn:
        stored = conn.execute(sa.select(db.jobs.c.request).where(db.jobs.c.id == r.json()["job"])).scalar()
        assert json.loads(stored)["global_program"] == program
        assert sa.inspect(conn).has_table("jobs")


def test_cancel_stops_a_running_job_at_its_next_round(service) -> None:
    client, token, _, _, _ = service
    r = client.post(
        "/api/v1/jobs",
        json=_job(groups=[{"name": "gr2"}], hyper={"rounds": 400, "clients_per_round": 2, "hidden": 8}),
        headers=_auth(token),
    )
    assert r.status_code == 202, r.text
    job = r.json()["id"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = client.get(f"/api/v1/jobs/{job}", headers=_auth(token)).json()
        if (status["progress"] or {}).get("round", 0) >= 1:
            break
        time.sleep(0.1)
    assert client.post(f"/api/v1/jobs/{job}/cancel", headers=_auth(token)).status_code == 200
    done = _wait(client, token, job, ("cancelled", "finished", "failed"))
    assert done["status"] == "cancelled"
    assert done["progress"]["round"] < 400
    assert client.post(f"/api/v1/jobs/{job}/cancel", headers=_auth(token)).status_code == 409
    assert client.get(f"/api/v1/jobs/{job}/model", headers=_auth(token)).status_code == 409


def test_a_restart_marks_running_jobs_interrupted_and_resume_finishes_them(tmp_path: Path) -> None:
    settings = ServiceSettings(db=str(tmp_path / "s.db"), folder=tmp_path, population=POPULATION, tls=False)
    app = create_app(settings)
    token = seed_demo(app.state.engine)
    job = _job(hyper={"rounds": 4, "clients_per_round": 3, "hidden": 8})
    with TestClient(app) as client:
        whole = client.post("/api/v1/jobs", json=job, headers=_auth(token)).json()["id"]
        first = _wait(client, token, whole, ("finished",))
        reference = client.get(f"/api/v1/jobs/{whole}/model", headers=_auth(token)).content
        cut = client.post("/api/v1/jobs", json=job, headers=_auth(token)).json()["id"]
        deadline = time.monotonic() + 120
        while (client.get(f"/api/v1/jobs/{cut}", headers=_auth(token)).json()["progress"] or {}).get(
            "round", 0
        ) < 8:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    # the service stopped in the middle of the second stage; a killed one would also leave it "running"
    with db.connect(settings.db).begin() as conn:
        conn.execute(db.jobs.update().where(db.jobs.c.id == cut).values(status="running"))
    first_stage = tmp_path / "jobs" / str(cut) / "program" / "call0.npz"
    stamp = first_stage.stat().st_mtime_ns
    app2 = create_app(settings)
    with TestClient(app2) as client:
        assert client.get(f"/api/v1/jobs/{cut}", headers=_auth(token)).json()["status"] == "interrupted"
        assert client.get(f"/api/v1/jobs/{cut}/model", headers=_auth(token)).status_code == 409
        resumed = client.post(f"/api/v1/jobs/{cut}/resume", headers=_auth(token)).json()
        assert resumed["status"] in ("queued", "running")
        again = _wait(client, token, cut, ("finished", "failed"))
        assert again["status"] == "finished" and again["outcome"]["released"]
        assert again["outcome"]["epsilon"] == pytest.approx(first["outcome"]["epsilon"])
        model = client.get(f"/api/v1/jobs/{cut}/model", headers=_auth(token)).content
        assert client.post(f"/api/v1/jobs/{cut}/resume", headers=_auth(token)).status_code == 409
    # the first stage was not trained again, and the result is the uninterrupted job's, bit for bit
    assert first_stage.stat().st_mtime_ns == stamp
    assert json.loads((tmp_path / "jobs" / str(cut) / "program" / "state.json").read_text())["round"] == 8
    assert load_safetensors(model).keys() == load_safetensors(reference).keys()
    for k, v in load_safetensors(reference).items():
        np.testing.assert_array_equal(load_safetensors(model)[k], v)


def test_the_openapi_schema_describes_the_job_api(service) -> None:
    client, *_ = service
    schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    assert {"/api/v1/jobs", "/api/v1/jobs/{job_id}", "/api/v1/jobs/{job_id}/model", "/api/v1/groups"} <= set(
        paths
    )
    assert not any(p.startswith("/admin") for p in paths)
    assert schema["components"]["schemas"]["JobRequest"]["additionalProperties"] is False
