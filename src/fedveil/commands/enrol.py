"""``fedveil enrol``: exchange a one-time enrolment token for this device's certificate."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``enrol`` command."""
    p = subparsers.add_parser("enrol", help="get this device's certificate with an enrolment token")
    p.add_argument("--server", required=True, help="the server's enrolment HOST:PORT")
    p.add_argument("--token", required=True, help="the token `fedveil certs token NAME` printed")
    p.add_argument("--ca", type=Path, required=True, help="the CA certificate (ca.crt) to trust")
    p.add_argument("--out", type=Path, required=True, help="where to write device.crt, device.key, ca.crt")
    p.add_argument("--server-name", default=None, help="TLS name to expect in the server certificate")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Make a key, send a CSR with the token, write the credentials (the key stays here, mode 0600)."""
    import asyncio

    from fedveil.runtime.network.enrol import enrol

    creds = asyncio.run(enrol(args.server, args.token, args.ca.read_bytes(), server_name=args.server_name))
    creds.write(args.out / creds.name)
    print(f"enrolled device {creds.name}: credentials in {args.out / creds.name}")
    return 0
