"""Benchmark: the wire codec's throughput on the largest FDML message (a TouchAuth gradient)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from fedveil.core import codec
from fedveil.protocols.messages import GradReply


def bench_codec(*, elements: int = 337_280, repeats: int = 200, seed: int = 0) -> dict[str, Any]:
    """Median encode, decode and round-trip seconds of a ``GradReply`` with ``elements`` float32
    (default: the TouchAuth net's parameter count), and the implied GB/s of payload."""
    rng = np.random.default_rng(seed)
    msg = GradReply(1, 1, 8, rng.standard_normal(elements).astype(np.float32))
    data = codec.encode(msg)
    enc, dec = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        data = codec.encode(msg)
        t1 = time.perf_counter()
        codec.decode(data, expected=GradReply)
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    e, d = statistics.median(enc), statistics.median(dec)
    payload = elements * 4
    return {
        "message": "fdml.grad_reply",
        "elements": elements,
        "wire_bytes": len(data),
        "overhead_bytes": len(data) - payload,
        "encode_seconds": e,
        "decode_seconds": d,
        "round_trip_seconds": e + d,
        "round_trip_gb_per_s": payload / (e + d) / 1e9,
        "repeats": repeats,
    }
