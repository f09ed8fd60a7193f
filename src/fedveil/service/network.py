"""Policy-enforcing device agents over the networked runtime ([PoliFL], Sec. 4.3 and Fig. 1).

**The server's device port** (:class:`DeviceNetwork`): a
:class:`~fedveil.runtime.network.server.NetworkRuntime` with mutual TLS under the service's PKI (the paper
uses a WireGuard VPN as its distribution layer; here each device has its own certificate, its id is the
certificate's name, and every stream is TLS), served on its own event-loop thread. A device that connects
is registered in the service's database (kind ``agent:<data kind>``) and appears on the dashboard, where an
administrator puts it in a group. A job then runs its stages over this port.

**The device** (:func:`device_pool`): each agent holds its user's data and its **own** policy locally and
enforces it there (Policile on the device: :class:`~fedveil.protocols.polifl.PolicyDevices`): the job's
local program runs in the sandbox on the device with time and memory limits, the device accepts the job
only if its own policy then admits ``runFL``, and what leaves it is only what the protocol sends back: a
:class:`~fedveil.protocols.polifl.JobReady` (accepted or the policy's reason) and the clipped model
updates. The model is built on the device from the job's spec by an allow-listed builder
(:func:`fedveil.experiments.polifl.runner.task_model`), for the data kind the device holds only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from fedveil.core.communicator import DeviceTiming
from fedveil.errors import ConfigError
from fedveil.models.device import resolve_device
from fedveil.privacy.pairs import DataPolicyPair
from fedveil.privacy.policy import parse

if TYPE_CHECKING:
    import torch

__all__ = ["DeviceNetwork", "device_pool", "population_data"]

log = logging.getLogger(__name__)


class DeviceNetwork:
    """The service's device port (module docstring): ``listen`` (``HOST:PORT``), the PKI directory, the
    data ``kind`` its devices hold; devices seen connected are registered in ``engine``'s database."""

    def __init__(
        self,
        engine: Engine,
        listen: str,
        pki: str | Path,
        kind: str,
        *,
        enrol_listen: str | None = None,
        heartbeat_seconds: float = 2.0,
    ) -> None:
        from fedveil.runtime.network.server import NetworkRuntime

        self.engine = engine
        self.kind = kind
        self.runtime = NetworkRuntime(
            listen, pki=pki, enrol_listen=enrol_listen, heartbeat_seconds=heartbeat_seconds
        )
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fedveil-devices", daemon=True)
        self._registered: set[str] = set()
        self._sync: asyncio.Task[None] | None = None
        self.port = 0

    def start(self) -> int:
        """Serve devices; returns the port."""
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self.runtime.start(), self.loop).result(30)

        async def sync() -> None:
            while True:
                self.register(self.runtime.available())
                await asyncio.sleep(0.25)

        self._sync = asyncio.run_coroutine_threadsafe(_task(sync()), self.loop).result(5)
        return self.port

    def stop(self) -> None:
        """Say goodbye to the devices and stop the loop."""
        if not self._thread.is_alive():
            return
        if self._sync is not None:
            self.loop.call_soon_threadsafe(self._sync.cancel)
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.runtime.close("service stopping"), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def register(self, names: Sequence[str]) -> None:
        """Record devices the first time they are seen."""
        from fedveil.service import db

        new = [n for n in names if n not in self._registered]
        if not new:
            return
        with self.engine.begin() as conn:
            known = {
                r[0] for r in conn.execute(sa.select(db.devices.c.name).where(db.devices.c.name.in_(new)))
            }
            fresh = [n for n in new if n not in known]
            if fresh:
                conn.execute(
                    db.devices.insert(),
                    [
                        {"name": n, "group_id": None, "kind": f"agent:{self.kind}", "created_at": db.now()}
                        for n in fresh
                    ],
                )
            for n in fresh:
                log.info("device %s registered", n)
        self._registered.update(new)

    def connected(self) -> list[str]:
        """The devices connected now."""
        return list(self.runtime.available())

    def network(self) -> Any:
        """What :func:`fedveil.experiments.polifl.runner.run_strategy` runs stages over."""
        from fedveil.experiments.polifl.runner import Network

        return Network(self.runtime, self.loop)

    def timings_since(self, start: int) -> list[DeviceTiming]:
        """The per-device timings recorded after the first ``start``."""
        return list(self.runtime.stats().timings[start:])


async def _task(coro: Any) -> asyncio.Task[None]:
    return asyncio.ensure_future(coro)


def device_pool(
    kind: str,
    data: dict[str, dict[str, Any]],
    policies: dict[str, str],
    *,
    seed: int = 0,
    program_seconds: float = 10.0,
    program_memory: int = 1 << 30,
    device: str | torch.device = "cpu",
) -> Any:
    """The devices an agent hosts (module docstring): each device's ``data`` (``x``, ``y`` and, for sensor
    data, ``sensor_columns``) and its own policy (paper syntax), enforcing it on the device; models are
    built only for ``kind`` data. Their DP noise shares come from the secure sampler (a deployment). They
    train on ``device`` (:func:`~fedveil.models.device.resolve_device`; the CPU by default, as a phone
    does)."""
    from fedveil.experiments.polifl.runner import TASKS, ModelSpec, task_model
    from fedveil.protocols.local import LocalOptimizer
    from fedveil.protocols.polifl import PolicyDevices

    if kind not in TASKS:
        raise ConfigError(f"data kind {kind!r} is not one of {', '.join(TASKS)}")
    missing = sorted(set(data) - set(policies))
    if missing:
        raise ConfigError(f"devices {missing[:5]} have no policy: every device holds its own")
    pairs = {d: DataPolicyPair(value, parse(policies[d])) for d, value in data.items()}

    def builder(text: str) -> Any:
        spec = ModelSpec.from_json(text)
        if spec.task != kind:
            raise ConfigError(f"this device holds {kind} data; it builds no {spec.task} model")
        return task_model(spec, seed)

    return PolicyDevices(
        None,
        pairs,
        optimizer=LocalOptimizer("sgd", 0.1),
        seed=seed,
        time_limit=program_seconds,
        memory_limit=program_memory,
        builder=builder,
        secure_noise=True,
        device=device,
    )


