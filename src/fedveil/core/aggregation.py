"""Pure aggregation functions of the untrusted server (FedAvg).

The FDML enclave has its own Eq. 2 aggregation (:mod:`fedveil.enclave.aggregate`): the trusted
computing base must not depend on code outside the enclave package, so the two stay separate.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fedveil.errors import ValidationError

BLOCK = 32768
"""Coordinates averaged per pass over the vectors (256 KiB of float64: the running sum and the product stay
in cache while each vector's block is read once)."""


def weighted_average(
    vectors: Mapping[str, np.ndarray], weights: Mapping[str, float], *, workers: int = 1
) -> np.ndarray:
    """FedAvg (McMahan et al. 2017, Alg. 1): ``sum_k (n_k / n) w_k`` over the clients that replied.

    ``vectors`` maps a client to its flat float32 parameters (all the same shape), ``weights`` to
    its number of samples ``n_k`` > 0. Accumulates in float64, returns float32. ``workers`` > 1 splits
    the coordinates among that many threads (numpy releases the GIL in its loops); every coordinate
    sees the same operations in the same order, so the result is the same bits.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValidationError(f"workers {workers!r} must be an integer >= 1")
    if not vectors:
        raise ValidationError("weighted_average of no vectors: at least one client must reply")
    if set(vectors) != set(weights):
        raise ValidationError("vectors and weights name different clients")
    for cid, w in weights.items():
        _check_weight(cid, w)
    total = float(sum(weights.values()))
    shape = next(iter(vectors.values())).shape
    for cid, v in vectors.items():
        if v.shape != shape:
            raise ValidationError(f"client {cid}: vector of shape {v.shape}, expected {shape}")
    flat = [(v.reshape(-1), weights[cid] / total) for cid, v in vectors.items()]
    size = flat[0][0].shape[0]
    out = np.empty(size, np.float32)
    blocks = -(-size // BLOCK)
    workers = min(workers, blocks)
    if workers == 1:
        _average_range(flat, out, 0, size)
    else:
        cuts = [min(size, blocks * i // workers * BLOCK) for i in range(workers + 1)]
        pool = _pool(workers, os.getpid())
        parts = [pool.submit(_average_range, flat, out, lo, hi) for lo, hi in itertools.pairwise(cuts)]
        for part in parts:
            part.result()
    return out.reshape(shape)


def _average_range(flat: list[tuple[np.ndarray, float]], out: np.ndarray, start: int, stop: int) -> None:
    """``out[start:stop] = sum_k f_k v_k[start:stop]`` for ``(v_k, f_k)`` in ``flat``, a cache-sized block
    of every vector at a time."""
    block = min(stop - start, BLOCK)
    acc = np.empty(block, np.float64)
    # the product in the vector's own dtype (a Python float times a float32 array is float32), as
    # ``(n_k / n) * w_k`` computes it; the sum in float64
    terms = {v.dtype: np.empty(block, np.result_type(v.dtype, 1.0)) for v, _ in flat}
    for lo in range(start, stop, BLOCK):
        # each coordinate sees the same operations in the same order as ``acc += (n_k / n) * w_k`` over
        # whole vectors, so the result is bit-identical
        hi = min(stop, lo + BLOCK)
        s = acc[: hi - lo]
        s.fill(0.0)
        for v, w in flat:
            _accumulate(s, v[lo:hi], w, terms[v.dtype][: hi - lo])
        out[lo:hi] = s


def _accumulate(acc: np.ndarray, v: np.ndarray, scale: float, term: np.ndarray) -> None:
    """``acc += scale * v``, the product computed in ``term``'s dtype (into ``term``), the sum in ``acc``'s:
    the one step of both :func:`weighted_average` and :class:`FedAvgSum`."""
    np.multiply(v, scale, out=term, dtype=term.dtype)
    acc += term


class FedAvgSum:
    """FedAvg (McMahan et al. 2017, Alg. 1) folded in as the uploads arrive: ``sum_k n_k w_k / n``.

    A running float64 sum of ``n_k * w_k`` (each product in float64: exact for integer ``n_k`` below
    2**29, as ``w_k`` is float32) and of ``n = sum_k n_k``, so the server holds one float64 vector
    however many clients reply, instead of every upload until the last arrived (:func:`weighted_average`).
    :meth:`add` checks an upload's shape, its sample count and that it is finite (one pass over it) before
    it touches the sum, so a refused upload changes nothing; :meth:`result` divides once and rounds once
    to float32.

    Tolerance, per coordinate, with ``S = sum_k (n_k / n) |w_k|`` and ``K`` uploads: the result is the
    float64 weighted mean, summed in the order the uploads were added, rounded once to float32. Against the
    exact mean (a float64 numpy reference) it is off by at most half a float32 ulp of the result plus
    ``K * 2**-52 * S`` (the float64 sum's rounding). Against :func:`weighted_average`, which rounds each
    ``(n_k / n) w_k`` to float32 before its float64 sum, it differs by at most one float32 ulp plus
    ``2**-23 * S``: one or two ulps of the result where the uploads share a sign, more only where they
    cancel (this sum is then the closer of the two). Two orders of adding the same uploads agree to the
    float64 rounding, so their float32 results differ, rarely, by one ulp.
    """

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = tuple(shape)
        self._sum = np.zeros(int(np.prod(self.shape, dtype=np.int64)), np.float64)
        self._term = np.empty(min(self._sum.shape[0], BLOCK), np.float64)
        self.total = 0.0
        self.count = 0

    def add(self, cid: str, vector: np.ndarray, num_samples: float) -> None:
        """Fold in client ``cid``'s upload ``vector`` (``shape``, float32) of ``num_samples`` > 0 samples;
        raises :class:`~fedveil.errors.ValidationError` (and adds nothing) for a wrong shape, a sample
        count that is not positive and finite, or a non-finite entry."""
        if vector.shape != self.shape:
            raise ValidationError(f"client {cid}: vector of shape {vector.shape}, expected {self.shape}")
        _check_weight(cid, num_samples)
        flat = vector.reshape(-1)
        if not np.isfinite(flat).all():
            raise ValidationError(
                f"client {cid}: the upload has NaN or infinite entries; leave the client out"
            )
        scale = float(num_samples)
        for lo in range(0, flat.shape[0], BLOCK):
            hi = min(flat.shape[0], lo + BLOCK)
            _accumulate(self._sum[lo:hi], flat[lo:hi], scale, self._term[: hi - lo])
        self.total += scale
        self.count += 1

    def result(self) -> np.ndarray:
        """The weighted mean so far, float32 of ``shape``; at least one upload must have been added."""
        if self.count == 0:
            raise ValidationError("FedAvgSum of no uploads: at least one client must reply")
        return (self._sum / self.total).astype(np.float32).reshape(self.shape)


def _check_weight(cid: str, weight: float) -> None:
    """A sample weight must be a finite number > 0."""
    if not (math.isfinite(weight) and weight > 0):
        raise ValidationError(
            f"client {cid}: weight {weight!r} must be a finite positive number (its sample count)"
        )


@functools.cache
def _pool(workers: int, pid: int) -> ThreadPoolExecutor:
    """One pool of ``workers`` threads per size and process, kept for the process's life (a forked child
    has none of its parent's threads, so it makes its own: keyed by ``pid``)."""
    return ThreadPoolExecutor(workers, thread_name_prefix="fedavg-average")
