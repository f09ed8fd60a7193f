"""The server side of the networked runtime: a :class:`~fedveil.core.communicator.Communicator` over
gRPC streams that device agents dial in to.

Each agent holds one long-lived bidirectional stream (:mod:`fedveil.runtime.network.wire`). The server's
:meth:`NetworkRuntime.available` are the devices whose stream is open and whose hello was accepted;
:meth:`NetworkRuntime.request` sends each addressed device its message and waits, in real seconds, for
the earliest ``min_replies`` valid replies or the timeout. Everything that can go wrong with a reply is a
dropout with its reason, exactly as in the simulation: no reply by the deadline (``late``), the device
disconnected (``disconnected``), the agent's handler refused (``client raised``), or the payload failed
decoding or the protocol's validation (``invalid reply``). Frames a peer should not send at all (garbage,
a reply to another device's request, a replayed reply, a second hello) are refused and logged with the
reason in :attr:`NetworkRuntime.refusals`; garbage closes that peer's stream; the server goes on.

Security: mutual TLS by default. The device id is its certificate's common name; a hello claiming
another id, or a certificate on the revocation list, is refused. Payload sizes are bounded twice: gRPC's
``max_receive_message_length`` refuses a larger frame before it reaches Python, and the codec's
``max_bytes`` bounds every payload before it is parsed. Enrolment tokens (exchanged for a certificate on
the enrolment port) are compared in constant time and never logged.

Timing (PoliFL Sec. 5): per device and request, TTD (server send -> agent receipt), TTE (agent receipt
-> agent send), TTR (agent send -> server receipt) and TTP (server decode + validation) in seconds;
TTD and TTR compare the two hosts' wall clocks (exact on one host, NTP-accurate across hosts).

Rejoining: every welcomed stream (a first connection, or a device that reconnected, e.g. because its
agent was restarted and lost its enclave session) is remembered until :meth:`NetworkRuntime.take_joined`
hands it out; the run registers (and, through the TEE, attests afresh) those devices before its next
round (:func:`fedveil.experiments.network_run.admit_joined`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from fedveil.core import codec
from fedveil.core.communicator import ClientId, CommStats, DeviceTiming, Dropout, Fold, Message, Validator
from fedveil.errors import CodecError, ConfigError, FedveilError, ValidationError
from fedveil.runtime.network import certs, wire

log = logging.getLogger(__name__)

HELLO_TIMEOUT = 10.0

WRITE_SLOT_SECONDS = 0.5
"""Longest a frame's write holds one of the server's write slots; a stream slower than that (a device that
stops reading) goes on writing outside them, so it cannot hold the others' broadcast back."""


@dataclass(frozen=True)
class Refusal:
    """A frame or connection the server refused: from whom (device id or peer address), and why."""

    peer: str
    reason: str


@dataclass
class _Connection:
    """One accepted agent stream."""

    device: str
    outbox: asyncio.Queue[bytes | None]
    last_seen: float
    closed: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Waiting:
    """A request the server awaits a reply to."""

    device: str
    phase: str
    sent_at: float
    bytes_down: int
    future: asyncio.Future[tuple[wire.AgentReply, float]]


def parse_listen(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); a clear error otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"address {address!r} is not HOST:PORT (e.g. 127.0.0.1:7443 or [::1]:7443)")
    return host.strip("[]"), int(port)


