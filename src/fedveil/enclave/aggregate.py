"""Gradient aggregation inside the enclave: Eq. (2) of FDML (000_5f3e2740eb021610.txt, Sec. IV, step 9).

``G = sum_i |d_i| / |D| * g_i`` over the participants ``i`` whose local gradients arrived, where
``|d_i|`` is participant ``i``'s number of training samples and ``|D| = sum_i |d_i|`` (over the same
participants, so the weights sum to one even when some dropped out).

It is computed as ``(sum_i |d_i| g_i) / |D|``: a float64 sum of the count-weighted gradients, divided once
at the end. For float32 gradients each term ``|d_i| g_i`` is exact in float64 (a 24-bit significand times
an integer below 2**29), so the only roundings are the float64 additions, in the participants' order, and
the final division and cast. The sum can therefore be fed in batches (:class:`GradientSum`): however the
participants are cut into batches, the same participants in the same order give the same bits. That lets
the enclave take step 9 in requests of any size while the uploads still arrive.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedveil.errors import ValidationError

__all__ = ["BLOCK", "GradientSum", "aggregate_gradients"]

BLOCK = 32768
"""Coordinates summed per pass over a batch's gradients (256 KiB of float64: the product stays in cache
while each gradient's block is read once)."""

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
