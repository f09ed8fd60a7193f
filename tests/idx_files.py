"""Test fixtures in the IDX format (MNIST's, Fashion-MNIST's and EMNIST's published file layout)."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

IDX_CODES = {np.dtype("u1"): 0x08, np.dtype("i1"): 0x09, np.dtype("i2"): 0x0B, np.dtype("i4"): 0x0C}
IDX_CODES |= {np.dtype("f4"): 0x0D, np.dtype("f8"): 0x0E}


def write_idx(path: Path, array: np.ndarray, *, compress: bool = False) -> Path:
    """The IDX format: 0, 0, type byte, ndim, big-endian uint32 dims, big-endian values."""
    header = bytes([0, 0, IDX_CODES[array.dtype], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    body = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    path.write_bytes(gzip.compress(body) if compress else body)
    return path
