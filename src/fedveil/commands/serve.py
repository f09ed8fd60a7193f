"""``fedveil serve``: PoliFL's server as a web service (docs/service.md)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fedveil.service import limits as defaults


def register(subparsers: Any) -> None:
    """Add the ``serve`` command."""
    p = subparsers.add_parser(
        "serve", help="the PoliFL web service: job API for applications, policy dashboard (docs/service.md)"
    )
    p.add_argument(
        "--data", type=Path, default=Path("fedveil-service"), help="data folder (default fedveil-service)"
    )
    p.add_argument(
        "--db", default=None, help="database file or URL (default DATA/fedveil.db; postgresql://...)"
    )
    p.add_argument(
        "--listen", default="127.0.0.1:8443", help="HOST:PORT (default 127.0.0.1:8443; port 0: any)"
    )
    p.add_argument(
        "--pki",
        type=Path,
        default=None,
        help="PKI from `fedveil certs init` (default DATA/pki, made if absent)",
    )
    p.add_argument("--insecure", action="store_true", help="plaintext HTTP (only behind a TLS proxy)")
    p.add_argument(
        "--population",
        default="mpu:40",
        help="simulated devices KIND:SIZE, KIND in mpu, images, text (default mpu:40)",
    )
    p.add_argument(
        "--devices-listen",
        default=None,
        help="device port HOST:PORT: devices are agents (fedveil polifl agent) holding --population's kind",
    )
    p.add_argument(
        "--enrol-listen",
        default=None,
        help="enrolment port HOST:PORT (tokens: fedveil certs token NAME --dir DATA/pki)",
    )
    p.add_argument("--admin", default="admin", help="name of the first administrator, made on first start")
    p.add_argument(
        "--demo", action="store_true", help="on first start: demo application, groups and policies"
    )
    p.add_argument("--stop-after", type=float, default=None, help="stop by itself after this many seconds")
    limits = p.add_argument_group("limits (docs/service.md, 'Limits')")
    limits.add_argument(
        "--job-seconds",
        type=float,
        default=defaults.JOB_SECONDS,
        help="each job's wall-clock budget: its check and its run, host calls included (default %(default)g)",
    )
    limits.add_argument(
        "--check-seconds",
        type=float,
        default=defaults.CHECK_SECONDS,
        help="how much of it the check during the submission may use (default %(default)g)",
    )
    limits.add_argument(
        "--jobs-per-application",
        type=int,
        default=defaults.JOBS_PER_APPLICATION,
        help="jobs an application may have checked, queued or running at once (default %(default)d)",
    )
    limits.add_argument(
        "--submissions-per-minute",
        type=int,
        default=defaults.SUBMISSIONS_PER_MINUTE,
        help="job submissions per application per minute (default %(default)d)",
    )
    limits.add_argument(
        "--max-body-bytes",
        type=int,
        default=defaults.MAX_BODY_BYTES,
        help="largest request body (default %(default)d)",
    )
    limits.add_argument(
        "--sign-in-failures",
        type=int,
        default=defaults.SIGN_IN_FAILURES,
        help="failed sign-ins per account name within --sign-in-lockout before it is locked "
        "(default %(default)d)",
    )
    limits.add_argument(
        "--sign-in-address-failures",
        type=int,
        default=defaults.SIGN_IN_ADDRESS_FAILURES,
        help="failed sign-ins per client address within --sign-in-lockout before it is locked "
        "(default %(default)d)",
    )
    limits.add_argument(
        "--sign-in-lockout",
        type=float,
        default=defaults.SIGN_IN_LOCKOUT,
        help="the window and the back-off of sign-in throttling, seconds "
        "(default %(default)g; a restart unlocks)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Start the service."""
    from fedveil.service.serve import ServeOptions, serve

    return serve(
        ServeOptions(
            folder=args.data,
            db=args.db,
            listen=args.listen,
            pki=args.pki,
            insecure=args.insecure,
            population=args.population,
            admin=args.admin,
            stop_after=args.stop_after,
            demo=args.demo,
            devices_listen=args.devices_listen,
            enrol_listen=args.enrol_listen,
            job_seconds=args.job_seconds,
            check_seconds=args.check_seconds,
            jobs_per_application=args.jobs_per_application,
            submissions_per_minute=args.submissions_per_minute,
            max_body_bytes=args.max_body_bytes,
            sign_in_failures=args.sign_in_failures,
            sign_in_address_failures=args.sign_in_address_failures,
            sign_in_lockout=args.sign_in_lockout,
        )
    )
