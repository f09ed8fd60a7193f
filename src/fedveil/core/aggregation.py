"""Pure aggregation functions of the untrusted server (FedAvg).

The FDML enclave has its own Eq. 2 aggregation (:mod:`fedveil.enclave.aggregate`): the trusted
computing base must not depend on code outside the enclave package, so the two stay separate.
"""

from __future__ import annotations

import functools
import itertools
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
    total = float(sum(weights.values()))
    if total <= 0 or any(w <= 0 for w in weights.values()):
        raise ValidationError(f"weights must be positive, got {sorted(weights.values())[:3]}...")
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
            t = terms[v.dtype][: hi - lo]
            np.multiply(v[lo:hi], w, out=t)
            s += t
        out[lo:hi] = s


@functools.cache
def _pool(workers: int, pid: int) -> ThreadPoolExecutor:
    """One pool of ``workers`` threads per size and process, kept for the process's life (a forked child
    has none of its parent's threads, so it makes its own: keyed by ``pid``)."""
    return ThreadPoolExecutor(workers, thread_name_prefix="fedavg-average")
