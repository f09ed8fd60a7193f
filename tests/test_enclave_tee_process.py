"""End to end through the spawned enclave process: same numbers as the direct calls, and the host
relays no plaintext (a relay spy searches every byte string it handled for the exact float32 bytes)."""

from __future__ import annotations

import io
import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from fedveil.core.attestation_verify import EnclaveClientSession, SimulatedQuoteVerifier
from fedveil.enclave.aggregate import aggregate_gradients
from fedveil.enclave.channel import FRAME_MAGIC, encode_array, pack_frame, unpack_frame
from fedveil.enclave.measure import EnclaveConfig, measure_enclave
from fedveil.enclave.process import COPIED, LENGTH, SHARED_ENV, SHARED_FLAG, serve
from fedveil.enclave.service import EnclaveMemoryError, launch_frame
from fedveil.enclave.triplet import loss_and_derivatives
from fedveil.runtime.enclave_host import SHARED_MIN_BYTES, EnclaveHost, EnclaveProcessError, ProcessTransport
from fedveil.runtime.quoting import SimulatedPlatform

CONFIG = EnclaveConfig(memory_limit_bytes=4 * 2**20, margin=0.5)
IDS = [f"device-{i}" for i in range(8)]


class Enclave:
    """One spawned enclave for the module, with a spy on every byte string the host handles."""

    def __init__(self) -> None:
        self.platform = SimulatedPlatform.generate()
        self.seen: list[bytes] = []
        self.host = EnclaveHost.start(
            CONFIG, platform=self.platform, boundary="process", tap=lambda _, data: self.seen.append(data)
        )
        verifier = SimulatedQuoteVerifier(self.platform.public_key)
        self.sessions = {}
        for cid in IDS:
            session = EnclaveClientSession(
                cid, verifier=verifier, expected_measurement=measure_enclave(CONFIG).digest
            )
            self.sessions[cid] = session
            session.establish(self.relay(self.host.open_session(self.relay(session.hello()))))

    def relay(self, data: bytes) -> bytes:
        """What the host receives from or hands to a client."""
        self.seen.append(data)
        return data


@pytest.fixture(scope="module")
def enclave() -> Enclave:
    e = Enclave()
    yield e
    e.host.close()


def _float_rows(array: np.ndarray) -> list[bytes]:
    return [np.ascontiguousarray(row, dtype=np.float32).tobytes() for row in np.atleast_2d(array)]


def test_the_enclave_is_a_separate_process_without_torch(enclave: Enclave) -> None:
    transport = enclave.host._transport
    assert isinstance(transport, ProcessTransport)
    assert transport.pid != os.getpid()
    assert "torch" in sys.modules  # the host has it (tests/conftest.py)
    maps = Path(f"/proc/{transport.pid}/maps")
    if maps.exists():
        mapped = maps.read_text()
        assert "libtorch" not in mapped and "numpy" in mapped


def test_a_training_round_through_the_process_matches_the_direct_calls(enclave: Enclave) -> None:
    rng = np.random.default_rng(7)
    emb = {c: rng.standard_normal((5, 16)).astype(np.float32) for c in IDS}
    sealed = {c: enclave.relay(enclave.sessions[c].seal_embeddings(1, emb[c])) for c in IDS}
    result = enclave.host.loss_and_derivatives(1, sealed, shape=(5, 16))
    derivs = {c: enclave.sessions[c].open_derivatives(1, enclave.relay(result.derivatives[c])) for c in IDS}

    stacked = np.concatenate([emb[c] for c in IDS])
    labels = np.repeat(np.arange(len(IDS)), 5)
    direct = loss_and_derivatives(stacked, labels, margin=CONFIG.margin, strategy=CONFIG.strategy)
    assert result.loss == direct.loss and result.num_active == direct.num_active > 0
    assert np.array_equal(np.concatenate([derivs[c] for c in IDS]), direct.derivatives)
    assert result.peak_bytes <= CONFIG.memory_limit_bytes

    grads = {c: rng.standard_normal(1000).astype(np.float32) for c in IDS}
    counts = dict.fromkeys(IDS, 5)
    sealed_grads = {c: enclave.relay(enclave.sessions[c].seal_gradient(1, grads[c])) for c in IDS}
    aggregate = enclave.host.aggregate(1, sealed_grads, counts, size=1000)
    assert np.array_equal(aggregate.gradient, aggregate_gradients(grads, counts))

    # The relay spy: no embedding, derivative or local-gradient plaintext in anything the host handled.
    secrets = [
        *(r for c in IDS for r in _float_rows(emb[c])),
        *(r for c in IDS for r in _float_rows(derivs[c])),
        *(np.ascontiguousarray(grads[c][i : i + 4]).tobytes() for c in IDS for i in range(0, 1000, 100)),
    ]
    assert len(enclave.seen) > 3 * len(IDS)
    for data in enclave.seen:
        for secret in secrets:
            assert secret not in data
    # positive control: the same search finds them in the plaintext frames
    assert _float_rows(emb[IDS[0]])[0] in encode_array(emb[IDS[0]])


