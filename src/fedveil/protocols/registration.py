"""Step 1 of FDML Fig. 2, shared by every protocol that selects clients by an attribute, and the
attestation handshake of every protocol whose clients talk to an enclave (FDML, PPFL)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from fedveil.core.communicator import ClientId, Communicator
from fedveil.errors import ConfigError, FedveilError
from fedveil.protocols.common import expect
from fedveil.protocols.messages import Register, RegistrationCall, SessionOffer, SessionReady

log = logging.getLogger(__name__)


async def register_clients(
    comm: Communicator,
    protocol: str,
    *,
    group_by: str = "phone_model",
    timeout: float = 60.0,
    clients: Sequence[ClientId] | None = None,
) -> tuple[dict[str, list[ClientId]], dict[ClientId, Register]]:
    """Gather registrations of every reachable device (or of ``clients`` only: devices that joined or
    reconnected during a run) and group them by the ``group_by`` attribute.

    Returns ``{attribute value: [client ids]}`` and the registrations themselves; devices whose
    registration fails are left out of both. Registering everyone and getting no registration is an
    error; registering ``clients`` and getting none is not (the run goes on without them).
    """
    call = RegistrationCall(protocol)
    everyone = clients is None
    clients = list(comm.available()) if clients is None else list(clients)

    def check(cid: ClientId, msg: Register) -> None:
        expect(msg.protocol == protocol, f"registration for protocol {msg.protocol!r}, expected {protocol!r}")
        expect(group_by in msg.attributes, f"registration lacks the attribute {group_by!r}")

    replies = await comm.request(
        {c: call for c in clients},
        phase="register",
        min_replies=len(clients),
        timeout=timeout,
        expected=Register,
        validate=check,
    )
    groups: dict[str, list[ClientId]] = {}
    for cid in clients:
        if cid in replies:
            groups.setdefault(replies[cid].attributes[group_by], []).append(cid)
    if not groups and everyone:
        raise ConfigError("no device registered; nothing to train")
    return groups, replies


def rejoin_groups(
    groups: Mapping[str, Sequence[ClientId]],
    registered: Mapping[str, Sequence[ClientId]],
    clients: Sequence[ClientId],
) -> dict[str, list[ClientId]]:
    """``groups`` after ``clients`` registered again and ``registered`` (their new groups) came back: a
    device keeps its place if it registered into the same group, joins the end of the group it
    registered into otherwise, and leaves its group if it did not register (or attest) again; the
    other devices are untouched. Groups left empty are dropped."""
    again = set(clients)
    group_of = {c: g for g, members in registered.items() for c in members}
    out = {g: [c for c in members if c not in again or group_of.get(c) == g] for g, members in groups.items()}
    for g, members in registered.items():
        kept = out.setdefault(g, [])
        kept.extend(c for c in members if c not in kept)
    return {g: members for g, members in out.items() if members}


async def attest_clients(
    comm: Communicator,
    open_session: Callable[[bytes], bytes],
    registrations: Mapping[ClientId, Register],
    protocol: str,
    *,
    timeout: float = 60.0,
) -> set[ClientId]:
    """Relay each registered device's hello to the enclave (``open_session``: hello -> server hello)
    and the enclave's quote back; return the devices that verified it (signature, measurement, their
    own nonce) and opened their channel. A device without a hello, or whose hello the enclave refuses,
    is left out; a refusal on the device's side is a dropout in phase ``attest``."""
    offers = {}
    for cid, reg in registrations.items():
        if reg.hello is None:
            log.info("device %s registered without an attestation hello; it will not be selected", cid)
            continue
        try:
            offers[cid] = SessionOffer(open_session(reg.hello))
        except FedveilError as exc:
            log.info("enclave refused the hello of device %s: %s", cid, exc)

    def ready(cid: ClientId, msg: SessionReady) -> None:
        expect(msg.protocol == protocol, f"session for protocol {msg.protocol!r}, expected {protocol!r}")

    done = await comm.request(
        offers,
        phase="attest",
        min_replies=len(offers),
        timeout=timeout,
        expected=SessionReady,
        validate=ready,
    )
    return set(done)
