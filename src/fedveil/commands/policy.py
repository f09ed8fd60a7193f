"""``fedveil policy check "<policy>" <command> ...``: advance a PoliFL policy by commands.

Each command is written as in a policy (``get_data``, ``filter(sensors=['mic','loc'])``); the policy is
advanced by each in turn (:func:`fedveil.privacy.policy.derivative`) and printed after each. Exit 0 when
every command is allowed (the last line says whether the policy is complete, i.e. the sequence may end
there), 1 at the first refused command (named, with what the policy would have accepted), 2 for a
policy or command that does not parse.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``policy`` command with its ``check`` action."""
    p = subparsers.add_parser("policy", help="PoliFL use-based policies: check a command sequence")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    c = actions.add_parser("check", help="advance a policy by commands; exit 0 if all are allowed")
    c.add_argument(
        "policy", help="the policy, e.g. \"get_data . filter(sensors=['mic','loc']) . runFL . return\""
    )
    c.add_argument(
        "commands", nargs="*", help="commands in order, e.g. get_data \"filter(sensors=['mic','loc'])\""
    )
    c.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Advance and report."""
    from fedveil.privacy.pairs import next_commands
    from fedveil.privacy.policy import ZERO, Call, PolicySyntaxError, derivative, nullable, parse, show

    policy = parse(args.policy)
    steps: list[dict[str, Any]] = []
    for text in args.commands:
        cmd = parse(text)
        if cmd.kind != "cmd" or cmd.cmd is None:
            raise PolicySyntaxError(f"{text!r} is not one command (write it as name or name(key=value, ...))")
        call: Call = cmd.cmd
        after = derivative(policy, call)
        if after == ZERO:
            steps.append({"command": show(cmd), "allowed": False, "would_accept": next_commands(policy)})
            _report(args, steps, show(policy), False)
            return 1
        steps.append({"command": show(cmd), "allowed": True, "policy": show(after)})
        policy = after
    _report(args, steps, show(policy), nullable(policy))
    return 0


def _report(args: argparse.Namespace, steps: list[dict[str, Any]], policy: str, complete: bool) -> None:
    if args.json:
        print(json.dumps({"steps": steps, "policy": policy, "complete": complete}, indent=2))
        return
    for step in steps:
        if step["allowed"]:
            print(f"{step['command']}: allowed -> {step['policy']}")
        else:
            accepts = ", ".join(step["would_accept"]) or "nothing more"
            print(f"{step['command']}: REFUSED by {policy!r}; it would accept: {accepts}")
            return
    print(f"policy now: {policy} ({'complete: the sequence may end here' if complete else 'not complete'})")
