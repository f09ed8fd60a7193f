"""The served OpenAPI schema, fuzzed with schemathesis: whatever a client sends, with or without a valid
token, the service answers with a status the schema declares, a body that matches it, and never a 5xx."""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from fedveil.service.app import ServiceSettings, create_app
from fedveil.service.demo import seed_demo
from fedveil.service.jobs import Population

_folder = Path(__import__("tempfile").mkdtemp(prefix="fedveil-schema-"))
_app = create_app(
    ServiceSettings(
        db=str(_folder / "s.db"), folder=_folder, population=Population("mpu", 6), tls=False, run_jobs=False
    )
)
TOKEN = seed_demo(_app.state.engine)
schema = schemathesis.openapi.from_asgi("/openapi.json", _app)
CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance]


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    yield
    _app.state.engine.dispose()
    __import__("shutil").rmtree(_folder, ignore_errors=True)


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_with_a_valid_token(case: schemathesis.Case) -> None:
    response = case.call(headers={"Authorization": f"Bearer {TOKEN}"})
    case.validate_response(response, checks=CHECKS)


@schema.parametrize()
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
def test_without_a_token(case: schemathesis.Case) -> None:
    response = case.call()
    case.validate_response(response, checks=CHECKS)
    if case.path != "/api/v1/health":
        assert response.status_code in (401, 405, 413, 422)
