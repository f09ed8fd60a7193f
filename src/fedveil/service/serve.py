"""``fedveil serve``: the PoliFL service on uvicorn, over TLS by default (docs/service.md).

One command starts it on an embedded database: the data folder (default ``fedveil-service/``) holds the
SQLite file, the job folders and, unless ``--pki`` names another or ``--insecure`` asks for plaintext, a
PKI made on first start (``fedveil certs init``'s layout) whose server certificate the HTTPS socket uses.
The first start with no administrator creates one: its password comes from ``FEDVEIL_ADMIN_PASSWORD``,
or is generated and printed once. The socket is bound before uvicorn starts, so ``--listen HOST:0``
picks a free port and the first line printed says which; ``--stop-after`` ends the service by itself
(tests, demos). ``--devices-listen`` opens the device port: the population is then the device agents
that connect with certificates of this PKI (``fedveil certs device NAME``, or enrolment tokens on
``--enrol-listen``), holding ``--population``'s kind of data. The limits (each job's time budget,
submissions per application, body size, sign-in throttling) take their defaults from
:mod:`fedveil.service.limits` unless options set them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from fedveil.errors import ConfigError
from fedveil.runtime.network.server import parse_listen
from fedveil.service import limits as defaults

__all__ = ["ServeOptions", "bootstrap_admin", "serve"]


@dataclass(frozen=True)
class ServeOptions:
    """What ``fedveil serve`` was asked for (module docstring)."""

    folder: Path = Path("fedveil-service")
    db: str | None = None
    listen: str = "127.0.0.1:8443"
    pki: Path | None = None
    insecure: bool = False
    population: str = "mpu:40"
    admin: str = "admin"
    stop_after: float | None = None
    max_body_bytes: int = defaults.MAX_BODY_BYTES
    demo: bool = False
    devices_listen: str | None = None
    enrol_listen: str | None = None
    job_seconds: float = defaults.JOB_SECONDS
    check_seconds: float = defaults.CHECK_SECONDS
    jobs_per_application: int = defaults.JOBS_PER_APPLICATION
    submissions_per_minute: int = defaults.SUBMISSIONS_PER_MINUTE
    sign_in_failures: int = defaults.SIGN_IN_FAILURES
    sign_in_address_failures: int = defaults.SIGN_IN_ADDRESS_FAILURES
    sign_in_lockout: float = defaults.SIGN_IN_LOCKOUT


def bootstrap_admin(engine: object, name: str) -> str | None:
    """Create the first administrator if there is none; returns the generated password (``None`` when
    one existed or the password came from ``FEDVEIL_ADMIN_PASSWORD``)."""
    import sqlalchemy as sa

    from fedveil.service import auth, db

    with engine.connect() as conn:  # type: ignore[attr-defined]
        if conn.execute(sa.select(db.admins.c.id)).first():
            return None
    given = os.environ.get("FEDVEIL_ADMIN_PASSWORD")
    password = given or secrets.token_urlsafe(15)
    auth.create_admin(engine, name, password)  # type: ignore[arg-type]
    return None if given else password


def _pki(options: ServeOptions, host: str) -> Path:
    from fedveil.runtime.network import certs

    root = options.pki or options.folder / "pki"
    paths = certs.PkiPaths.of(root)
    if not paths.server_cert.exists():
        if options.pki is not None:
            raise ConfigError(f"{root} holds no PKI: make one with `fedveil certs init {root}`")
        hosts = list(dict.fromkeys([*certs.DEFAULT_HOSTS, host])) if host not in ("0.0.0.0", "::") else None
        certs.init_pki(root, hosts or certs.DEFAULT_HOSTS)
        print(f"fedveil serve: made a PKI in {root} (its CA certificate: {paths.ca_cert})", file=sys.stderr)
    return root


def serve(options: ServeOptions) -> int:
    """Run the service until interrupted (or ``stop_after`` seconds)."""
    import uvicorn

    from fedveil.service import db
    from fedveil.service.app import ServiceSettings, create_app
    from fedveil.service.jobs import Population

    settings = ServiceSettings(
        db=options.db or str(options.folder / "fedveil.db"),
        folder=options.folder,
        max_body_bytes=options.max_body_bytes,
        tls=not options.insecure,
        job_seconds=options.job_seconds,
        check_seconds=options.check_seconds,
        jobs_per_application=options.jobs_per_application,
        submissions_per_minute=options.submissions_per_minute,
        sign_in_failures=options.sign_in_failures,
        sign_in_address_failures=options.sign_in_address_failures,
        sign_in_lockout=options.sign_in_lockout,
    )  # checks the limits before anything starts
    host, port = parse_listen(options.listen)
    if options.pki is not None and options.insecure:
        raise ConfigError("give either --pki or --insecure, not both")
    if options.stop_after is not None and not options.stop_after > 0:
        raise ConfigError(f"--stop-after {options.stop_after!r} must be > 0 seconds")
    options.folder.mkdir(parents=True, exist_ok=True)
    url = settings.db
    if options.enrol_listen is not None and options.devices_listen is None:
        raise ConfigError("--enrol-listen enrols networked devices: give --devices-listen too")
    if options.devices_listen is not None:
        parse_listen(options.devices_listen)
        population = Population(options.population.partition(":")[0], 4, networked=True)
    else:
        population = Population.parse(options.population)
    engine = db.connect(url)
    db.migrate(engine)
    password = bootstrap_admin(engine, options.admin)
    if password is not None:
        print(
            f"fedveil serve: created administrator {options.admin!r} with password {password} "
            "(shown once; set FEDVEIL_ADMIN_PASSWORD to choose it)",
            file=sys.stderr,
        )
    engine.dispose()
    tls: dict[str, str] = {}
    root = _pki(options, host) if not options.insecure or options.devices_listen else None
    if not options.insecure:
        assert root is not None
        tls = {"ssl_keyfile": str(root / "server.key"), "ssl_certfile": str(root / "server.crt")}
    else:
        print("fedveil serve: WARNING: --insecure: plaintext HTTP, tokens travel in clear", file=sys.stderr)
    settings = replace(
        settings,
        population=population,
        devices_listen=options.devices_listen,
        enrol_listen=options.enrol_listen,
        pki=root,
    )
    app = create_app(settings)
    if options.demo:
        from fedveil.service.demo import seed_demo

        with contextlib.suppress(ConfigError):
            token = seed_demo(app.state.engine)
            print(f"fedveil serve: demo application 'demo-app', token (shown once): {token}", flush=True)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {options.listen}: {exc}") from None
    bound = sock.getsockname()[1]
    scheme = "http" if options.insecure else "https"
    shown = f"[{host}]" if ":" in host else host
    print(
        f"fedveil serve: {scheme}://{shown}:{bound}/admin (API: /api/v1, schema: /openapi.json)", flush=True
    )
    config = uvicorn.Config(app, log_level="warning", **tls)  # type: ignore[arg-type]
    server = uvicorn.Server(config)

    async def main() -> None:
        if options.stop_after is not None:
            loop = asyncio.get_running_loop()
            loop.call_later(options.stop_after, lambda: setattr(server, "should_exit", True))
        await server.serve(sockets=[sock])

    asyncio.run(main())
    return 0
