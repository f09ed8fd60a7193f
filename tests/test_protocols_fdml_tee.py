"""FDML through the emulated TEE: the host relays only ciphertext, and the boundary changes no number."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest

from conftest import ToyPopulation
from fedveil.core.attestation_verify import MeasurementMismatchError
from fedveil.errors import ConfigError
from fedveil.experiments.config import load_config
from fedveil.experiments.fdml.privacy_setup import plan_privacy
from fedveil.experiments.fdml.runner import EMBEDDING_DIM, build_trainer
from fedveil.protocols.messages import EmbedReply, GradReply

SMALL = [
    "data.train_users_per_model=[6, 6]",
    "fdml.num_required=4",
    "fdml.samples_per_client=4",
    "fdml.lr=0.003",
]


def _train(cfg, population, rounds: int, *, tap=None, wrap=None):
    privacy = plan_privacy(cfg, population, EMBEDDING_DIM)
    trainer = build_trainer(cfg, population, privacy.release if privacy else None, tap=tap)
    if wrap is not None:
        wrap(trainer)
    try:

        async def go():
            await trainer.server.register(trainer.runtime)
            return [await trainer.server.run_round(r, trainer.runtime) for r in range(1, rounds + 1)]

        reports = asyncio.run(go())
    finally:
        trainer.close()
    return trainer.server.weights, reports


@pytest.mark.parametrize("dp", [False, True])
def test_the_boundary_changes_no_number(toy_population, dp: bool) -> None:
    extra = ["dp.enabled=true", "dp.mode=strict", "dp.round_epsilon=50", "dp.bound_T=0.01"] if dp else []
    runs = {}
    for boundary in ("none", "inprocess", "process"):
        cfg = load_config(None, [*SMALL, *extra, f"enclave.boundary={boundary}"])
        runs[boundary] = _train(cfg, toy_population, 3)
    w_none, r_none = runs["none"]
    for boundary in ("inprocess", "process"):
        w, r = runs[boundary]
        np.testing.assert_array_equal(w, w_none)
        assert [x.loss for x in r] == [x.loss for x in r_none]
        assert all(x.applied for x in r)


class _Spy:
    """Wraps a device's enclave session and keeps every plaintext it seals or opens."""

    def __init__(self, inner, store: list[np.ndarray]) -> None:
        self.inner, self.store = inner, store

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def seal_embeddings(self, rnd, embeddings, *, attempt=0):
        self.store.append(np.array(embeddings, dtype=np.float32))
        return self.inner.seal_embeddings(rnd, embeddings, attempt=attempt)

    def seal_gradient(self, rnd, gradient, *, attempt=0, out=None):
        pieces = gradient if isinstance(gradient, (list, tuple)) else [gradient]
        self.store.append(np.concatenate([np.ravel(p) for p in pieces]).astype(np.float32))
        return self.inner.seal_gradient(rnd, gradient, attempt=attempt, out=out)

    def open_derivatives(self, rnd, record, *, attempt=0):
        out = self.inner.open_derivatives(rnd, record, attempt=attempt)
        self.store.append(np.array(out, dtype=np.float32))
        return out


