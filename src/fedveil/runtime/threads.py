"""Thread settings of the host process: numpy's BLAS pool, set on purpose, and what torch uses.

numpy's matrix products (FDML Alg. 1 and Eq. 2 when the host runs them in its own process, the
verification metrics) go to the BLAS library numpy loaded (OpenBLAS in the wheels). Left alone, OpenBLAS
starts one worker thread per core; on a machine whose cores are busy with other work those workers spin
and make Alg. 1 several times slower in CPU time. The enclave process runs its BLAS on one thread
(:data:`fedveil.runtime.enclave_host.ENCLAVE_ENV`), as an SGX enclave with one TCS would; the host does
the same by default: :func:`blas_threads` limits the BLAS pools for the duration of a ``with`` block
(the ``fedveil`` command runs every subcommand inside one), to :data:`DEFAULT_BLAS_THREADS`, or to
``FEDVEIL_BLAS_THREADS`` when that variable is set.

Only the BLAS pools are limited. torch's intra-op threads (its own OpenMP pool) follow each run's
``threads`` setting through :func:`torch.set_num_threads`, as before. :func:`thread_settings` reports
both, for the benchmarks to record beside their numbers.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy  # noqa: F401  (loads numpy's BLAS library, so that it is among the pools limited)
from threadpoolctl import threadpool_info, threadpool_limits

from fedveil.errors import ConfigError

__all__ = [
    "BLAS_THREADS_ENV",
    "DEFAULT_BLAS_THREADS",
    "blas_threads",
    "configured_blas_threads",
    "thread_settings",
]

DEFAULT_BLAS_THREADS = 1
"""BLAS threads of numpy's kernels in the host unless ``FEDVEIL_BLAS_THREADS`` says otherwise."""

BLAS_THREADS_ENV = "FEDVEIL_BLAS_THREADS"
"""Environment variable that overrides :data:`DEFAULT_BLAS_THREADS` (a positive integer)."""

_ENV_KEYS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", BLAS_THREADS_ENV)


def configured_blas_threads() -> int:
    """The BLAS thread count the host uses: ``FEDVEIL_BLAS_THREADS`` if set, else
    :data:`DEFAULT_BLAS_THREADS`; :class:`~fedveil.errors.ConfigError` for a value that is no positive
    integer."""
    text = os.environ.get(BLAS_THREADS_ENV)
    if text is None:
        return DEFAULT_BLAS_THREADS
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{BLAS_THREADS_ENV}={text!r} must be a positive integer, e.g. 1")
    return value


@contextmanager
def blas_threads(limit: int | None = None) -> Iterator[int]:
    """Limit the BLAS pools of the loaded libraries (numpy's, imported here first) to ``limit`` threads
    (``None``: :func:`configured_blas_threads`) inside the block, restoring them after; yields the
    limit."""
    threads = configured_blas_threads() if limit is None else limit
    if threads < 1:
        raise ConfigError(f"BLAS threads {threads!r} must be >= 1")
    with threadpool_limits(limits=threads, user_api="blas"):
        yield threads


def thread_settings() -> dict[str, Any]:
    """The thread settings in effect now: ``blas`` (each loaded BLAS library's name and threads),
    ``openmp`` (likewise; torch's own pool), ``torch_threads`` (:func:`torch.get_num_threads`, ``None``
    when torch is not imported), ``cpu_count`` and the thread variables of the environment."""
    pools = threadpool_info()
    torch = sys.modules.get("torch")
    return {
        "blas": [
            {"library": p["internal_api"], "prefix": p["prefix"], "threads": p["num_threads"]}
            for p in pools
            if p["user_api"] == "blas"
        ],
        "openmp": [
            {"prefix": p["prefix"], "threads": p["num_threads"]} for p in pools if p["user_api"] == "openmp"
        ],
        "torch_threads": None if torch is None else torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "env": {key: os.environ.get(key) for key in _ENV_KEYS},
    }
