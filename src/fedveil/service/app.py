"""The PoliFL server as a web service (Sec. 4.2, Fig. 1): the Access Service API
for third-party applications and the administrators' policy dashboard, on FastAPI.

**Access Service API** (``/api/v1``, documented by the served OpenAPI schema at ``/openapi.json``): an
application authenticates with ``Authorization: Bearer <token>``; a missing, malformed, wrong or revoked
token gets the same 401 and nothing else. It lists the groups it may ask for with its policies
(``GET /api/v1/groups``), submits a job (``POST /api/v1/jobs``: checked against the policies before
anything runs, :func:`fedveil.service.jobs.validate`; 202 when queued, 403 naming the policy and command
that refuse it, 422 for a program that does not compile or leaves the sandbox), follows it
(``GET /api/v1/jobs/{id}``: status, round, per-group epsilon spent), lists, cancels and resumes its jobs,
and downloads the released model as safetensors (``GET /api/v1/jobs/{id}/model``; 403 with the policy's
refusal when the release was refused). Another application's job answers exactly like a job that does
not exist (404), so ids leak nothing.

**Dashboard** (``/admin``): an administrator signs in with a name and password (not an application
token) and manages applications and their tokens (a new token is shown once), groups, devices' groups,
and the policy each application may use each group's data under (parsed on save: the parser's error is
shown in the page; edits carry the version they started from, and a stale edit is refused with 409 rather
than overwriting someone else's). It shows jobs and a chart of each group's epsilon spent per job against
its policy's budget. Every form carries the session's CSRF token (the sign-in form a double-submit
cookie's); every page is served with a strict Content-Security-Policy (no scripts at all) and
``X-Frame-Options: DENY``.

**Abuse**: bodies over ``max_body_bytes`` are refused with 413 (declared or streamed); malformed JSON
is 422 naming the field, and a 422's body never echoes the input (so NaN or infinity in it cannot break
the answer); ids in paths are whole numbers in digits; all SQL binds its parameters; a crash in a job
fails that job, never the service. A job has one wall-clock budget (``job_seconds``, of which its check
during the submission may use ``check_seconds``: :mod:`fedveil.service.jobs`); an application may have
at most ``jobs_per_application`` jobs being checked, queued or running and submit at most
``submissions_per_minute`` (429 with ``Retry-After`` beyond). Sign-in is throttled per account and per
client address (:class:`~fedveil.service.auth.SignInThrottle`): after too many failures in a window
further attempts get 429 for a back-off period, the same whether the account exists or not.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi import Path as PathParam
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape
from pydantic import BaseModel, BeforeValidator
from sqlalchemy.engine import Engine
from starlette.exceptions import HTTPException as StarletteHTTPException

from fedveil._version import __version__
from fedveil.errors import ConfigError, FedveilError
from fedveil.privacy.policy import budget_of, parse, show
from fedveil.service import auth, db
from fedveil.service import limits as defaults
from fedveil.service.jobs import JobRequest, JobRunner, JobState, Population, Refused, audit, validate

__all__ = ["ServiceSettings", "SubmissionLimits", "create_app"]

log = logging.getLogger(__name__)

LOGIN_COOKIE = "fv_login"
SESSION_COOKIE = "fv_session"
CSP = "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'"


@dataclass(frozen=True)
class ServiceSettings:
    """Where the service keeps its database (a path: SQLite; or a URL) and job files, the simulated
    device ``population``, the largest request body, whether it is served over TLS (cookies are then
    ``Secure``), whether to run jobs (tests of the API alone may not), how long a job's global
    program may run by itself (``program_seconds``), each job's wall-clock budget for everything it
    causes (``job_seconds``) and how much of it its check during the submission may use
    (``check_seconds``), the submissions allowed per application (``jobs_per_application`` checked,
    queued or running at once; ``submissions_per_minute``), sign-in throttling (``sign_in_failures``
    per account and ``sign_in_address_failures`` per client address within ``sign_in_lockout``
    seconds, then refused for ``sign_in_lockout`` seconds) and, for a networked population, the device
    port (``HOST:PORT``), the enrolment port (one-time tokens exchanged for certificates) and the PKI
    directory whose CA signs the devices' certificates."""

    db: str
    folder: Path
    population: Population = field(default_factory=Population)
    max_body_bytes: int = defaults.MAX_BODY_BYTES
    tls: bool = True
    run_jobs: bool = True
    program_seconds: float = 10.0
    job_seconds: float = defaults.JOB_SECONDS
    check_seconds: float = defaults.CHECK_SECONDS
    jobs_per_application: int = defaults.JOBS_PER_APPLICATION
    submissions_per_minute: int = defaults.SUBMISSIONS_PER_MINUTE
    sign_in_failures: int = defaults.SIGN_IN_FAILURES
    sign_in_address_failures: int = defaults.SIGN_IN_ADDRESS_FAILURES
    sign_in_lockout: float = defaults.SIGN_IN_LOCKOUT
    devices_listen: str | None = None
    enrol_listen: str | None = None
    pki: Path | None = None

    def __post_init__(self) -> None:
        for name in ("program_seconds", "job_seconds", "check_seconds", "sign_in_lockout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} {value!r} must be a number of seconds > 0")
        for name in (
            "max_body_bytes",
            "jobs_per_application",
            "submissions_per_minute",
            "sign_in_failures",
            "sign_in_address_failures",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} {value!r} must be a whole number >= 1")


