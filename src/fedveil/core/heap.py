"""Keep freed memory in the process heap, so that each round reuses the last round's pages.

A round of FDML moves many large buffers: 64 sealed gradients of 1.35 MB, their plaintexts, the codec's byte
strings, and an 86 MB request to the enclave. glibc's malloc serves every allocation above its mmap threshold
(128 KiB at first, adapting up to 32 MiB) with fresh pages from the kernel and returns them on free. Each new
buffer then page-faults its way in: about 330 faults, each zeroing a page, per 1.35 MB, tens of thousands per
round. Raising the mmap and trim thresholds keeps such buffers in the heap, where the next round finds them
already mapped. Side by side, the host's setting took FDML from 2.6 to 3.7 rounds/s (``python
benchmarks/fdml_rounds_ablation.py``, docs/benchmarks.md). Image FedAvg's clients are the same story at a
smaller scale: each LeNet client of ``fedveil bench peers`` (1.26M parameters) allocates and frees its
5 MB vectors at every step, and faulted thousands of pages in per client without the setting, none with
it. The cost is that the process keeps its peak heap: its resident size does not fall back after a
round. So the processes that train turn it on: every training command of the ``fedveil`` command
(:data:`fedveil.cli.TRAINING_COMMANDS`: ``run``, ``reproduce``, each system's runs, ``attack``, ``bench``,
``server``, ``agent``), the library's :func:`fedveil.experiments.fdml.runner.run_experiment` and
``fedveil bench rounds`` when called from Python, and the enclave process.

Only glibc has these knobs. Elsewhere this is a no-op, and nothing depends on it but speed.
"""

from __future__ import annotations

import ctypes

__all__ = ["HEAP_RETAINING_ENV", "RETAIN_BYTES", "retain_freed_memory"]

RETAIN_BYTES = 2**30
"""Allocations up to this size come from, and return to, the heap (glibc may cap it lower)."""

HEAP_RETAINING_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(RETAIN_BYTES),
    "MALLOC_TRIM_THRESHOLD_": str(RETAIN_BYTES),
}
"""The same setting for a child process, through glibc's environment tunables (read at its start)."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def retain_freed_memory() -> bool:
    """Raise this process's mmap and trim thresholds to :data:`RETAIN_BYTES` (module docstring); whether
    glibc accepted both."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the interpreter is linked with
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, RETAIN_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, RETAIN_BYTES))
