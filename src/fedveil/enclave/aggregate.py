"""Gradient aggregation inside the enclave: Eq. (2) of FDML (Sec. IV, step 9).

``G = sum_i |d_i| / |D| * g_i`` over the participants ``i`` whose local gradients arrived, where
``|d_i|`` is participant ``i``'s number of training samples and ``|D| = sum_i |d_i|`` (over the same
participants, so the weights sum to one even when some dropped out).

It is computed as ``(sum_i |d_i| g_i) / |D|``: a float64 sum of the count-weighted gradients, divided once
at the end. For float32 gradients each term ``|d_i| g_i`` is exact in float64 (a 24-bit significand times
an integer below 2**29), so the only roundings are the float64 additions, in the participants' order, and
the final division and cast. The sum can therefore be fed in batches (:class:`GradientSum`): however the
participants are cut into batches, the same participants in the same order give the same bits. That lets
the enclave take step 9 in requests of any size while the uploads still arrive.

**One upload's reach.** Eq. 2 gives every participant a say in proportion to its sample count, so one
finite but absurd gradient (say 3e38 in every coordinate) would dominate the aggregate and, through
Adam's second moment (which it makes infinite), stop every later update of the network. Before it is
aggregated, each upload is checked by :func:`check_upload`: one whose values are not all finite or whose
L2 norm exceeds ``max_upload_norm`` is refused (a dropout with its reason), never clipped, so an honest
upload is aggregated unchanged. The FDML server (plain and in the enclave) and the FedAvg engine share
this check and the default bound :data:`DEFAULT_MAX_UPLOAD_NORM`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import numpy as np

from fedveil.errors import ConfigError, ValidationError

__all__ = [
    "BLOCK",
    "DEFAULT_MAX_UPLOAD_NORM",
    "GradientSum",
    "aggregate_gradients",
    "check_max_upload_norm",
    "check_upload",
    "upload_norm",
]

BLOCK = 32768
"""Coordinates summed per pass over a batch's gradients (256 KiB of float64: the product stays in cache
while each gradient's block is read once)."""

DEFAULT_MAX_UPLOAD_NORM = 1e6
"""The default bound on one upload's L2 norm (an FDML local gradient; a FedAvg client's change to the
weights it was sent): generous, orders of magnitude above any honest upload of fedveil's models, yet
small enough that Adam's moments and a sample-weighted mean stay finite whatever one device sends."""

MAX_COUNT = 2**29 - 1
"""The largest sample count ``|d_i|``: below 2**29 a float32 value times the count is exact in float64."""


class GradientSum:
    """Eq. (2) fed one batch of participants at a time: the float64 sum of ``|d_i| g_i`` and of ``|d_i|``.

    :meth:`add` folds a batch in, in the batch's order; :meth:`mean` is ``G``. The result depends on the
    participants and their order only, not on how they were cut into batches (module docstring). After
    :meth:`add` raises for a non-finite value, the sum is unusable (it may hold part of that batch).
    """

    def __init__(self) -> None:
        self.total = 0
        self.size: int | None = None
        self._sum: np.ndarray | None = None
        self._broken = False

    @property
    def nbytes(self) -> int:
        """Heap the running sum holds (its float64 accumulator)."""
        return 0 if self._sum is None else self._sum.nbytes

    def add(self, gradients: Mapping[str, np.ndarray], num_samples: Mapping[str, int]) -> None:
        """Fold ``gradients`` (participant -> flat real float ``(P,)``, one shape for every batch, finite)
        weighted by ``num_samples`` (the same participants -> positive int below 2**29) into the sum.
        Raises :class:`~fedveil.errors.ValidationError` naming the participant for an empty batch,
        mismatched keys, shapes or dtypes, non-finite values, or counts that are not positive integers."""
        if self._broken:
            raise ValidationError("this Eq. 2 sum was left unusable by an earlier non-finite gradient")
        if not gradients:
            raise ValidationError("no gradients to aggregate: Eq. (2) needs at least one participant")
        if set(gradients) != set(num_samples):
            missing = sorted(set(gradients) - set(num_samples))
            extra = sorted(set(num_samples) - set(gradients))
            raise ValidationError(
                f"gradients and num_samples must name the same participants; no count for {missing}, "
                f"no gradient for {extra}"
            )
        shape = None if self.size is None else (self.size,)
        counts = []
        for cid, grad in gradients.items():
            count = num_samples[cid]
            if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count <= 0:
                raise ValidationError(f"num_samples[{cid!r}] = {count!r}; it must be a positive int")
            if count > MAX_COUNT:
                raise ValidationError(f"num_samples[{cid!r}] = {count}; at most {MAX_COUNT} are supported")
            counts.append(int(count))
            if not isinstance(grad, np.ndarray) or grad.dtype.kind != "f":
                kind = grad.dtype if isinstance(grad, np.ndarray) else type(grad).__name__
                raise ValidationError(f"gradient of {cid!r} is {kind}; it must be a float numpy array")
            if grad.ndim != 1 or (shape is not None and grad.shape != shape):
                want = "a flat (P,) vector" if shape is None else f"shape {shape} like the others"
                raise ValidationError(f"gradient of {cid!r} has shape {grad.shape}; it must be {want}")
            shape = grad.shape
        size = shape[0]  # type: ignore[index]
        if self._sum is None:
            self.size = size
            self._sum = np.zeros(size, np.float64)
        terms = [(grad, np.float64(count)) for grad, count in zip(gradients.values(), counts, strict=True)]
        term = np.empty(min(size, BLOCK), np.float64)
        finite = True
        for lo in range(0, size, BLOCK):
            # one cache-sized block of every gradient at a time; each coordinate sees the same operations in
            # the same order as a sum over whole vectors, so the result is bit-identical to it
            hi = min(size, lo + BLOCK)
            s, t = self._sum[lo:hi], term[: hi - lo]
            for grad, weight in terms:
                np.multiply(grad[lo:hi], weight, out=t)
                s += t
            finite = finite and bool(np.isfinite(s).all())
        self.total += sum(counts)
        if not finite:
            self._broken = True
            # a sum of finite float32 terms is finite, so some input holds NaN or inf: name the first
            for cid, grad in gradients.items():
                if not np.isfinite(grad).all():
                    raise ValidationError(f"gradient of {cid!r} holds NaN or inf")
            raise ValidationError("the weighted gradients overflow float64: they are far too large")

    def mean(self) -> np.ndarray:
        """``G`` of every participant added so far, as float32 ``(P,)``."""
        if self._sum is None or self._broken:
            raise ValidationError("no gradients to aggregate: Eq. (2) needs at least one participant")
        out = np.empty(self._sum.shape[0], np.float32)
        term = np.empty(min(out.shape[0], BLOCK), np.float64)
        for lo in range(0, out.shape[0], BLOCK):
            hi = min(out.shape[0], lo + BLOCK)
            np.divide(self._sum[lo:hi], self.total, out=term[: hi - lo])
            out[lo:hi] = term[: hi - lo]
        return out


