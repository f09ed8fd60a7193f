"""Gradient aggregation inside the enclave: Eq. (2) of FDML (000_5f3e2740eb021610.txt, Sec. IV, step 9).

``G = sum_i |d_i| / |D| * g_i`` over the participants ``i`` whose local gradients arrived, where
``|d_i|`` is participant ``i``'s number of training samples and ``|D| = sum_i |d_i|`` (over the same
participants, so the weights sum to one even when some dropped out).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedveil.errors import ValidationError

__all__ = ["BLOCK", "aggregate_gradients"]

BLOCK = 32768
"""Coordinates summed per pass over the gradients (256 KiB of float64: the sum and the product stay in
cache while each gradient's block is read once)."""


def aggregate_gradients(gradients: Mapping[str, np.ndarray], num_samples: Mapping[str, int]) -> np.ndarray:
    """Eq. (2) of FDML: the sample-weighted mean of flat gradients ``(P,)``, returned as float32 ``(P,)``.

    ``gradients`` maps each participant to its local gradient (any real float dtype, one shared shape
    ``(P,)``, finite); ``num_samples`` maps the same participants to their positive sample counts
    ``|d_i|``. Accumulates in float64. Raises :class:`~fedveil.errors.ValidationError` naming the
    participant for an empty input, mismatched keys, shapes or dtypes, non-finite values, or counts
    that are not positive integers.
    """
    if not gradients:
        raise ValidationError("no gradients to aggregate: Eq. (2) needs at least one participant")
    if set(gradients) != set(num_samples):
        missing = sorted(set(gradients) - set(num_samples))
        extra = sorted(set(num_samples) - set(gradients))
        raise ValidationError(
            f"gradients and num_samples must name the same participants; no count for {missing}, "
            f"no gradient for {extra}"
        )
    shape = None
    total = 0
    for cid, grad in gradients.items():
        count = num_samples[cid]
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count <= 0:
            raise ValidationError(f"num_samples[{cid!r}] = {count!r}; it must be a positive int")
        total += int(count)
        if not isinstance(grad, np.ndarray) or grad.dtype.kind != "f":
            kind = grad.dtype if isinstance(grad, np.ndarray) else type(grad).__name__
            raise ValidationError(f"gradient of {cid!r} is {kind}; it must be a float numpy array")
        if grad.ndim != 1 or (shape is not None and grad.shape != shape):
            want = "a flat (P,) vector" if shape is None else f"shape {shape} like the others"
            raise ValidationError(f"gradient of {cid!r} has shape {grad.shape}; it must be {want}")
        shape = grad.shape
    size = next(iter(gradients.values())).shape[0]
    weights = [(grad, np.float64(int(num_samples[cid]) / total)) for cid, grad in gradients.items()]
    out = np.empty(size, np.float32)
    acc = np.empty(min(size, BLOCK), np.float64)
    term = np.empty_like(acc)
    finite = True
    for lo in range(0, size, BLOCK):
        # one cache-sized block of every gradient at a time; each coordinate sees the same operations in
        # the same order as a sum over whole vectors, so the result is bit-identical to it
        hi = min(size, lo + BLOCK)
        s, t = acc[: hi - lo], term[: hi - lo]
        s.fill(0.0)
        for grad, w in weights:
            np.multiply(grad[lo:hi], w, out=t)
            s += t
        finite = finite and bool(np.isfinite(s).all())
        out[lo:hi] = s
    if not finite:
        # a weighted mean of finite values is finite, so some input holds NaN or inf: name the first
        for cid, grad in gradients.items():
            if not np.isfinite(grad).all():
                raise ValidationError(f"gradient of {cid!r} holds NaN or inf")
    return out