class NetworkRuntime:
    """A gRPC server whose connected device agents are the protocol's clients.

    ``pki`` is a directory made by ``fedveil certs init`` (mutual TLS); ``pki=None`` needs
    ``insecure=True`` and then serves plaintext, identifying devices by their hello alone (for a
    network you fully trust; it logs a warning). ``enrol_listen`` opens the enrolment port (server TLS
    only; a token buys one certificate). ``heartbeat_seconds`` is what agents are told; a device silent
    for ``3 x heartbeat_seconds`` is dropped from :meth:`available`. ``write_slots`` bounds how many
    frames are being written at once (each for at most :data:`WRITE_SLOT_SECONDS`): gRPC copies a frame
    into every stream it is written to, so a broadcast written to all devices at once would hold one copy
    of the model per device.
    """

    def __init__(
        self,
        listen: str = "127.0.0.1:0",
        *,
        pki: str | Path | None = None,
        insecure: bool = False,
        enrol_listen: str | None = None,
        max_message_bytes: int = 64 * 2**20,
        heartbeat_seconds: float = 5.0,
        write_slots: int = 16,
    ) -> None:
        if pki is None and not insecure:
            raise ConfigError(
                "a PKI directory is needed for mutual TLS (fedveil certs init DIR), or --insecure"
            )
        if pki is not None and insecure:
            raise ConfigError("give either a PKI directory or insecure=True, not both")
        if max_message_bytes <= 0:
            raise ConfigError(f"max_message_bytes {max_message_bytes!r} must be positive")
        if not heartbeat_seconds > 0:
            raise ConfigError(f"heartbeat_seconds {heartbeat_seconds!r} must be > 0")
        if isinstance(write_slots, bool) or not isinstance(write_slots, int) or write_slots < 1:
            raise ConfigError(f"write_slots {write_slots!r} must be an integer >= 1")
        parse_listen(listen)
        if enrol_listen is not None:
            parse_listen(enrol_listen)
            if pki is None:
                raise ConfigError("enrolment issues certificates: it needs a PKI directory, not --insecure")
        self.listen = listen
        self.enrol_listen = enrol_listen
        self.pki = Path(pki) if pki is not None else None
        self.insecure = insecure
        self.max_message_bytes = max_message_bytes
        self.heartbeat_seconds = heartbeat_seconds
        self.write_slots = write_slots
        self._slots: asyncio.Semaphore | None = None
        self.refusals: list[Refusal] = []
        self._stats = CommStats()
        self._conns: dict[str, _Connection] = {}
        self._waiting: dict[tuple[str, int], _Waiting] = {}
        self._welcomed: dict[str, None] = {}
        self._ids = itertools.count(1)
        self._server: grpc.aio.Server | None = None
        self._joined: asyncio.Condition | None = None
        self.port = 0
        self.enrol_port = 0
        self._awake: float | None = None
        self._clock: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> int:
        """Bind and serve; returns the device port (useful with port 0)."""
        limit = self.max_message_bytes + wire.ENVELOPE_OVERHEAD
        options = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.http2.max_frame_size", 1 << 22),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ]
        self._joined = asyncio.Condition()
        self._slots = asyncio.Semaphore(self.write_slots)
        server = grpc.aio.server(options=options)
        handlers = {
            "Connect": grpc.stream_stream_rpc_method_handler(self._connect),
        }
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("fedveil.Device", handlers)])
        if self.enrol_listen is not None:
            server.add_generic_rpc_handlers(
                [
                    grpc.method_handlers_generic_handler(
                        "fedveil.Enrol", {"Enrol": grpc.unary_unary_rpc_method_handler(self._enrol)}
                    )
                ]
            )
        if self.pki is None:
            log.warning(
                "serving WITHOUT TLS on %s (--insecure): traffic is plaintext and device ids are not "
                "authenticated",
                self.listen,
            )
            self.port = server.add_insecure_port(self.listen)
        else:
            key, cert, ca = certs.server_credentials(self.pki)
            creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
            self.port = server.add_secure_port(self.listen, creds)
            if self.enrol_listen is not None:
                enrol_creds = grpc.ssl_server_credentials([(key, cert)], require_client_auth=False)
                self.enrol_port = server.add_secure_port(self.enrol_listen, enrol_creds)
        if self.port == 0:
            raise ConfigError(f"could not listen on {self.listen}")
        await server.start()
        self._server = server
        self._clock = asyncio.create_task(self._keep_awake())
        log.info("serving devices on port %d%s", self.port, " (insecure)" if self.insecure else " (mTLS)")
        return self.port

    async def _keep_awake(self) -> None:
        """Note when the event loop last ran (every 0.2 s at most): a device is stale only if it was
        silent while the server could have heard it, not while the loop was busy (a long step 5, a
        checkpoint's fsync) with its heartbeats waiting to be read."""
        while True:
            self._awake = time.monotonic()
            await asyncio.sleep(0.2)

    async def close(
        self, reason: str = "training finished", *, final: bool = True, grace: float = 2.0
    ) -> None:
        """Say goodbye to every agent (``final``: training is over, agents may exit) and stop serving."""
        frame = codec.encode(wire.Goodbye(reason, final))
        for conn in list(self._conns.values()):
            conn.outbox.put_nowait(frame)
            conn.outbox.put_nowait(None)
        if self._conns:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*(c.closed.wait() for c in list(self._conns.values()))), grace
                )
        for w in self._waiting.values():
            if not w.future.done():
                w.future.set_exception(ConnectionError("server closing"))
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        if self._clock is not None:
            self._clock.cancel()
            self._clock = None

    async def wait_for_devices(self, devices: int | Sequence[str], timeout: float) -> list[str]:
        """Wait until ``devices`` (a count, or these ids) are connected, at most ``timeout`` seconds;
        returns who is connected then (the caller decides whether that is enough)."""
        assert self._joined is not None, "start() the runtime first"

        def enough() -> bool:
            if isinstance(devices, int):
                return len(self.available()) >= devices
            return set(devices) <= set(self._conns)

        deadline = time.monotonic() + timeout
        async with self._joined:
            while not enough():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._joined.wait(), left)
        return list(self.available())

    # ---------------------------------------------------------------- Communicator

    def available(self) -> list[ClientId]:
        """Devices connected now, hello accepted, heard from within three heartbeats (sorted). The
        heartbeats are counted up to the last moment the server's event loop ran, so that a server busy
        for longer than that between two rounds does not take its devices' unread heartbeats for
        silence."""
        now = time.monotonic() if self._awake is None else self._awake
        limit = 3 * self.heartbeat_seconds
        return sorted(
            d for d, c in self._conns.items() if now - c.last_seen <= limit and not c.closed.is_set()
        )

    def take_joined(self) -> list[ClientId]:
        """Devices welcomed on a new stream (first connection or reconnection) since the last call, in
        the order they were welcomed, each once; they need registering (and attesting) before they are
        selected. Those no longer connected are left out."""
        joined = [d for d in self._welcomed if d in self._conns and not self._conns[d].closed.is_set()]
        self._welcomed.clear()
        return joined

    def stats(self) -> CommStats:
        """Counters so far (the live object; ``.copy()`` for a snapshot); ``sim_seconds`` is wall time
        spent waiting in :meth:`request`."""
        return self._stats

    def _drop(self, device: str, phase: str, reason: str) -> None:
        self._stats.dropouts.append(Dropout(device, phase, reason))
        log.info("dropout: device %s in phase %s: %s", device, phase, reason)

    def _refuse(self, peer: str, reason: str, *, level: int = logging.WARNING) -> None:
        self.refusals.append(Refusal(peer, reason))
        log.log(level, "refused %s: %s", peer, reason)

    async def request(
        self,
        msgs: Mapping[ClientId, Message],
        *,
        phase: str,
        min_replies: int,
        timeout: float,
        expected: type | tuple[type, ...],
        validate: Validator | None = None,
        fold: Fold | None = None,
    ) -> dict[ClientId, Message]:
        """Send ``msgs`` and gather the earliest ``min_replies`` valid replies within ``timeout`` real
        seconds. Replies are returned in the order the devices were addressed (so a run whose replies
        all arrive matches the simulation's order); late ones are dropouts. ``fold`` takes each valid
        reply as it arrives (its time counts in TTP), and the request keeps what it returns instead."""
        if min_replies < 0:
            raise ConfigError(f"min_replies {min_replies} must be >= 0")
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        frames: dict[int, tuple[int, bytes, int, float]] = {}
        pending: dict[asyncio.Future[Any], tuple[str, int]] = {}
        for cid, msg in msgs.items():
            conn = self._conns.get(cid)
            if conn is None or conn.closed.is_set():
                self._drop(cid, phase, "disconnected: not connected when the request was sent")
                continue
            if id(msg) not in frames:
                # one envelope per distinct message: a broadcast is encoded once for every device
                payload = codec.encode(msg)
                rid, sent_at = next(self._ids), time.time()
                frame = codec.encode(wire.ServerRequest(rid, phase, float(timeout), sent_at, payload))
                frames[id(msg)] = (rid, frame, len(payload), sent_at)
                self._stats.bytes_down_coded += len(payload)
            rid, frame, size, sent_at = frames[id(msg)]
            fut: asyncio.Future[tuple[wire.AgentReply, float]] = loop.create_future()
            self._waiting[(cid, rid)] = _Waiting(cid, phase, sent_at, size, fut)
            conn.outbox.put_nowait(frame)
            self._stats.bytes_down += size
            self._stats.messages_down += 1
            pending[fut] = (cid, rid)
        replies: dict[ClientId, Message] = {}
        deadline = loop.time() + timeout
        timed_out = False
        try:
            while pending and len(replies) < min_replies:
                left = deadline - loop.time()
                if left <= 0:
                    timed_out = True
                    break
                done, _ = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    timed_out = True
                    break
                for fut in done:
                    key = pending.pop(fut)
                    waiting = self._waiting.pop(key)
                    msg = self._accept(waiting, fut, expected, validate, fold)
                    if msg is not None:
                        replies[waiting.device] = msg
                # each arrived payload is folded or dropped: keep none of them while awaiting the next
                del done, fut, waiting
        finally:
            for fut, key in pending.items():
                waiting = self._waiting.pop(key)
                fut.cancel()
                why = (
                    "late: no reply within the timeout"
                    if timed_out
                    else "late: round moved on without this reply"
                )
                self._drop(waiting.device, waiting.phase, why)
        self._stats.sim_seconds += time.perf_counter() - started
        return {cid: replies[cid] for cid in msgs if cid in replies}

    def _accept(
        self,
        waiting: _Waiting,
        fut: asyncio.Future[tuple[wire.AgentReply, float]],
        expected: type | tuple[type, ...],
        validate: Validator | None,
        fold: Fold | None,
    ) -> Message | None:
        """Decode, validate and fold one arrived reply; a dropout (and ``None``) if it does not count."""
        cid, phase = waiting.device, waiting.phase
        exc = fut.exception()
        if exc is not None:
            self._drop(cid, phase, f"disconnected: {exc}")
            return None
        reply, arrived = fut.result()
        t0 = time.perf_counter()
        self._stats.bytes_up += len(reply.payload)
        self._stats.messages_up += 1
        try:
            if reply.error:
                raise ValidationError(f"client raised {reply.error}")
            if len(reply.payload) > self.max_message_bytes:
                raise ValidationError(
                    f"reply of {len(reply.payload)} bytes exceeds the limit of {self.max_message_bytes} bytes"
                )
            msg = codec.decode(reply.payload, max_bytes=self.max_message_bytes, expected=expected)
            if validate is not None:
                validate(cid, msg)
            if fold is not None:
                msg = fold(cid, msg)
        except (CodecError, ValidationError) as err:
            self._drop(cid, phase, f"invalid reply: {err}")
            msg = None
        ttp = time.perf_counter() - t0
        self._stats.timings.append(
            DeviceTiming(
                client=cid,
                phase=phase,
                bytes_down=waiting.bytes_down,
                bytes_up=len(reply.payload),
                ttd=max(0.0, reply.received_at - waiting.sent_at),
                tte=max(0.0, reply.sent_at - reply.received_at),
                ttr=max(0.0, arrived - reply.sent_at),
                ttp=ttp,
            )
        )
        return msg

    # ---------------------------------------------------------------- gRPC handlers

    def _identity(self, context: grpc.aio.ServicerContext) -> tuple[str | None, bytes | None]:
        """(certificate CN, certificate PEM) of the peer, or (None, None) without mutual TLS."""
        auth = context.auth_context()
        names = auth.get("x509_common_name") or []
        pems = auth.get("x509_pem_cert") or []
        if not names or not pems:
            return None, None
        return names[0].decode("utf-8", "replace"), pems[0]

    async def _refuse_stream(self, context: grpc.aio.ServicerContext, peer: str, reason: str) -> None:
        self._refuse(peer, reason)
        with contextlib.suppress(Exception):
            await context.write(codec.encode(wire.Goodbye(f"refused: {reason}", False)))
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)

    async def _connect(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        """One agent's stream: hello, identity checks, then requests out and replies in."""
        peer = context.peer()
        cn, pem = self._identity(context)
        if self.pki is not None and (cn is None or pem is None):
            await self._refuse_stream(context, peer, "no client certificate")
            return
        try:
            first = await asyncio.wait_for(context.read(), HELLO_TIMEOUT)
        except TimeoutError:
            await self._refuse_stream(context, peer, f"no hello within {HELLO_TIMEOUT:g} s")
            return
        if first is grpc.aio.EOF:
            return
        try:
            hello = codec.decode(first, max_bytes=wire.ENVELOPE_OVERHEAD, expected=wire.AgentHello)
        except CodecError as exc:
            await self._refuse_stream(context, peer, f"garbage instead of a hello: {exc}")
            return
        device = hello.device
        if hello.version != wire.PROTOCOL_VERSION:
            await self._refuse_stream(
                context, peer, f"wire version {hello.version}, this server speaks {wire.PROTOCOL_VERSION}"
            )
            return
        if self.pki is not None:
            if device != cn:
                await self._refuse_stream(
                    context, peer, f"hello claims device {device!r} but the certificate is for {cn!r}"
                )
                return
            revoked = certs.is_revoked(self.pki, pem)
            if revoked:
                await self._refuse_stream(context, f"{device} ({peer})", revoked)
                return
        else:
            try:
                certs.check_device_name(device)
            except FedveilError as exc:
                await self._refuse_stream(context, peer, str(exc))
                return
        conn = _Connection(device, asyncio.Queue(), time.monotonic())
        old = self._conns.get(device)
        if old is not None:
            log.info("device %s reconnected from %s; closing its older stream", device, peer)
            old.outbox.put_nowait(None)
            self._fail_waiting(device, "the device reconnected on a new stream")
        self._conns[device] = conn
        self._welcomed.pop(device, None)
        self._welcomed[device] = None
        await context.write(
            codec.encode(wire.Welcome(device, self.heartbeat_seconds, self.max_message_bytes))
        )
        assert self._joined is not None
        async with self._joined:
            self._joined.notify_all()
        writer = asyncio.create_task(self._write_loop(context, conn))
        try:
            await self._read_loop(context, conn)
        finally:
            conn.closed.set()
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
            if self._conns.get(device) is conn:
                del self._conns[device]
                self._fail_waiting(device, "the device's stream closed")
            log.info("device %s disconnected", device)

    async def _write_loop(self, context: grpc.aio.ServicerContext, conn: _Connection) -> None:
        """Write ``conn``'s frames in order, each started inside one of the write slots (class docstring)."""
        assert self._slots is not None, "start() the runtime first"
        while True:
            frame = await conn.outbox.get()
            if frame is None:
                conn.closed.set()
                return
            write: asyncio.Future[None] | None = None
            try:
                async with self._slots:
                    write = asyncio.ensure_future(context.write(frame))
                    await asyncio.wait({write}, timeout=WRITE_SLOT_SECONDS)
                await write
            finally:
                if write is not None:
                    write.cancel()

    async def _read_loop(self, context: grpc.aio.ServicerContext, conn: _Connection) -> None:
        limit = self.max_message_bytes + wire.ENVELOPE_OVERHEAD
        while not conn.closed.is_set():
            read = asyncio.ensure_future(context.read())
            closed = asyncio.ensure_future(conn.closed.wait())
            done, _ = await asyncio.wait({read, closed}, return_when=asyncio.FIRST_COMPLETED)
            if read not in done:
                read.cancel()
                return
            closed.cancel()
            try:
                frame = read.result()
            except (grpc.aio.AioRpcError, asyncio.CancelledError, grpc.aio.AbortError) as exc:
                log.info("stream of device %s ended: %s", conn.device, exc)
                return
            if frame is grpc.aio.EOF:
                return
            arrived = time.time()
            conn.last_seen = time.monotonic()
            try:
                env = codec.decode(frame, max_bytes=limit, expected=(wire.AgentReply, wire.Heartbeat))
            except CodecError as exc:
                self._refuse(conn.device, f"garbage frame, stream closed: {exc}")
                return
            if isinstance(env, wire.AgentReply):
                self._route(conn, env, arrived)
            # neither the frame nor its reply stays referenced while this stream waits for its next frame
            # (a heartbeat away): held by every stream, they would be two models per device
            del read, done, frame, env

    def _route(self, conn: _Connection, reply: wire.AgentReply, arrived: float) -> None:
        """Hand a reply to the request it answers, if that request is still waiting for this device."""
        waiting = self._waiting.get((conn.device, reply.request_id))
        if waiting is None:
            others = sorted(d for d, r in self._waiting if r == reply.request_id)
            why = (
                f"which was not sent to this device (it awaits {others[:3]})"
                if others
                else "which is not awaited (late, replayed or unknown)"
            )
            # a late reply is routine (the round moved on); one for another device is not
            self._refuse(
                conn.device,
                f"reply to request {reply.request_id}, {why}",
                level=logging.WARNING if others else logging.INFO,
            )
            return
        if not waiting.future.done():
            waiting.future.set_result((reply, arrived))

    def _fail_waiting(self, device: str, why: str) -> None:
        for waiting in self._waiting.values():
            if waiting.device == device and not waiting.future.done():
                waiting.future.set_exception(ConnectionError(why))

    async def _enrol(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Exchange a one-time token and a CSR for a device certificate (never logs the token)."""
        peer = context.peer()
        try:
            msg = codec.decode(request, max_bytes=64 * 1024, expected=wire.EnrolRequest)
            assert self.pki is not None
            certs.check_csr(msg.csr)
            name = certs.redeem_token(self.pki, msg.token)
            cert = certs.sign_csr(self.pki, msg.csr, name)
        except FedveilError as exc:
            self._refuse(peer, f"enrolment refused: {exc}")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"enrolment refused: {exc}")
            raise AssertionError("unreachable") from exc
        _, _, ca = certs.server_credentials(self.pki)
        log.info("enrolled device %s from %s", name, peer)
        return codec.encode(wire.EnrolReply(name, cert, ca))
