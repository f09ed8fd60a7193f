"""The enclave host every runner passes (:mod:`fedveil.runtime.enclave_host`) is what the protocols'
typing protocols (:mod:`fedveil.protocols.enclave_relay`) say: every member they name, with the same
parameters (names, kinds, defaults and annotations)."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from fedveil.protocols import enclave_relay
from fedveil.runtime import enclave_host

PAIRS = [
    (enclave_relay.LayerwiseEnclave, enclave_host.EnclaveHost),
    (enclave_relay.AggregateStream, enclave_host.AggregateStream),
    (enclave_relay.AggregateRelease, enclave_host.AggregateResult),
    (enclave_relay.LayerAggregate, enclave_host.LayerAggregateResult),
]


def _parameters(function: object) -> list[tuple[object, ...]]:
    return [
        (p.name, p.kind, p.default, p.annotation) for p in inspect.signature(function).parameters.values()
    ]


def _mismatches(proto: type, impl: type) -> list[str]:
    """What ``impl`` lacks of the methods, properties and attributes ``proto`` declares, or declares
    otherwise."""
    declared: dict[str, object] = {k: v for k, v in vars(proto).items() if not k.startswith("_")}
    declared.update({k: None for k in vars(proto).get("__annotations__", {})})
    fields = {f.name for f in dataclasses.fields(impl)} if dataclasses.is_dataclass(impl) else set()
    out = []
    for name, member in declared.items():
        if inspect.isfunction(member):
            if not inspect.isfunction(getattr(impl, name, None)):
                out.append(f"no method {name}")
            elif _parameters(member) != _parameters(getattr(impl, name)):
                out.append(f"{name}{inspect.signature(getattr(impl, name))}")
        elif not (
            name in fields
            or isinstance(getattr(impl, name, None), property)
            or (not fields and re.search(rf"self\.{name}\s*[:=]", inspect.getsource(impl.__init__)))
        ):
            out.append(f"no attribute {name}")
    return out


@pytest.mark.parametrize(("proto", "impl"), PAIRS, ids=lambda c: c.__name__)
def test_the_host_has_every_member_the_protocols_call(proto: type, impl: type) -> None:
    assert vars(proto).get("__annotations__") or any(inspect.isfunction(v) for v in vars(proto).values())
    assert _mismatches(proto, impl) == []


def test_a_host_that_differs_is_caught() -> None:
    class Partial:
        def __init__(self) -> None:
            self.clients: list[str] = []

        def add(self, cid: str, record: bytes, num_samples: int) -> None:
            """A record typed ``bytes`` where the protocol takes any buffer."""

        def abort(self) -> None:
            """Nothing to gather."""

    assert _mismatches(enclave_relay.AggregateStream, Partial) == [
        "add(self, cid: 'str', record: 'bytes', num_samples: 'int') -> 'None'",
        "no method finish",
    ]
    assert _mismatches(enclave_relay.LayerAggregate, enclave_host.AggregateResult) == ["no attribute loss"]
