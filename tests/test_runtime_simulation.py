"""The simulation runtime: codec on every message, metering, virtual clock, faults, dropouts."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pytest

from fedveil.core import codec
from fedveil.core.communicator import Deferred
from fedveil.core.messages import array_field, message
from fedveil.errors import ConfigError, ValidationError
from fedveil.runtime.simulation import LatencyModel, PhaseFaults, SimulationRuntime


@message("test.sim.ping")
@dataclass(frozen=True)
class Ping:
    round: int
    payload: np.ndarray = array_field(dtype="float32", ndim=1)


@message("test.sim.pong")
@dataclass(frozen=True)
class Pong:
    round: int
    value: np.ndarray = array_field(dtype="float32", ndim=1)


class EchoPool:
    """Clients that echo the payload; some misbehave as configured."""

    def __init__(self, n: int, bad: Mapping[str, object] | None = None) -> None:
        self.ids = [f"c{i}" for i in range(n)]
        self.bad = dict(bad or {})
        self.calls: list[list[str]] = []

    def client_ids(self) -> list[str]:
        return self.ids

    def handle_batch(self, msgs):
        self.calls.append(list(msgs))
        out = {}
        for cid, m in msgs.items():
            out[cid] = self.bad.get(cid, Pong(m.round, np.asarray(m.payload) * 2))
        return out


def _run(coro):
    return asyncio.run(coro)


def test_every_message_is_metered_as_its_encoded_length() -> None:
    pool = EchoPool(4)
    rt = SimulationRuntime(pool, rng=np.random.default_rng(0))
    ping = Ping(1, np.arange(5, dtype=np.float32))
    replies = _run(
        rt.request({c: ping for c in pool.ids}, phase="p", min_replies=4, timeout=1.0, expected=Pong)
    )
    assert set(replies) == set(pool.ids)
    np.testing.assert_array_equal(replies["c0"].value, np.arange(5) * 2)
    down = len(codec.encode(ping))
    up = len(codec.encode(Pong(1, np.arange(5, dtype=np.float32) * 2)))
    s = rt.stats()
    assert (s.bytes_down, s.bytes_up, s.messages_down, s.messages_up) == (4 * down, 4 * up, 4, 4)


def test_failures_are_dropouts_and_the_clock_advances_by_the_timeout() -> None:
    pool = EchoPool(5)
    faults = {"p": PhaseFaults(1.0, LatencyModel("constant", 0.1, 0.0))}
    rt = SimulationRuntime(pool, rng=np.random.default_rng(0), faults=faults)
    replies = _run(
        rt.request(
            {c: Ping(1, np.zeros(1, np.float32)) for c in pool.ids},
            phase="p",
            min_replies=3,
            timeout=7.0,
            expected=Pong,
        )
    )
    assert replies == {}
    assert rt.stats().sim_seconds == pytest.approx(7.0)
    assert [d.reason for d in rt.stats().dropouts] == ["failed: no reply"] * 5
    assert pool.calls == []


def test_earliest_replies_are_used_and_the_rest_are_late() -> None:
    pool = EchoPool(6)
    faults = {"p": PhaseFaults(0.0, LatencyModel("exponential", 1.0, 0.0))}
    rng = np.random.default_rng(3)
    latencies = LatencyModel("exponential", 1.0, 0.0)
    rng_copy = np.random.default_rng(3)
    expected_lat = latencies.sample(rng_copy, 6)
    rt = SimulationRuntime(pool, rng=rng, faults=faults)
    replies = _run(
        rt.request(
            {c: Ping(1, np.zeros(1, np.float32)) for c in pool.ids},
            phase="p",
            min_replies=2,
            timeout=100.0,
            expected=Pong,
        )
    )
    fastest = {pool.ids[i] for i in np.argsort(expected_lat)[:2]}
    assert set(replies) == fastest
    assert rt.stats().sim_seconds == pytest.approx(np.sort(expected_lat)[1])
    assert sum(d.reason.startswith("late") for d in rt.stats().dropouts) == 4
    assert sum(len(c) for c in pool.calls) == 2


def test_replies_over_the_timeout_are_late() -> None:
    pool = EchoPool(3)
    faults = {"p": PhaseFaults(0.0, LatencyModel("constant", 5.0, 0.0))}
    rt = SimulationRuntime(pool, rng=np.random.default_rng(0), faults=faults)
    replies = _run(
        rt.request(
            {c: Ping(1, np.zeros(1, np.float32)) for c in pool.ids},
            phase="p",
            min_replies=1,
            timeout=2.0,
            expected=Pong,
        )
    )
    assert replies == {}
    assert all("late" in d.reason for d in rt.stats().dropouts)


@pytest.mark.parametrize(
    "bad, reason",
    [
        (b"garbage bytes", "invalid reply"),
        (ValidationError("boom"), "client raised"),
        (Ping(1, np.zeros(1, np.float32)), "expected"),
    ],
)
def test_an_invalid_reply_is_a_dropout_and_the_next_arrival_replaces_it(bad, reason) -> None:
    pool = EchoPool(4, bad={"c0": bad})
    rt = SimulationRuntime(pool, rng=np.random.default_rng(0))
    replies = _run(
        rt.request(
            {c: Ping(1, np.zeros(2, np.float32)) for c in pool.ids},
            phase="p",
            min_replies=3,
            timeout=1.0,
            expected=Pong,
        )
    )
    assert set(replies) == {"c1", "c2", "c3"}
    (drop,) = rt.stats().dropouts
    assert drop.client == "c0" and reason in drop.reason


def test_oversized_reply_is_a_dropout() -> None:
    pool = EchoPool(2)
    rt = SimulationRuntime(pool, rng=np.random.default_rng(0), max_message_bytes=200)
    replies = _run(
        rt.request(
            {c: Ping(1, np.zeros(100, np.float32)) for c in pool.ids},
            phase="p",
            min_replies=2,
            timeout=1.0,
            expected=Pong,
        )
    )
    assert replies == {}
    assert all("exceeds the limit" in d.reason for d in rt.stats().dropouts)


def test_protocol_validation_failure_is_a_dropout() -> None:
    pool = EchoPool(3)
    rt = SimulationRuntime(pool, rng=np.random.default_rng(0))

    def only_c1(cid, msg):
        if cid != "c1":
            raise ValidationError("not c1")

    replies = _run(
        rt.request(
            {c: Ping(1, np.zeros(2, np.float32)) for c in pool.ids},
            phase="p",
            min_replies=3,
            timeout=1.0,
            expected=Pong,
            validate=only_c1,
        )
    )
    assert set(replies) == {"c1"}
    assert len(rt.stats().dropouts) == 2


def test_same_seed_same_outcome() -> None:
    def once():
        pool = EchoPool(20)
        faults = {"p": PhaseFaults(0.3, LatencyModel("lognormal", 0.5, 1.0))}
        rt = SimulationRuntime(pool, rng=np.random.default_rng(11), faults=faults)
        r = _run(
            rt.request(
                {c: Ping(1, np.zeros(1, np.float32)) for c in pool.ids},
                phase="p",
                min_replies=8,
                timeout=2.0,
                expected=Pong,
            )
        )
        return sorted(r), rt.stats().sim_seconds

    assert once() == once()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="fail_prob"):
        PhaseFaults(1.5)
    with pytest.raises(ConfigError, match="latency kind"):
        LatencyModel("gamma")
    with pytest.raises(ConfigError, match="max_message_bytes"):
        SimulationRuntime(EchoPool(1), rng=np.random.default_rng(0), max_message_bytes=0)
    rt = SimulationRuntime(EchoPool(1), rng=np.random.default_rng(0))
    with pytest.raises(ConfigError, match="unknown clients"):
        _run(
            rt.request(
                {"zz": Ping(1, np.zeros(1, np.float32))}, phase="p", min_replies=1, timeout=1.0, expected=Pong
            )
        )


def test_deferred_replies_are_built_as_the_runtime_takes_each_up() -> None:
    """A pool may leave each reply's last step (FDML: sealing the upload) to the runtime: it is built
    right before that reply is metered and validated, after the earlier replies were validated; what it
    builds counts as if returned directly, an exception included."""
    events: list[str] = []

    class LazyPool(EchoPool):
        def handle_batch(self, msgs):
            def build(cid, m):
                events.append(f"build {cid}")
                return (
                    ValidationError("seal failed")
                    if cid == "c2"
                    else Pong(m.round, np.asarray(m.payload) * 2)
                )

            return {cid: Deferred(lambda cid=cid, m=m: build(cid, m)) for cid, m in msgs.items()}

    pool = LazyPool(4)
    rt = SimulationRuntime(pool, rng=np.random.default_rng(0))
    ping = Ping(1, np.arange(3, dtype=np.float32))
    replies = _run(
        rt.request(
            dict.fromkeys(pool.ids, ping),
            phase="p",
            min_replies=3,
            timeout=1.0,
            expected=Pong,
            validate=lambda cid, msg: events.append(f"validate {cid}"),
        )
    )
    assert list(replies) == ["c0", "c1", "c3"]
    assert events == [
        "build c0",
        "validate c0",
        "build c1",
        "validate c1",
        "build c2",
        "build c3",
        "validate c3",
    ]
    np.testing.assert_array_equal(replies["c3"].value, [0, 2, 4])
    assert [d.client for d in rt.stats().dropouts] == ["c2"]


def test_fold_takes_each_valid_reply_in_addressed_order_and_the_request_keeps_what_it_returns() -> None:
    """Replies arrive in the order of their sampled latencies, but the fold sees the valid ones in the
    order the clients were addressed; an undecodable reply, one of the wrong type and one that fails
    validation never reach it."""
    pool = EchoPool(7, bad={"c1": b"garbage bytes", "c3": Ping(1, np.zeros(1, np.float32))})
    rt = SimulationRuntime(
        pool, rng=np.random.default_rng(3), default=PhaseFaults(latency=LatencyModel("uniform", 0.5, 0.4))
    )
    folded: list[str] = []

    def refuse_c4(cid: str, msg: Pong) -> None:
        if cid == "c4":
            raise ValidationError("not c4")

    def strip(cid: str, msg: Pong) -> tuple[str, int]:
        folded.append(cid)
        return ("folded", msg.round)

    replies = _run(
        rt.request(
            {c: Ping(1, np.ones(3, np.float32)) for c in pool.ids},
            phase="p",
            min_replies=7,
            timeout=1.0,
            expected=Pong,
            validate=refuse_c4,
            fold=strip,
        )
    )
    (arrivals,) = pool.calls
    assert arrivals != sorted(arrivals), "the latencies must reorder the arrivals for this test to mean it"
    assert folded == ["c0", "c2", "c5", "c6"]
    assert replies == {c: ("folded", 1) for c in folded}
    assert list(replies) == [c for c in arrivals if c in folded], "returned in arrival order, as without fold"
    assert {d.client for d in rt.stats().dropouts} == {"c1", "c3", "c4"}


def test_a_reply_the_fold_refuses_is_a_dropout_and_the_next_arrival_replaces_it() -> None:
    pool = EchoPool(4)
    rt = SimulationRuntime(pool, rng=np.random.default_rng(0))

    def refuse_c0(cid: str, msg: Pong) -> Pong:
        if cid == "c0":
            raise ValidationError("c0's upload has NaN entries")
        return msg

    replies = _run(
        rt.request(
            {c: Ping(1, np.zeros(2, np.float32)) for c in pool.ids},
            phase="p",
            min_replies=3,
            timeout=1.0,
            expected=Pong,
            fold=refuse_c0,
        )
    )
    assert list(replies) == ["c1", "c2", "c3"] and pool.calls == [["c0", "c1", "c2"], ["c3"]]
    (drop,) = rt.stats().dropouts
    assert drop.client == "c0" and drop.reason == "invalid reply: c0's upload has NaN entries"