class JobStatus(BaseModel):
    """A job as its application sees it."""

    id: int
    name: str
    status: JobState
    created_at: str
    updated_at: str
    plan: dict[str, Any] | None = None
    progress: dict[str, Any] | None = None
    outcome: dict[str, Any] | None = None


class GroupInfo(BaseModel):
    """A group the application may ask for, with its policy for this application and device count."""

    name: str
    policy: str
    budget: float | None
    devices: int


class Problem(BaseModel):
    """An error: what is wrong and what to do (``job``: the id a refused job was stored under)."""

    detail: str
    job: int | None = None


class FieldError(BaseModel):
    """One invalid field: where (``loc``), what is wrong (``msg``) and its kind (``type``)."""

    loc: list[str | int]
    msg: str
    type: str


class Invalid(BaseModel):
    """A request that cannot be read (``detail``: one entry per invalid field) or a job that cannot run
    (``detail``: why; ``job``: the id it was stored under)."""

    detail: str | list[FieldError]
    job: int | None = None


CHECK_GRACE_SECONDS = 2.0
"""How long past its check's budget a submission waits for the check to stop by itself before it answers
that the check ran out of time (a call into the server that outlasts the deadline ends on its own)."""


def _digits(value: Any) -> Any:
    """An id in a path is written in digits only (``1.0``, ``+1``, ``1e0`` are not ids)."""
    if isinstance(value, str) and not (value.isascii() and value.isdigit()):
        raise ValueError(f"an id is a whole number written in digits (like 12), not {value[:20]!r}")
    return value


JobId = Annotated[int, PathParam(ge=1, le=2**31 - 1, description="the job's id"), BeforeValidator(_digits)]
RowId = Annotated[int, PathParam(ge=1, le=2**31 - 1), BeforeValidator(_digits)]

_ERRORS: dict[int | str, dict[str, Any]] = {
    **{code: {"model": Problem} for code in (401, 403, 404, 409, 413)},
    422: {"model": Invalid},
}