def population_data(kind: str, size: int, seed: int, devices: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The chosen devices' data from the service's seeded population of ``kind`` (SYNTHETIC for ``mpu``):
    what simulated users' phones hold, for agents that stand in for them."""
    from fedveil.service.jobs import Population, population_values

    values = population_values(Population(kind, size, seed))
    unknown = sorted(set(devices) - set(values))
    if unknown:
        raise ConfigError(f"devices {unknown[:5]} are not in the {kind}:{size} population")
    return {d: values[d] for d in devices}


def read_device_data(path: str | Path) -> dict[str, Any]:
    """One device's own data from an ``.npz`` file (no pickle): ``x`` and ``y`` arrays, and optionally
    ``sensor_columns`` (strings: the sensors along ``x``'s last axis) and ``location`` (latitude,
    longitude per example)."""
    source = Path(path)
    if not source.is_file():
        raise ConfigError(f"device data {source} does not exist: give an .npz file with x and y")
    try:
        with np.load(source, allow_pickle=False) as z:
            arrays = {k: np.asarray(z[k]) for k in z.files}
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{source} is not a readable .npz file without pickled objects: {exc}") from None
    missing = sorted({"x", "y"} - set(arrays))
    if missing:
        raise ConfigError(f"{source} lacks {', '.join(missing)}: a device's data needs x and y")
    if len(arrays["x"]) != len(arrays["y"]):
        raise ConfigError(f"{source}: x has {len(arrays['x'])} examples but y has {len(arrays['y'])}")
    value: dict[str, Any] = {"x": arrays["x"], "y": arrays["y"]}
    if "sensor_columns" in arrays:
        value["sensor_columns"] = tuple(str(c) for c in arrays["sensor_columns"])
    if "location" in arrays:
        value["location"] = arrays["location"]
    return value


def read_policies(
    devices: Sequence[str], policy: str | None, policy_file: str | Path | None
) -> dict[str, str]:
    """Each hosted device's own policy: ``policy`` for all, or a JSON file mapping device -> policy;
    every policy must parse."""
    import json

    if (policy is None) == (policy_file is None):
        raise ConfigError(
            "give each device its policy: --policy TEXT (all devices) or --policy-file FILE.json"
        )
    if policy is not None:
        mapping = {d: policy for d in devices}
    else:
        try:
            loaded = json.loads(Path(policy_file).read_text())  # type: ignore[arg-type]
        except (OSError, ValueError) as exc:
            raise ConfigError(f"policy file {policy_file}: {exc}") from None
        if not isinstance(loaded, dict) or not all(isinstance(v, str) for v in loaded.values()):
            raise ConfigError(f"policy file {policy_file} must map device names to policy text")
        mapping = {d: loaded[d] for d in devices if d in loaded}
        missing = sorted(set(devices) - set(mapping))
        if missing:
            raise ConfigError(f"policy file {policy_file} has no policy for {missing[:5]}")
    for device, text in mapping.items():
        try:
            parse(text)
        except ConfigError as exc:
            raise ConfigError(f"device {device}'s policy does not parse: {exc}") from None
    return mapping


def serve_agent(
    server: str,
    *,
    kind: str,
    devices: Sequence[str],
    policies: dict[str, str],
    population: str | None = None,
    data_file: str | Path | None = None,
    credentials: str | Path | None = None,
    insecure: bool = False,
    server_name: str | None = None,
    give_up_after: float | None = None,
    program_seconds: float = 10.0,
    program_memory: int = 1 << 30,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> int:
    """``fedveil polifl agent``: host ``devices`` (each with its own data and policy) against the service's
    device port until it says goodbye; the data is one device's ``data_file`` or, for simulated users,
    their share of the seeded ``population`` (``KIND:SIZE``). They train on ``device``
    (:func:`~fedveil.models.device.resolve_device`), resolved first: a device this machine lacks is a
    :class:`~fedveil.errors.ConfigError` before any data is read or the server dialled."""
    from fedveil.experiments.network_run import agent_host, serve_devices

    where = resolve_device(device)
    if not devices:
        raise ConfigError("name the devices this agent hosts (--device NAME, repeatable)")
    if (population is None) == (data_file is None):
        raise ConfigError(
            "give the devices' data: --population KIND:SIZE (simulated users) or --data FILE.npz"
        )
    if data_file is not None:
        if len(devices) != 1:
            raise ConfigError("--data holds one device's data: name exactly one --device")
        data = {devices[0]: read_device_data(data_file)}
    else:
        from fedveil.service.jobs import Population

        pop = Population.parse(population or "")
        if pop.kind != kind:
            raise ConfigError(f"population {population} holds {pop.kind} data, not {kind}")
        data = population_data(kind, pop.size, pop.seed, devices)
    pool = device_pool(
        kind,
        data,
        policies,
        seed=seed,
        program_seconds=program_seconds,
        program_memory=program_memory,
        device=where,
    )
    host = agent_host(
        server,
        pool,
        credentials=credentials,
        insecure=insecure,
        give_up_after=give_up_after,
        server_name=server_name,
    )
    return serve_devices(host, "fedveil polifl agent")
