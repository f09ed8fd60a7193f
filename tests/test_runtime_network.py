"""The networked runtime on loopback: mutual TLS, identity, dropouts, hostile peers (all bounded in time)."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import numpy as np
import pytest

from fedveil.core import codec
from fedveil.core.messages import array_field, message
from fedveil.errors import ConfigError, ValidationError
from fedveil.runtime.network import certs, server, wire
from fedveil.runtime.network.agent import AgentHost
from fedveil.runtime.network.server import NetworkRuntime, _Connection, _Waiting, parse_listen


@message("test.net.ping")
@dataclass(frozen=True)
class Ping:
    round: int
    values: np.ndarray = array_field(dtype="float32", ndim=1, finite=True)


@message("test.net.pong")
@dataclass(frozen=True)
class Pong:
    round: int
    device: str
    total: float


class EchoPool:
    """Answers a Ping with the sum of its values; ``sleep`` delays chosen devices, ``fail`` refuses."""

    def __init__(
        self, ids: list[str], *, sleep: Mapping[str, float] | None = None, fail: set[str] | None = None
    ):
        self.ids = ids
        self.sleep = dict(sleep or {})
        self.fail = set(fail or ())
        self.batches: list[list[str]] = []

    def client_ids(self) -> list[str]:
        return self.ids

    def handle_batch(self, msgs: Mapping[str, object]) -> dict[str, object]:
        self.batches.append(sorted(msgs))
        out: dict[str, object] = {}
        for cid, m in msgs.items():
            assert isinstance(m, Ping)
            if cid in self.fail:
                out[cid] = ValidationError("this device refuses")
                continue
            time.sleep(self.sleep.get(cid, 0.0))
            out[cid] = Pong(m.round, cid, float(np.sum(m.values)))
        return out


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    certs.init_pki(root)
    return root


def _creds(pki: Path, names: list[str]) -> dict[str, certs.DeviceCredentials]:
    return {n: certs.issue_device(pki, n) for n in names}


async def _serve(pki: Path | None, **kw: object) -> tuple[NetworkRuntime, str]:
    runtime = NetworkRuntime("127.0.0.1:0", pki=pki, insecure=pki is None, heartbeat_seconds=0.5, **kw)
    port = await runtime.start()
    return runtime, f"127.0.0.1:{port}"


def _host(
    address: str, creds: Mapping[str, certs.DeviceCredentials | None], pool: object, **kw: object
) -> AgentHost:
    return AgentHost(
        address, creds, pool, insecure=all(c is None for c in creds.values()), give_up_after=5.0, seed=0, **kw
    )


def _run(coro: object, timeout: float = 60.0) -> object:
    async def bounded() -> object:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def test_parse_listen() -> None:
    assert parse_listen("127.0.0.1:7443") == ("127.0.0.1", 7443)
    assert parse_listen("[::1]:80") == ("::1", 80)
    for bad in ("7443", "host:", "host:port", ":1", "h:99999"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            parse_listen(bad)


def test_insecure_must_be_explicit() -> None:
    with pytest.raises(ConfigError, match="insecure"):
        NetworkRuntime("127.0.0.1:0")


def test_round_trip_over_mutual_tls(pki: Path) -> None:
    names = ["d0", "d1", "d2"]
    pool = EchoPool(names)

    async def go() -> None:
        runtime, address = await _serve(pki)
        host = _host(address, _creds(pki, names), pool)
        agents = asyncio.create_task(host.run())
        assert await runtime.wait_for_devices(3, 10) == names
        ping = Ping(1, np.arange(4, dtype=np.float32))
        replies = await runtime.request(
            {n: ping for n in names}, phase="p", min_replies=3, timeout=10, expected=Pong
        )
        assert list(replies) == names
        assert all(r.total == 6.0 and r.device == n for n, r in replies.items())
        stats = runtime.stats()
        assert stats.bytes_down == 3 * len(codec.encode(ping))
        assert stats.bytes_down_coded == len(codec.encode(ping))  # the broadcast is encoded once
        assert stats.bytes_up == sum(len(codec.encode(r)) for r in replies.values())
        assert len(stats.timings) == 3
        for t in stats.timings:
            assert t.ttd is not None and t.tte is not None and t.ttr is not None and t.ttp is not None
            assert t.ttd >= 0 and t.tte >= 0 and t.ttr >= 0 and t.ttp >= 0
            assert t.bytes_down == len(codec.encode(ping))
        await runtime.close()
        assert set((await agents).values()) == {"finished"}

    _run(go())
    assert sorted(d for batch in pool.batches for d in batch) == names


def test_late_refused_and_missing_devices_are_dropouts(pki: Path) -> None:
    names = ["a", "b", "c"]
    creds = _creds(pki, names)
    quick = EchoPool(["a", "c"], fail={"c"})
    slow = EchoPool(
        ["b"], sleep={"b": 1.5}
    )  # its own process in real life: a host computes its devices in turn

    async def go() -> None:
        runtime, address = await _serve(pki)
        agents = asyncio.gather(
            _host(address, {n: creds[n] for n in ("a", "c")}, quick).run(),
            _host(address, {"b": creds["b"]}, slow).run(),
        )
        await runtime.wait_for_devices(3, 10)
        ping = Ping(2, np.ones(2, dtype=np.float32))
        t0 = time.monotonic()
        replies = await runtime.request(
            {n: ping for n in [*names, "ghost"]}, phase="p", min_replies=4, timeout=0.8, expected=Pong
        )
        assert time.monotonic() - t0 < 1.4, "a slow device must not hold the round past its deadline"
        assert list(replies) == ["a"]
        reasons = {d.client: d.reason for d in runtime.stats().dropouts}
        assert reasons["ghost"].startswith("disconnected")
        assert reasons["c"].startswith("invalid reply: client raised ValidationError: this device refuses")
        assert reasons["b"].startswith("late")
        await asyncio.sleep(1.0)  # b's late reply arrives after the round moved on: refused, not counted
        assert any("not awaited" in r.reason for r in runtime.refusals)
        await runtime.close()
        await agents

    _run(go())


def test_protocol_validation_failure_is_a_dropout(pki: Path) -> None:
    pool = EchoPool(["v"])

    def only_round_seven(cid: str, msg: Pong) -> None:
        if msg.round != 7:
            raise ValidationError(f"reply for round {msg.round}, expected 7")

    async def go() -> None:
        runtime, address = await _serve(pki)
        agents = asyncio.create_task(_host(address, _creds(pki, ["v"]), pool).run())
        await runtime.wait_for_devices(1, 10)
        replies = await runtime.request(
            {"v": Ping(3, np.ones(1, np.float32))},
            phase="p",
            min_replies=1,
            timeout=5,
            expected=Pong,
            validate=only_round_seven,
        )
        assert replies == {}
        assert "expected 7" in runtime.stats().dropouts[-1].reason
        await runtime.close()
        await agents

    _run(go())


async def _raw_stream(address: str, cred: certs.DeviceCredentials | None, frames: list[bytes]) -> list[bytes]:
    """Dial as a hand-written peer, send ``frames``, return what the server wrote back."""
    if cred is None:
        channel = grpc.aio.insecure_channel(address)
    else:
        creds = grpc.ssl_channel_credentials(cred.ca_pem, cred.key_pem, cred.cert_pem)
        channel = grpc.aio.secure_channel(address, creds)
    got: list[bytes] = []
    async with channel:
        call = channel.stream_stream(wire.CONNECT_METHOD)()
        try:
            for f in frames:
                await call.write(f)
            await call.done_writing()
            while True:
                frame = await asyncio.wait_for(call.read(), 5)
                if frame is grpc.aio.EOF:
                    break
                got.append(frame)
        except grpc.aio.AioRpcError:
            pass
    return got


def test_hostile_peers_are_refused_and_the_server_goes_on(pki: Path, tmp_path: Path) -> None:
    creds = _creds(pki, ["good", "mallory"])
    other_ca = tmp_path / "other"
    certs.init_pki(other_ca)
    foreign = certs.issue_device(other_ca, "good")
    hello = codec.encode(wire.AgentHello("good", wire.PROTOCOL_VERSION))

    async def go() -> None:
        runtime, address = await _serve(pki, max_message_bytes=4096)
        # another device's id under mallory's certificate
        got = await _raw_stream(address, creds["mallory"], [hello])
        assert any("certificate is for 'mallory'" in codec.decode(f).reason for f in got)
        # garbage instead of a hello
        await _raw_stream(address, creds["mallory"], [b"\x00garbage"])
        # no certificate at all: the TLS handshake fails before any hello
        with pytest.raises(grpc.aio.AioRpcError):
            async with grpc.aio.secure_channel(
                address, grpc.ssl_channel_credentials(creds["good"].ca_pem)
            ) as ch:
                call = ch.stream_stream(wire.CONNECT_METHOD)()
                await call.write(hello)
                await asyncio.wait_for(call.read(), 5)
        # a certificate from another CA: refused by the handshake
        with pytest.raises(grpc.aio.AioRpcError):
            async with grpc.aio.secure_channel(
                address, grpc.ssl_channel_credentials(creds["good"].ca_pem, foreign.key_pem, foreign.cert_pem)
            ) as ch:
                call = ch.stream_stream(wire.CONNECT_METHOD)()
                await call.write(hello)
                await asyncio.wait_for(call.read(), 5)
        # a welcomed peer that sends garbage, a forged reply id and an oversize frame
        welcomed = codec.encode(wire.AgentHello("mallory", wire.PROTOCOL_VERSION))
        forged = codec.encode(wire.AgentReply(999, 0.0, 0.0, b""))
        await _raw_stream(address, creds["mallory"], [welcomed, forged, b"junk"])
        await _raw_stream(address, creds["mallory"], [welcomed, b"\x00" * 20_000])
        reasons = " | ".join(r.reason for r in runtime.refusals)
        assert "garbage instead of a hello" in reasons
        assert "request 999, which is not awaited" in reasons
        assert "garbage frame" in reasons
        # revoked certificates are refused at the hello
        certs.revoke(pki, "mallory")
        got = await _raw_stream(address, creds["mallory"], [welcomed])
        assert any("revoked" in codec.decode(f).reason for f in got)
        # ...and the server still serves a good device
        pool = EchoPool(["good"])
        agents = asyncio.create_task(_host(address, {"good": creds["good"]}, pool).run())
        await runtime.wait_for_devices(["good"], 10)
        replies = await runtime.request(
            {"good": Ping(1, np.ones(3, np.float32))}, phase="p", min_replies=1, timeout=5, expected=Pong
        )
        assert replies["good"].total == 3.0
        await runtime.close()
        await agents

    _run(go())


def test_reply_to_another_devices_request_is_refused(pki: Path) -> None:
    creds = _creds(pki, ["slow", "eve"])
    pool = EchoPool(["slow"], sleep={"slow": 0.6})

    async def go() -> None:
        runtime, address = await _serve(pki)
        agents = asyncio.create_task(_host(address, {"slow": creds["slow"]}, pool).run())
        await runtime.wait_for_devices(["slow"], 10)
        ask = asyncio.create_task(
            runtime.request(
                {"slow": Ping(1, np.ones(2, np.float32))}, phase="p", min_replies=1, timeout=5, expected=Pong
            )
        )
        await asyncio.sleep(0.2)
        rid = max(r for _, r in runtime._waiting)
        forged = Pong(1, "slow", 1e6)
        eve = [
            codec.encode(wire.AgentHello("eve", wire.PROTOCOL_VERSION)),
            codec.encode(wire.AgentReply(rid, 0.0, 0.0, codec.encode(forged))),
        ]
        await _raw_stream(address, creds["eve"], eve)
        replies = await ask
        assert replies["slow"].total == 2.0, "eve's forged reply must not be taken for slow's"
        assert any("not sent to this device (it awaits ['slow'])" in r.reason for r in runtime.refusals)
        await runtime.close()
        await agents

    _run(go())


def test_agent_reconnects_after_the_server_restarts(pki: Path) -> None:
    pool = EchoPool(["r"])

    async def go() -> None:
        runtime, address = await _serve(pki)
        host = _host(address, _creds(pki, ["r"]), pool, backoff=(0.05, 0.3))
        agents = asyncio.create_task(host.run())
        await runtime.wait_for_devices(1, 10)
        await runtime.close("maintenance", final=False)
        again = NetworkRuntime(address, pki=pki, heartbeat_seconds=0.5)
        await again.start()
        assert await again.wait_for_devices(["r"], 10) == ["r"]
        for _ in range(100):  # the agent counts the welcome when it reads it
            if host.connections("r") == 2:
                break
            await asyncio.sleep(0.02)
        assert host.connections("r") == 2
        replies = await again.request(
            {"r": Ping(5, np.ones(1, np.float32))}, phase="p", min_replies=1, timeout=5, expected=Pong
        )
        assert replies["r"].round == 5
        await again.close()
        assert (await agents) == {"r": "finished"}

    _run(go())


def test_agent_without_a_server_gives_up_by_itself() -> None:
    async def go() -> dict[str, str]:
        host = AgentHost(
            "127.0.0.1:9", {"x": None}, EchoPool(["x"]), insecure=True, give_up_after=0.5, backoff=(0.05, 0.1)
        )
        return await host.run()

    out = _run(go(), timeout=20)
    assert out["x"].startswith("gave up: no server")


def test_enrolment_token_buys_one_certificate(pki: Path, caplog: pytest.LogCaptureFixture) -> None:
    from fedveil.runtime.network.enrol import enrol

    token = certs.create_token(pki, "newbie")
    secret = token.rpartition(".")[2]
    ca = (pki / "ca.crt").read_bytes()

    async def go() -> None:
        runtime = NetworkRuntime("127.0.0.1:0", pki=pki, enrol_listen="127.0.0.1:0", heartbeat_seconds=0.5)
        port = await runtime.start()
        creds = await enrol(f"127.0.0.1:{runtime.enrol_port}", token, ca)
        assert creds.name == "newbie"
        with pytest.raises(ConfigError, match=r"enrolment at .* failed"):
            await enrol(f"127.0.0.1:{runtime.enrol_port}", token, ca)  # used once already
        with pytest.raises(ConfigError, match="failed"):
            await enrol(f"127.0.0.1:{runtime.enrol_port}", "newbie.wrong-secret", ca)
        pool = EchoPool(["newbie"])
        agents = asyncio.create_task(_host(f"127.0.0.1:{port}", {"newbie": creds}, pool).run())
        assert await runtime.wait_for_devices(["newbie"], 10) == ["newbie"]
        await runtime.close()
        await agents
        # the enrolment port asks for no client certificate; the device port still does
        assert not any(secret in r.reason for r in runtime.refusals)

    _run(go())
    assert secret not in caplog.text


def test_an_agent_that_connects_and_never_speaks_does_not_hold_a_round(pki: Path) -> None:
    creds = _creds(pki, ["mute", "ok"])

    async def go() -> None:
        runtime, address = await _serve(pki)
        cred = creds["mute"]
        channel = grpc.aio.secure_channel(
            address, grpc.ssl_channel_credentials(cred.ca_pem, cred.key_pem, cred.cert_pem)
        )
        call = channel.stream_stream(wire.CONNECT_METHOD)()
        await call.write(codec.encode(wire.AgentHello("mute", wire.PROTOCOL_VERSION)))
        assert isinstance(codec.decode(await call.read()), wire.Welcome)  # welcomed, then silent
        agents = asyncio.create_task(_host(address, {"ok": creds["ok"]}, EchoPool(["ok"])).run())
        assert await runtime.wait_for_devices(2, 10) == ["mute", "ok"]
        t0 = time.monotonic()
        replies = await runtime.request(
            {d: Ping(1, np.ones(1, np.float32)) for d in ("mute", "ok")},
            phase="p",
            min_replies=2,
            timeout=0.7,
            expected=Pong,
        )
        assert time.monotonic() - t0 < 1.5
        assert list(replies) == ["ok"]
        assert runtime.stats().dropouts[-1].client == "mute"
        assert runtime.stats().dropouts[-1].reason == "late: no reply within the timeout"
        call.cancel()
        await channel.close()
        await runtime.close()
        await agents

    _run(go())


def test_a_busy_server_does_not_take_unread_heartbeats_for_silence(pki: Path) -> None:
    """``available()`` counts heartbeats up to the last moment the server's event loop ran: a loop held up
    for longer than three heartbeats (a long step 5, a slow fsync) still sees its devices when it selects
    the next cohort. ``take_joined`` hands out each welcome once."""
    pool = EchoPool(["b"])

    async def go() -> None:
        runtime, address = await _serve(pki)
        host = _host(address, _creds(pki, ["b"]), pool)
        agents = asyncio.create_task(host.run())
        assert await runtime.wait_for_devices(["b"], 10) == ["b"]
        assert runtime.take_joined() == ["b"]
        assert runtime.take_joined() == []
        time.sleep(4 * runtime.heartbeat_seconds)  # busy: nothing is read, no heartbeat is sent
        assert runtime.available() == ["b"]
        await runtime.close()
        assert (await agents) == {"b": "finished"}

    _run(go())


def test_fold_takes_each_valid_reply_as_it_arrives_and_invalid_ones_never(pki: Path) -> None:
    """The fold sees replies in arrival order (``a`` computes longest), the request returns what it
    kept in the order the devices were addressed, and a refused or invalid reply never reaches it."""
    creds = _creds(pki, ["a", "b", "c", "d"])
    quick = EchoPool(["b", "c", "d"], fail={"c"})
    slow = EchoPool(["a"], sleep={"a": 0.4})
    folded: list[str] = []

    def refuse_d(cid: str, msg: Pong) -> None:
        if cid == "d":
            raise ValidationError("not d")

    def strip(cid: str, msg: Pong) -> tuple[str, float]:
        folded.append(cid)
        return ("folded", msg.total)

    async def go() -> None:
        runtime, address = await _serve(pki)
        agents = asyncio.gather(
            _host(address, {n: creds[n] for n in ("b", "c", "d")}, quick).run(),
            _host(address, {"a": creds["a"]}, slow).run(),
        )
        await runtime.wait_for_devices(4, 10)
        replies = await runtime.request(
            {n: Ping(1, np.ones(3, np.float32)) for n in ["a", "b", "c", "d"]},
            phase="p",
            min_replies=4,
            timeout=5,
            expected=Pong,
            validate=refuse_d,
            fold=strip,
        )
        assert folded == ["b", "a"]
        assert list(replies.items()) == [("a", ("folded", 3.0)), ("b", ("folded", 3.0))]
        reasons = {d.client: d.reason for d in runtime.stats().dropouts}
        assert reasons == {
            "c": "invalid reply: client raised ValidationError: this device refuses",
            "d": "invalid reply: not d",
        }
        await runtime.close()
        await agents

    _run(go())


class _SlowContext:
    """A stream's write side: each write takes ``seconds`` (forever for ``None``); ``live`` counts the
    writes in progress across all streams, ``most`` the largest count seen."""

    live = 0
    most = 0

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.written: list[bytes] = []

    async def write(self, frame: bytes) -> None:
        type(self).live += 1
        type(self).most = max(type(self).most, type(self).live)
        try:
            await (asyncio.Event().wait() if self.seconds is None else asyncio.sleep(self.seconds))
            self.written.append(frame)
        finally:
            type(self).live -= 1


def test_a_broadcast_is_written_a_few_streams_at_a_time_and_a_stalled_stream_holds_no_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gRPC copies a frame into each stream it is written to: the server writes at most ``write_slots``
    at once, and a stream that stops reading gives its slot up after ``WRITE_SLOT_SECONDS``."""
    monkeypatch.setattr(server, "WRITE_SLOT_SECONDS", 0.05)

    async def go() -> None:
        runtime = NetworkRuntime("127.0.0.1:0", insecure=True, write_slots=3)
        runtime._slots = asyncio.Semaphore(runtime.write_slots)
        stalled = [_SlowContext(None) for _ in range(3)]
        healthy = [_SlowContext(0.01) for _ in range(12)]
        conns = [_Connection(f"d{i}", asyncio.Queue(), 0.0) for i in range(15)]
        for conn in conns:
            conn.outbox.put_nowait(b"model")
            conn.outbox.put_nowait(None)
        loops = [
            asyncio.create_task(runtime._write_loop(ctx, conn))
            for ctx, conn in zip([*stalled, *healthy], conns, strict=True)
        ]
        t0 = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*loops[3:]), 5)
        assert time.monotonic() - t0 < 2, "the stalled streams held the broadcast back"
        assert all(ctx.written == [b"model"] for ctx in healthy)
        assert _SlowContext.most <= 3 + len(stalled), "more writes at once than the slots (and the stalled)"
        for loop in loops[:3]:
            loop.cancel()
        await asyncio.gather(*loops[:3], return_exceptions=True)
        assert _SlowContext.live == 0

    asyncio.run(go())
    with pytest.raises(ConfigError, match="write_slots 0 must be an integer >= 1"):
        NetworkRuntime("127.0.0.1:0", insecure=True, write_slots=0)