def aggregate_gradients(gradients: Mapping[str, np.ndarray], num_samples: Mapping[str, int]) -> np.ndarray:
    """Eq. (2) of FDML: the sample-weighted mean of flat gradients ``(P,)``, returned as float32 ``(P,)``.

    ``gradients`` maps each participant to its local gradient (any real float dtype, one shared shape
    ``(P,)``, finite); ``num_samples`` maps the same participants to their positive sample counts
    ``|d_i|``. One batch of :class:`GradientSum`; raises as its :meth:`GradientSum.add` does.
    """
    acc = GradientSum()
    acc.add(gradients, num_samples)
    return acc.mean()


def check_max_upload_norm(max_norm: float) -> float:
    """``max_norm`` as a float if it is a finite number > 0, else :class:`~fedveil.errors.ConfigError`."""
    real = isinstance(max_norm, numbers.Real) and not isinstance(max_norm, bool)
    if not (real and math.isfinite(max_norm) and max_norm > 0):
        raise ConfigError(
            f"max_upload_norm {max_norm!r} must be a finite number > 0 (the default, "
            f"{DEFAULT_MAX_UPLOAD_NORM:g}, is far above any honest update)"
        )
    return float(max_norm)


def upload_norm(values: np.ndarray, reference: np.ndarray | None = None) -> float:
    """The L2 norm of flat ``values - reference`` (of ``values`` when ``reference`` is None), summed in
    float64 one :data:`BLOCK` at a time (no float64 copy of the whole vector; float32 values up to their
    largest cannot overflow it). NaN or infinity when a value is not finite."""
    total = 0.0
    for lo in range(0, values.shape[0], BLOCK):
        part = values[lo : lo + BLOCK].astype(np.float64)
        if reference is not None:
            part -= reference[lo : lo + BLOCK]
        total += float(np.dot(part, part))
    return math.sqrt(total)


def check_upload(
    values: np.ndarray, max_norm: float, *, reference: np.ndarray | None = None, what: str = "gradient"
) -> None:
    """Refuse one upload before it is aggregated (module docstring): :class:`ValidationError` naming
    ``what`` when flat ``values`` hold NaN or infinity, or when the L2 norm of ``values - reference``
    (:func:`upload_norm`) exceeds ``max_norm``. An upload whose norm in its own precision is finite and
    at most half the bound (every honest one) passes on that one pass; the rest are decided on the exact
    float64 norm, so rounding never decides a refusal."""
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow here only sends it to the exact norm
        quick = float(np.linalg.norm(values if reference is None else values - reference))
    if math.isfinite(quick) and quick <= max_norm / 2:
        return
    norm = upload_norm(values, reference)
    if not math.isfinite(norm):
        raise ValidationError(f"{what} holds NaN or infinity")
    if norm > max_norm:
        raise ValidationError(
            f"{what} of L2 norm {norm:.3g} exceeds max_upload_norm {max_norm:.3g}; refused (raise "
            "max_upload_norm if honest updates reach it)"
        )
