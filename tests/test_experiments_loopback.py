"""Loopback measurement helpers (:mod:`fedveil.experiments.loopback`): percentiles, a throw-away PKI,
waiting for agents."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from fedveil.errors import ConfigError
from fedveil.experiments.loopback import percentiles, throwaway_pki, wait_connected


def test_percentiles_of_known_values() -> None:
    values = [float(v) for v in range(1, 101)]
    got = percentiles(values)
    assert got == pytest.approx({"p50": 50.5, "p95": 95.05, "p99": 99.01, "max": 100.0})
    assert percentiles(values, [("p10", 10.0)]) == pytest.approx({"p10": 10.9})
    assert percentiles([]) == {}


def test_a_throwaway_pki_issues_one_certificate_per_device(tmp_path: Path) -> None:
    pki, devices, seconds = throwaway_pki(tmp_path, ["d0", "d1"])
    assert pki == tmp_path / "pki" and devices == tmp_path / "devices" and seconds >= 0
    for name in ("d0", "d1"):
        assert {"device.crt", "device.key", "ca.crt"} <= {p.name for p in (devices / name).iterdir()}


class _Runtime:
    def __init__(self, connected: list[str]) -> None:
        self.connected = connected

    async def wait_for_devices(self, devices: int, timeout: float) -> list[str]:
        return self.connected


def test_waiting_for_agents_names_how_many_came() -> None:
    runtime: Any = _Runtime(["a", "b", "c"])
    assert asyncio.run(wait_connected(runtime, 3, 1.0)) >= 0
    with pytest.raises(ConfigError, match=r"only 3 of 4 agents connected in 0\.5 s"):
        asyncio.run(wait_connected(runtime, 4, 0.5))
