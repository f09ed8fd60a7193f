"""Experiments over the network: the server side of ``fedveil server`` / ``fedveil run --runtime network``
and what a device agent needs (its host, its devices' choice): docs/deployment.md. An FDML or
FL-traditional device agent is built by :mod:`fedveil.experiments.fdml.agent`.

The server and every device build their halves from the **same experiment config**: the server its
protocol server and enclave, a device its client code (:func:`fedveil.experiments.fdml.runner.build_clients`),
its data (the synthetic population regenerated from the config's seed, or its local touch-log CSV) and,
for FDML through the emulated TEE, the enclave measurement it expects, computed from the config: a
server that launches any other enclave fails attestation.

The emulated quoting platform's key lives in the PKI directory (``platform.key``, 0600, the server's
host only; ``platform.pub``, given to every device to pin: :func:`fedveil.runtime.quoting.platform_for`).
On real SGX hardware that root is the CPU vendor's, not a file: docs/tee.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedveil.errors import ConfigError
from fedveil.runtime.network import certs
from fedveil.runtime.network.agent import AgentHost
from fedveil.runtime.network.server import NetworkRuntime
from fedveil.runtime.quoting import SimulatedPlatform, platform_for

log = logging.getLogger(__name__)


@dataclass
class NetworkPlan:
    """How a run reaches its devices: the server's ``listen`` address, its ``pki`` (``None`` with
    ``agents`` > 0: one is made in ``<run dir>/pki``), ``insecure`` plaintext (explicit only), how many
    local agent processes to start (``agents``; 0 = devices connect by themselves), how long to wait
    for them (``wait_seconds``) and how many devices must be connected to start (``min_devices``,
    default: every device of the population)."""

    listen: str = "127.0.0.1:0"
    pki: Path | None = None
    insecure: bool = False
    agents: int = 0
    wait_seconds: float = 300.0
    min_devices: int | None = None
    enrol_listen: str | None = None
    heartbeat_seconds: float = 5.0
    agent_threads: int = 1
    _procs: list[asyncio.subprocess.Process] = field(default_factory=list, init=False, repr=False)

    def make_runtime(
        self, out: Path, *, max_message_bytes: int, attested: bool
    ) -> tuple[NetworkRuntime, SimulatedPlatform | None]:
        """The server-side runtime (not yet listening) and, for an ``attested`` enclave, its platform."""
        if self.agents < 0:
            raise ConfigError(f"agents {self.agents!r} must be >= 0")
        pki = self.pki
        if pki is None and not self.insecure:
            if not self.agents:
                raise ConfigError(
                    "the server needs --pki DIR (made by `fedveil certs init DIR`), or --insecure"
                )
            pki = out / "pki"
            if not (pki / "ca.crt").exists():
                certs.init_pki(pki)
        runtime = NetworkRuntime(
            self.listen,
            pki=pki,
            insecure=self.insecure,
            enrol_listen=self.enrol_listen,
            max_message_bytes=max_message_bytes,
            heartbeat_seconds=self.heartbeat_seconds,
        )
        platform = None
        if attested:
            if pki is None:
                raise ConfigError(
                    "FDML through the emulated TEE pins a platform key kept in the PKI directory"
                )
            platform = platform_for(pki)
        return runtime, platform

    async def start(
        self, runtime: NetworkRuntime, ids: list[str], out: Path, agent_command: list[str]
    ) -> None:
        """Listen, start the local agents (``fedveil <agent_command> --server ... --shard I/N ...``), and
        wait until enough of the devices ``ids`` are connected."""
        port = await runtime.start()
        if self.agents:
            await self._spawn(runtime, port, ids, out, agent_command)
        need = len(ids) if self.min_devices is None else self.min_devices
        log.info("waiting up to %.0f s for %d devices on port %d", self.wait_seconds, need, port)
        got = await runtime.wait_for_devices(need, self.wait_seconds)
        if len(got) < need:
            raise ConfigError(
                f"only {len(got)} of {need} devices connected within {self.wait_seconds:g} s; "
                "start more agents or lower --min-devices"
            )
        # the run registers every connected device next; later joiners are admitted between rounds
        runtime.take_joined()

    async def _spawn(
        self, runtime: NetworkRuntime, port: int, ids: list[str], out: Path, agent_command: list[str]
    ) -> None:
        cred_dir = out / "devices"
        cred_dir.mkdir(exist_ok=True)
        if not self.insecure:
            for name in ids:
                if not (cred_dir / name / "device.crt").exists():
                    certs.issue_device(runtime.pki, name).write(cred_dir / name)
        n = min(self.agents, len(ids))
        for i in range(n):
            cmd = [
                sys.executable,
                "-m",
                "fedveil",
                *agent_command,
                "--server",
                f"127.0.0.1:{port}",
                "--shard",
                f"{i}/{n}",
                "--give-up-after",
                str(max(60.0, self.wait_seconds)),
                "--threads",
                str(self.agent_threads),
            ]
            cmd += ["--insecure"] if self.insecure else ["--credentials", str(cred_dir)]
            log_path = out / f"agent-{i}.log"
            with open(log_path, "wb") as fh:
                proc = await asyncio.create_subprocess_exec(
                    *cmd, stdout=fh, stderr=fh, start_new_session=True
                )
            self._procs.append(proc)

    async def stop(self, runtime: NetworkRuntime, grace: float = 30.0) -> None:
        """Tell every agent training is over, stop serving, and make sure local agents exit."""
        await runtime.close()
        for proc in self._procs:
            try:
                await asyncio.wait_for(proc.wait(), grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        self._procs.clear()


async def admit_joined(server: Any, runtime: Any) -> list[str]:
    """Between rounds: register the devices that connected or reconnected since the last call
    (:meth:`NetworkRuntime.take_joined`) into ``server``'s groups; through the TEE each opens a fresh
    attested session (a restarted agent has lost its old one). Returns them; those that fail to register
    or attest leave the groups and are not selected. Nothing is awaited once none are left, so the round
    that follows selects among devices admitted on their current stream. A runtime that does not report
    joins (Flower's, whose SuperLink owns its nodes' connections) admits none."""
    take = getattr(runtime, "take_joined", None)
    admitted: list[str] = []
    while take is not None and (joined := take()):
        log.info("admitting %d device(s) that joined or reconnected: %s", len(joined), joined[:5])
        await server.register(runtime, clients=joined)
        admitted += joined
    return admitted


def parse_shard(text: str) -> tuple[int, int]:
    """``I/N`` -> (I, N) with 0 <= I < N."""
    left, sep, right = text.partition("/")
    if not sep or not left.isdigit() or not right.isdigit() or not 0 <= int(left) < int(right):
        raise ConfigError(f"shard {text!r} is not I/N with 0 <= I < N (e.g. 0/8)")
    return int(left), int(right)


def choose_devices(ids: list[str], devices: list[str] | None, shard: tuple[int, int] | None) -> list[str]:
    """The devices an agent runs: ``devices`` (checked against ``ids``), shard ``I/N`` of ``ids``, or all."""
    if devices:
        unknown = sorted(set(devices) - set(ids))
        if unknown:
            raise ConfigError(f"devices {unknown[:5]} are not users of this experiment's data")
        return list(devices)
    if shard is not None:
        return ids[shard[0] :: shard[1]]
    return ids


def agent_host(
    server: str,
    pool: Any,
    *,
    devices: list[str] | None = None,
    shard: tuple[int, int] | None = None,
    credentials: str | Path | None = None,
    insecure: bool = False,
    give_up_after: float | None = None,
    server_name: str | None = None,
    max_message_bytes: int = 64 * 2**20,
) -> AgentHost:
    """An :class:`AgentHost` for the chosen devices of ``pool`` with their credentials
    (``credentials/<device>/device.crt`` ...); the pool's torch settings carry to its worker thread."""
    import torch

    mine = choose_devices(list(pool.client_ids()), devices, shard)
    creds: dict[str, certs.DeviceCredentials | None] = {}
    for name in mine:
        if insecure:
            creds[name] = None
        elif credentials is None:
            raise ConfigError("devices need their credentials (--credentials DIR), or --insecure")
        else:
            creds[name] = certs.DeviceCredentials.read(Path(credentials) / name)
    threads = torch.get_num_threads()
    return AgentHost(
        server,
        creds,
        pool,
        insecure=insecure,
        max_message_bytes=max_message_bytes,
        give_up_after=give_up_after,
        server_name=server_name,
        worker_init=lambda: torch.set_num_threads(threads),
    )


def serve_devices(host: AgentHost, command: str) -> int:
    """Run ``host`` until its devices are done; print each device that did not finish (``command`` names
    the caller); exit status 0 if all finished, else 1."""
    endings = asyncio.run(host.run())
    failed = {d: e for d, e in endings.items() if e != "finished"}
    for d, e in failed.items():
        print(f"{command}: device {d}: {e}", file=sys.stderr)
    return 1 if failed else 0
