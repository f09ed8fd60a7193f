"""The heap-retaining malloc setting: accepted by glibc (this project's Linux machines), a harmless no-op
elsewhere, and handed to the enclave process through glibc's environment tunables."""

from __future__ import annotations

import platform

import numpy as np

from fedveil.core.heap import HEAP_RETAINING_ENV, RETAIN_BYTES, retain_freed_memory
from fedveil.runtime.enclave_host import ENCLAVE_ENV


def test_glibc_accepts_the_setting_and_large_buffers_still_work() -> None:
    accepted = retain_freed_memory()
    assert accepted is (platform.libc_ver()[0] == "glibc")
    for _ in range(3):  # buffers freed and allocated again, as a round does
        buf = np.ones(4 * 2**20, np.float32)
        assert float(buf.sum()) == 4 * 2**20
        del buf


def test_the_enclave_process_gets_the_same_setting() -> None:
    assert {
        "MALLOC_MMAP_THRESHOLD_": str(RETAIN_BYTES),
        "MALLOC_TRIM_THRESHOLD_": str(RETAIN_BYTES),
    } == HEAP_RETAINING_ENV
    assert HEAP_RETAINING_ENV.items() <= ENCLAVE_ENV.items()
    assert ENCLAVE_ENV["OPENBLAS_NUM_THREADS"] == "1"