def test_an_oversized_request_is_refused_unread_and_the_enclave_keeps_serving(enclave: Enclave) -> None:
    transport = enclave.host._transport
    reply, _ = unpack_frame(transport.request(bytes(CONFIG.memory_limit_bytes + 1)))
    assert reply["ok"] is False and reply["error"] == "EnclaveMemoryError"
    assert "exceeds the enclave memory limit" in reply["message"]
    big = {c: np.ones((64, 512), np.float32) for c in IDS}
    sealed = {c: enclave.sessions[c].seal_embeddings(2, big[c]) for c in IDS}
    with pytest.raises(EnclaveMemoryError):
        enclave.host.loss_and_derivatives(2, sealed, shape=(64, 512))
    reply, _ = unpack_frame(transport.request(pack_frame({"op": "nope"})))
    assert reply["error"] == "CodecError"


def test_closing_stops_the_process_and_a_dead_enclave_is_reported() -> None:
    with EnclaveHost.start(CONFIG, platform=SimulatedPlatform.generate(), boundary="process") as host:
        proc = host._transport._proc
    assert proc.wait(timeout=5) == 0
    host.close()

    host = EnclaveHost.start(CONFIG, platform=SimulatedPlatform.generate(), boundary="process")
    host._transport._proc.kill()
    host._transport._proc.wait(timeout=5)
    with pytest.raises(EnclaveProcessError, match="exited with status"):
        host.open_session(b"hello")
    host.close()
    with pytest.raises(EnclaveProcessError, match="closed"):
        host.open_session(b"hello")


def _frames(*frames: bytes) -> io.BytesIO:
    return io.BytesIO(b"".join(LENGTH.pack(len(f)) + f for f in frames))


def _replies(data: bytes) -> list[dict]:
    """The reply frames' headers, past the COPIED marks of shared-region requests."""
    out, pos = [], 0
    while pos < len(data):
        (n,) = LENGTH.unpack_from(data, pos)
        pos += 8
        if n != COPIED:
            out.append(unpack_frame(data[pos : pos + n])[0])
            pos += n
    return out


def test_the_process_loop_frames_replies_skips_oversized_requests_and_stops_on_shutdown() -> None:
    config = EnclaveConfig(memory_limit_bytes=2**20)
    reader = _frames(
        launch_frame(config, bytes(32)),
        bytes(2**20 + 1),
        pack_frame({"op": "shutdown"}),
        pack_frame({"op": "never read"}),
    )
    writer = io.BytesIO()
    assert serve(reader, writer) == 0
    launched, oversized, shutdown = _replies(writer.getvalue())
    assert launched["ok"] and shutdown["ok"]
    assert oversized["error"] == "EnclaveMemoryError"
    assert reader.read() == LENGTH.pack(len(pack_frame({"op": "never read"}))) + pack_frame(
        {"op": "never read"}
    )


def test_the_process_loop_pins_its_config_and_ends_with_its_input() -> None:
    writer = io.BytesIO()
    reader = _frames(launch_frame(EnclaveConfig(), bytes(32)), launch_frame(CONFIG, bytes(32)))
    assert serve(reader, writer, pinned_config=CONFIG) == 0
    refused, launched = _replies(writer.getvalue())
    assert "differs from the measured FEDVEIL_ENCLAVE_CONFIG" in refused["message"]
    assert launched["ok"] is True
    with pytest.raises(EOFError, match="after 3 of 8 bytes"):
        serve(io.BytesIO(b"abc"), io.BytesIO())
    with pytest.raises(EOFError, match="before a 100-byte request"):
        serve(io.BytesIO(LENGTH.pack(100)), io.BytesIO())


