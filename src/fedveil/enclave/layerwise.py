"""PPFL's server TEE (Alg. 1): the layer under training lives here.

For each layer (or block of layers) ``l`` the server's enclave

1. initialises ``theta_l`` (the layer and the classifier the clients train atop it) *inside*, from the
   parameter shapes and PyTorch's default initialisation rule (:class:`ParamSpec`), with a generator
   seeded at :meth:`LayerwiseState.begin` (a seed fixed by the experiment, so runs repeat; the values
   never leave the enclave unsealed), or, when the server transfers public knowledge (PPFL Sec. 4.3,
   Appendix A.1), from the public values the host hands in (a model pre-trained on public data: public,
   so the host may see them; what the clients make of them is sealed from then on);
2. each round seals ``theta_l`` to every selected client's TEE (records of kind ``model``, bound to the
   round; a client session's channel, :mod:`fedveil.enclave.channel`);
3. opens the clients' sealed updates (kind ``update``: ``theta_l^(j)`` followed by the client's mean
   training loss; in as many requests as its memory bound needs, summed in float64 between them),
   checks each one's length and finiteness, and replaces ``theta_l`` by their average:
   ``theta_l = 1 / size(J) * sum_j theta_l^(j)`` (Alg. 1, "FedAvg with Secure Aggregation ... in TEE"),
   or the sample-weighted average when asked;
4. after the layer's last round releases ``theta_l^0`` to the REE (Alg. 1, "Save theta_l from TEE as
   theta_l^0 in REE"), optionally keeping a tail of it inside (the classifier atop the last layer, PPFL
   Sec. 4.1's defence against membership inference on the last layer).

Rounds are numbered across the whole run (layer after layer), so a record sealed for one layer's round
can never be opened as another's. Numpy only: the enclave process does not import torch.

**Sealed storage** (a checkpoint of the layer in training, :meth:`LayerwiseState.seal`): after a round
the enclave encrypts what it needs to continue the stage (the stage, ``theta_l`` and the last applied
round; the enclave keeps no optimiser state: it averages, and the clients' optimisers start afresh each
round) under a *sealing key* bound to its measurement, and the host stores only the sealed blob. An SGX
enclave gets that key from the CPU (``EGETKEY``, MRENCLAVE policy): it never leaves the processor. The
emulation derives it as ``HKDF-SHA256(secret, salt=measurement, info=b"fedveil/enclave-seal/v1")`` from
a secret the host hands in (a run directory's ``sealing.key``, mode 0600): it is only as safe as that
file, since whoever reads it can derive the key. The blob is ``b"FVS1" | measurement (32) | nonce (12)
| AES-256-GCM(state)``, authenticated with the stage and round it was sealed after, so an enclave of
another measurement (changed code or launch config) refuses it by name, and a changed byte, another
run's secret or another round's blob fails authentication.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedveil.enclave.aggregate import DEFAULT_MAX_UPLOAD_NORM, check_upload
from fedveil.enclave.channel import canonical_json, decode_array, encode_array, pack_frame, unpack_frame
from fedveil.errors import CodecError, ValidationError

INITS = ("uniform", "zeros", "ones")
MAX_SPEC_PARAMS = 2**31
"""A layer + classifier of more than 2**31 values is refused (8 GiB of float32, beyond any TEE)."""
SEAL_MAGIC = b"FVS1"
SEAL_INFO = b"fedveil/enclave-seal/v1"
SEAL_SECRET_BYTES = 32
_SEAL_NONCE_BYTES = 12


def sealing_key(secret: bytes, measurement: bytes) -> bytes:
    """The emulated sealing key (module docstring): HKDF-SHA256 of the host's ``secret`` (32 bytes), salted
    with the enclave's 32-byte ``measurement``."""
    if len(secret) != SEAL_SECRET_BYTES or len(measurement) != 32:
        raise ValidationError(
            f"a sealing secret of {len(secret)} bytes and a measurement of {len(measurement)}: need 32 and 32"
        )
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=measurement, info=SEAL_INFO).derive(secret)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor of ``theta_l``: its ``shape`` and initialisation ``init``.

    ``uniform`` draws from ``U(-bound, bound)``: PyTorch's default for ``Conv2d`` / ``Linear`` weights
    (Kaiming-uniform with ``a = sqrt(5)``) and biases, both ``bound = 1 / sqrt(fan_in)``. ``zeros`` and
    ``ones`` are BatchNorm's shift and scale.
    """

    shape: tuple[int, ...]
    init: str = "uniform"
    bound: float = 0.0

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise CodecError(f"parameter init {self.init!r} is not one of {', '.join(INITS)}")
        if not all(type(d) is int and d >= 1 for d in self.shape):
            raise CodecError(f"parameter shape {self.shape!r} must be positive ints")
        if not (math.isfinite(self.bound) and self.bound >= 0):
            raise CodecError(f"uniform bound {self.bound!r} must be finite and >= 0")

    @property
    def size(self) -> int:
        """Number of values."""
        return math.prod(self.shape)

    def to_json(self) -> dict[str, object]:
        """The spec as the enclave request header carries it."""
        return {"shape": list(self.shape), "init": self.init, "bound": self.bound}

    @classmethod
    def from_json(cls, value: object) -> ParamSpec:
        """Parse one header entry; :class:`CodecError` names what is wrong."""
        if not isinstance(value, dict) or sorted(value) != ["bound", "init", "shape"]:
            raise CodecError(f"parameter spec {value!r} must have exactly shape, init and bound")
        shape, bound = value["shape"], value["bound"]
        if not isinstance(shape, list) or not shape or len(shape) > 8:
            raise CodecError(f"parameter shape {shape!r} must be a list of 1 to 8 ints")
        if type(bound) not in (int, float):
            raise CodecError(f"uniform bound {bound!r} must be a number")
        return cls(tuple(shape), str(value["init"]), float(bound))


def initialise(specs: Sequence[ParamSpec], rng: np.random.Generator) -> np.ndarray:
    """``theta_l`` as one flat float32 vector, each tensor drawn by its spec, in order."""
    parts = []
    for spec in specs:
        if spec.init == "uniform":
            parts.append(rng.uniform(-spec.bound, spec.bound, spec.size).astype(np.float32))
        else:
            parts.append(np.full(spec.size, 0.0 if spec.init == "zeros" else 1.0, dtype=np.float32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


class LayerwiseState:
    """The PPFL layer the enclave trains (module docstring): begin, seal, average, release."""

    def __init__(self) -> None:
        self.stage: int | None = None
        self.theta: np.ndarray | None = None
        self.kept: np.ndarray | None = None
        self.last_round = -1
        self._round: int | None = None
        self._sum: np.ndarray | None = None
        self._weight = 0.0

    @property
    def resident_bytes(self) -> int:
        """Bytes of the layer in training, any kept tail, and a round's running sum."""
        return sum(a.nbytes for a in (self.theta, self.kept, self._sum) if a is not None)

    def begin(
        self, stage: int, specs: Sequence[ParamSpec], seed: int, initial: np.ndarray | None = None
    ) -> int:
        """Initialise ``theta_l`` of ``stage`` inside (from ``initial``, public values, when given: one
        finite float32 value per spec value); returns its number of values."""
        if self.stage is not None and stage <= self.stage:
            raise ValidationError(
                f"layer stage {stage} does not follow stage {self.stage}: stages only advance"
            )
        total = sum(s.size for s in specs)
        if not specs or total > MAX_SPEC_PARAMS:
            raise ValidationError(f"a layer of {total} values: need 1 to {MAX_SPEC_PARAMS}")
        if initial is not None and (initial.shape != (total,) or not np.isfinite(initial).all()):
            raise ValidationError(
                f"initial values of shape {initial.shape} for a layer of {total} values: need {total} "
                "finite values"
            )
        self.stage = stage
        self.theta = (
            initialise(specs, np.random.default_rng([seed, stage]))
            if initial is None
            else initial.astype(np.float32, copy=True)
        )
        self.kept = None
        return total

    def current(self, stage: int) -> np.ndarray:
        """``theta_l`` of ``stage`` (the stage must be the one in training)."""
        if self.theta is None or self.stage != stage:
            raise ValidationError(
                f"layer stage {stage} is not in training (the enclave holds stage {self.stage})"
            )
        return self.theta

    def check_round(self, rnd: int) -> None:
        """Rounds only advance over the whole run, so no record is valid in two rounds."""
        if rnd <= self.last_round:
            raise ValidationError(f"round {rnd} is not after round {self.last_round}: rounds only advance")

    def average(
        self,
        stage: int,
        rnd: int,
        updates: Mapping[str, np.ndarray],
        num_samples: Mapping[str, int],
        *,
        weighted: bool,
        final: bool = True,
        max_norm: float = DEFAULT_MAX_UPLOAD_NORM,
    ) -> tuple[dict[str, str], float | None]:
        """Fold the valid ``updates`` (each ``theta_l^(j)`` then the client's mean loss) into round
        ``rnd``'s running sum; with ``final``, replace ``theta_l`` by the average (``1 / size(J)``, or
        weighted by ``num_samples``) of every update folded this round. An update of the wrong size, not
        finite, or whose change to ``theta_l`` has an L2 norm above ``max_norm``
        (:func:`~fedveil.enclave.aggregate.check_upload`, as for FedAvg uploads) is rejected. A round may
        come in several requests (the enclave's memory bounds one request); the sum is kept in float64
        between them.
        Returns the rejected clients with reasons, and (when ``final``) the clients' mean loss, ``None``
        if no update was valid (``theta_l`` is then unchanged)."""
        theta = self.current(stage)
        self.check_round(rnd)
        if self._round != rnd:
            self._round, self._sum, self._weight = rnd, None, 0.0
        rejected: dict[str, str] = {}
        for cid, values in updates.items():
            if values.shape != (theta.size + 1,):
                rejected[cid] = (
                    f"ValidationError: update of {values.shape[0]} values, expected {theta.size + 1}"
                )
            elif not np.isfinite(values).all():
                rejected[cid] = "ValidationError: update contains NaN or infinity"
            elif (why := _refusal(values[:-1], max_norm, theta)) is not None:
                rejected[cid] = why
            else:
                weight = float(num_samples[cid]) if weighted else 1.0
                if self._sum is None:
                    self._sum = np.zeros(theta.size + 1, dtype=np.float64)
                self._sum += weight * values
                self._weight += weight
        if not final:
            return rejected, None
        total, weight = self._sum, self._weight
        self._round, self._sum, self._weight = None, None, 0.0
        if total is None:
            return rejected, None
        total /= weight
        self.theta = total[:-1].astype(np.float32)
        self.last_round = rnd
        return rejected, float(total[-1])

    def seal(self, stage: int, rnd: int, secret: bytes, measurement: bytes) -> bytes:
        """The state of ``stage`` in training after round ``rnd``, sealed (module docstring)."""
        theta = self.current(stage)
        header = {"stage": stage, "round": rnd, "last_round": self.last_round}
        nonce = os.urandom(_SEAL_NONCE_BYTES)
        sealed = AESGCM(sealing_key(secret, measurement)).encrypt(
            nonce, pack_frame(header, [encode_array(theta)]), _seal_context(stage, rnd, measurement)
        )
        return SEAL_MAGIC + measurement + nonce + sealed

    def unseal(self, stage: int, rnd: int, secret: bytes, measurement: bytes, blob: bytes) -> int:
        """Continue ``stage`` from the state :meth:`seal` sealed after round ``rnd`` (on this enclave's
        ``measurement``, under ``secret``); returns its number of values. The enclave must hold no later
        stage; a blob of another measurement, round or secret, or changed, is a :class:`ValidationError`."""
        head = len(SEAL_MAGIC) + 32 + _SEAL_NONCE_BYTES
        if len(blob) < head or blob[: len(SEAL_MAGIC)] != SEAL_MAGIC:
            raise ValidationError(f"a sealed layer starts with {SEAL_MAGIC!r}: this blob is not one")
        theirs = blob[len(SEAL_MAGIC) : len(SEAL_MAGIC) + 32]
        if theirs != measurement:
            raise ValidationError(
                f"the layer was sealed by an enclave of measurement {theirs.hex()}, this enclave is "
                f"{measurement.hex()}: a changed enclave cannot unseal it; resume with the enclave code and "
                "config that sealed it, or start afresh with --overwrite"
            )
        try:
            plain = AESGCM(sealing_key(secret, measurement)).decrypt(
                blob[head - _SEAL_NONCE_BYTES : head], blob[head:], _seal_context(stage, rnd, measurement)
            )
        except InvalidTag:
            raise ValidationError(
                f"the sealed layer of stage {stage} after round {rnd} fails authentication: it was changed, "
                "sealed after another round, or under another run directory's sealing.key"
            ) from None
        header, blobs = unpack_frame(plain)
        if self.stage is not None and stage <= self.stage:
            raise ValidationError(
                f"layer stage {stage} does not follow stage {self.stage}: stages only advance"
            )
        self.stage = stage
        self.theta = np.array(decode_array(blobs[0], dtype="<f4", ndim=1))
        self.last_round = int(header["last_round"])
        self.kept = None
        return int(self.theta.size)

    def release(self, stage: int, keep: int) -> np.ndarray:
        """End ``stage``: return ``theta_l^0`` for the REE, all but its last ``keep`` values, which stay
        inside (PPFL Sec. 4.1)."""
        theta = self.current(stage)
        if not 0 <= keep <= theta.size:
            raise ValidationError(f"keep {keep} values of a layer of {theta.size}")
        self.kept = theta[theta.size - keep :].copy() if keep else None
        self.theta = None
        return theta[: theta.size - keep].copy()


def _seal_context(stage: int, rnd: int, measurement: bytes) -> bytes:
    """What a sealed layer is authenticated with besides its contents."""
    return SEAL_INFO + measurement + canonical_json({"round": rnd, "stage": stage})


def _refusal(values: np.ndarray, max_norm: float, theta: np.ndarray) -> str | None:
    """Why an update of ``theta`` is refused by the norm bound, or None."""
    try:
        check_upload(values, max_norm, reference=theta, what="update")
    except ValidationError as exc:
        return f"ValidationError: {exc}"
    return None
