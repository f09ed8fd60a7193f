"""The service with networked device agents (003 Sec. 4.3): a real ``fedveil polifl agent`` process hosts
six devices, each with its own data and its own policy, over mutual TLS; a job submitted through the API
trains on them; a device whose own policy forbids ``runFL`` refuses the job on the device; a spy on the
server's side of the streams shows that no device's data ever reaches the server; TTD/TTE/TTR/TTP are
recorded per reply."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from fedveil.core import codec
from fedveil.protocols.messages import FitReply
from fedveil.protocols.polifl import JobReady
from fedveil.runtime.network import certs
from fedveil.service.app import ServiceSettings, create_app
from fedveil.service.demo import CASCADED, DEMO_POLICIES, LOCAL, seed_demo
from fedveil.service.jobs import Population, population_values
from fedveil.service.network import population_data

REFUSER = 'get_data(data_type="MPU").return'


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("devices")
    certs.init_pki(tmp / "pki")
    names = sorted(population_values(Population("mpu", 12)))[:6]
    for name in names:
        certs.issue_device(tmp / "pki", name).write(tmp / "creds" / name)
    # seed_demo puts the sorted devices in gr1, gr2, gr1, ...; each device's own policy says the same,
    # except the last, whose owner allows no training at all
    own = {n: DEMO_POLICIES["gr1" if i % 2 == 0 else "gr2"] for i, n in enumerate(names)}
    own[names[-1]] = REFUSER
    (tmp / "policies.json").write_text(json.dumps(own))
    settings = ServiceSettings(
        db=str(tmp / "s.db"),
        folder=tmp,
        population=Population("mpu", 4, networked=True),
        tls=False,
        devices_listen="127.0.0.1:0",
        pki=tmp / "pki",
    )
    app = create_app(settings)
    with TestClient(app) as client:
        port = app.state.devices.port
        agent = subprocess.Popen(
            [sys.executable, "-m", "fedveil", "polifl", "agent", "--server", f"127.0.0.1:{port}"]
            + ["--server-name", "localhost", "--credentials", str(tmp / "creds"), "--kind", "mpu"]
            + ["--population", "mpu:12", "--policy-file", str(tmp / "policies.json"), "--give-up-after", "60"]
            + [arg for n in names for arg in ("--device", n)],
            stdout=subprocess.DEVNULL,
            stderr=(tmp / "agent.log").open("w"),
        )
        try:
            _wait_for(lambda: len(app.state.devices.connected()) == 6, 60, "six devices to connect")
            _wait_for(lambda: len(app.state.devices._registered) == 6, 10, "their registration")
            token = seed_demo(app.state.engine)
            yield client, app, token, names, agent, tmp
        finally:
            if agent.poll() is None:
                agent.terminate()
                agent.wait(20)
    # the service said goodbye when it stopped: the agent finished by itself
    assert agent.wait(30) is not None


def test_a_job_trains_on_networked_devices_that_enforce_their_own_policies(deployment) -> None:
    client, app, token, names, _, _ = deployment
    runtime = app.state.devices.runtime
    payloads: list[bytes] = []
    accept = runtime._accept

    failed: list[tuple[bytes, str]] = []

    def spy(waiting, fut, expected, validate, fold):  # everything the devices send, as the server receives it
        if fut.exception() is None:
            reply = fut.result()[0]
            # a device's error reply (a dropout, e.g. a step that failed on a loaded machine) has no payload
            if reply.error:
                failed.append((reply.payload, reply.error))
            else:
                payloads.append(reply.payload)
        return accept(waiting, fut, expected, validate, fold)

    runtime._accept = spy
    job = {
        "name": "networked",
        "global_program": CASCADED,
        "local_program": LOCAL,
        "model": "engagement",
        "hyper": {"rounds": 2, "clients_per_round": 2, "hidden": 8},
        "groups": [{"name": "gr1", "noise": 5.0}, {"name": "gr2", "noise": 5.0}],
    }
    r = client.post("/api/v1/jobs", json=job, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    status = {}

    def finished() -> bool:
        status.update(
            client.get(f"/api/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}).json()
        )
        return status["status"] not in ("queued", "running")

    _wait_for(finished, 180, "the job")
    assert status["status"] == "finished", status
    outcome = status["outcome"]
    assert outcome["released"] and outcome["rounds"] == 4
    gr1, gr2 = outcome["stages"]
    assert gr1["refused_devices"] == 0
    assert gr2["refused_devices"] == 1 and "does not allow runFL" in gr2["refusal_example"]
    timings = outcome["timings_ms"]
    assert {"job", "train"} <= set(timings)
    for phase in ("job", "train"):
        for measure in ("ttd", "tte", "ttr", "ttp"):
            assert timings[phase][f"{measure}_max_ms"] >= timings[phase][f"{measure}_p50_ms"] >= 0
    # what left the devices: job acceptances/refusals and model updates, never the data
    errors = [error for _, error in failed]
    assert all(payload == b"" for payload, _ in failed), errors
    decoded = [codec.decode(p) for p in payloads]
    assert decoded and all(isinstance(m, (JobReady, FitReply)) for m in decoded), errors
    assert sum(isinstance(m, JobReady) for m in decoded) == 6, errors
    data = population_data("mpu", 12, 0, names)
    for value in data.values():
        x = np.ascontiguousarray(value["x"]).tobytes()
        chunk = x[len(x) // 2 : len(x) // 2 + 64]
        assert not any(chunk in p for p in payloads)
    model = client.get(f"/api/v1/jobs/{job_id}/model", headers={"Authorization": f"Bearer {token}"})
    assert model.status_code == 200


def test_the_dashboard_lists_the_connected_agents(deployment) -> None:
    client, app, _, names, _, _ = deployment
    from fedveil.service import auth

    auth.create_admin(app.state.engine, "root", "a long enough password")
    login = client.get("/admin/login")
    csrf = login.text.split('name="csrf" value="')[1].split('"')[0]
    client.post("/admin/login", data={"csrf": csrf, "name": "root", "password": "a long enough password"})
    page = client.get("/admin/devices").text
    assert "6 device agents have connected (6 now)" in page
    for name in names:
        assert f'data-device="{name}"' in page
    assert page.count("agent:mpu") == 6