def test_large_requests_go_through_shared_memory_with_the_same_results(enclave: Enclave) -> None:
    """A request of at least SHARED_MIN_BYTES is written into the memfd the enclave inherited (its
    length alone goes through the pipe); the result is the direct call's, and the relay spy still sees
    every byte string the host handles."""
    transport = enclave.host._transport
    assert transport._shared is not None and len(transport._shared) == CONFIG.memory_limit_bytes
    environ = Path(f"/proc/{transport.pid}/environ")
    if environ.exists():
        assert f"{SHARED_ENV}=".encode() in environ.read_bytes()
        assert b"MALLOC_MMAP_THRESHOLD_=" in environ.read_bytes()
    rng = np.random.default_rng(11)
    grads = {c: rng.standard_normal(30_000).astype(np.float32) for c in IDS}
    counts = {c: 3 + i for i, c in enumerate(IDS)}
    sealed = {c: enclave.relay(enclave.sessions[c].seal_gradient(3, grads[c])) for c in IDS}
    assert sum(map(len, sealed.values())) > SHARED_MIN_BYTES
    transport._shared[: len(FRAME_MAGIC)] = bytes(len(FRAME_MAGIC))
    before = len(enclave.seen)
    aggregate = enclave.host.aggregate(3, sealed, counts, size=30_000)
    assert aggregate.batches == 1
    assert transport._shared[: len(FRAME_MAGIC)] == FRAME_MAGIC, "the request was put in the shared region"
    assert np.array_equal(aggregate.gradient, aggregate_gradients(grads, counts))
    request = next(d for d in enclave.seen[before:] if d.startswith(FRAME_MAGIC))
    assert transport._shared[: len(request)] == request
    for c in IDS:
        assert np.ascontiguousarray(grads[c][:4]).tobytes() not in request


def _shared_frames(region: mmap.mmap, frame: bytes, *, flag_size: int | None = None) -> bytes:
    region[: len(frame)] = frame
    return LENGTH.pack((len(frame) if flag_size is None else flag_size) | SHARED_FLAG)


def test_the_process_loop_reads_flagged_requests_from_the_shared_region_only() -> None:
    config = EnclaveConfig(memory_limit_bytes=2**20)
    region = mmap.mmap(-1, 2**16)
    launch = launch_frame(config, bytes(32))
    reader = io.BytesIO(
        _shared_frames(region, launch)
        + LENGTH.pack(2**17 | SHARED_FLAG)  # longer than the region
        + LENGTH.pack((2**20 + 1) | SHARED_FLAG)  # over the enclave's memory limit
        + LENGTH.pack(len(pack_frame({"op": "shutdown"})))
        + pack_frame({"op": "shutdown"})
    )
    writer = io.BytesIO()
    assert serve(reader, writer, shared=region) == 0
    # the shared request is marked copied before its reply; refused ones are never read, so not marked
    assert (
        writer.getvalue().startswith(LENGTH.pack(COPIED))
        and writer.getvalue().count(LENGTH.pack(COPIED)) == 1
    )
    launched, too_long, oversized, shutdown = _replies(writer.getvalue())
    assert launched["ok"] and shutdown["ok"]
    assert too_long["error"] == "CodecError" and "shared region of 65536 bytes" in too_long["message"]
    assert oversized["error"] == "EnclaveMemoryError"

    writer = io.BytesIO()
    reader = io.BytesIO(LENGTH.pack(len(launch) | SHARED_FLAG))
    assert serve(reader, writer) == 0
    (refused,) = _replies(writer.getvalue())
    assert refused["error"] == "CodecError" and "no shared region" in refused["message"]


def test_submitted_requests_are_answered_in_order_through_the_region_and_the_pipe() -> None:
    """The host may submit shared-region requests back to back (each is written once the enclave has
    copied the previous one in) and pipe requests behind them; replies come back in order."""
    transport = ProcessTransport(shared_bytes=2**21)
    try:
        assert unpack_frame(transport.request(launch_frame(CONFIG, bytes(32))))[0]["ok"]
        big = bytes(SHARED_MIN_BYTES)
        ops = ["region-1", "region-2", "pipe", "region-3"]
        for op in ops:
            transport.submit(pack_frame({"op": op}, [big] if op.startswith("region") else []))
        with pytest.raises(EnclaveProcessError, match="outstanding"):
            transport.request(pack_frame({"op": "x"}))
        said = [unpack_frame(transport.collect())[0]["message"] for _ in ops]
        assert all(f"unknown enclave operation '{op}'" in m for op, m in zip(ops, said, strict=True))
        with pytest.raises(EnclaveProcessError, match="no request outstanding"):
            transport.collect()
        transport.submit(pack_frame({"op": "left-unread"}, [big]))
    finally:
        transport.close()  # reads what is still owed before it asks the enclave to shut down
    assert transport._proc.wait(timeout=5) == 0
