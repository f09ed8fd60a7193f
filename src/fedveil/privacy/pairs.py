"""PoliFL's data-policy pairs and where commands run ([PoliFL], Sec. 3.3 and 4.1).

A :class:`DataPolicyPair` holds a value and the :mod:`~fedveil.privacy.policy` that governs it. It is
opaque: it has no attribute that returns the value, its ``repr`` shows only the policy, and it cannot be
pickled, copied field by field or compared by value. The only way to use the value is :func:`apply`,
which a trusted library function calls with the command it implements: ``apply`` checks that the command
may run on this side (:data:`COMMAND_SIDES`: the paper's blue commands run on devices, red ones on the
server), advances the policy of every input pair by the command (the derivative of
:func:`~fedveil.privacy.policy.derivative`), and, when several pairs are combined (``train_local`` takes
the model's pair and the data's, ``accumulate`` two models), gives the result the **intersection** of
their advanced policies (Sec. 3.3: ``P_model & P_data``). A refused command raises
:class:`PolicyViolation`, which names the command, the side, the policy state and the commands it would
have accepted; no part of any value is ever in the message.

The opacity is a Python object's: a program that can reach :func:`unwrap` or the pair's slots can read
the value. Third-party programs therefore run in the sandbox, which refuses names
that start with an underscore and gives programs only the trusted library, never this module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Any

from fedveil.errors import FedveilError
from fedveil.privacy.policy import ZERO, Call, Policy, derivative, inter, is_empty, nullable, show

__all__ = ["COMMAND_SIDES", "DataPolicyPair", "PolicyViolation", "Side", "apply", "next_commands", "release"]


class Side(Enum):
    """Where a command runs: on the ``device`` (blue in the paper), the ``server`` (red), or ``both``
    (``runFL``, which expands into both)."""

    DEVICE = "device"
    SERVER = "server"
    BOTH = "both"


COMMAND_SIDES: dict[str, Side] = {
    "get_data": Side.DEVICE,
    "filter": Side.DEVICE,
    "in_geofence_cond": Side.DEVICE,
    "train_local": Side.DEVICE,
    "train_local_dp": Side.DEVICE,
    "accumulate": Side.SERVER,
    "average": Side.SERVER,
    "enforce_dp_budget": Side.SERVER,
    "enforce_privacy_budget": Side.SERVER,
    "check_privacy_budget": Side.SERVER,
    "runFL": Side.BOTH,
    "return": Side.SERVER,
    "release": Side.SERVER,
}
"""The trusted library's commands and where each runs (Sec. 3.3's colours, Table 3)."""


class PolicyViolation(FedveilError):
    """A command a policy (or the side it runs on) does not allow."""


def next_commands(policy: Policy) -> list[str]:
    """The command names (with the arguments the policy requires) that could come next: what a refusal
    says the policy would have accepted (a walk with a stack: a policy's depth is no limit)."""
    found: set[str] = set()
    todo, seen = [policy], {id(policy)}
    while todo:
        p = todo.pop()
        if p.kind == "not":
            found.add("anything but " + show(p.parts[0]))
            continue
        if p.kind == "cmd":
            found.add(show(p))
        for q in p.parts[:1] if p.kind == "seq" and not nullable(p.parts[0]) else p.parts:
            if id(q) not in seen:
                seen.add(id(q))
                todo.append(q)
    return sorted(found)


class DataPolicyPair:
    """A value and its policy (module docstring); build one with ``DataPolicyPair(value, policy)``."""

    __slots__ = ("__value", "policy")

    def __init__(self, value: Any, policy: Policy) -> None:
        if not isinstance(policy, Policy):
            raise TypeError(f"a pair's policy must be a Policy, not {type(policy).__name__}")
        self.__value = value
        self.policy = policy

    def __repr__(self) -> str:
        return f"DataPolicyPair(<value withheld>, policy={show(self.policy)!r})"

    def __reduce__(self) -> Any:
        raise TypeError("a data-policy pair cannot be serialised: its value never leaves without its policy")

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__

    def _value(self) -> Any:
        return self.__value


def apply(
    command: str,
    pairs: Sequence[DataPolicyPair],
    fn: Callable[..., Any],
    *,
    side: Side,
    args: Mapping[str, Any] | None = None,
) -> DataPolicyPair:
    """Run ``fn`` on the values of ``pairs`` as the command ``command(args)`` on ``side``; return the
    result paired with the intersection of the inputs' advanced policies, or raise
    :class:`PolicyViolation` (module docstring)."""
    if not pairs or not all(isinstance(p, DataPolicyPair) for p in pairs):
        raise PolicyViolation(f"{command} needs one or more data-policy pairs")
    where = COMMAND_SIDES.get(command)
    if where is None:
        raise PolicyViolation(
            f"{command} is not a command of the trusted library ({', '.join(COMMAND_SIDES)})"
        )
    if where is not Side.BOTH and where is not side:
        raise PolicyViolation(f"{command} runs on the {where.value}, not on the {side.value}")
    call = Call.of(command, args)
    advanced = []
    for pair in pairs:
        after = derivative(pair.policy, call)
        if after == ZERO:
            accepted = ", ".join(next_commands(pair.policy)) or "nothing more"
            raise PolicyViolation(
                f"{show(Policy('cmd', cmd=call))} is not allowed by the policy {show(pair.policy)!r}; it "
                f"would accept: {accepted}"
            )
        advanced.append(after)
    policy = inter(*advanced)
    if len(advanced) > 1 and is_empty(policy):
        raise PolicyViolation(
            f"{command} combines pairs whose policies allow no common continuation: "
            + " & ".join(repr(show(p)) for p in advanced)
        )
    return DataPolicyPair(fn(*(p._value() for p in pairs)), policy)


def release(pair: DataPolicyPair, command: str = "return") -> Any:
    """The value, to the application, when ``command`` ends the policy (the advanced policy accepts the
    empty sequence); otherwise :class:`PolicyViolation`."""
    out = apply(command, [pair], lambda v: v, side=Side.SERVER)
    if not nullable(out.policy):
        raise PolicyViolation(
            f"{command} does not end the policy {show(pair.policy)!r}; still required: "
            + (", ".join(next_commands(out.policy)) or "nothing")
        )
    return out._value()
