"""``fedveil certs {init,device,token,revoke,list}``: the PKI of the networked runtime (mutual TLS).

- ``fedveil certs init DIR [--host H]... [--days N] [--force]`` makes a CA and the server's
  certificate for the hosts devices dial (default: localhost, 127.0.0.1, ::1).
- ``fedveil certs device NAME [--dir DIR] [--out OUTDIR] [--days N]`` issues a device's key and
  certificate into ``OUTDIR`` (default ``DIR/devices/NAME``, so ``fedveil agent --credentials
  DIR/devices`` finds it).
- ``fedveil certs token NAME [--dir DIR]`` makes a one-time enrolment token, printed once.
- ``fedveil certs revoke NAME_OR_SERIAL [--dir DIR]`` revokes a device or one certificate.
- ``fedveil certs list [--dir DIR] [--json]`` lists issued certificates, revocations and tokens
  (never token secrets or hashes).

The logic lives in :mod:`fedveil.runtime.network.certs`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path("pki")


def register(subparsers: Any) -> None:
    """Add the ``certs`` command with its ``init``, ``device``, ``token``, ``revoke`` and ``list`` actions."""
    p = subparsers.add_parser(
        "certs", help="PKI for the networked runtime: CA, server and device certificates"
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    i = actions.add_parser("init", help="make a CA and the server certificate in DIR")
    i.add_argument("dir", type=Path, metavar="DIR", help="PKI directory to create")
    i.add_argument(
        "--host",
        action="append",
        default=[],
        help="a host name or IP address devices dial (repeatable; default: localhost, 127.0.0.1, ::1)",
    )
    i.add_argument("--days", type=int, default=825, help="validity of the CA and server certificates")
    i.add_argument(
        "--force", action="store_true", help="replace an existing PKI (invalidates its certificates)"
    )

    d = actions.add_parser("device", help="issue a device's key and certificate")
    d.add_argument("name", metavar="NAME", help="device name (the certificate's CN)")
    _dir_arg(d)
    d.add_argument("--out", type=Path, default=None, help="where to write them (default: DIR/devices/NAME)")
    d.add_argument("--days", type=int, default=825, help="validity of the certificate (default: 825)")

    t = actions.add_parser("token", help="make a one-time enrolment token for a device")
    t.add_argument("name", metavar="NAME", help="device name the token enrols")
    _dir_arg(t)

    r = actions.add_parser("revoke", help="revoke a device (by name) or one certificate (by serial)")
    r.add_argument(
        "target", metavar="NAME_OR_SERIAL", help="device name, or hex serial from `fedveil certs list`"
    )
    _dir_arg(r)

    ls = actions.add_parser("list", help="list issued certificates, revocations and enrolment tokens")
    _dir_arg(ls)
    ls.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def _dir_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir", type=Path, default=DEFAULT_DIR, help=f"PKI directory (default: ./{DEFAULT_DIR})"
    )


def run(args: argparse.Namespace) -> int:
    """Dispatch to the action."""
    from fedveil.runtime.network import certs

    if args.action == "init":
        hosts = args.host or list(certs.DEFAULT_HOSTS)
        paths = certs.init_pki(args.dir, hosts, days=args.days, force=args.force)
        print(f"{paths.ca_cert}: CA certificate (give to every device)")
        print(f"{paths.ca_key}: CA private key (0600; keep secret, it signs every certificate)")
        print(f"{paths.server_cert}: server certificate for {', '.join(hosts)}")
        print(f"{paths.server_key}: server private key (0600)")
        print(f"{paths.revoked}: revoked certificates and devices (empty)")
        print(f"{paths.tokens}: enrolment tokens, stored hashed (empty)")
        print(f"{paths.issued}: log of issued device certificates (empty)")
        print(f"next: fedveil certs device NAME --dir {paths.root}   # credentials for a device")
        print(f"next: fedveil certs token NAME --dir {paths.root}    # or a one-time enrolment token")
        print(f"next: fedveil server CONFIG --pki {paths.root}")
        return 0

    if args.action == "device":
        out = args.out if args.out is not None else args.dir / "devices" / args.name
        creds = certs.issue_device(args.dir, args.name, days=args.days)
        creds.write(out)
        _, serial = certs.certificate_identity(creds.cert_pem)
        print(f"device {creds.name} (serial {serial}): wrote {out}/device.crt, device.key (0600), ca.crt")
        return 0

    if args.action == "token":
        token = certs.create_token(args.dir, args.name)
        print(token)
        print(
            f"fedveil certs: enrolment token for device {args.name}: shown only once and stored hashed; "
            "it works once (a new one replaces it)",
            file=sys.stderr,
        )
        return 0

    if args.action == "revoke":
        what = certs.revoke(args.dir, args.target)
        print(f"revoked {what}; the server refuses it from its next connection")
        return 0

    devices = certs.issued_devices(args.dir)
    tokens = certs.token_summary(args.dir)
    if args.json:
        doc = {
            "devices": [{**d, "revoked": d["revoked"] is not None, "reason": d["revoked"]} for d in devices],
            "revoked": certs.revocations(args.dir),
            "tokens": tokens,
        }
        print(json.dumps(doc, indent=2))
        return 0
    print(f"devices ({len(devices)}):")
    for d in devices:
        state = f"REVOKED ({d['revoked']})" if d["revoked"] else "valid"
        print(f"  {d['name']}  serial {d['serial']}  until {d['not_after']}  {state}")
    revoked = certs.revocations(args.dir)
    if revoked["names"] or revoked["serials"]:
        names, serials = ", ".join(revoked["names"]) or "-", ", ".join(revoked["serials"]) or "-"
        print(f"revoked: devices {names}; serials {serials}")
    print(f"tokens ({len(tokens)}):")
    for t in tokens:
        print(f"  {t['name']}  {'used' if t['used'] else 'unused'}  created {t['created']}")
    return 0
