"""Pure aggregation functions of the untrusted server (FedAvg).

The FDML enclave has its own Eq. 2 aggregation (:mod:`fedveil.enclave.aggregate`): the trusted
computing base must not depend on code outside the enclave package, so the two stay separate.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedveil.errors import ValidationError

BLOCK = 32768
"""Coordinates averaged per pass over the vectors (256 KiB of float64: the running sum and the product stay
in cache while each vector's block is read once)."""


def weighted_average(vectors: Mapping[str, np.ndarray], weights: Mapping[str, float]) -> np.ndarray:
    """FedAvg (McMahan et al. 2017, Alg. 1): ``sum_k (n_k / n) w_k`` over the clients that replied.

    ``vectors`` maps a client to its flat float32 parameters (all the same shape), ``weights`` to
    its number of samples ``n_k`` > 0. Accumulates in float64, returns float32.
    """
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
    block = min(size, BLOCK)
    out = np.empty(size, np.float32)
    acc = np.empty(block, np.float64)
    # the product in the vector's own dtype (a Python float times a float32 array is float32), as
    # ``(n_k / n) * w_k`` computes it; the sum in float64
    terms = {v.dtype: np.empty(block, np.result_type(v.dtype, 1.0)) for v, _ in flat}
    for lo in range(0, size, BLOCK):
        # a cache-sized block of every vector at a time; each coordinate sees the same operations in the
        # same order as ``acc += (n_k / n) * w_k`` over whole vectors, so the result is bit-identical
        hi = min(size, lo + BLOCK)
        s = acc[: hi - lo]
        s.fill(0.0)
        for v, w in flat:
            t = terms[v.dtype][: hi - lo]
            np.multiply(v[lo:hi], w, out=t)
            s += t
        out[lo:hi] = s
    return out.reshape(shape)
