"""The enclave's operations over sealed inputs (in-process boundary: the same bytes as the process)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from fedveil.core.attestation_verify import EnclaveClientSession, SimulatedQuoteVerifier
from fedveil.enclave.aggregate import aggregate_gradients
from fedveil.enclave.channel import RecordAuthenticationError, pack_frame, unpack_frame
from fedveil.enclave.measure import EnclaveConfig, measure_enclave
from fedveil.enclave.service import EnclaveMemoryError, EnclaveService, launch_frame
from fedveil.enclave.triplet import loss_and_derivatives
from fedveil.errors import CodecError, ValidationError
from fedveil.runtime.enclave_host import EnclaveHost
from fedveil.runtime.quoting import SimulatedPlatform

LIMIT = 8 * 2**20


def _start(limit: int = LIMIT, **kwargs: object) -> tuple[EnclaveHost, SimulatedPlatform, EnclaveConfig]:
    platform = SimulatedPlatform.generate()
    config = EnclaveConfig(memory_limit_bytes=limit, **kwargs)
    return EnclaveHost.start(config, platform=platform, boundary="inprocess"), platform, config


def _sessions(host: EnclaveHost, platform: SimulatedPlatform, config: EnclaveConfig, ids: list[str]) -> dict:
    verifier = SimulatedQuoteVerifier(platform.public_key)
    expected = measure_enclave(config).digest
    out = {}
    for cid in ids:
        s = EnclaveClientSession(cid, verifier=verifier, expected_measurement=expected)
        s.establish(host.open_session(s.hello()))
        out[cid] = s
    return out


def _embeddings(ids: list[str], n: int = 4, d: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {cid: rng.standard_normal((n, d)).astype(np.float32) for cid in ids}


def _direct(embeddings: dict[str, np.ndarray], config: EnclaveConfig, limit: int | None = None):
    order = list(embeddings)
    stacked = np.concatenate([embeddings[c] for c in order])
    labels = np.repeat(np.arange(len(order)), [len(embeddings[c]) for c in order])
    return loss_and_derivatives(
        stacked, labels, margin=config.margin, strategy=config.strategy, memory_limit_bytes=limit or LIMIT
    )


@pytest.mark.parametrize("strategy", ["batch-all", "semi-hard"])
def test_derivatives_through_the_boundary_equal_the_direct_call(strategy: str) -> None:
    host, platform, config = _start(strategy=strategy, margin=0.5)
    ids = [f"c{i}" for i in range(6)]
    sessions = _sessions(host, platform, config, ids)
    emb = _embeddings(ids)
    result = host.loss_and_derivatives(
        3, {c: sessions[c].seal_embeddings(3, emb[c]) for c in ids}, shape=(4, 8)
    )
    direct = _direct(emb, config)
    assert result.rejected == {}
    assert result.loss == direct.loss and result.num_active == direct.num_active > 0
    got = np.concatenate([sessions[c].open_derivatives(3, result.derivatives[c]) for c in ids])
    assert np.array_equal(got, direct.derivatives)
    assert 0 < result.peak_bytes <= config.memory_limit_bytes


def test_bad_records_are_dropouts_and_the_rest_is_computed_without_them() -> None:
    host, platform, config = _start()
    ids = ["ok1", "flipped", "replayed", "reordered", "ok2", "stale"]
    sessions = _sessions(host, platform, config, ids)
    emb = _embeddings([*ids, "nosession"])
    warmup = {c: sessions[c].seal_embeddings(1, emb[c]) for c in ids}
    assert not host.loss_and_derivatives(1, warmup, shape=(4, 8)).rejected

    sealed = {c: sessions[c].seal_embeddings(2, emb[c]) for c in ids}
    flipped = bytearray(sealed["flipped"])
    flipped[40] ^= 0x10
    sealed["flipped"] = bytes(flipped)
    sealed["replayed"] = warmup["replayed"]
    late = sessions["reordered"].seal_embeddings(2, emb["reordered"])
    sealed["reordered"], early = late, sealed["reordered"]
    sealed["stale"] = sessions["stale"].seal_embeddings(1, emb["stale"])
    sealed["nosession"] = b"anything"
    result = host.loss_and_derivatives(2, sealed, shape=(4, 8))
    assert set(result.derivatives) == {"ok1", "ok2", "reordered"}
    assert result.rejected["flipped"].startswith("RecordAuthenticationError")
    assert result.rejected["replayed"].startswith("RecordContextError")  # a round-1 record in round 2
    assert result.rejected["stale"].startswith("RecordContextError")
    assert result.rejected["nosession"].startswith("no session")
    kept = {c: emb[c] for c in ("ok1", "reordered", "ok2")}
    direct = _direct(kept, config)
    assert result.loss == direct.loss

    again = host.loss_and_derivatives(2, {"reordered": early, "ok1": warmup["ok1"]}, shape=(4, 8))
    assert again.rejected["reordered"].startswith("RecordReplayError")
    assert "replayed or reordered" in again.rejected["reordered"]
    assert again.rejected["ok1"].startswith("RecordContextError")
    assert again.loss is None and again.derivatives == {}


def test_a_replayed_record_in_the_same_round_is_refused() -> None:
    host, platform, config = _start()
    sessions = _sessions(host, platform, config, ["a", "b"])
    emb = _embeddings(["a", "b"])
    sealed = {c: sessions[c].seal_embeddings(0, emb[c]) for c in sessions}
    host.loss_and_derivatives(0, sealed, shape=(4, 8))
    replay = host.loss_and_derivatives(0, sealed, shape=(4, 8))
    assert set(replay.rejected) == {"a", "b"}
    assert all(r.startswith("RecordReplayError") for r in replay.rejected.values())


def test_derivatives_are_sealed_to_their_own_client_only() -> None:
    host, platform, config = _start()
    sessions = _sessions(host, platform, config, ["a", "b", "c"])
    emb = _embeddings(list(sessions))
    result = host.loss_and_derivatives(
        0, {c: sessions[c].seal_embeddings(0, emb[c]) for c in sessions}, shape=(4, 8)
    )
    with pytest.raises(RecordAuthenticationError):
        sessions["b"].open_derivatives(0, result.derivatives["a"])
    assert sessions["a"].open_derivatives(0, result.derivatives["a"]).shape == (4, 8)


def test_aggregation_in_one_batch_equals_the_direct_call_exactly() -> None:
    host, platform, config = _start()
    ids = [f"c{i}" for i in range(5)]
    sessions = _sessions(host, platform, config, ids)
    rng = np.random.default_rng(1)
    grads = {c: rng.standard_normal(300).astype(np.float32) for c in ids}
    counts = {c: int(k) for c, k in zip(ids, rng.integers(1, 20, len(ids)), strict=True)}
    result = host.aggregate(4, {c: sessions[c].seal_gradient(4, grads[c]) for c in ids}, counts, size=300)
    assert result.batches == 1 and result.rejected == {} and result.accepted == ids
    assert np.array_equal(result.gradient, aggregate_gradients(grads, counts))
    assert result.peak_bytes <= config.memory_limit_bytes


def test_aggregation_in_batches_follows_eq_2() -> None:
    host, platform, config = _start(limit=2**20)
    ids = [f"c{i}" for i in range(40)]
    sessions = _sessions(host, platform, config, ids)
    rng = np.random.default_rng(2)
    grads = {c: rng.standard_normal(6000).astype(np.float32) for c in ids}
    counts = {c: int(k) for c, k in zip(ids, rng.integers(1, 20, len(ids)), strict=True)}
    sealed = {c: sessions[c].seal_gradient(0, grads[c]) for c in ids}
    sealed["c3"] = sessions["c3"].seal_gradient(0, np.ones(10, np.float32))
    result = host.aggregate(0, sealed, counts, size=6000)
    assert result.batches > 1
    assert result.rejected["c3"].startswith("ValidationError")
    kept = [c for c in ids if c != "c3"]
    total = sum(counts[c] for c in kept)
    eq2 = sum(counts[c] / total * grads[c].astype(np.float64) for c in kept)
    np.testing.assert_allclose(result.gradient, eq2, rtol=1e-5, atol=1e-6)
    # the cut into requests does not change a bit: the same gradients one, two or as many as fit at a time
    kept_counts = {c: counts[c] for c in kept}
    assert np.array_equal(result.gradient, aggregate_gradients({c: grads[c] for c in kept}, kept_counts))
    for attempt, request_bytes in enumerate((1, 2 * len(sealed["c0"]), 10**9), start=1):
        resealed = {c: sessions[c].seal_gradient(0, grads[c], attempt=attempt) for c in kept}
        again = host.aggregate(
            0, resealed, kept_counts, size=6000, attempt=attempt, request_bytes=request_bytes
        )
        assert np.array_equal(again.gradient, result.gradient) and again.accepted == kept
        if request_bytes == 1:
            assert again.batches == len(kept)
    assert result.peak_bytes <= config.memory_limit_bytes


def test_aggregation_without_any_valid_gradient_releases_nothing() -> None:
    host, platform, config = _start()
    sessions = _sessions(host, platform, config, ["a"])
    sealed = {"a": sessions["a"].seal_gradient(1, np.ones(5, np.float32))}
    result = host.aggregate(2, sealed, {"a": 3}, size=5)
    assert result.gradient is None and result.rejected["a"].startswith("RecordContextError")
    with pytest.raises(ValidationError, match="at least one"):
        host.aggregate(2, {}, {}, size=5)
    with pytest.raises(ValidationError, match="different clients"):
        host.aggregate(2, sealed, {"b": 1}, size=5)


def test_an_input_over_the_memory_limit_is_refused_before_computing() -> None:
    host, platform, config = _start(limit=2**20)
    ids = [f"c{i}" for i in range(64)]
    sessions = _sessions(host, platform, config, ids)
    big = _embeddings(ids, n=8, d=512)
    sealed = {c: sessions[c].seal_embeddings(0, big[c]) for c in ids}
    with pytest.raises(EnclaveMemoryError, match=r"over the limit of 1\.0 MiB"):
        host.loss_and_derivatives(0, sealed, shape=(8, 512))

    wide = _embeddings(ids, n=48, d=4)
    sealed = {c: sessions[c].seal_embeddings(1, wide[c]) for c in ids}
    with pytest.raises(EnclaveMemoryError, match="does not fit"):
        host.loss_and_derivatives(1, sealed, shape=(48, 4))

    small = _embeddings(ids[:16], n=8, d=16)
    result = host.loss_and_derivatives(
        2, {c: sessions[c].seal_embeddings(2, small[c]) for c in ids[:16]}, shape=(8, 16)
    )
    assert result.num_active > 0
    assert result.peak_bytes <= config.memory_limit_bytes


def test_peak_memory_stays_under_the_limit_while_chunking() -> None:
    host, platform, config = _start(limit=4 * 2**20)
    ids = [f"c{i}" for i in range(128)]
    sessions = _sessions(host, platform, config, ids)
    emb = _embeddings(ids, n=8, d=32, seed=5)
    result = host.loss_and_derivatives(
        0, {c: sessions[c].seal_embeddings(0, emb[c]) for c in ids}, shape=(8, 32)
    )
    direct = _direct(emb, config, limit=None)
    got = np.concatenate([sessions[c].open_derivatives(0, result.derivatives[c]) for c in ids])
    np.testing.assert_allclose(got, direct.derivatives, rtol=1e-4, atol=1e-7)
    # Tiles sum float32 distances in another order than the one-shot call, so a triplet whose hinge
    # sits within rounding of zero can flip (seen: 5,778,748 vs 5,778,747 of 7.3 M valid triplets).
    assert abs(result.num_active - direct.num_active) <= 1e-6 * direct.num_valid
    assert result.peak_bytes <= config.memory_limit_bytes


def _reply(service: EnclaveService, header: dict, blobs: list[bytes] = ()) -> dict:
    head, _ = unpack_frame(service.handle(pack_frame(header, blobs)))
    return head


def test_the_service_answers_bad_requests_with_errors_and_keeps_working() -> None:
    service = EnclaveService()
    assert _reply(service, {"op": "loss"})["message"].startswith("loss before launch")
    assert unpack_frame(service.handle(launch_frame(EnclaveConfig(), bytes(32))))[0]["ok"] is True
    again = unpack_frame(service.handle(launch_frame(EnclaveConfig(), bytes(32))))[0]
    assert again["ok"] is False and "already launched" in again["message"]
    assert _reply(service, {"op": ["loss"]})["error"] == "CodecError"
    garbage = unpack_frame(service.handle(b"not a frame"))[0]
    assert garbage == {"ok": False, "error": "CodecError", "message": garbage["message"]}
    assert _reply(service, {"op": "nope"})["error"] == "CodecError"
    assert _reply(service, {"op": "loss", "round": -1, "attempt": 0, "clients": []})["error"] == "CodecError"
    bad = _reply(service, {"op": "loss", "round": 0, "attempt": 0, "clients": ["a", "a"]}, [b"", b""])
    assert "twice" in bad["message"]
    bad = _reply(
        service,
        {"op": "aggregate", "round": 0, "attempt": 0, "clients": ["a"], "num_samples": [0], "final": True},
        [b""],
    )
    assert "num_samples" in bad["message"]
    assert _reply(service, {"op": "open_session"}, [b"FVH1"])["error"] == "CodecError"
    ok = _reply(service, {"op": "loss", "round": 0, "attempt": 0, "clients": ["x"], "shape": [4, 8]}, [b"zz"])
    assert ok["ok"] is True and ok["rejected"]["x"].startswith("no session")


def test_host_side_errors_name_the_enclave_refusal() -> None:
    host, _, _ = _start()
    with pytest.raises(CodecError, match="enclave refused open_session"):
        host.open_session(b"FVH1 broken")
    with pytest.raises(ValidationError, match="already launched"):
        host._call({"op": "launch"}, [])


def test_a_pinned_config_refuses_any_other_launch_config() -> None:
    pinned = EnclaveConfig(margin=0.25)
    service = EnclaveService(pinned_config=pinned)
    refused = unpack_frame(service.handle(launch_frame(EnclaveConfig(), bytes(32))))[0]
    assert refused["ok"] is False and "FEDVEIL_ENCLAVE_CONFIG" in refused["message"]
    assert unpack_frame(service.handle(launch_frame(pinned, bytes(32))))[0]["ok"] is True
    assert service.config == pinned


def test_a_client_with_overflowing_embeddings_is_rejected_alone() -> None:
    host, platform, config = _start()
    sessions = _sessions(host, platform, config, ["a", "b", "huge"])
    emb = _embeddings(["a", "b", "huge"])
    emb["huge"] = np.full((4, 8), 1e19, np.float32)
    result = host.loss_and_derivatives(
        0, {c: sessions[c].seal_embeddings(0, emb[c]) for c in sessions}, shape=(4, 8)
    )
    assert set(result.derivatives) == {"a", "b"}
    assert "too large" in result.rejected["huge"]
    assert result.loss == _direct({c: emb[c] for c in ("a", "b")}, config).loss


def test_a_client_with_non_finite_embeddings_is_rejected_alone() -> None:
    host, platform, config = _start()
    sessions = _sessions(host, platform, config, ["a", "nan", "b"])
    emb = _embeddings(list(sessions))
    emb["nan"][2, 3] = np.nan
    result = host.loss_and_derivatives(
        0, {c: sessions[c].seal_embeddings(0, emb[c]) for c in sessions}, shape=(4, 8)
    )
    assert list(result.derivatives) == ["a", "b"]
    assert result.rejected == {"nan": "ValidationError: embeddings contain NaN or infinity"}
    assert result.loss == _direct({c: emb[c] for c in ("a", "b")}, config).loss


def _true_peak(service: EnclaveService, build: object) -> tuple[int, dict]:
    """Whole-call heap peak by tracemalloc (request and reply included) and the reply header."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        reply = service.handle(build())
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return peak, unpack_frame(reply)[0]