def test_the_host_never_handles_plaintext(toy_population) -> None:
    """A relay spy records every byte string the server (host) handles during an FDML run: messages
    to and from devices and frames to and from the enclave. No embedding, derivative or gradient
    value appears in any of them, searched as the exact float32 bytes of rows and slices."""
    seen: list[bytes] = []
    plaintext: list[np.ndarray] = []

    def wrap(trainer) -> None:
        pool = trainer.runtime.pool
        pool.sessions = {c: _Spy(s, plaintext) for c, s in pool.sessions.items()}

    cfg = load_config(None, [*SMALL, "enclave.boundary=process"])
    _train(cfg, toy_population, 2, tap=lambda direction, data: seen.append(bytes(data)), wrap=wrap)
    assert len(plaintext) == 2 * 2 * 4 + 2 * 4  # embeddings and derivatives (2 x 4 devices), gradients
    assert seen
    haystack = b"\x00".join(seen)
    needles = 0
    for array in plaintext:
        flat = array.reshape(-1)
        step = 16
        for start in range(0, flat.size - step + 1, max(step, flat.size // 50)):
            piece = flat[start : start + step]
            if np.count_nonzero(piece) < step // 2:
                continue
            needles += 1
            assert piece.tobytes() not in haystack
    assert needles > 100
    # The spy does see plaintext where the host is not involved: a sanity check of the search.
    assert plaintext[0].reshape(-1)[:16].tobytes() in plaintext[0].tobytes()


def test_a_device_refuses_an_enclave_with_the_wrong_measurement(toy_population) -> None:
    """Devices expecting another measurement refuse the quote: none is selected, and each refusal
    is a dropout that names the failed check."""
    cfg = load_config(None, [*SMALL, "enclave.boundary=inprocess"])
    trainer = build_trainer(cfg, toy_population)
    for session in trainer.runtime.pool.sessions.values():
        session.expected_measurement = b"\x00" * 32
    try:
        with pytest.raises(ConfigError, match="no device completed attestation"):
            asyncio.run(trainer.server.register(trainer.runtime))
    finally:
        trainer.close()
    drops = [d for d in trainer.runtime.stats().dropouts if d.phase == "attest"]
    assert len(drops) == 12
    assert all(MeasurementMismatchError.__name__ in d.reason for d in drops)


@pytest.mark.parametrize("boundary", ["inprocess", "process"])
def test_streamed_step_nine_equals_the_direct_call_over_several_requests(
    toy_population, monkeypatch: pytest.MonkeyPatch, boundary: str
) -> None:
    """With an enclave too small for one round's gradients, step 9 takes several requests. Fed to the
    enclave as the uploads arrive (pipelined through the shared region), it trains the same network, bit
    for bit, as the direct call after all uploads are in."""
    from fedveil.protocols.fdml import AttestedEnclave
    from fedveil.runtime.enclave_host import AggregateStream, EnclaveHost

    cfg = load_config(None, [*SMALL, f"enclave.boundary={boundary}", "enclave.memory_limit_mib=20"])
    finished: list[int] = []
    real_finish = AggregateStream.finish

    def finish(self):
        result = real_finish(self)
        finished.append(result.batches)
        return result

    monkeypatch.setattr(AggregateStream, "finish", finish)
    streamed = _train(cfg, toy_population, 3)
    assert finished == [2, 2, 2]  # two requests of two devices' gradients each round
    direct_batches: list[int] = []
    real_aggregate = EnclaveHost.aggregate

    def aggregate(self, *args, **kwargs):
        result = real_aggregate(self, *args, **kwargs)
        direct_batches.append(result.batches)
        return result

    monkeypatch.setattr(EnclaveHost, "aggregate", aggregate)
    monkeypatch.setattr(AttestedEnclave, "gradient_stream", lambda self, *a: None)
    direct = _train(cfg, toy_population, 3)
    assert direct_batches == [2, 2, 2]
    np.testing.assert_array_equal(streamed[0], direct[0])
    assert [x.loss for x in streamed[1]] == [x.loss for x in direct[1]]


def test_uploads_sealed_into_their_messages_bytes_change_no_number(toy_population) -> None:
    """In simulation each device seals its gradient straight into its encoded message when the runtime
    takes the upload up (``defer_uploads``); built as a message and encoded by the runtime instead, the
    same training gives the same weights and losses, bit for bit, and the same bytes on the wire."""
    cfg = load_config(None, [*SMALL, "enclave.boundary=inprocess"])
    wires: dict[bool, list[int]] = {}

    def run(defer: bool):
        sizes = wires.setdefault(defer, [])

        def wrap(trainer) -> None:
            trainer.pool.defer_uploads = defer

        return _train(cfg, toy_population, 3, tap=lambda way, data: sizes.append(len(data)), wrap=wrap)

    framed, built = run(True), run(False)
    np.testing.assert_array_equal(framed[0], built[0])
    assert [x.loss for x in framed[1]] == [x.loss for x in built[1]]
    assert wires[True] == wires[False] and wires[True]


def test_a_stream_that_missed_a_kept_reply_falls_back_to_the_direct_call(
    toy_population, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the replies a round keeps are not exactly those the stream was fed (a runtime that validated a
    reply and then did not keep it, say), the stream is drained unreleased and step 9 runs directly."""
    from fedveil.protocols.fdml import AttestedEnclave
    from fedveil.runtime.enclave_host import AggregateStream

    cfg = load_config(None, [*SMALL, "enclave.boundary=process", "enclave.memory_limit_mib=20"])
    reference = _train(cfg, toy_population, 2)
    aborted: list[int] = []
    real_stream, real_abort = AttestedEnclave.gradient_stream, AggregateStream.abort

    def gradient_stream(self, *args):
        stream = real_stream(self, *args)
        inner = stream.add
        # this stream misses every reply but the first
        stream.add = lambda cid, record, n: None if stream.clients else inner(cid, record, n)
        return stream

    def abort(self):
        aborted.append(len(self.clients))
        real_abort(self)

    monkeypatch.setattr(AttestedEnclave, "gradient_stream", gradient_stream)
    monkeypatch.setattr(AggregateStream, "abort", abort)
    weights, reports = _train(cfg, toy_population, 2)
    assert aborted == [1, 1] and all(r.applied for r in reports)
    np.testing.assert_array_equal(weights, reference[0])


def test_a_gradient_phase_that_fails_midway_leaves_the_enclave_channel_in_step(toy_population) -> None:
    """If the gradient phase raises after some uploads went into step 9's stream, the replies the enclave
    owes are collected before the error propagates, so the next round talks to the enclave as usual."""
    cfg = load_config(None, [*SMALL, "enclave.boundary=process", "enclave.memory_limit_mib=20"])
    privacy = plan_privacy(cfg, toy_population, EMBEDDING_DIM)
    trainer = build_trainer(cfg, toy_population, privacy.release if privacy else None)
    real = trainer.runtime.request

    async def request(msgs, *, phase, **kwargs):
        replies = await real(msgs, phase=phase, **kwargs)
        if phase == "grad" and not failed:
            failed.append(len(replies))
            raise ConnectionError("the network went away after the uploads")
        return replies

    failed: list[int] = []
    trainer.runtime.request = request
    try:

        async def go():
            await trainer.server.register(trainer.runtime)
            with pytest.raises(ConnectionError, match="went away"):
                await trainer.server.run_round(1, trainer.runtime)
            return await trainer.server.run_round(2, trainer.runtime)

        report = asyncio.run(go())
    finally:
        trainer.close()
    assert failed == [4] and report.applied


# --- hostile devices, at every boundary -------------------------------------------------------------


@dataclass(frozen=True)
class Attack:
    """What a hostile device makes of its honest upload in ``phase``, and the refusal expected: a regex
    of its reason (``{P}`` is the model's parameter count)."""

    phase: str
    tamper: Callable[[np.ndarray], np.ndarray]
    reason: str


ATTACKS = {
    # finite, but squared distances overflow float32 (between the enclave's old filter and Alg. 1's limit)
    "huge_embeddings": Attack("embed", lambda e: np.full_like(e, 6e17), r"too large for float32"),
    # as many bytes as the right shape (the host cannot tell), another width: the enclave must refuse it
    "reshaped_embeddings": Attack(
        "embed", lambda e: e.reshape(2 * e.shape[0], e.shape[1] // 2), r"shape \(8, 32\), expected \(4, 64\)"
    ),
    "missing_row": Attack(
        "embed", lambda e: e[:-1].copy(), r"shape \(3, 64\), expected|embeddings of shape \(4, 64\) seal to"
    ),
    "long_gradient": Attack(
        "grad", lambda g: np.append(g, np.float32(0.5)), r"shape \({P1},\), expected|{P} values seal to"
    ),
    # finite but absurd: Adam's second moment would turn infinite and freeze the network for good
    "huge_gradient": Attack("grad", lambda g: np.full_like(g, 3e38), r"L2 norm .* exceeds max_upload_norm"),
}


class _HostileSession:
    """A device's real enclave session that seals what the attack makes of its embeddings or gradient:
    the record is authentic, only its content is hostile."""

    def __init__(self, inner: Any, cid: str, hostile: Hostile) -> None:
        self.inner, self.cid, self.hostile = inner, cid, hostile

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def seal_embeddings(self, rnd: int, embeddings: np.ndarray, *, attempt: int = 0) -> Any:
        array = self.hostile.apply(self.cid, rnd, "embed", embeddings)
        return self.inner.seal_embeddings(rnd, array, attempt=attempt)

    def seal_gradient(self, rnd: int, gradient: Any, *, attempt: int = 0, out: Any = None) -> Any:
        if isinstance(gradient, (list, tuple)):
            gradient = np.concatenate(gradient)
        array = self.hostile.apply(self.cid, rnd, "grad", gradient)
        return self.inner.seal_gradient(rnd, array, attempt=attempt, out=out)


class Hostile:
    """An FDML training in which, while ``attack`` is set, the first device addressed in the attack's
    phase of each round uploads what the attack makes of its honest array: on the plain path its reply
    is rewritten, through the TEE it seals the rewritten array itself. Being first, its upload is also
    the first the enclave opens (the one an enclave that took shapes from the first record would trust).
    Refusals are gathered from the runtime's dropouts and the server's log of enclave rejections."""

    def __init__(self, boundary: str) -> None:
        cfg = load_config(
            None, [*SMALL, "fdml.k=1.5", "fdml.min_gradients=1", f"enclave.boundary={boundary}"]
        )
        self.boundary = boundary
        self.trainer = build_trainer(cfg, ToyPopulation())
        self.attack: Attack | None = None
        self.victims: dict[int, str] = {}
        self.round = 0
        pool = self.trainer.pool
        pool.defer_uploads = False  # a tampered gradient is sealed afresh, not into a slot of the honest size
        asyncio.run(self.trainer.server.register(self.trainer.runtime))
        if pool.sessions is None:
            honest = pool.handle_batch

            def handle_batch(msgs: dict[str, Any]) -> dict[str, Any]:
                out = honest(msgs)
                for cid, reply in out.items():
                    if isinstance(reply, EmbedReply):
                        out[cid] = replace(
                            reply, embeddings=self.apply(cid, reply.round, "embed", reply.embeddings)
                        )
                    elif isinstance(reply, GradReply):
                        out[cid] = replace(
                            reply, gradient=self.apply(cid, reply.round, "grad", reply.gradient)
                        )
                return out

            pool.handle_batch = handle_batch
        else:
            pool.sessions = {c: _HostileSession(s, c, self) for c, s in pool.sessions.items()}

    def apply(self, cid: str, rnd: int, phase: str, array: np.ndarray) -> np.ndarray:
        """The array ``cid`` uploads in ``phase`` of round ``rnd``."""
        if self.attack is None or self.attack.phase != phase or self.victims.setdefault(rnd, cid) != cid:
            return array
        return self.attack.tamper(np.asarray(array))

    def run_round(self, caplog: pytest.LogCaptureFixture) -> tuple[Any, dict[str, str], float]:
        """One round: its report, the devices refused in it (dropouts that are not merely late, and
        enclave rejections) with their reasons, and how far the round moved the weights."""
        self.round += 1
        server, runtime = self.trainer.server, self.trainer.runtime
        seen, before = len(runtime.stats().dropouts), server.weights
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fedveil.protocols.fdml"):
            report = asyncio.run(server.run_round(self.round, runtime))
        refused = {
            d.client: d.reason for d in runtime.stats().dropouts[seen:] if not d.reason.startswith("late")
        }
        for record in caplog.records:
            if record.msg.startswith("enclave rejected device"):
                refused[record.args[0]] = record.args[2]
        return report, refused, float(np.abs(server.weights - before).max())


@pytest.fixture(scope="module", params=["none", "inprocess", "process"])
def hostile(request: pytest.FixtureRequest) -> Iterator[Hostile]:
    """One training per boundary (one enclave process for ``process``), shared by the attacks."""
    run = Hostile(request.param)
    yield run
    run.trainer.close()


@pytest.mark.parametrize("name", list(ATTACKS))
def test_a_hostile_upload_is_a_dropout_and_training_goes_on(
    hostile: Hostile, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """In every phase and at every boundary, a device whose upload has the wrong shape, or values Alg. 1
    or Adam cannot take, is refused with its reason (on the plain path as in the TEE: never as an error
    out of the round, and never by rejecting the honest devices), the others' round is applied, and the
    network keeps learning in the rounds after."""
    attack = ATTACKS[name]
    hostile.attack = attack
    report, refused, moved = hostile.run_round(caplog)
    hostile.attack = None
    victim = hostile.victims[hostile.round]
    params = int(hostile.trainer.server.params.numel())
    assert list(refused) == [victim], refused
    assert re.search(attack.reason.format(P=params, P1=params + 1), refused[victim]), refused[victim]
    assert report.applied and moved > 0
    for _ in range(2):
        report, refused, moved = hostile.run_round(caplog)
        assert report.applied and not refused and moved > 0
    assert np.isfinite(hostile.trainer.server.weights).all()
