"""The enclave's operations behind one bytes-in, bytes-out entry point (:meth:`EnclaveService.handle`).

FDML Sec. V-A puts the loss and derivative computation (Fig. 2 step 5, Alg. 1) and the gradient
aggregation (step 9, Eq. 2) inside the TEE: participants attest it, send their embeddings and local
gradients into it, and receive their derivatives directly from it. Every request and reply is a
:func:`fedveil.enclave.channel.pack_frame` frame whose header names the operation:

``launch``
    First request only, sent by the platform (:mod:`fedveil.runtime.quoting`): blob 0 the canonical
    :class:`~fedveil.enclave.measure.EnclaveConfig` JSON, blob 1 the 32-byte report key. An enclave
    started with a pinned config (``FEDVEIL_ENCLAVE_CONFIG``, which the Gramine manifest sets and
    MRENCLAVE therefore covers) refuses any other config.
``open_session``
    Blob 0 a :class:`~fedveil.enclave.attestation.ClientHello`. The enclave makes a fresh X25519 key
    for the session, derives the channel, forgets the private key, and replies with its public key
    (blob 0) and a REPORT over ``SHA-256(public key | nonce)`` (blob 1). A nonce already seen is refused.
``loss``
    ``{"round", "attempt", "clients": [...], "shape": [n, d]}`` and one sealed embeddings record per
    client; ``shape`` is what every client must send (``n`` samples of the round, the network's
    embedding width ``d``: the host knows both from the model and the round's settings). Each record is
    opened on that client's session; a client whose record is missing a session, fails authentication,
    is stale, or does not hold float32 embeddings of that shape which Alg. 1 accepts (finite, below
    :func:`~fedveil.enclave.triplet.magnitude_limit`) is *rejected* (a dropout, with its reason) and
    left out. The rest are stacked in request order and labelled by
    client (FDML: every participant is one user), Alg. 1 runs through
    :func:`fedveil.enclave.triplet.loss_and_derivatives`, and each client's float32 derivatives are
    sealed to that client alone. The reply releases the loss and the number of active triplets, and
    two scalars for watching training: the active fraction (active over valid triplets) and the loss over
    all valid triplets (:attr:`~fedveil.enclave.triplet.TripletResult.valid_loss`). Beside the first two
    they reveal only the number of valid triplets, ``sum k (n - 1 - k)`` over the labels' sizes ``k + 1``
    among the ``n`` embeddings Alg. 1 ran on: without DP the host knows it already from the accepted
    clients and ``shape``; under Alg. 2 it tells how many embeddings the drop kept per client, in that
    sum (never which ones), which depends on the drop's coin flips only and on no one's data.
``aggregate``
    ``{"round", "attempt", "clients", "num_samples", "size", "max_norm", "final"}`` and one sealed
    gradient record per client. A gradient that is not ``size`` float32 values (the network's parameter
    count), not finite, or of L2 norm above ``max_norm`` (:func:`~fedveil.enclave.aggregate.check_upload`)
    rejects its client only. Batches of one (round, attempt) are folded into one float64 sum of
    ``|d_i| g_i`` (:class:`fedveil.enclave.aggregate.GradientSum`), so however the clients are cut into
    requests the result is bit for bit that of :func:`~fedveil.enclave.aggregate.aggregate_gradients`
    over them all.
    The ``final`` batch releases the aggregate gradient to the host for the optimizer step, as FDML's
    cloud updates the global network.
``layer_begin`` / ``layer_broadcast`` / ``layer_aggregate`` / ``layer_release``
    PPFL Alg. 1 (:mod:`fedveil.enclave.layerwise`): ``{"stage", "seed", "specs"}`` initialises the layer
    under training inside (from one blob of public float32 values, when the request carries one);
    ``{"round", "stage", "clients", "kept"}`` seals it (or, with ``kept``, the tail kept inside after
    training) to each client's session as a ``model`` record; ``{"round", "stage", "clients",
    "num_samples", "weighted", "max_norm", "final"}`` with one sealed ``update`` record per client opens them
    (failures reject that client only) and folds them into the round's sum inside; the ``final`` request
    of a round averages and releases only the clients' mean loss; ``{"stage", "keep"}`` releases the
    trained layer to the host, but for its last ``keep`` values.
``layer_seal`` / ``layer_unseal``
    Sealed storage of the layer in training (:meth:`fedveil.enclave.layerwise.LayerwiseState.seal`):
    ``{"stage", "round"}`` with blob 0 the host's 32-byte sealing secret replies the stage's state sealed
    under a key bound to this enclave's measurement (computed at launch, as the platform measures it);
    the same header with blob 1 a sealed blob restores the stage from it in a fresh enclave.
``shutdown``
    Ends the enclave process's loop.

Replies are ``{"ok": true, ...}`` or ``{"ok": false, "error": NAME, "message": TEXT}``. Only
:class:`~fedveil.errors.FedveilError` messages (written by fedveil, never holding data values) leave
the enclave; any other failure reports its exception type only.

**Bounded memory.** The enclave's heap budget is ``config.memory_limit_bytes`` (SGX1's EPC: 96 MiB by
default). Before computing, an operation estimates what it will hold (request, plaintexts, stacked
inputs, sealed outputs, reply) and refuses with :class:`EnclaveMemoryError` when that cannot fit;
what is left is passed to the maths as its ``memory_limit_bytes``, which works in chunks within it.
Every call replies ``peak_bytes``, a bound on its peak heap kept by :class:`HeapMeter`: the buffers
the service allocates itself (request, plaintexts, stacked inputs, sealed outputs, reply) are counted
exactly, phase by phase, plus the state kept between calls (sessions, the running aggregate) and a fixed
slack for small objects; the library calls are bounded by construction: Alg. 1 by its memory plan
(:attr:`~fedveil.enclave.triplet.TripletResult.workspace_bytes`, the working memory the plan chose
its tiles to stay within), Alg. 2 and Eq. 2 by the arrays they allocate (:func:`alg2_bytes`,
:func:`eq2_bytes`). Measuring them with :mod:`tracemalloc` instead cost a third of Alg. 1's time at
512 participants (every small Python allocation is traced); ``tests/test_enclave_tee_service.py``
checks the bound against tracemalloc over whole calls, and ``tests/test_enclave_triplet.py`` the plan's
bound against tracemalloc over Alg. 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedveil.enclave.aggregate import BLOCK as AGGREGATE_BLOCK
from fedveil.enclave.aggregate import GradientSum, check_upload
from fedveil.enclave.attestation import REPORT_KEY_BYTES, ClientHello, make_report, report_data_for
from fedveil.enclave.channel import (
    DERIVATIVES,
    EMBEDDINGS,
    GRADIENT,
    KIND_NAMES,
    MODEL,
    RECORD_OVERHEAD,
    UPDATE,
    SecureChannel,
    canonical_json,
    check_client_id,
    decode_array,
    enclave_channel,
    encode_array,
    pack_frame,
    public_bytes,
    unpack_frame,
)
from fedveil.enclave.dp import NoiseSource, private_derivatives
from fedveil.enclave.layerwise import LayerwiseState, ParamSpec
from fedveil.enclave.measure import EnclaveConfig, measure_enclave
from fedveil.enclave.secure_noise import SECURE_NOISE_BYTES_PER_VALUE, SecureNoise
from fedveil.enclave.triplet import TripletResult, loss_and_derivatives, unusable_rows
from fedveil.errors import CodecError, ConfigError, FedveilError, ValidationError

PINNED_CONFIG_ENV = "FEDVEIL_ENCLAVE_CONFIG"
"""Environment variable that fixes the launch config (set by the Gramine manifest, hence measured)."""

SESSION_BYTES = 1024
"""Heap charged per open session (keys, counters, dictionary entry), a generous bound."""

FRAME_SLACK_BYTES = 64 * 1024
"""Headers, per-blob lengths and small temporaries charged on top of each estimate."""

_Blobs = list[memoryview]
_Reply = tuple[dict[str, Any], list[bytes]]


_NO_LOSS: dict[str, Any] = {"loss": None, "num_active": 0, "active_fraction": 0.0, "valid_loss": None}
"""What step 5 releases when no client was accepted: no loss, no active triplet."""


class HeapMeter:
    """A bound on the peak heap of one enclave call, in bytes: the largest phase declared with
    :meth:`hold` (the sizes of the buffers held together), on top of ``base`` (state kept between calls)."""

    def __init__(self, base: int = 0) -> None:
        self.base = base
        self.peak = base

    def hold(self, nbytes: int) -> None:
        """A phase that holds ``nbytes`` of buffers at once."""
        self.peak = max(self.peak, self.base + nbytes)


def alg2_bytes(n: int, d: int) -> int:
    """Heap that FDML Alg. 2 (:func:`~fedveil.enclave.dp.private_derivatives`) allocates around Alg. 1 for
    ``n`` float32 embeddings of dimension ``d``, summed over its phases (an upper bound of their peak):
    the keep mask, the kept embeddings and labels, the zero-filled derivatives, and the release's float64
    copy, clipped copy, noise and sum, with its float32 cast."""
    return n + (4 * d + 8) * n + 4 * n * d + 4 * 8 * n * d + 4 * n * d


def eq2_bytes(size: int) -> int:
    """Heap that Eq. 2 (:class:`~fedveil.enclave.aggregate.GradientSum`) allocates for gradients of
    ``size`` values in one request: the float64 sum (when the request starts it), the float32 result
    (when it is the final one), and for one block of coordinates a float64 term and a finiteness mask
    (plus, when the sum is not finite, one gradient's mask to name the culprit)."""
    block = min(size, AGGREGATE_BLOCK)
    return 8 * size + 4 * size + 8 * block + block + size  # the masks: a block's, or one whole gradient's


class EnclaveMemoryError(ValidationError):
    """An input the enclave refuses because it cannot be processed within its memory limit."""


def launch_frame(config: EnclaveConfig, report_key: bytes) -> bytes:
    """The ``launch`` request the platform sends first: the measured config and the report key."""
    if len(report_key) != REPORT_KEY_BYTES:
        raise ValueError(f"report key of {len(report_key)} bytes, expected {REPORT_KEY_BYTES}")
    return pack_frame({"op": "launch"}, [config.canonical_json(), report_key])


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _int(header: dict[str, Any], key: str, *, minimum: int = 0) -> int:
    value = header.get(key)
    if type(value) is not int or value < minimum or value >= 2**63:
        raise CodecError(f"request field {key!r} is {value!r}, expected an int >= {minimum}")
    return value


def _clients(header: dict[str, Any], count: int) -> list[str]:
    clients = header.get("clients")
    if not isinstance(clients, list) or len(clients) != count:
        raise CodecError(f"request field 'clients' must list one client per record ({count} records)")
    for cid in clients:
        check_client_id(cid)
    if len(set(clients)) != len(clients):
        raise CodecError("request field 'clients' names a client twice")
    return clients


def _num_samples(header: dict[str, Any], count: int) -> list[int]:
    num_samples = header.get("num_samples")
    if (
        not isinstance(num_samples, list)
        or len(num_samples) != count
        or any(type(k) is not int or not 0 < k < 2**53 for k in num_samples)
    ):
        raise CodecError("request field 'num_samples' must list one positive int per client")
    return num_samples


def _shape(header: dict[str, Any], key: str, ndim: int) -> tuple[int, ...]:
    value = header.get(key)
    if (
        not isinstance(value, list)
        or len(value) != ndim
        or any(type(k) is not int or not 0 < k < 2**31 for k in value)
    ):
        raise CodecError(f"request field {key!r} is {value!r}, expected {ndim} positive int(s)")
    return tuple(value)


def _max_norm(header: dict[str, Any]) -> float:
    value = header.get("max_norm")
    if type(value) not in (int, float) or not (math.isfinite(value) and value > 0):
        raise CodecError(f"request field 'max_norm' is {value!r}, expected a finite number > 0")
    return float(value)


def _rejection(exc: FedveilError) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass
class _Aggregation:
    """Eq. 2 in progress for one (round, attempt): the weighted sum so far."""

    rnd: int
    attempt: int
    sum: GradientSum = dataclasses.field(default_factory=GradientSum)


class EnclaveService:
    """The enclave: sessions, Alg. 1 and Eq. 2 over sealed inputs, all through :meth:`handle`."""

    def __init__(self, *, pinned_config: EnclaveConfig | None = None) -> None:
        self.pinned_config = pinned_config
        self.config: EnclaveConfig | None = None
        self.closed = False
        self._report_key = b""
        self._sessions: dict[str, SecureChannel] = {}
        self._nonces: set[bytes] = set()
        self._aggregation: _Aggregation | None = None
        self._dp_rng: NoiseSource | None = None
        self._ops: dict[str, Callable[[dict[str, Any], _Blobs, int, HeapMeter], _Reply]] = {
            "launch": self._launch,
            "open_session": self._open_session,
            "loss": self._loss,
            "aggregate": self._aggregate,
            "layer_begin": self._layer_begin,
            "layer_broadcast": self._layer_broadcast,
            "layer_aggregate": self._layer_aggregate,
            "layer_release": self._layer_release,
            "layer_seal": self._layer_seal,
            "layer_unseal": self._layer_unseal,
            "shutdown": self._shutdown,
        }
        self._layers = LayerwiseState()
        self._measurement = b""

    @property
    def resident_bytes(self) -> int:
        """Heap the enclave keeps between calls: sessions and the running aggregate."""
        held = SESSION_BYTES * len(self._sessions)
        if self._aggregation is not None:
            held += self._aggregation.sum.nbytes
        return held + self._layers.resident_bytes

    @property
    def memory_limit_bytes(self) -> int:
        """The configured heap budget; before launch, the budget of a launch request (1 MiB)."""
        return self.config.memory_limit_bytes if self.config is not None else 2**20

    def handle(self, request: bytes | bytearray | memoryview) -> bytes:
        """Run one request frame and return the reply frame; never raises for bad input."""
        size = memoryview(request).nbytes
        meter = HeapMeter(self.resident_bytes + FRAME_SLACK_BYTES)
        meter.hold(size)
        try:
            header, blobs = unpack_frame(request)
            op = header.get("op")
            if not isinstance(op, str) or op not in self._ops:
                raise CodecError(f"unknown enclave operation {op!r}; expected one of {sorted(self._ops)}")
            if op == "launch" and self.config is not None:
                raise ValidationError("the enclave is already launched; launch comes once, first")
            if op != "launch" and self.config is None:
                raise ValidationError(f"{op} before launch: the enclave's first request must be launch")
            reply, out = self._ops[op](header, blobs, size, meter)
            sealed = sum(len(b) for b in out)
            meter.hold(size + 2 * sealed + 16 * len(out) + len(canonical_json(reply)) + 64)
            reply["peak_bytes"] = meter.peak
        except FedveilError as exc:
            reply, out = {"ok": False, "error": type(exc).__name__, "message": str(exc)}, []
        except Exception as exc:
            reply = {"ok": False, "error": "EnclaveInternalError", "message": type(exc).__name__}
            out = []
        return pack_frame(reply, out)

    def _launched(self) -> EnclaveConfig:
        if self.config is None:
            raise ValidationError("the enclave has not been launched")
        return self.config

    @staticmethod
    def _drop_unusable(
        accepted: list[str], counts: list[int], stacked: np.ndarray, rejected: dict[str, str]
    ) -> tuple[list[str], list[int], np.ndarray]:
        """Reject, as a whole, each client with an embedding that Alg. 1 refuses (non-finite, or too large
        for float32 squared distances: :func:`fedveil.enclave.triplet.unusable_rows`, the same limit
        Alg. 1 applies, so what is kept is computed); checked once over the stacked rows."""
        owner = np.repeat(np.arange(len(accepted)), counts)
        non_finite, too_large = unusable_rows(stacked)
        unusable = np.bincount(owner[non_finite | too_large], minlength=len(accepted))
        bad = set(np.flatnonzero(unusable).tolist())
        if not bad:
            return accepted, counts, stacked
        for i in bad:
            why = "contain NaN or infinity" if non_finite[owner == i].any() else "are too large for float32"
            rejected[accepted[i]] = f"ValidationError: embeddings {why}"
        keep = [i for i in range(len(accepted)) if i not in bad]
        rows = ~np.isin(owner, list(bad))
        return [accepted[i] for i in keep], [counts[i] for i in keep], stacked[rows]

    def _check_fits(self, need: int, what: str) -> None:
        """Refuse, before computing, when ``need`` bytes of buffers, with the state kept between calls
        and the slack for small objects, would exceed the memory limit."""
        limit = self.memory_limit_bytes
        total = need + self.resident_bytes + FRAME_SLACK_BYTES
        if total > limit:
            raise EnclaveMemoryError(
                f"{what} needs about {_mib(total)} of enclave heap, over the limit of {_mib(limit)} "
                f"({limit} bytes): send fewer or smaller inputs per request, or launch the enclave "
                "with a larger memory_limit_bytes"
            )

    # --- operations -----------------------------------------------------------------------------

    def _launch(self, header: dict[str, Any], blobs: _Blobs, size: int, meter: HeapMeter) -> _Reply:
        if len(blobs) != 2 or blobs[1].nbytes != REPORT_KEY_BYTES:
            raise CodecError("launch carries the config and a 32-byte report key")
        config = EnclaveConfig.from_json(bytes(blobs[0]))
        if self.pinned_config is not None and config != self.pinned_config:
            raise ValidationError(
                f"launch config {config.canonical_json().decode()} differs from the measured "
                f"{PINNED_CONFIG_ENV} {self.pinned_config.canonical_json().decode()}"
            )
        self.config = config
        self._measurement = measure_enclave(config).digest
        self._report_key = bytes(blobs[1])
        if config.dp_mode is not None:
            # seeded numpy for a simulation; a deployment (no seed) draws exact discrete noise from the CSPRNG
            seeded = config.dp_seed is not None
            self._dp_rng = np.random.default_rng(config.dp_seed) if seeded else SecureNoise()
        return {"ok": True}, []

    def _shutdown(self, header: dict[str, Any], blobs: _Blobs, size: int, meter: HeapMeter) -> _Reply:
        self.closed = True
        return {"ok": True}, []

    def _open_session(self, header: dict[str, Any], blobs: _Blobs, size: int, meter: HeapMeter) -> _Reply:
        if len(blobs) != 1:
            raise CodecError(f"open_session carries one client hello, got {len(blobs)} blobs")
        hello = ClientHello.decode(blobs[0])
        if hello.nonce in self._nonces:
            raise ValidationError(
                f"client {hello.client_id!r} sent a nonce this enclave has already seen: a replayed hello"
            )
        self._check_fits(SESSION_BYTES, "a new session")
        key = X25519PrivateKey.generate()
        public = public_bytes(key)
        self._sessions[hello.client_id] = enclave_channel(
            key, hello.client_public, client_id=hello.client_id, nonce=hello.nonce
        )
        self._nonces.add(hello.nonce)
        report = make_report(self._report_key, report_data_for(public, hello.nonce))
        return {"ok": True, "client": hello.client_id}, [public, report]

    def _open_records(
        self,
        clients: list[str],
        blobs: _Blobs,
        *,
        kind: int,
        rnd: int,
        attempt: int,
        shape: tuple[int, ...] | None,
        ndim: int,
    ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """Open each client's record on its session; a failure rejects that client only. Each array
        must have ``shape``, the one the request states (known from the model and the round's settings,
        never taken from another client's record), or, where ``shape`` is None, ``ndim`` dimensions (a
        PPFL update is checked against its layer). Gradients must be finite here; embeddings are checked
        together in :meth:`_drop_unusable`."""
        opened: dict[str, np.ndarray] = {}
        rejected: dict[str, str] = {}
        for cid, blob in zip(clients, blobs, strict=True):
            channel = self._sessions.get(cid)
            if channel is None:
                rejected[cid] = "no session: the client must attest the enclave and open a session first"
                continue
            try:
                plaintext = channel.open(blob, kind=kind, rnd=rnd, attempt=attempt)
                array = decode_array(plaintext, dtype="<f4", ndim=ndim, finite=kind != EMBEDDINGS)
            except FedveilError as exc:
                rejected[cid] = _rejection(exc)
                continue
            if shape is not None and array.shape != shape:
                what = KIND_NAMES[kind]
                rejected[cid] = f"ValidationError: {what} of shape {array.shape}, expected {shape}"
                continue
            opened[cid] = array
        return opened, rejected

    def _loss(self, header: dict[str, Any], blobs: _Blobs, size: int, meter: HeapMeter) -> _Reply:
        config = self._launched()
        rnd, attempt = _int(header, "round"), _int(header, "attempt")
        clients = _clients(header, len(blobs))
        shape = _shape(header, "shape", 2)
        sealed_total = sum(b.nbytes for b in blobs)
        self._check_fits(size + sealed_total, f"decrypting {len(clients)} embedding records")
        embeddings, rejected = self._open_records(
            clients, blobs, kind=EMBEDDINGS, rnd=rnd, attempt=attempt, shape=shape, ndim=2
        )
        accepted = list(embeddings)
        if not accepted:
            return {"ok": True, **_NO_LOSS, "clients": [], "rejected": rejected}, []
        meter.hold(size + sealed_total)
        counts = [shape[0]] * len(accepted)
        n, d = sum(counts), shape[1]
        matrix = n * d * 4
        # Buffers held together in each phase (besides the request): plaintexts and their stacked copy;
        # the drop check's |x|, flags and row maxima; Alg. 1 beside the stacked copy and the labels;
        # sealing beside the derivatives: the sealed records and the reply frame.
        staging = size + sealed_total + matrix
        checking = size + 2 * matrix + matrix // 4 + 32 * n
        computing = size + matrix + 8 * n
        sealing = size + 2 * (matrix + len(accepted) * (RECORD_OVERHEAD + 64))
        # Alg. 1 needs at least room for its float32 derivatives; the rest of the room is its budget.
        self._check_fits(
            max(staging, checking, max(computing, sealing) + matrix),
            f"Alg. 1 over {n} embeddings of dimension {d}",
        )
        budget = config.memory_limit_bytes - self.resident_bytes - FRAME_SLACK_BYTES - max(computing, sealing)
        stacked = np.concatenate([embeddings[c] for c in accepted])
        meter.hold(staging)
        del embeddings
        meter.hold(checking)
        accepted, counts, stacked = self._drop_unusable(accepted, counts, stacked, rejected)
        if not accepted:
            return {"ok": True, **_NO_LOSS, "clients": [], "rejected": rejected}, []
        n = stacked.shape[0]
        labels = np.repeat(np.arange(len(accepted), dtype=np.int64), counts)
        held = size + stacked.nbytes + labels.nbytes
        try:
            result = self._step_five(config, stacked, labels, budget)
            meter.hold(held + result.workspace_bytes)
        except ConfigError as exc:  # the config was validated at launch: only the memory plan can fail
            raise EnclaveMemoryError(
                f"Alg. 1 over {n} embeddings of dimension {d} does not fit the {_mib(budget)} of enclave "
                f"heap left for it under the limit of {_mib(config.memory_limit_bytes)}: {exc}"
            ) from exc
        del stacked, labels
        derivatives = np.asarray(result.derivatives).astype(np.float32, copy=False)
        out: list[bytes] = []
        start = 0
        for cid, count in zip(accepted, counts, strict=True):
            out.append(
                self._sessions[cid].seal_array(DERIVATIVES, rnd, attempt, derivatives[start : start + count])
            )
            start += count
        extra = 0 if derivatives is result.derivatives else result.derivatives.nbytes
        meter.hold(size + extra + derivatives.nbytes + sum(map(len, out)) + 2 * max(map(len, out)))
        reply = {
            "ok": True,
            "loss": float(result.loss),
            "num_active": int(result.num_active),
            "active_fraction": float(result.active_fraction),
            "valid_loss": float(result.valid_loss),
            "clients": accepted,
            "rejected": rejected,
        }
        return reply, out

    def _step_five(
        self, config: EnclaveConfig, stacked: np.ndarray, labels: np.ndarray, budget: int
    ) -> TripletResult:
        """FDML step 5: Alg. 1, or Alg. 2 around it when the measured config enables DP (the loss and
        active count are then those of the kept embeddings; the derivatives are the released ones, and
        ``workspace_bytes`` also bounds Alg. 2's own arrays, :func:`alg2_bytes`, and with the secure sampler
        its working arrays, :data:`~fedveil.enclave.secure_noise.SECURE_NOISE_BYTES_PER_VALUE`)."""

        def alg1(emb: np.ndarray, lab: np.ndarray) -> TripletResult:
            return loss_and_derivatives(
                emb, lab, margin=config.margin, strategy=config.strategy, memory_limit_bytes=budget
            )

        if config.dp_mode is None or self._dp_rng is None:
            return alg1(stacked, labels)
        kept: list[TripletResult] = []

        def derivative_fn(emb: np.ndarray, lab: np.ndarray) -> np.ndarray:
            kept.append(alg1(emb, lab))
            return kept[-1].derivatives

        released, _ = private_derivatives(
            stacked,
            labels,
            derivative_fn,
            drop_rate=config.dp_drop_rate,
            mode=config.dp_mode,
            bound_T=config.dp_bound_T,
            noise_b=config.dp_noise_b,
            rng=self._dp_rng,
        )
        extra = alg2_bytes(*stacked.shape)
        if isinstance(self._dp_rng, SecureNoise):
            extra += SECURE_NOISE_BYTES_PER_VALUE * stacked.size
        if not kept:
            return TripletResult(0.0, released, 0, 0, 0, extra)
        return dataclasses.replace(
            kept[0], derivatives=released, workspace_bytes=kept[0].workspace_bytes + extra
        )

    def _aggregate(self, header: dict[str, Any], blobs: _Blobs, size: int, meter: HeapMeter) -> _Reply:
        rnd, attempt = _int(header, "round"), _int(header, "attempt")
        clients = _clients(header, len(blobs))
        num_samples = _num_samples(header, len(clients))
        width = _int(header, "size", minimum=1)
        max_norm = _max_norm(header)
        final = header.get("final")
        if type(final) is not bool:
            raise CodecError(f"request field 'final' is {final!r}, expected a bool")
        state = self._aggregation
        if state is None or (state.rnd, state.attempt) != (rnd, attempt):
            state = self._aggregation = _Aggregation(rnd, attempt)
        sealed_total = sum(b.nbytes for b in blobs)
        largest = max((b.nbytes for b in blobs), default=0)
        # request + plaintexts + Eq. 2's float64 work (accumulator, a product, the result, slack)
        self._check_fits(
            size + sealed_total + 4 * 2 * largest,
            f"aggregating {len(clients)} gradient records of up to {_mib(largest)}",
        )
        if state.sum.size not in (None, width):
            raise CodecError(
                f"request field 'size' is {width}, but this round's aggregate so far has {state.sum.size}"
            )
        gradients, rejected = self._open_records(
            clients, blobs, kind=GRADIENT, rnd=rnd, attempt=attempt, shape=(width,), ndim=1
        )
        meter.hold(size + sealed_total + 8 * min(width, AGGREGATE_BLOCK))  # the norm's float64 block
        for cid, g in list(gradients.items()):
            try:
                check_upload(g, max_norm)
            except ValidationError as exc:
                rejected[cid] = _rejection(exc)
                del gradients[cid]
        if gradients:
            samples = dict(zip(clients, num_samples, strict=True))
            state.sum.add(gradients, {cid: samples[cid] for cid in gradients})
            meter.hold(size + sealed_total + eq2_bytes(state.sum.size or 0))
        reply: dict[str, Any] = {"ok": True, "final": final, "clients": list(gradients), "rejected": rejected}
        out: list[bytes] = []
        if final:
            self._aggregation = None
            if state.sum.total:
                gradient = state.sum.mean()
                reply["num_samples_total"] = state.sum.total
                reply["dtype"] = gradient.dtype.newbyteorder("<").str
                out.append(encode_array(gradient))
        return reply, out

    # --- PPFL (Alg. 1) ------------------------------------------------------------------------------

    def _layer_begin(self, header: dict[str, Any], blobs: _Blobs, size: int, meter: HeapMeter) -> _Reply:
        stage, seed = _int(header, "stage"), _int(header, "seed")
        specs_json = header.get("specs")
        if not isinstance(specs_json, list):
            raise CodecError("request field 'specs' must list the layer's parameter specs")
        specs = [ParamSpec.from_json(v) for v in specs_json]
        total = sum(spec.size for spec in specs)
        self._check_fits(8 * total, f"layer stage {stage} of {total} values")
        if len(blobs) > 1:
            raise CodecError(f"layer_begin takes at most one blob of initial values, not {len(blobs)}")
        initial = np.asarray(decode_array(blobs[0], dtype="<f4", ndim=1)) if blobs else None
        count = self._layers.begin(stage, specs, seed, initial)
        meter.hold(size + 4 * count)
        return {"ok": True, "stage": stage, "size": count}, []

    def _layer_broadcast(self, header: dict[str, Any], blobs: _Blobs, size: int, meter: HeapMeter) -> _Reply:
        rnd, stage = _int(header, "round"), _int(header, "stage")
        clients = header.get("clients")
        if not isinstance(clients, list) or len(set(clients)) != len(clients):
            raise CodecError("request field 'clients' must list distinct client ids")
        kept = header.get("kept")
        if type(kept) is not bool:
            raise CodecError(f"request field 'kept' is {kept!r}, expected a bool")
        if kept:
            if self._layers.kept is None or self._layers.stage != stage:
                raise ValidationError(f"no tail of layer stage {stage} is kept inside the enclave")
            values = self._layers.kept
        else:
            values = self._layers.current(stage)
        plaintext = encode_array(values)
        self._check_fits(
            len(plaintext) + len(clients) * (len(plaintext) + RECORD_OVERHEAD),
            f"sealing {values.size} values to {len(clients)} clients",
        )
        out = []
        for cid in clients:
            channel = self._sessions.get(check_client_id(cid))
            if channel is None:
                raise ValidationError(f"client {cid!r} has no session: it must attest the enclave first")
            out.append(channel.seal(MODEL, rnd, 0, plaintext))
        return {"ok": True, "clients": clients}, out

    def _layer_aggregate(self, header: dict[str, Any], blobs: _Blobs, size: int, meter: HeapMeter) -> _Reply:
        rnd, stage = _int(header, "round"), _int(header, "stage")
        clients = _clients(header, len(blobs))
        num_samples = _num_samples(header, len(clients))
        weighted, final = header.get("weighted"), header.get("final")
        if type(weighted) is not bool or type(final) is not bool:
            raise CodecError(
                f"request fields 'weighted' and 'final' are {weighted!r}, {final!r}: expected bools"
            )
        max_norm = _max_norm(header)
        theta = self._layers.current(stage)
        sealed_total = sum(b.nbytes for b in blobs)
        # the float64 sum, and one float64 block of an update's change for its norm
        work = 8 * (theta.size + 1) + 8 * min(theta.size, AGGREGATE_BLOCK)
        self._check_fits(size + sealed_total + work, f"averaging {len(clients)} layer updates")
        updates, rejected = self._open_records(
            clients, blobs, kind=UPDATE, rnd=rnd, attempt=0, shape=None, ndim=1
        )
        meter.hold(size + sealed_total + work)
        more, loss = self._layers.average(
            stage,
            rnd,
            updates,
            dict(zip(clients, num_samples, strict=True)),
            weighted=weighted,
            final=final,
            max_norm=max_norm,
        )
        rejected.update(more)
        accepted = [c for c in clients if c in updates and c not in more]
        return {"ok": True, "clients": accepted, "rejected": rejected, "loss": loss}, []

    def _layer_release(self, header: dict[str, Any], blobs: _Blobs, size: int, meter: HeapMeter) -> _Reply:
        stage, keep = _int(header, "stage"), _int(header, "keep")
        released = self._layers.release(stage, keep)
        return {"ok": True, "stage": stage, "kept": keep}, [encode_array(released)]

    def _layer_seal(self, header: dict[str, Any], blobs: _Blobs, size: int, meter: HeapMeter) -> _Reply:
        stage, rnd = _int(header, "stage"), _int(header, "round")
        if len(blobs) != 1:
            raise CodecError(f"layer_seal takes one blob, the sealing secret, not {len(blobs)}")
        self._check_fits(3 * self._layers.resident_bytes, f"sealing layer stage {stage}")
        sealed = self._layers.seal(stage, rnd, bytes(blobs[0]), self._measurement)
        return {"ok": True, "stage": stage, "round": rnd}, [sealed]

    def _layer_unseal(self, header: dict[str, Any], blobs: _Blobs, size: int, meter: HeapMeter) -> _Reply:
        stage, rnd = _int(header, "stage"), _int(header, "round")
        if len(blobs) != 2:
            raise CodecError(
                f"layer_unseal takes two blobs, the sealing secret and the sealed layer, not {len(blobs)}"
            )
        self._check_fits(3 * blobs[1].nbytes, f"unsealing layer stage {stage}")
        count = self._layers.unseal(stage, rnd, bytes(blobs[0]), self._measurement, bytes(blobs[1]))
        meter.hold(size + 4 * count)
        return {"ok": True, "stage": stage, "size": count}, []
