"""The device side of an FDML or FL-traditional run over the network (``fedveil agent``).

An agent's devices are built from the same experiment config as the server: their client code
(:func:`fedveil.experiments.fdml.runner.build_clients`), their data (the population regenerated from the
config's seed, or a local touch-log CSV) and, for FDML through the emulated TEE, the enclave measurement
they expect, computed from the config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedveil.enclave.measure import measure_enclave
from fedveil.errors import ConfigError
from fedveil.experiments.config import ExperimentConfig
from fedveil.experiments.fdml.privacy_setup import plan_privacy
from fedveil.experiments.fdml.runner import (
    EMBEDDING_DIM,
    build_clients,
    build_population,
    device_sessions,
    enclave_config,
    uses_enclave,
)
from fedveil.experiments.network_run import agent_host, choose_devices
from fedveil.runtime.network.agent import AgentHost, RoundSeededPool

__all__ = ["agent_pool", "build_agent"]


def build_agent(
    cfg: ExperimentConfig,
    server: str,
    *,
    devices: list[str] | None = None,
    shard: tuple[int, int] | None = None,
    credentials: str | Path | None = None,
    insecure: bool = False,
    platform_public_key: bytes | None = None,
    give_up_after: float | None = None,
    population: Any = None,
    server_name: str | None = None,
) -> AgentHost:
    """A device agent for ``cfg``: its devices (``devices``, or shard ``I/N`` of the population, or all),
    their client code and data (:func:`agent_pool`), each round's randomness drawn from that round's
    seed (:class:`~fedveil.runtime.network.agent.RoundSeededPool`: a resumed server or a restarted agent
    gets the draws an uninterrupted run gets) and their credentials (``credentials/<device>/
    device.crt`` ...)."""
    pool, mine = agent_pool(
        cfg, devices=devices, shard=shard, platform_public_key=platform_public_key, population=population
    )
    return agent_host(
        server,
        RoundSeededPool(pool, cfg.seed),
        devices=mine,
        credentials=credentials,
        insecure=insecure,
        give_up_after=give_up_after,
        server_name=server_name,
        max_message_bytes=cfg.runtime.max_message_bytes,
    )


def agent_pool(
    cfg: ExperimentConfig,
    *,
    devices: list[str] | None = None,
    shard: tuple[int, int] | None = None,
    platform_public_key: bytes | None = None,
    population: Any = None,
) -> tuple[Any, list[str]]:
    """The client pool a device agent of ``cfg`` hosts, and the devices it runs (``devices``, shard
    ``I/N``, or all): for FDML through the emulated TEE, with their enclave sessions pinned to
    ``platform_public_key`` and the measurement computed from ``cfg``."""
    population = population if population is not None else build_population(cfg)
    mine = choose_devices(list(population.train_user_ids()), devices, shard)
    sessions = None
    if uses_enclave(cfg):
        if platform_public_key is None:
            raise ConfigError(
                "FDML through the emulated TEE: give the platform's public key (--platform-key FILE)"
            )
        privacy = plan_privacy(cfg, population, EMBEDDING_DIM)
        measurement = measure_enclave(enclave_config(cfg, privacy.release if privacy else None, dp_seed=None))
        sessions = device_sessions(mine, platform_public_key, measurement.digest)
    return build_clients(cfg, population, sessions=sessions), mine
