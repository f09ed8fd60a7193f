"""Device agents: the client side of the networked runtime.

An :class:`AgentHost` runs one or more devices in one process. Each device dials the server on its own
gRPC stream with its own identity (its certificate under mutual TLS), sends its hello, then answers the
server's requests with the **same client code as the simulation**: a protocol's client pool
(``FDMLClients``, ``FedAvgClients``, ``UvClients``...) whose ``handle_batch`` gets the decoded messages and
whose state persists across rounds. Requests for several of the host's devices that are waiting at the
same moment are handed to the pool together, so a pool that batches a phase (one forward pass for the
cohort) does so here too, behind the same equality tests as in simulation; a broadcast payload is
decoded once for all of them.

A device's randomness on the network path comes from its round, not its history: a
:class:`RoundSeededPool` reseeds each device's generator for every request that carries a round
(``SeedSequence([seed, ROUND_STREAM, device index, round, attempt])``, the seed being the experiment's),
so what a device draws for a round does not depend on what it drew before, on whether its agent was
restarted, or on whether the server already asked it once for this round before a crash: a resumed server
gets the same draws as an uninterrupted one.

A device reconnects by itself after any failure, with exponential backoff and full jitter
(``base * 2**attempt``, capped, times a uniform factor in [0.5, 1.5)), sends heartbeats, and exits when
the server says training is over (:class:`~fedveil.runtime.network.wire.Goodbye` with ``final``) or, if
``give_up_after`` is set, after that many seconds without reaching the server. A server that vanishes
never crashes an agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import numpy as np

from fedveil.core import codec
from fedveil.core.communicator import ClientId, Deferred, Message
from fedveil.errors import CodecError, ConfigError, FedveilError
from fedveil.protocols.common import restore_pool_rngs
from fedveil.runtime.network import certs, wire
from fedveil.runtime.simulation import ClientPool, LatencyModel

log = logging.getLogger(__name__)

ROUND_STREAM = 0x726F756E
"""Tags the per-round seed sequences so that none equals a per-client stream's (``[seed, index]``)."""


def round_rng(seed: int, index: int, rnd: int, attempt: int = 0) -> np.random.Generator:
    """The generator device number ``index`` of a run seeded ``seed`` draws from for ``attempt`` of
    round ``rnd`` (attempt 0 for protocols without attempts)."""
    return np.random.default_rng(np.random.SeedSequence([seed, ROUND_STREAM, index, rnd, attempt]))


class RoundSeededPool:
    """A client pool whose devices draw each round's randomness (training samples, augmentation, local
    batches) from :func:`round_rng` of the request's round and attempt. The seed is the experiment's,
    which the server knows too: nothing that must stay secret from the server (noise that protects a
    device's update) may be drawn from these generators.

    Before ``pool.handle_batch`` sees a message with a ``round`` field (and ``attempt``, if it has one),
    the addressed device's generator is set to that round's; messages without a round (registration,
    attestation) leave it alone. The device index is its position in ``pool.client_ids()``, the same
    numbering as the pool's own per-client streams. The pool's code is unchanged: only where its
    generators start each round differs from the simulation's single stream per device.
    """

    def __init__(self, pool: ClientPool, seed: int) -> None:
        self.pool = pool
        self.seed = int(seed)
        self._index = {cid: i for i, cid in enumerate(pool.client_ids())}

    def client_ids(self) -> Sequence[ClientId]:
        """The wrapped pool's devices."""
        return self.pool.client_ids()

    def handle_batch(
        self, msgs: Mapping[ClientId, Message]
    ) -> dict[ClientId, Message | bytes | Exception | Deferred]:
        """Reseed each addressed device for its message's round, then let the pool answer."""
        states = {
            cid: round_rng(
                self.seed, self._index[cid], int(m.round), int(getattr(m, "attempt", 0))
            ).bit_generator.state
            for cid, m in msgs.items()
            if isinstance(getattr(m, "round", None), int) and cid in self._index
        }
        if states:
            restore_pool_rngs(self.pool, states)
        return self.pool.handle_batch(msgs)


@dataclass
class _Work:
    device: str
    request: wire.ServerRequest
    received_at: float
    call: Any


@dataclass
class _DeviceState:
    name: str
    credentials: certs.DeviceCredentials | None
    call: Any = None
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    done: bool = False
    refused: str = ""
    connections: int = 0


