"""The simulation on a Ray cluster: client pools sharded across Ray actors (``pip install fedveil[ray]``).

The runtime is still :class:`~fedveil.runtime.simulation.SimulationRuntime`, with its virtual clock,
seeded per-phase faults, and every message through the codec and metered. Only its client pool changes:
a :class:`RayPool` keeps no clients in this process.

- **Sharding.** Each of ``actors`` Ray actors builds its shard of the clients once, with their data, by
  calling a pool factory (the same client code as the simulation and the device agents).
- **A phase.** The pool encodes each distinct message once and puts it in Ray's object store once, so a
  broadcast travels once per actor. Each actor decodes what it was sent and computes its shard's part
  of the phase in one batch. It returns each client's reply as codec bytes, or the error the client
  raised. The server's ``request()`` fans out and gathers exactly as in-process.
- **Same results.** Clients draw from their own per-client generators, so sharding changes nothing. A
  run on Ray gives the in-process model bit for bit when the clients compute one at a time (a test shows
  it for FDML and FedAvg). A batched pool groups the cohort per shard, and float32 sums then differ in
  the last bits.
- **Failures.** An actor that dies mid-phase makes its clients' replies errors, which the runtime turns
  into dropouts with the reason. Ray restarts the actor (its clients rebuilt from the factory), and the
  run goes on. A cluster address that does not answer is refused within ``connect_timeout`` seconds.

Ray moves the factory and the messages between our own processes with its own serialisation; nothing a
client sends is unpickled: replies are codec bytes.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fedveil.core import codec
from fedveil.core.communicator import ClientId, Message
from fedveil.errors import ConfigError

__all__ = ["PoolFactory", "RayPool", "check_address", "connect"]

log = logging.getLogger(__name__)

PoolFactory = Callable[[list[ClientId]], Any]
"""Builds the client pool of a shard (the client ids it serves), in the actor's process."""


def connect(
    address: str | None = None, *, num_cpus: int | None = None, connect_timeout: float = 10.0
) -> None:
    """Join the Ray cluster at ``address`` (``HOST:PORT`` of its head, or ``auto``), or start a local one
    with ``num_cpus`` when ``address`` is None; a no-op when this process is connected already."""
    import ray

    if ray.is_initialized():
        return
    if address and address != "auto":
        check_address(address, timeout=connect_timeout)
    if address:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)


def check_address(address: str, *, timeout: float = 10.0) -> None:
    """Refuse, within ``timeout`` seconds, a Ray head address that is malformed or does not answer."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(
            f"Ray address {address!r} is not HOST:PORT (the head's GCS port, e.g. 10.0.0.1:6379)"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConfigError(
            f"no Ray cluster answers at {address} within {timeout:g} s ({exc}): start one with "
            "`ray start --head` there, or leave --address out for a local cluster"
        ) from None


class _Shard:
    """One actor's clients (made a Ray actor class by :class:`RayPool`)."""

    def __init__(self, factory: PoolFactory, ids: list[ClientId], threads: int) -> None:
        import torch

        torch.set_num_threads(max(1, threads))
        self.ids = list(ids)
        self.pool = factory(self.ids)

    def ready(self) -> int:
        """How many clients the shard serves (returns once it is built)."""
        return len(self.ids)

    def handle(
        self, index: Mapping[ClientId, int], *blobs: bytes
    ) -> dict[ClientId, tuple[bool, bytes | str]]:
        """Decode each client's message (``blobs[index[client]]``), run the shard's batch, and return
        each reply as ``(True, codec bytes)`` or ``(False, "Error: message")``."""
        decoded = [codec.decode(b) for b in blobs]
        results = self.pool.handle_batch({cid: decoded[i] for cid, i in index.items()})
        out: dict[ClientId, tuple[bool, bytes | str]] = {}
        for cid in index:
            reply = results.get(cid)
            if isinstance(reply, Exception):
                out[cid] = (False, f"{type(reply).__name__}: {reply}")
            elif reply is None:
                out[cid] = (False, "the client produced no reply")
            else:
                out[cid] = (
                    True,
                    bytes(reply) if isinstance(reply, (bytes, bytearray)) else codec.encode(reply),
                )
        return out

    def rng_states(self) -> dict[ClientId, Any]:
        """The shard's clients' generator states (for checkpoints)."""
        rngs = getattr(self.pool, "rngs", None) or {}
        return {c: rngs[c].bit_generator.state for c in self.ids if c in rngs}

    def set_rng_states(self, states: Mapping[ClientId, Any]) -> None:
        """Restore generator states from a checkpoint."""
        for cid, state in states.items():
            self.pool.rngs[cid].bit_generator.state = state


