"""Step 1 of FDML Fig. 2, shared by every protocol that selects clients by an attribute, and the
attestation handshake of every protocol whose clients talk to an enclave (FDML, PPFL)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from fedveil.core.communicator import ClientId, Communicator
from fedveil.errors import ConfigError, FedveilError
from fedveil.protocols.common import expect
from fedveil.protocols.messages import Register, RegistrationCall, SessionOffer, SessionReady

log = logging.getLogger(__name__)


async def register_clients(
    comm: Communicator, protocol: str, *, group_by: str = "phone_model", timeout: float = 60.0
) -> tuple[dict[str, list[ClientId]], dict[ClientId, Register]]:
    """Gather registrations of every reachable device and group them by the ``group_by`` attribute.

    Returns ``{attribute value: [client ids]}`` and the registrations themselves; devices whose
    registration fails are left out of both.
    """
    call = RegistrationCall(protocol)
    clients = list(comm.available())

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
    if not groups:
        raise ConfigError("no device registered; nothing to train")
    return groups, replies


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