class SubmissionLimits:
    """How many jobs each application may submit (module docstring): at most ``concurrent`` of its
    jobs being checked, queued or running at once, and at most ``per_minute`` submissions in any 60 s;
    ``busy_seconds`` is the wait suggested when it has too many jobs at once."""

    def __init__(
        self,
        concurrent: int,
        per_minute: int,
        busy_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.concurrent, self.per_minute, self.busy_seconds, self.clock = (
            concurrent,
            per_minute,
            busy_seconds,
            clock,
        )
        self._lock = threading.Lock()
        self._checking: dict[int, int] = {}
        self._recent: dict[int, deque[float]] = {}

    def enter(self, app_id: int, active: Callable[[], int]) -> float | None:
        """Admit one submission of ``app_id`` (``active()``: its jobs queued or running now): ``None``
        when admitted (then :meth:`leave` when its check ends), else the seconds to wait."""
        with self._lock:
            now = self.clock()
            recent = self._recent.setdefault(app_id, deque())
            while recent and recent[0] <= now - 60.0:
                recent.popleft()
            if len(recent) >= self.per_minute:
                return recent[0] + 60.0 - now
            if active() + self._checking.get(app_id, 0) >= self.concurrent:
                return self.busy_seconds
            recent.append(now)
            self._checking[app_id] = self._checking.get(app_id, 0) + 1
            return None

    def leave(self, app_id: int) -> None:
        """The check of a submission :meth:`enter` admitted has ended."""
        with self._lock:
            self._checking[app_id] -= 1


def _field_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    """A request's invalid fields as JSON-safe :class:`FieldError` dicts: where, what, which kind; never
    the input itself (it may hold NaN or infinity, which JSON cannot carry, or be huge)."""
    return [
        {
            "loc": [part if isinstance(part, int) else str(part) for part in error.get("loc", ())],
            "msg": str(error.get("msg", "invalid")),
            "type": str(error.get("type", "value_error")),
        }
        for error in exc.errors()
    ]


def _retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


class _BodyLimit:
    """ASGI middleware: 413 for a body larger than ``limit`` bytes, whether its ``Content-Length``
    declares it or it is streamed (chunked): a body without a declared length is read here, up to the
    limit, before the application sees it."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.limit:
                await _too_large(send, self.limit)
                return
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.limit:
                await _too_large(send, self.limit)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _too_large(send: Any, limit: int) -> None:
    body = json.dumps({"detail": f"request body larger than {limit} bytes"}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _iso(value: Any) -> str:
    return value.isoformat() + "Z" if value is not None else ""


def _status(row: Any) -> JobStatus:
    request = json.loads(row["request"])
    return JobStatus(
        id=row["id"],
        name=request.get("name", ""),
        status=row["status"],
        created_at=_iso(row["created_at"]),
        updated_at=_iso(row["updated_at"]),
        plan=json.loads(row["plan"]) if row["plan"] else None,
        progress=json.loads(row["progress"]) if row["progress"] else None,
        outcome=json.loads(row["outcome"]) if row["outcome"] else None,
    )


def create_app(settings: ServiceSettings) -> FastAPI:
    """The service (module docstring): migrates the database, registers the population's devices, marks
    jobs a killed service left running as interrupted and starts the job runner."""
    engine = db.connect(settings.db)
    db.migrate(engine)
    from fedveil.service.jobs import ensure_population

    ensure_population(engine, settings.population)
    devices = None
    if settings.population.networked:
        from fedveil.service.network import DeviceNetwork

        if settings.devices_listen is None or settings.pki is None:
            raise ConfigError("networked devices need a device port (HOST:PORT) and a PKI directory")
        devices = DeviceNetwork(
            engine,
            settings.devices_listen,
            settings.pki,
            settings.population.kind,
            enrol_listen=settings.enrol_listen,
        )
    runner = JobRunner(
        engine,
        settings.population,
        settings.folder / "jobs",
        program_seconds=settings.program_seconds,
        job_seconds=settings.job_seconds,
        devices=devices,
    )
    limits = SubmissionLimits(
        settings.jobs_per_application, settings.submissions_per_minute, settings.check_seconds
    )
    runner.recover()
    templates = Environment(
        loader=PackageLoader("fedveil.service", "templates"), autoescape=select_autoescape()
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if devices is not None:
            port = devices.start()
            print(f"fedveil serve: device agents connect to port {port} (mutual TLS)", flush=True)
        if settings.run_jobs:
            runner.start()
        yield
        runner.stop()
        if devices is not None:
            devices.stop()

    app = FastAPI(
        title="fedveil PoliFL service",
        version=__version__,
        description="PoliFL's Access Service: submit federated jobs that policies govern (Sec. 4.2).",
        lifespan=lifespan,
    )
    app.state.engine = engine
    app.state.runner = runner
    app.state.sign_in = auth.SignInThrottle(
        settings.sign_in_failures, settings.sign_in_address_failures, settings.sign_in_lockout
    )
    app.state.devices = devices
    app.add_middleware(_BodyLimit, limit=settings.max_body_bytes)

    @app.middleware("http")
    async def _headers(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await call_next(request)
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Referrer-Policy"] = "no-referrer"
        if request.url.path.startswith("/admin"):
            response.headers["Content-Security-Policy"] = CSP
            response.headers["Cache-Control"] = "no-store"
        return response

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # a body that is not even UTF-8 is malformed JSON too: 422 naming the body, like any other
        if exc.status_code == 400 and request.url.path.startswith("/api/"):
            detail = [{"loc": ["body"], "msg": "the body is not valid JSON (UTF-8)", "type": "json_invalid"}]
            return JSONResponse({"detail": detail}, status_code=422)
        return await http_exception_handler(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _field_errors(exc)}, status_code=422)

    @app.exception_handler(FedveilError)
    async def _fedveil_error(_: Request, exc: FedveilError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=422)

    # ------------------------------------------------------------------ Access Service API

    def application(request: Request) -> int:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        app_id = auth.verify_token(engine, token.strip()) if scheme.lower() == "bearer" else None
        if app_id is None:
            raise HTTPException(401, "a valid application token is needed", {"WWW-Authenticate": "Bearer"})
        return app_id

    def own_job(job_id: int, app_id: int) -> Any:
        with engine.connect() as conn:
            row = conn.execute(sa.select(db.jobs).where(db.jobs.c.id == job_id)).mappings().first()
        if row is None or row["application_id"] != app_id:
            raise HTTPException(404, f"job {job_id} not found")
        return row

    @app.get("/api/v1/health", tags=["service"])
    def health() -> dict[str, str]:
        """The service answers."""
        return {"status": "ok", "version": __version__}

    @app.get("/api/v1/groups", response_model=list[GroupInfo], responses=_ERRORS, tags=["jobs"])
    def list_groups(app_id: int = Depends(application)) -> list[GroupInfo]:
        """The groups whose data this application may use, with its policy for each."""
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(db.groups.c.id, db.groups.c.name, db.policies.c.text)
                .join(db.policies, db.policies.c.group_id == db.groups.c.id)
                .where(db.policies.c.application_id == app_id)
                .order_by(db.groups.c.name)
            ).all()
            counts = dict(
                conn.execute(
                    sa.select(db.devices.c.group_id, sa.func.count()).group_by(db.devices.c.group_id)
                ).all()
            )
        return [
            GroupInfo(name=name, policy=text, budget=_budget(text), devices=int(counts.get(gid, 0)))
            for gid, name, text in rows
        ]

    def active_jobs(app_id: int) -> int:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    sa.select(sa.func.count()).where(
                        db.jobs.c.application_id == app_id, db.jobs.c.status.in_(("queued", "running"))
                    )
                ).scalar_one()
            )

    @app.post(
        "/api/v1/jobs",
        status_code=202,
        response_model=JobStatus,
        responses={**_ERRORS, 429: {"model": Problem}},
        tags=["jobs"],
    )
    def submit(job: JobRequest, app_id: int = Depends(application)) -> Any:
        """Submit a job; it is checked against the groups' policies before anything runs (429 with
        ``Retry-After`` when the application has too many jobs at once or submits too often)."""
        wait = limits.enter(app_id, lambda: active_jobs(app_id))
        if wait is not None:
            detail = (
                f"too many submissions: at most {settings.jobs_per_application} jobs checked, queued or "
                f"running at once and {settings.submissions_per_minute} submissions a minute per "
                "application; retry later"
            )
            return JSONResponse({"detail": detail}, status_code=429, headers=_retry_after(wait))
        seconds = min(settings.check_seconds, settings.job_seconds)
        result: dict[str, Any] = {}
        finished = threading.Event()
        parties = [2]  # the check and this request: the application's slot is freed when both are done
        lock = threading.Lock()

        def done() -> None:
            with lock:
                parties[0] -= 1
                if parties[0] == 0:
                    limits.leave(app_id)

        def check() -> None:
            try:
                result["plan"] = validate(
                    engine,
                    settings.population,
                    app_id,
                    job,
                    program_seconds=settings.program_seconds,
                    seconds=seconds,
                )
            except Refused as exc:
                result["refused"] = exc
            except FedveilError as exc:
                result["refused"] = Refused(str(exc), 422)
            finally:
                finished.set()
                done()

        # the check runs beside this request, which answers by the deadline even if one call into the
        # server outlasts it; the application's slot stays taken until that call has ended too
        threading.Thread(target=check, name=f"fedveil-check-app{app_id}", daemon=True).start()
        try:
            if finished.wait(seconds + CHECK_GRACE_SECONDS):
                return stored_job(job, app_id, result.get("plan"), result.get("refused"))
            late = Refused(
                f"checking the job took longer than its {seconds} s: a call into the server ran past the "
                "deadline; ask for fewer rounds or more noise",
                422,
                program_failed=True,
            )
            return stored_job(job, app_id, None, late)
        finally:
            done()

    def stored_job(job: JobRequest, app_id: int, plan: dict[str, Any] | None, refused: Refused | None) -> Any:
        """Store a checked ``job`` and queue it, or store and answer its refusal."""
        status = "queued" if refused is None else ("failed" if refused.program_failed else "refused")
        outcome = None if refused is None else json.dumps({"released": False, "reason": str(refused)})
        with engine.begin() as conn:
            job_id = conn.execute(
                db.jobs.insert().values(
                    application_id=app_id,
                    status=status,
                    request=job.model_dump_json(),
                    plan=json.dumps(plan, default=float) if plan else None,
                    outcome=outcome,
                    cancel=False,
                    created_at=db.now(),
                    updated_at=db.now(),
                )
            ).inserted_primary_key[0]
        if refused is not None:
            action = "program failed" if refused.program_failed else "job refused"
            audit(engine, f"application {app_id}", action, f"job {job_id}: {refused}")
            log.warning("job %d refused: %s", job_id, refused)
            return JSONResponse({"detail": str(refused), "job": job_id}, status_code=refused.status)
        runner.wake()
        return _status(own_job(int(job_id), app_id))

    @app.get("/api/v1/jobs", response_model=list[JobStatus], responses=_ERRORS, tags=["jobs"])
    def list_jobs(app_id: int = Depends(application)) -> list[JobStatus]:
        """This application's jobs, newest first."""
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(db.jobs).where(db.jobs.c.application_id == app_id).order_by(db.jobs.c.id.desc())
            ).mappings()
            return [_status(r) for r in rows]

    @app.get("/api/v1/jobs/{job_id}", response_model=JobStatus, responses=_ERRORS, tags=["jobs"])
    def job_status(job_id: JobId, app_id: int = Depends(application)) -> JobStatus:
        """A job's status, round and per-group epsilon spent."""
        return _status(own_job(job_id, app_id))

    @app.post("/api/v1/jobs/{job_id}/cancel", response_model=JobStatus, responses=_ERRORS, tags=["jobs"])
    def cancel(job_id: JobId, app_id: int = Depends(application)) -> JobStatus:
        """Cancel a job: a queued or interrupted job at once, a running one at its next round."""
        row = own_job(job_id, app_id)
        with engine.begin() as conn:
            if row["status"] in ("queued", "interrupted"):
                conn.execute(
                    db.jobs.update()
                    .where(db.jobs.c.id == job_id, db.jobs.c.status == row["status"])
                    .values(status="cancelled", cancel=True, updated_at=db.now())
                )
            elif row["status"] == "running":
                conn.execute(db.jobs.update().where(db.jobs.c.id == job_id).values(cancel=True))
            else:
                raise HTTPException(409, f"job {job_id} is {row['status']}: there is nothing to cancel")
        return _status(own_job(job_id, app_id))

    @app.post("/api/v1/jobs/{job_id}/resume", response_model=JobStatus, responses=_ERRORS, tags=["jobs"])
    def resume(job_id: JobId, app_id: int = Depends(application)) -> JobStatus:
        """Queue an interrupted job again: it continues from its last finished stage."""
        row = own_job(job_id, app_id)
        if row["status"] != "interrupted":
            raise HTTPException(409, f"job {job_id} is {row['status']}; only an interrupted job resumes")
        with engine.begin() as conn:
            conn.execute(
                db.jobs.update().where(db.jobs.c.id == job_id).values(status="queued", updated_at=db.now())
            )
        runner.wake()
        return _status(own_job(job_id, app_id))

    @app.get(
        "/api/v1/jobs/{job_id}/model",
        responses={200: {"content": {"application/octet-stream": {}}}, **_ERRORS},
        response_class=Response,
        tags=["jobs"],
    )
    def model(job_id: JobId, app_id: int = Depends(application)) -> Response:
        """The released model (safetensors), only if the policies authorised its release."""
        row = own_job(job_id, app_id)
        outcome = json.loads(row["outcome"]) if row["outcome"] else {}
        if row["status"] != "finished":
            if row["status"] == "refused":
                raise HTTPException(403, f"no model: {outcome.get('reason', 'the job was refused')}")
            raise HTTPException(409, f"job {job_id} is {row['status']}: no model yet")
        if not outcome.get("released"):
            raise HTTPException(403, f"the policies refused the model's release: {outcome.get('reason')}")
        path = runner.model_path(job_id)
        if not path.exists():
            raise HTTPException(409, f"job {job_id}'s model file is missing: resume or resubmit the job")
        return FileResponse(path, media_type="application/octet-stream", filename=f"job{job_id}.safetensors")

    # ------------------------------------------------------------------ dashboard

    _install_dashboard(app, engine, settings, templates)
    return app


