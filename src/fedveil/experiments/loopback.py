"""Loopback deployments for measurements: a throw-away PKI, local device-agent processes, waiting for
them to connect, and latency percentiles. ``fedveil bench network`` and PoliFL's scale experiment
(:mod:`fedveil.experiments.polifl.scale`) measure with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedveil.errors import ConfigError
from fedveil.runtime.network import certs
from fedveil.runtime.network.server import NetworkRuntime

__all__ = ["PERCENTILES", "agent_processes", "percentiles", "throwaway_pki", "wait_connected"]

PERCENTILES = (("p50", 50.0), ("p95", 95.0), ("p99", 99.0), ("max", 100.0))
"""The latency percentiles the benchmark reports (name, percent)."""


def percentiles(
    values: Sequence[float], points: Sequence[tuple[str, float]] = PERCENTILES
) -> dict[str, float]:
    """``{name: percentile}`` of ``values`` for each ``(name, percent)`` of ``points`` (``{}`` when empty)."""
    if not len(values):
        return {}
    arr = np.asarray(values, dtype=float)
    return {p: float(np.percentile(arr, q)) for p, q in points}


def throwaway_pki(root: str | Path, names: Sequence[str]) -> tuple[Path, Path, float]:
    """A throw-away PKI for loopback measurements: ``root/pki`` (:func:`certs.init_pki`) and one device
    certificate per name under ``root/devices/NAME``; returns (PKI folder, devices folder, seconds spent
    issuing the device certificates)."""
    base = Path(root)
    pki = base / "pki"
    certs.init_pki(pki)
    t0 = time.perf_counter()
    for name in names:
        certs.issue_device(pki, name).write(base / "devices" / name)
    return pki, base / "devices", time.perf_counter() - t0


async def wait_connected(runtime: NetworkRuntime, devices: int, timeout: float) -> float:
    """Wait until ``devices`` agents are connected to ``runtime``; the seconds it took, or a
    :class:`ConfigError` after ``timeout`` seconds."""
    t0 = time.perf_counter()
    connected = await runtime.wait_for_devices(devices, timeout)
    if len(connected) < devices:
        raise ConfigError(f"only {len(connected)} of {devices} agents connected in {timeout:g} s")
    return time.perf_counter() - t0


@contextlib.asynccontextmanager
async def agent_processes(
    runtime: NetworkRuntime,
    commands: Sequence[Sequence[str]],
    *,
    grace: float = 30.0,
    log_dir: str | Path | None = None,
) -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """Start one agent process per command (output discarded, or stderr to ``log_dir/agent-I.log``);
    on leaving, close ``runtime`` (its final goodbye ends the agents) and wait up to ``grace`` seconds for
    each process, killing any still running."""
    procs: list[asyncio.subprocess.Process] = []
    logs: list[Any] = []
    try:
        for i, cmd in enumerate(commands):
            err: Any = asyncio.subprocess.DEVNULL
            if log_dir is not None:
                err = open(Path(log_dir) / f"agent-{i}.log", "wb")  # noqa: SIM115 - closed below
                logs.append(err)
            procs.append(
                await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.DEVNULL, stderr=err)
            )
        yield procs
    finally:
        await runtime.close()
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()
        for f in logs:
            f.close()
