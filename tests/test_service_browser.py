"""End to end through real processes: ``fedveil serve`` (TLS, its own PKI, SQLite) and Debian's Chromium in
headless mode driven by Playwright. An administrator signs in, adds a group and a policy, sees a bad policy
rejected with the parser's error, watches a job submitted through the API appear and finish, and deletes a
policy. Chromium comes from the system (``.ci/run`` installs Debian's package when it is missing)."""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import sys
import time

import httpx
import pytest
from playwright.sync_api import Page, expect

from fedveil.service.demo import CASCADED, LOCAL

PASSWORD = "browser test password"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("served")
    env = {**os.environ, "FEDVEIL_ADMIN_PASSWORD": PASSWORD}
    command = [sys.executable, "-m", "fedveil", "serve", "--data", str(folder), "--listen", "127.0.0.1:0"]
    log = (folder / "serve.log").open("w")
    proc = subprocess.Popen(
        [*command, "--population", "mpu:12", "--demo", "--stop-after", "240"],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
    )
    token = url = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and url is None:
        line = proc.stdout.readline()
        if not line:
            break
        if "token (shown once):" in line:
            token = line.rsplit(" ", 1)[1].strip()
        found = re.search(r"(https://127\.0\.0\.1:\d+)/admin", line)
        if found:
            url = found.group(1)
    assert url and token, (
        f"fedveil serve did not start: {proc.stderr.read() if proc.poll() is not None else ''}"
    )
    yield url, token, folder / "pki" / "ca.crt"
    proc.terminate()
    proc.wait(20)
    log.close()


@pytest.fixture(scope="module")
def page(chromium_page: Page) -> Page:
    return chromium_page


def _sign_in(page: Page, url: str) -> None:
    page.goto(f"{url}/admin")
    expect(page).to_have_url(f"{url}/admin/login")
    page.fill("#name", "admin")
    page.fill("#password", PASSWORD)
    page.click("#login button")
    expect(page.locator("header")).to_contain_text("signed in as admin")


def test_the_dashboard_in_a_real_browser(server, page: Page) -> None:
    url, token, ca = server
    page.goto(f"{url}/admin")
    page.fill("#name", "admin")
    page.fill("#password", "not the password")
    page.click("#login button")
    expect(page.locator("#error")).to_have_text("Wrong name or password.")
    _sign_in(page, url)
    # the demo's policies are listed
    expect(page.locator("tr.policy-row")).to_have_count(2)
    # a new group, then a bad policy for it: refused, with the parser's error in the page
    page.fill("#group-name", "gr3")
    page.click("#add-group button")
    expect(page.locator("#note")).to_have_text("group created")
    page.select_option("#policy-app", "demo-app")
    page.select_option("#policy-group", "gr3")
    page.fill("#policy-new", 'get_data(data_type="MPU").runFL.(return')
    page.click("#add-policy button")
    expect(page.locator("#error")).to_contain_text("the policy does not parse")
    expect(page.locator("#policy-new")).to_have_value('get_data(data_type="MPU").runFL.(return')
    # corrected: accepted and listed
    page.fill("#policy-new", 'get_data(data_type="MPU").runFL.check_privacy_budget(max_eps=20).return')
    page.click("#add-policy button")
    expect(page.locator("#note")).to_have_text("policy added")
    row = page.locator('tr.policy-row[data-group="gr3"]')
    expect(row).to_contain_text("check_privacy_budget(max_eps=20)")
    expect(row).to_contain_text("20.0")
    # a job submitted through the API appears and finishes
    job = {
        "name": "browser-job",
        "global_program": CASCADED,
        "local_program": LOCAL,
        "model": "engagement",
        "hyper": {"rounds": 2, "clients_per_round": 3, "hidden": 8},
        "groups": [{"name": "gr1", "noise": 5.0}, {"name": "gr2", "noise": 5.0}],
    }
    with httpx.Client(base_url=url, verify=ssl.create_default_context(cafile=str(ca)), timeout=120) as api:
        r = api.post("/api/v1/jobs", json=job, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        page.goto(f"{url}/admin")
        expect(page.locator(f"#job-{job_id}")).to_be_visible()
        deadline = time.monotonic() + 150
        while page.locator(f"#job-{job_id} .status").inner_text() != "finished":
            assert time.monotonic() < deadline, "the job did not finish"
            time.sleep(1.0)
            page.reload()
        expect(page.locator(f"#job-{job_id}")).to_contain_text("released")
        expect(page.locator("#budgets rect.bar")).to_have_count(2)
        model = api.get(f"/api/v1/jobs/{job_id}/model", headers={"Authorization": f"Bearer {token}"})
        assert model.status_code == 200 and len(model.content) > 1000
    # delete the gr3 policy
    page.locator('tr.policy-row[data-group="gr3"] a').click()
    page.click("#delete-policy")
    expect(page.locator("#note")).to_have_text("policy deleted")
    expect(page.locator('tr.policy-row[data-group="gr3"]')).to_have_count(0)
    # signing out ends the session
    page.click("#logout")
    page.goto(f"{url}/admin")
    expect(page).to_have_url(f"{url}/admin/login")


def test_a_cross_site_form_is_refused(server, page: Page) -> None:
    url, _, _ = server
    _sign_in(page, url)
    # a page elsewhere posting to the dashboard carries the cookie's name but not the session's token
    page.set_content(
        f'<form id="evil" method="post" action="{url}/admin/groups"><input name="name" value="pwned"></form>'
    )
    with page.expect_response(f"{url}/admin/groups") as answer:
        page.evaluate("document.getElementById('evil').submit()")
    assert answer.value.status in (401, 403)
    page.goto(f"{url}/admin")
    expect(page.locator("#groups")).not_to_contain_text("pwned")