DP_CONFIG = {"dp_mode": "paper", "dp_bound_T": 2e-5, "dp_noise_b": 1e-5, "dp_drop_rate": 0.2, "dp_seed": 1}


@pytest.mark.parametrize("dp", [False, True], ids=["alg1", "alg2"])
def test_the_heap_meter_bounds_the_traced_peak_of_whole_calls(dp: bool) -> None:
    host, platform, config = _start(limit=16 * 2**20, **(DP_CONFIG if dp else {}))
    service = host._transport._service
    ids = [f"c{i}" for i in range(64)]
    sessions = _sessions(host, platform, config, ids)
    emb = _embeddings(ids, n=8, d=32, seed=3)
    grads = {c: np.full(20000, 0.5, np.float32) for c in ids}

    def loss_request() -> bytes:
        sealed = [sessions[c].seal_embeddings(0, emb[c]) for c in ids]
        return pack_frame({"op": "loss", "round": 0, "attempt": 0, "clients": ids, "shape": [8, 32]}, sealed)

    def aggregate_request() -> bytes:
        sealed = [sessions[c].seal_gradient(0, grads[c]) for c in ids]
        header = {
            "op": "aggregate",
            "round": 0,
            "attempt": 0,
            "clients": ids,
            "num_samples": [8] * 64,
            "size": 20000,
            "max_norm": 1e6,
        }
        return pack_frame({**header, "final": True}, sealed)

    for build in (loss_request, aggregate_request):
        true_peak, reply = _true_peak(service, build)
        assert reply["ok"] is True
        assert true_peak <= reply["peak_bytes"] <= config.memory_limit_bytes
        # a bound by construction (Alg. 1's memory plan, Eq. 2's arrays), not a measurement: loose but
        # within a small factor of the truth
        assert reply["peak_bytes"] < 5 * true_peak, (true_peak, reply["peak_bytes"])


