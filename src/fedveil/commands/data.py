"""``fedveil data info [--json]``: which real data sets this machine has, and how to add Fashion-MNIST."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``data`` command with its ``info`` action."""
    p = subparsers.add_parser("data", help="the real data sets found on this machine")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    info = actions.add_parser("info", help="list real data found (Fashion-MNIST, $FEDVEIL_DATA_DIR)")
    info.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print what :func:`fedveil.data.images.find_real_data` finds."""
    from fedveil.data.images import FASHION_MNIST_DIRS, INSTALL_HINT, find_real_data

    found = find_real_data()
    has_fashion = any(d["name"] == "fashion-mnist" for d in found)
    hint = (
        None
        if has_fashion
        else f"Fashion-MNIST is absent: `{INSTALL_HINT}` puts it in {FASHION_MNIST_DIRS[0]}"
    )
    if args.json:
        print(json.dumps({"found": found, "hint": hint}, indent=2))
        return 0
    for d in found:
        splits = ", ".join(f"{k} {v}" for k, v in d["splits"].items())
        print(f"{d['name']:14s} {d['path']}  ({splits}; images {'x'.join(map(str, d['image_shape']))})")
    if not found:
        print("no real data found; experiments use labelled synthetic stand-ins")
    if hint:
        print(hint)
    return 0