class AgentHost:
    """Devices of one process, each on its own stream to ``server`` (``HOST:PORT``).

    ``devices`` maps each device id to its credentials (``None`` only with ``insecure=True``);
    ``pool`` is the client pool that answers for all of them. ``tte`` adds a simulated time on the
    device before each reply (PoliFL Sec. 5.4 replays TTE from a distribution); ``server_name``
    overrides the TLS host name checked against the server certificate. The pool runs on one worker
    thread (so the event loop keeps serving heartbeats while it computes); ``worker_init`` runs first on
    that thread, e.g. to give it the process's torch thread settings (OpenMP keeps them per thread).
    """

    def __init__(
        self,
        server: str,
        devices: Mapping[str, certs.DeviceCredentials | None],
        pool: ClientPool,
        *,
        insecure: bool = False,
        server_name: str | None = None,
        max_message_bytes: int = 64 * 2**20,
        backoff: tuple[float, float] = (0.2, 10.0),
        give_up_after: float | None = None,
        tte: LatencyModel | None = None,
        seed: int | None = None,
        worker_init: Callable[[], None] | None = None,
    ) -> None:
        if not devices:
            raise ConfigError("an agent needs at least one device")
        for name, cred in devices.items():
            certs.check_device_name(name)
            if cred is None and not insecure:
                raise ConfigError(
                    f"device {name!r} has no credentials (fedveil certs device {name}), or --insecure"
                )
        self.server = server
        self.pool = pool
        self.insecure = insecure
        self.server_name = server_name
        self.max_message_bytes = max_message_bytes
        self.backoff = backoff
        self.give_up_after = give_up_after
        self.tte = tte
        self._jitter = random.Random(seed)
        self._tte_rng = np.random.default_rng(seed)
        self._devices = {name: _DeviceState(name, cred) for name, cred in devices.items()}
        self._queue: asyncio.Queue[_Work] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="fedveil-agent", initializer=worker_init
        )
        self.batch_window = 0.002
        """Seconds the worker waits after a request for others to join its batch."""

    @property
    def devices(self) -> list[str]:
        """The hosted device ids."""
        return list(self._devices)

    def connections(self, device: str) -> int:
        """How many times ``device`` has been welcomed (1 + reconnections)."""
        return self._devices[device].connections

    async def run(self) -> dict[str, str]:
        """Serve until every device is done; returns each device's ending (``finished`` or a reason)."""
        worker = asyncio.create_task(self._worker())
        try:
            results = await asyncio.gather(*(self._device_loop(d) for d in self._devices.values()))
        finally:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
            self._executor.shutdown(wait=False)
        return dict(zip(self._devices, results, strict=True))

    def _channel(self, state: _DeviceState) -> grpc.aio.Channel:
        limit = self.max_message_bytes + wire.ENVELOPE_OVERHEAD
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.http2.max_frame_size", 1 << 22),
            # one connection per device, never shared between the host's devices
            ("grpc.use_local_subchannel_pool", 1),
            ("fedveil.device", state.name),
        ]
        if self.insecure:
            return grpc.aio.insecure_channel(self.server, options=options)
        cred = state.credentials
        assert cred is not None
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        creds = grpc.ssl_channel_credentials(
            root_certificates=cred.ca_pem, private_key=cred.key_pem, certificate_chain=cred.cert_pem
        )
        return grpc.aio.secure_channel(self.server, creds, options=options)

    async def _device_loop(self, state: _DeviceState) -> str:
        attempt = 0
        last_contact = time.monotonic()
        while True:
            welcomed = False
            try:
                welcomed = await self._session(state)
            except (grpc.aio.AioRpcError, CodecError, ConnectionError, OSError) as exc:
                detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                log.info("device %s: connection to %s lost: %s", state.name, self.server, detail)
            if state.done:
                return "finished"
            if welcomed:
                attempt = 0
                last_contact = time.monotonic()
            if self.give_up_after is not None and time.monotonic() - last_contact > self.give_up_after:
                reason = state.refused or f"no server at {self.server} for {self.give_up_after:g} s"
                log.warning("device %s gives up: %s", state.name, reason)
                return f"gave up: {reason}"
            delay = min(self.backoff[1], self.backoff[0] * 2**attempt) * self._jitter.uniform(0.5, 1.5)
            attempt += 1
            await asyncio.sleep(delay)

    async def _session(self, state: _DeviceState) -> bool:
        """One connection: hello, welcome, then requests until the stream ends; True if welcomed."""
        async with self._channel(state) as channel:
            call = channel.stream_stream(wire.CONNECT_METHOD)()
            await call.write(codec.encode(wire.AgentHello(state.name, wire.PROTOCOL_VERSION)))
            first = await call.read()
            if first is grpc.aio.EOF:
                return False
            env = codec.decode(first, max_bytes=wire.ENVELOPE_OVERHEAD, expected=(wire.Welcome, wire.Goodbye))
            if isinstance(env, wire.Goodbye):
                state.refused = env.reason
                log.warning("device %s refused by the server: %s", state.name, env.reason)
                return False
            state.connections += 1
            state.refused = ""
            state.call = call
            beat = asyncio.create_task(self._heartbeats(state, call, env.heartbeat_seconds))
            try:
                await self._read(state, call)
            finally:
                beat.cancel()
                # a heartbeat written after the stream ended fails too: the read's error is the one that
                # counts (the device reconnects), never the heartbeat's, which would end the agent
                with contextlib.suppress(
                    asyncio.CancelledError,
                    asyncio.InvalidStateError,
                    grpc.aio.AioRpcError,
                    grpc.aio.UsageError,
                ):
                    await beat
                state.call = None
            return True

    async def _heartbeats(self, state: _DeviceState, call: Any, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            async with state.write_lock:
                await call.write(codec.encode(wire.Heartbeat(time.time())))

    async def _read(self, state: _DeviceState, call: Any) -> None:
        limit = self.max_message_bytes + wire.ENVELOPE_OVERHEAD
        while True:
            frame = await call.read()
            if frame is grpc.aio.EOF:
                return
            received = time.time()
            env = codec.decode(frame, max_bytes=limit, expected=(wire.ServerRequest, wire.Goodbye))
            if isinstance(env, wire.Goodbye):
                log.info("device %s: server says goodbye: %s", state.name, env.reason)
                if env.final:
                    state.done = True
                    with contextlib.suppress(Exception):
                        await call.done_writing()
                return
            self._queue.put_nowait(_Work(state.name, env, received, call))

    async def _worker(self) -> None:
        """Hand waiting requests to the pool together (one per device per batch), send the replies."""
        while True:
            batch = [await self._queue.get()]
            await asyncio.sleep(self.batch_window)
            deferred: list[_Work] = []
            seen = {batch[0].device}
            while not self._queue.empty():
                item = self._queue.get_nowait()
                (deferred if item.device in seen else batch).append(item)
                seen.add(item.device)
            for item in deferred:
                self._queue.put_nowait(item)
            await self._answer(batch)

    async def _answer(self, batch: list[_Work]) -> None:
        decoded: dict[bytes, Any] = {}
        msgs: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for item in batch:
            payload = item.request.payload
            try:
                if payload not in decoded:
                    decoded[payload] = codec.decode(payload, max_bytes=self.max_message_bytes)
                msgs[item.device] = decoded[payload]
            except CodecError as exc:
                errors[item.device] = f"CodecError: {exc}"
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(self._executor, self.pool.handle_batch, msgs) if msgs else {}
        if self.tte is not None:
            await asyncio.sleep(float(self.tte.sample(self._tte_rng, 1)[0]))
        for item in batch:
            reply = results.get(item.device)
            error = errors.get(item.device, "")
            payload = b""
            if isinstance(reply, Exception):
                error = f"{type(reply).__name__}: {reply}"
            elif reply is not None:
                try:
                    payload = reply if isinstance(reply, bytes) else codec.encode(reply)
                except (CodecError, FedveilError) as exc:
                    error = f"{type(exc).__name__}: {exc}"
            elif not error:
                error = "the device produced no reply"
            frame = codec.encode(
                wire.AgentReply(item.request.request_id, item.received_at, time.time(), payload, error)
            )
            state = self._devices[item.device]
            if state.call is not item.call:
                log.info(
                    "device %s: reply to request %d dropped (stream closed)",
                    item.device,
                    item.request.request_id,
                )
                continue
            try:
                async with state.write_lock:
                    await item.call.write(frame)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
                log.info("device %s: could not send reply: %s", item.device, exc)