class RayPool:
    """A client pool whose clients live in ``actors`` Ray actors (module docstring). ``factory`` builds a
    shard's pool from its client ids in the actor; ``client_ids`` are all clients, dealt to the actors in
    turn; ``threads``: torch threads per actor; ``timeout``: seconds to wait for one phase of an actor."""

    def __init__(
        self,
        factory: PoolFactory,
        client_ids: Sequence[ClientId],
        *,
        actors: int,
        address: str | None = None,
        threads: int = 1,
        timeout: float = 3600.0,
        max_restarts: int = 3,
    ) -> None:
        import ray

        if isinstance(actors, bool) or not isinstance(actors, int) or actors < 1:
            raise ConfigError(f"actors {actors!r} must be an integer >= 1")
        ids = list(client_ids)
        if not ids:
            raise ConfigError("a Ray pool needs clients")
        connect(address, num_cpus=None)
        self._ids = ids
        self.timeout = timeout
        shards = [ids[k::actors] for k in range(min(actors, len(ids)))]
        self._actor_of = {cid: k for k, shard in enumerate(shards) for cid in shard}
        remote = ray.remote(num_cpus=0, max_restarts=max_restarts, max_task_retries=0)(_Shard)
        self._actors = [
            remote.options(scheduling_strategy="SPREAD").remote(factory, shard, threads) for shard in shards
        ]
        ray.get([a.ready.remote() for a in self._actors], timeout=timeout)
        log.info("Ray pool: %d clients over %d actors", len(ids), len(self._actors))

    @property
    def actors(self) -> int:
        """How many actors hold the clients."""
        return len(self._actors)

    def client_ids(self) -> list[ClientId]:
        """Every client."""
        return list(self._ids)

    def handle_batch(self, msgs: Mapping[ClientId, Message]) -> dict[ClientId, Message | bytes | Exception]:
        """One phase's messages to their actors, every distinct message encoded and stored once; the
        replies as codec bytes, or the error (an actor that died: every one of its clients)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        blobs: list[Any] = []
        slot: dict[int, int] = {}
        per_actor: dict[int, dict[ClientId, int]] = {}
        for cid, msg in msgs.items():
            if cid not in self._actor_of:
                raise ConfigError(f"client {cid!r} is not in this Ray pool")
            if id(msg) not in slot:
                slot[id(msg)] = len(blobs)
                blobs.append(ray.put(codec.encode(msg)))
            per_actor.setdefault(self._actor_of[cid], {})[cid] = slot[id(msg)]
        calls = {}
        for k, index in per_actor.items():
            used = sorted(set(index.values()))
            local = {b: j for j, b in enumerate(used)}
            calls[k] = self._actors[k].handle.remote(
                {cid: local[b] for cid, b in index.items()}, *[blobs[b] for b in used]
            )
        out: dict[ClientId, Message | bytes | Exception] = {}
        for k, call in calls.items():
            try:
                replies = ray.get(call, timeout=self.timeout)
            except (RayActorError, RayTaskError, GetTimeoutError) as exc:
                reason = f"Ray actor {k} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                log.warning("%s; its %d clients drop out of this phase", reason, len(per_actor[k]))
                for cid in per_actor[k]:
                    out[cid] = ConnectionError(reason)
                continue
            for cid, (ok, payload) in replies.items():
                out[cid] = payload if ok else RuntimeError(str(payload))
        return out

    def rng_states(self) -> dict[ClientId, Any]:
        """Every client's generator state, gathered from the actors."""
        import ray

        states: dict[ClientId, Any] = {}
        for part in ray.get([a.rng_states.remote() for a in self._actors], timeout=self.timeout):
            states.update(part)
        return states

    def set_rng_states(self, states: Mapping[ClientId, Any]) -> None:
        """Send each actor its clients' generator states."""
        import ray

        parts: dict[int, dict[ClientId, Any]] = {}
        for cid, state in states.items():
            parts.setdefault(self._actor_of[cid], {})[cid] = state
        ray.get([self._actors[k].set_rng_states.remote(p) for k, p in parts.items()], timeout=self.timeout)

    def kill_actor(self, k: int) -> None:
        """Kill actor ``k`` (Ray restarts it): for failure tests."""
        import ray

        ray.kill(self._actors[k], no_restart=False)