def test_expected_shapes_come_from_the_request_never_from_the_first_client() -> None:
    """A first client with another embedding width (or as many values in another shape), or a first
    gradient of one value more, does not become the reference: it alone is rejected, and the honest
    clients are computed and aggregated. Gradients over the norm bound are rejected likewise."""
    host, platform, config = _start()
    ids = ["narrow", "tall", "a", "b", "c"]
    sessions = _sessions(host, platform, config, ids)
    emb = _embeddings(ids)
    emb["narrow"] = emb["narrow"][:, :7].copy()
    emb["tall"] = emb["tall"].reshape(8, 4)
    sealed = {c: sessions[c].seal_embeddings(0, emb[c]) for c in ids}
    result = host.loss_and_derivatives(0, sealed, shape=(4, 8))
    assert list(result.derivatives) == ["a", "b", "c"]
    assert result.rejected == {
        "narrow": "ValidationError: embeddings of shape (4, 7), expected (4, 8)",
        "tall": "ValidationError: embeddings of shape (8, 4), expected (4, 8)",
    }
    assert result.loss == _direct({c: emb[c] for c in ("a", "b", "c")}, config).loss

    rng = np.random.default_rng(3)
    grads = {c: rng.standard_normal(300).astype(np.float32) for c in ids}
    grads["narrow"] = rng.standard_normal(301).astype(np.float32)
    grads["tall"] = np.full(300, 3e38, np.float32)
    counts = dict.fromkeys(ids, 4)
    sealed = {c: sessions[c].seal_gradient(0, grads[c]) for c in ids}
    agg = host.aggregate(0, sealed, counts, size=300, max_norm=1e3)
    assert agg.accepted == ["a", "b", "c"]
    assert agg.rejected["narrow"] == "ValidationError: gradient of shape (301,), expected (300,)"
    assert "exceeds max_upload_norm 1e+03" in agg.rejected["tall"]
    honest = {c: grads[c] for c in ("a", "b", "c")}
    assert np.array_equal(agg.gradient, aggregate_gradients(honest, {c: 4 for c in honest}))


def test_a_request_without_the_expected_shapes_is_refused() -> None:
    host, platform, config = _start()
    sessions = _sessions(host, platform, config, ["a"])
    record = bytes(sessions["a"].seal_embeddings(0, _embeddings(["a"])["a"]))
    service = host._transport._service
    refused = _reply(service, {"op": "loss", "round": 0, "attempt": 0, "clients": ["a"]}, [record])
    assert refused["error"] == "CodecError" and "'shape'" in refused["message"]
    header = {
        "op": "aggregate",
        "round": 0,
        "attempt": 0,
        "clients": ["a"],
        "num_samples": [1],
        "final": True,
    }
    assert "'size'" in _reply(service, header, [record])["message"]
    assert "'max_norm'" in _reply(service, {**header, "size": 3, "max_norm": 0}, [record])["message"]