class _Frame(bytearray):
    """A received frame that can be watched (weakly referenced)."""


class _ReadContext:
    """A stream's read side: yields ``frames``, then waits for ever (``idle`` set)."""

    def __init__(self, frames: list[_Frame]) -> None:
        self.frames = frames
        self.idle = asyncio.Event()

    async def read(self) -> bytes:
        if self.frames:
            return self.frames.pop(0)
        self.idle.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def test_a_stream_keeps_no_frame_while_it_waits_for_the_next() -> None:
    """Once a reply is routed to its request, the stream's read loop holds no reference to the frame it
    came in: held by every stream until its next heartbeat, they would be one model per device."""

    async def go() -> None:
        runtime = NetworkRuntime("127.0.0.1:0", insecure=True)
        conn = _Connection("d0", asyncio.Queue(), 0.0)
        reply = wire.AgentReply(7, 0.0, 0.0, codec.encode(Pong(1, "d0", 1.0)))
        frames = [_Frame(codec.encode(reply))]
        seen = weakref.ref(frames[0])
        future = asyncio.get_running_loop().create_future()
        runtime._waiting[("d0", 7)] = _Waiting("d0", "p", 0.0, 0, future)
        context = _ReadContext(frames)
        loop = asyncio.create_task(runtime._read_loop(context, conn))
        await asyncio.wait_for(context.idle.wait(), 5)
        assert future.done() and future.result()[0] == reply
        assert seen() is None, "the read loop still holds the last frame"
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)

    asyncio.run(go())