def _named_policies() -> sa.Select[Any]:
    """Policies with their application's and group's names (``app``, ``group``)."""
    return (
        sa.select(db.policies, db.applications.c.name.label("app"), db.groups.c.name.label("group"))
        .join(db.applications, db.applications.c.id == db.policies.c.application_id)
        .join(db.groups, db.groups.c.id == db.policies.c.group_id)
    )


def _budget(text: str) -> float | None:
    try:
        return budget_of(parse(text))
    except FedveilError:
        return None


def _install_dashboard(
    app: FastAPI, engine: Engine, settings: ServiceSettings, templates: Environment
) -> None:
    """The administrators' pages (module docstring)."""
    from fastapi.staticfiles import StaticFiles

    static = Path(__file__).with_name("static")
    app.mount("/admin/static", StaticFiles(directory=static), name="static")

    def page(name: str, status: int = 200, **context: Any) -> HTMLResponse:
        return HTMLResponse(templates.get_template(name).render(**context), status_code=status)

    def session(request: Request) -> auth.Session | None:
        return auth.session_of(engine, request.cookies.get(SESSION_COOKIE))

    async def checked(request: Request) -> tuple[auth.Session, dict[str, str]]:
        """The signed-in session and the form, after the CSRF check; else an HTTP error."""
        s = session(request)
        if s is None:
            raise HTTPException(401, "sign in first")
        form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
        if not auth.csrf_ok(s, form.get("csrf")):
            raise HTTPException(403, "the form's CSRF token is missing or wrong: reload the page")
        return s, form

    def back(note: str = "") -> RedirectResponse:
        return RedirectResponse("/admin" + (f"?note={note}" if note else ""), status_code=303)

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/admin", status_code=303)

    def sign_in_page(error: str, status: int = 200) -> HTMLResponse:
        token = secrets.token_urlsafe(24)
        response = page("login.html", status, csrf=token, error=error[:200])
        response.set_cookie(
            LOGIN_COOKIE, token, httponly=True, samesite="strict", secure=settings.tls, path="/admin"
        )
        return response

    @app.get("/admin/login", include_in_schema=False)
    def login_page(error: str = "") -> HTMLResponse:
        return sign_in_page(error)

    @app.post("/admin/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
        cookie = request.cookies.get(LOGIN_COOKIE, "")
        if not cookie or not secrets.compare_digest(cookie.encode(), form.get("csrf", "").encode()):
            raise HTTPException(403, "the sign-in form's CSRF token is missing or wrong: reload the page")
        name, address = form.get("name", ""), request.client.host if request.client else "?"
        throttle: auth.SignInThrottle = app.state.sign_in
        wait = throttle.retry_after(name, address)
        if wait is not None:
            minutes = max(1, math.ceil(wait / 60))
            response = sign_in_page(
                f"Too many failed sign-ins: try again in {minutes} minute{'s' if minutes > 1 else ''}.", 429
            )
            response.headers.update(_retry_after(wait))
            return response
        admin = auth.check_admin(engine, name, form.get("password", ""))
        if admin is None:
            audit(engine, name[:100] or "?", "sign-in failed", f"wrong name or password, from {address}")
            if throttle.failed(name, address):
                audit(
                    engine,
                    name[:100] or "?",
                    "sign-in locked",
                    f"too many failed sign-ins for this name or from {address}: refused for "
                    f"{settings.sign_in_lockout:g} s (restarting the service unlocks)",
                )
            return sign_in_page("Wrong name or password.")
        throttle.succeeded(name)
        response = RedirectResponse("/admin", status_code=303)
        response.set_cookie(
            SESSION_COOKIE,
            auth.start_session(engine, admin),
            httponly=True,
            samesite="strict",
            secure=settings.tls,
            max_age=auth.SESSION_HOURS * 3600,
        )
        response.delete_cookie(LOGIN_COOKIE, path="/admin")
        audit(engine, form.get("name", ""), "signed in", "")
        return response

    @app.post("/admin/logout", include_in_schema=False)
    async def logout(request: Request) -> Response:
        await checked(request)
        auth.end_session(engine, request.cookies.get(SESSION_COOKIE))
        response = RedirectResponse("/admin/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE)
        return response

    def overview() -> dict[str, Any]:
        with engine.connect() as conn:
            apps = conn.execute(sa.select(db.applications).order_by(db.applications.c.name)).mappings().all()
            toks = conn.execute(sa.select(db.tokens).order_by(db.tokens.c.id)).mappings().all()
            groups = conn.execute(sa.select(db.groups).order_by(db.groups.c.name)).mappings().all()
            pols = (
                conn.execute(_named_policies().order_by(db.applications.c.name, db.groups.c.name))
                .mappings()
                .all()
            )
            counts = dict(
                conn.execute(
                    sa.select(db.devices.c.group_id, sa.func.count()).group_by(db.devices.c.group_id)
                ).all()
            )
            jobs = (
                conn.execute(
                    sa.select(db.jobs, db.applications.c.name.label("app"))
                    .join(db.applications, db.applications.c.id == db.jobs.c.application_id)
                    .order_by(db.jobs.c.id.desc())
                    .limit(50)
                )
                .mappings()
                .all()
            )
            events = (
                conn.execute(sa.select(db.audit).order_by(db.audit.c.id.desc()).limit(20)).mappings().all()
            )
        job_rows = [{**_status(j).model_dump(), "app": j["app"]} for j in jobs]
        return {
            "apps": apps,
            "tokens": toks,
            "groups": [{**g, "devices": counts.get(g["id"], 0)} for g in groups],
            "unassigned": counts.get(None, 0),
            "policies": [{**p, "budget": _budget(p["text"])} for p in pols],
            "jobs": job_rows,
            "chart": _chart(job_rows, pols),
            "events": events,
        }

    @app.get("/admin", include_in_schema=False)
    def dashboard(request: Request, note: str = "") -> Response:
        s = session(request)
        if s is None:
            return RedirectResponse("/admin/login", status_code=303)
        return page("dashboard.html", s=s, note=note[:200], population=settings.population, **overview())

    def again(s: auth.Session, error: str, status: int = 400, **form: Any) -> HTMLResponse:
        return page(
            "dashboard.html",
            status,
            s=s,
            error=error,
            form=form,
            population=settings.population,
            **overview(),
        )

    @app.post("/admin/applications", include_in_schema=False)
    async def add_application(request: Request) -> Response:
        s, form = await checked(request)
        try:
            app_id = auth.create_application(engine, form.get("name", ""))
        except ConfigError as exc:
            return again(s, str(exc))
        token = auth.issue_token(engine, app_id)
        audit(engine, s.admin, "application created", form["name"])
        return page("token.html", s=s, app=form["name"], token=token)

    @app.post("/admin/applications/{app_id}/token", include_in_schema=False)
    async def new_token(request: Request, app_id: RowId) -> Response:
        s, _ = await checked(request)
        try:
            token = auth.issue_token(engine, app_id)
        except ConfigError as exc:
            return again(s, str(exc), 404)
        with engine.connect() as conn:
            name = conn.execute(
                sa.select(db.applications.c.name).where(db.applications.c.id == app_id)
            ).scalar()
        audit(engine, s.admin, "token issued", str(name))
        return page("token.html", s=s, app=name, token=token)

    @app.post("/admin/tokens/{key_id}/revoke", include_in_schema=False)
    async def revoke(request: Request, key_id: str) -> Response:
        s, _ = await checked(request)
        if not auth.revoke_token(engine, key_id[:32]):
            return again(s, f"no live token {key_id[:32]!r}", 404)
        audit(engine, s.admin, "token revoked", key_id[:32])
        return back("token revoked")

    @app.post("/admin/groups", include_in_schema=False)
    async def add_group(request: Request) -> Response:
        s, form = await checked(request)
        name = form.get("name", "")
        try:
            auth.check_name(name, "group")
            with engine.begin() as conn:
                if conn.execute(sa.select(db.groups.c.id).where(db.groups.c.name == name)).first():
                    raise ConfigError(f"a group named {name!r} exists already")
                conn.execute(db.groups.insert().values(name=name, created_at=db.now()))
        except ConfigError as exc:
            return again(s, str(exc))
        audit(engine, s.admin, "group created", name)
        return back("group created")

    @app.post("/admin/devices/assign", include_in_schema=False)
    async def assign(request: Request) -> Response:
        s, _ = await checked(request)
        with engine.begin() as conn:
            gids = [r[0] for r in conn.execute(sa.select(db.groups.c.id).order_by(db.groups.c.id))]
            if not gids:
                return again(s, "create a group first")
            free = [
                r[0]
                for r in conn.execute(
                    sa.select(db.devices.c.id)
                    .where(db.devices.c.group_id.is_(None))
                    .order_by(db.devices.c.name)
                )
            ]
            for i, dev in enumerate(free):
                conn.execute(
                    db.devices.update().where(db.devices.c.id == dev).values(group_id=gids[i % len(gids)])
                )
        audit(engine, s.admin, "devices assigned", f"{len(free)} devices over {len(gids)} groups")
        return back(f"{len(free)} devices assigned")

    @app.get("/admin/devices", include_in_schema=False)
    def device_page(request: Request) -> Response:
        s = session(request)
        if s is None:
            return RedirectResponse("/admin/login", status_code=303)
        with engine.connect() as conn:
            rows = (
                conn.execute(
                    sa.select(db.devices, db.groups.c.name.label("group"))
                    .outerjoin(db.groups, db.groups.c.id == db.devices.c.group_id)
                    .order_by(db.devices.c.name)
                )
                .mappings()
                .all()
            )
            groups = conn.execute(sa.select(db.groups).order_by(db.groups.c.name)).mappings().all()
        network = app.state.devices
        connected = set(network.connected()) if network is not None else None
        return page(
            "devices.html",
            s=s,
            devices=rows,
            groups=groups,
            population=settings.population,
            connected=connected,
        )

    @app.post("/admin/devices/{device_id}", include_in_schema=False)
    async def move_device(request: Request, device_id: RowId) -> Response:
        s, form = await checked(request)
        group = form.get("group", "")
        with engine.begin() as conn:
            gid = None
            if group:
                gid = conn.execute(sa.select(db.groups.c.id).where(db.groups.c.name == group)).scalar()
                if gid is None:
                    return again(s, f"there is no group {group!r}", 404)
            done = conn.execute(db.devices.update().where(db.devices.c.id == device_id).values(group_id=gid))
        if not done.rowcount:
            return again(s, f"there is no device {device_id}", 404)
        return RedirectResponse("/admin/devices", status_code=303)

    def _ids(form: dict[str, str]) -> tuple[int | None, int | None]:
        with engine.connect() as conn:
            app_id = conn.execute(
                sa.select(db.applications.c.id).where(db.applications.c.name == form.get("application", ""))
            ).scalar()
            gid = conn.execute(
                sa.select(db.groups.c.id).where(db.groups.c.name == form.get("group", ""))
            ).scalar()
        return app_id, gid

    @app.post("/admin/policies", include_in_schema=False)
    async def add_policy(request: Request) -> Response:
        s, form = await checked(request)
        text = form.get("text", "")
        app_id, gid = _ids(form)
        if app_id is None or gid is None:
            return again(s, "choose an application and a group that exist", 400, **form)
        try:
            canonical = show(parse(text))
        except FedveilError as exc:
            return again(s, f"the policy does not parse: {exc}", 400, **form)
        with engine.begin() as conn:
            exists = conn.execute(
                sa.select(db.policies.c.id).where(
                    db.policies.c.application_id == app_id, db.policies.c.group_id == gid
                )
            ).first()
            if exists:
                return again(s, "this application has a policy for this group already: edit it", 409, **form)
            conn.execute(
                db.policies.insert().values(
                    application_id=app_id, group_id=gid, text=text, version=1, updated_at=db.now()
                )
            )
        audit(
            engine, s.admin, "policy added", f"{form.get('application')} / {form.get('group')}: {canonical}"
        )
        return back("policy added")

    def policy_row(policy_id: int) -> Any:
        with engine.connect() as conn:
            row = conn.execute(_named_policies().where(db.policies.c.id == policy_id)).mappings().first()
        if row is None:
            raise HTTPException(404, f"there is no policy {policy_id}")
        return row

    @app.get("/admin/policies/{policy_id}", include_in_schema=False)
    def edit_page(request: Request, policy_id: RowId) -> Response:
        s = session(request)
        if s is None:
            return RedirectResponse("/admin/login", status_code=303)
        row = policy_row(policy_id)
        return page("policy.html", s=s, p=row, text=row["text"], version=row["version"], error="")

    @app.post("/admin/policies/{policy_id}", include_in_schema=False)
    async def edit_policy(request: Request, policy_id: RowId) -> Response:
        s, form = await checked(request)
        row = policy_row(policy_id)
        text = form.get("text", "")
        version = form.get("version", "")
        try:
            parse(text)
        except FedveilError as exc:
            return page(
                "policy.html",
                400,
                s=s,
                p=row,
                text=text,
                version=version,
                error=f"the policy does not parse: {exc}",
            )
        if not version.isdigit():
            return page(
                "policy.html", 400, s=s, p=row, text=text, version=row["version"], error="reload the page"
            )
        with engine.begin() as conn:
            done = conn.execute(
                db.policies.update()
                .where(db.policies.c.id == policy_id, db.policies.c.version == int(version))
                .values(text=text, version=int(version) + 1, updated_at=db.now())
            )
        if not done.rowcount:
            fresh = policy_row(policy_id)
            return page(
                "policy.html",
                409,
                s=s,
                p=fresh,
                text=text,
                version=fresh["version"],
                error=(
                    f"someone saved this policy (now version {fresh['version']}: {fresh['text']}) after you "
                    "opened it; your text is kept below: save again to replace theirs"
                ),
            )
        audit(engine, s.admin, "policy edited", f"{row['app']} / {row['group']}: {text}")
        return back("policy saved")

    @app.post("/admin/policies/{policy_id}/delete", include_in_schema=False)
    async def delete_policy(request: Request, policy_id: RowId) -> Response:
        s, _ = await checked(request)
        row = policy_row(policy_id)
        with engine.begin() as conn:
            conn.execute(db.policies.delete().where(db.policies.c.id == policy_id))
        audit(engine, s.admin, "policy deleted", f"{row['app']} / {row['group']}")
        return back("policy deleted")


def _chart(jobs: list[dict[str, Any]], policies: Any) -> dict[str, Any]:
    """Bars of epsilon spent per (job, group), with each group's smallest policy budget as a mark: the
    data of the dashboard's SVG chart (no script)."""
    bars = []
    for j in reversed(jobs):
        spent = (j.get("progress") or {}).get("epsilon") or (j.get("outcome") or {}).get("epsilon") or {}
        for group, eps in sorted(spent.items()):
            if eps is not None and eps == eps and eps != float("inf"):
                bars.append({"label": f"#{j['id']} {group}", "group": group, "eps": float(eps)})
    budgets: dict[str, float] = {}
    for p in policies:
        b = _budget(p["text"])
        if b is not None:
            budgets[p["group"]] = min(b, budgets.get(p["group"], b))
    top = max([b["eps"] for b in bars] + list(budgets.values()) + [1.0])
    width = 560
    for b in bars:
        b["w"] = max(1.0, width * b["eps"] / top)
        b["budget_x"] = width * budgets[b["group"]] / top if b["group"] in budgets else None
    return {"bars": bars[-24:], "top": top, "width": width}
