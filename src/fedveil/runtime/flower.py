"""fedveil's protocols on Flower (``pip install fedveil[flower]``): a runtime over Flower's Message API.

The protocols do not change. Only the runtime does: :class:`FlowerRuntime` is a
:class:`~fedveil.core.communicator.Communicator` over a Flower ``Grid`` (the ServerApp's handle on the
SuperLink), and :func:`client_app_for` makes a Flower ``ClientApp`` hosting fedveil's client code, the
same client pools the in-process simulation, the Ray actors and the device agents run.

- **Messages.** Every fedveil message is its codec bytes, carried in a Flower ``ConfigRecord`` named
  ``fedveil`` of a message of type ``query.fedveil``. One Flower message goes to each SuperNode per phase,
  with every one of that node's clients' messages (a broadcast's bytes once). The reply carries each
  client's reply bytes, or the error it raised. Nothing is pickled. A reply that is not a fedveil record,
  or one that fails the codec or the protocol's validation, is a dropout with the reason, as on every
  runtime. Bytes are metered as codec bytes, once per client, as in the simulation.
- **Nodes and clients.** A SuperNode hosts the share ``I/N`` of the population given by the Flower
  convention ``partition-id`` = I and ``num-partitions`` = N in its node config (Flower's simulation
  engine sets them; start a deployed SuperNode with ``--node-config "partition-id=0 num-partitions=2"``).
  At start the server sends each node a ``hello`` with the device-agent command that describes the
  clients (``agent --config ...`` or ``feduv agent --config ... --method ...``). The ClientApp's
  ``build_pool`` turns it into the clients a device agent would build (parsed by fedveil's own parser,
  never executed: :func:`fedveil.experiments.agent_options.pool_from_command`) and answers with their
  ids. The server then waits until every client of the population is hosted.
- **Client state.** A ClientApp keeps its clients in its process, as a device agent does. Each client's
  random generator is also saved in the node's Flower ``Context.state`` (kept by the SuperNode, on the
  device) after every message and restored before the next. That is all a FedAvg client holds between
  messages, so FedAvg is correct even where every message meets a fresh ClientApp process, which is how
  a Flower 1.42 SuperNode runs them. FDML (the activations a device keeps between its embed and
  gradient phases, and its attested enclave session) and FedUV (a user's secret codeword and deployed
  model) hold more, and that state lives only in the ClientApp's process. Flower's simulation engine, as
  :func:`run_on_flower` starts it, runs every node in one long-lived process, so all three protocols run
  there. On a deployed SuperNode, a fresh process asked to continue such devices answers with an error
  that says so, and the server records those clients as dropouts with that reason.
- **Clock.** Flower's runtime is real: ``sim_seconds`` is wall time, and a reply that misses the timeout
  is a dropout.

``fedveil run CONFIG --runtime flower --supernodes N`` (and ``fedveil feduv run --runtime flower``) starts
Flower's simulation engine in this process (:func:`run_on_flower`). ``flwr run`` runs the Flower App in
``packaging/flower-app`` (:mod:`fedveil.flower_app`), whose ServerApp runs the fedveil command line given
as its ``argv`` run-config value on its grid (:func:`serving`). See ``docs/flower.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedveil.core import codec
from fedveil.core.communicator import ClientId, CommStats, Dropout, Fold, Validator
from fedveil.core.communicator import Message as FedveilMessage
from fedveil.errors import CodecError, ConfigError, ValidationError
from fedveil.runtime.quoting import platform_for

__all__ = [
    "MESSAGE_TYPE",
    "RECORD",
    "FlowerPlan",
    "FlowerRuntime",
    "PoolBuilder",
    "client_app_for",
    "handle",
    "run_on_flower",
    "serving",
]

log = logging.getLogger(__name__)

MESSAGE_TYPE = "query.fedveil"
"""The Flower message type of every fedveil message (Flower routes it to the ClientApp's
``@query("fedveil")`` function)."""
RECORD = "fedveil"
"""The name of the ``ConfigRecord`` that carries fedveil's bytes in a Flower message."""

HELLO, BYE = "hello", "bye"

PoolBuilder = Callable[[Sequence[str]], Any]
"""Builds the client pool (every client of the population) a device-agent command describes."""

T = TypeVar("T")


# --------------------------------------------------------------------------------------------- server


class FlowerRuntime:
    """A :class:`~fedveil.core.communicator.Communicator` over a Flower ``Grid`` (module docstring).
    ``max_message_bytes`` bounds each client's reply; ``poll`` is the seconds between pulls."""

    def __init__(
        self, grid: Grid, *, max_message_bytes: int = 64 * 2**20, poll: float = 0.005, pki: Path | None = None
    ) -> None:
        if max_message_bytes <= 0:
            raise ConfigError(f"max_message_bytes {max_message_bytes!r} must be positive")
        self.grid = grid
        self.max_message_bytes = max_message_bytes
        self.poll = poll
        self.pki = pki
        self._node_of: dict[ClientId, int] = {}
        self._stats = CommStats()

    def available(self) -> Sequence[ClientId]:
        """The clients the connected SuperNodes host."""
        return tuple(self._node_of)

    def stats(self) -> CommStats:
        """Counters so far (the live object; ``.copy()`` for a snapshot)."""
        return self._stats

    def _drop(self, cid: ClientId, phase: str, reason: str) -> None:
        self._stats.dropouts.append(Dropout(cid, phase, reason))
        log.info("dropout: client %s in phase %s: %s", cid, phase, reason)

    async def connect(
        self, command: Sequence[str], ids: Sequence[ClientId], *, need: int | None = None, wait: float = 300.0
    ) -> list[ClientId]:
        """Send every SuperNode a ``hello`` with the device-agent ``command`` until ``need`` (default:
        all) of the clients ``ids`` are hosted, within ``wait`` seconds; returns the hosted clients."""
        known = set(ids)
        need = len(known) if need is None else need
        asked: set[int] = set()
        failed: dict[int, str] = {}
        deadline = time.monotonic() + wait
        while True:
            nodes = [n for n in self.grid.get_node_ids() if n not in asked]
            if nodes:
                asked.update(nodes)
                record = ConfigRecord({"phase": HELLO, "command": list(command)})
                replies = await self._exchange({n: record for n in nodes}, deadline)
                for node, reply in replies.items():
                    try:
                        if isinstance(reply, str):
                            raise ValidationError(reply)
                        if "error" in reply:
                            raise ValidationError(_field(reply, "error", str))
                        hosted = _field(reply, "clients", list)
                    except ValidationError as exc:
                        failed[node] = str(exc)
                        log.warning("SuperNode %d cannot host clients: %s", node, exc)
                        continue
                    bad = [c for c in hosted if not isinstance(c, str) or c not in known]
                    taken = [c for c in hosted if c in self._node_of]
                    if bad or taken:
                        log.warning(
                            "SuperNode %d hosts unknown %s or already-hosted %s clients: left out",
                            node,
                            bad[:3],
                            taken[:3],
                        )
                        continue
                    for cid in hosted:
                        self._node_of[cid] = node
            if len(self._node_of) >= need:
                # the population's order, not the order nodes answered: selection draws from this list
                self._node_of = {c: self._node_of[c] for c in ids if c in self._node_of}
                return list(self._node_of)
            if time.monotonic() >= deadline:
                why = "".join(f"; SuperNode {n}: {e}" for n, e in list(failed.items())[:3])
                raise ConfigError(
                    f"only {len(self._node_of)} of {need} clients are hosted by the SuperNodes that joined "
                    f"within {wait:g} s: start more SuperNodes (each with partition-id and num-partitions "
                    f"in its node config){why}"
                )
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        """Tell every node the run is over (they drop their clients); replies are not awaited long."""
        nodes = sorted(set(self._node_of.values()))
        if nodes:
            with contextlib.suppress(Exception):
                await self._exchange({n: ConfigRecord({"phase": BYE}) for n in nodes}, time.monotonic() + 5.0)

    async def _exchange(
        self,
        records: Mapping[int, ConfigRecord],
        deadline: float,
        *,
        on_reply: Callable[[int, ConfigRecord | str], None] | None = None,
        enough: Callable[[], bool] | None = None,
    ) -> dict[int, ConfigRecord | str]:
        """Push one record to each node; gather each node's reply record (or why it is not one), handing
        each to ``on_reply`` as it comes, until all replied, ``enough()`` holds, or ``deadline``."""
        messages = [
            Message(RecordDict({RECORD: rec}), dst_node_id=node, message_type=MESSAGE_TYPE)
            for node, rec in records.items()
        ]
        ids = list(self.grid.push_messages(messages))
        node_of_msg = {mid: node for mid, node in zip(ids, records, strict=True) if mid}
        pending = set(node_of_msg)
        out: dict[int, ConfigRecord | str] = {}
        while pending:
            for reply in self.grid.pull_messages(pending):
                mid = reply.metadata.reply_to_message_id
                if mid not in pending:
                    continue
                pending.discard(mid)
                node = node_of_msg[mid]
                out[node] = _record_of(reply)
                if on_reply is not None:
                    on_reply(node, out[node])
                if enough is not None and enough():
                    break
            if not pending or (enough is not None and enough()) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(self.poll)
        return out

    async def request(
        self,
        msgs: Mapping[ClientId, FedveilMessage],
        *,
        phase: str,
        min_replies: int,
        timeout: float,
        expected: type | tuple[type, ...],
        validate: Validator | None = None,
        fold: Fold | None = None,
    ) -> dict[ClientId, FedveilMessage]:
        """Send each client its message through its SuperNode and gather replies (Communicator): each
        node's replies in the order of its clients, folded (``fold``) as they are accepted, until
        ``min_replies`` are (those a node sent beyond are dropouts, late)."""
        if min_replies < 0:
            raise ConfigError(f"min_replies {min_replies} must be >= 0")
        unknown = [c for c in msgs if c not in self._node_of]
        if unknown:
            raise ConfigError(f"request to clients no SuperNode hosts: {unknown[:5]}")
        started = time.monotonic()
        encoded: dict[int, bytes] = {}
        per_node: dict[int, tuple[list[str], list[bytes], list[int], dict[int, int]]] = {}
        for cid, msg in msgs.items():
            if id(msg) not in encoded:
                encoded[id(msg)] = codec.encode(msg)
                self._stats.bytes_down_coded += len(encoded[id(msg)])
            data = encoded[id(msg)]
            self._stats.bytes_down += len(data)
            self._stats.messages_down += 1
            clients, blobs, index, slot = per_node.setdefault(self._node_of[cid], ([], [], [], {}))
            if id(msg) not in slot:
                slot[id(msg)] = len(blobs)
                blobs.append(data)
            clients.append(cid)
            index.append(slot[id(msg)])
        records = {
            node: ConfigRecord({"phase": phase, "clients": clients, "blobs": blobs, "index": index})
            for node, (clients, blobs, index, _) in per_node.items()
        }
        valid: dict[ClientId, FedveilMessage] = {}
        answered: set[ClientId] = set()

        def take(node: int, reply: ConfigRecord | str) -> None:
            asked = per_node[node][0]
            answered.update(asked)
            if isinstance(reply, str):
                for cid in asked:
                    self._drop(cid, phase, f"invalid reply from SuperNode {node}: {reply}")
            else:
                self._receive(node, reply, asked, phase, (expected, validate, fold, min_replies), valid)

        def enough() -> bool:
            return 0 < min_replies <= len(valid)

        await self._exchange(records, started + timeout, on_reply=take, enough=enough)
        late = f"late: no reply within {timeout:g} s"
        if enough():
            late = "late: round moved on without this reply"
        for cid in msgs:
            if cid not in answered:
                self._drop(cid, phase, late)
        self._stats.sim_seconds += time.monotonic() - started
        return {cid: valid[cid] for cid in msgs if cid in valid}

    def _receive(
        self,
        node: int,
        reply: ConfigRecord,
        asked: list[ClientId],
        phase: str,
        accept: tuple[type | tuple[type, ...], Validator | None, Fold | None, int],
        valid: dict[ClientId, FedveilMessage],
    ) -> None:
        """Decode, validate and fold one node's reply record into ``valid``; the rest are dropouts.
        ``accept`` is the request's ``(expected, validate, fold, min_replies)``."""
        expected, validate, fold, min_replies = accept
        try:
            if "error" in reply:
                raise ValidationError(f"the node failed: {_field(reply, 'error', str)}")
            clients = _field(reply, "clients", list)
            errors = _field(reply, "errors", list)
            payloads = _field(reply, "payloads", list)
            if not (len(clients) == len(errors) == len(payloads)) or set(clients) != set(asked):
                raise ValidationError("its clients, errors and payloads do not match the request")
        except ValidationError as exc:
            for cid in asked:
                self._drop(cid, phase, f"invalid reply from SuperNode {node}: {exc}")
            return
        for cid, error, payload in zip(clients, errors, payloads, strict=True):
            if error:
                self._drop(cid, phase, f"client raised {error!s:.300}")
                continue
            if not isinstance(payload, bytes):
                self._drop(cid, phase, "invalid reply: payload is not bytes")
                continue
            self._stats.bytes_up += len(payload)
            self._stats.messages_up += 1
            if 0 < min_replies <= len(valid):
                self._drop(cid, phase, "late: round moved on without this reply")
                continue
            try:
                if len(payload) > self.max_message_bytes:
                    raise ValidationError(
                        f"reply of {len(payload)} bytes exceeds the limit of {self.max_message_bytes} bytes"
                    )
                msg = codec.decode(payload, max_bytes=self.max_message_bytes, expected=expected)
                if validate is not None:
                    validate(cid, msg)
                valid[cid] = msg if fold is None else fold(cid, msg)
            except (CodecError, ValidationError) as exc:
                self._drop(cid, phase, f"invalid reply: {exc}")


def _record_of(reply: Message) -> ConfigRecord | str:
    """The ``fedveil`` record of a Flower reply, or why there is none."""
    if reply.has_error():
        return f"Flower error {reply.error.code}: {reply.error.reason}"
    if not reply.has_content():
        return "a reply without content"
    content = reply.content
    if RECORD not in content.config_records:
        return f"not a fedveil record (records: {sorted(content.keys())[:5]})"
    return content.config_records[RECORD]


def _field(record: ConfigRecord, name: str, kind: type) -> Any:
    """``record[name]``, checked to be a ``kind``."""
    if name not in record:
        raise ValidationError(f"the fedveil record has no {name!r}")
    value = record[name]
    if not isinstance(value, kind):
        raise ValidationError(f"{name!r} is {type(value).__name__}, not {kind.__name__}")
    return value


@dataclass
class FlowerPlan:
    """How a run reaches its clients through Flower: the ServerApp's ``grid``, how long to wait for the
    SuperNodes (``wait_seconds``), how many clients must be hosted to start (``min_devices``, default:
    all), and torch ``threads`` for the clients. It has the shape of
    :class:`~fedveil.experiments.network_run.NetworkPlan`, so the runners take either."""

    grid: Grid
    wait_seconds: float = 300.0
    min_devices: int | None = None
    threads: int = 1
    name: str = field(default="flower", init=False)

    def make_runtime(self, out: Path, *, max_message_bytes: int, attested: bool) -> tuple[FlowerRuntime, Any]:
        """The runtime and, for an ``attested`` enclave, the emulated platform (kept in ``out/pki``)."""
        pki = Path(out) / "pki"
        platform = None
        if attested:
            pki.mkdir(parents=True, exist_ok=True)
            platform = platform_for(pki)
        return FlowerRuntime(self.grid, max_message_bytes=max_message_bytes, pki=pki), platform

    async def start(
        self, runtime: FlowerRuntime, ids: list[str], out: Path, agent_command: list[str]
    ) -> None:
        """Have the SuperNodes build the clients ``agent_command`` describes, and wait for them."""
        command = [*agent_command, "--threads", str(self.threads)]
        await runtime.connect(command, ids, need=self.min_devices, wait=self.wait_seconds)

    async def stop(self, runtime: FlowerRuntime) -> None:
        """Tell the SuperNodes the run is over."""
        await runtime.close()


class _Active(threading.local):
    grid: Grid | None = None


_ACTIVE = _Active()


@contextlib.contextmanager
def serving(grid: Grid) -> Iterator[None]:
    """Within it, :func:`run_on_flower` runs its work on ``grid``, the grid of the ServerApp that
    ``flwr run`` started (in this thread), instead of starting Flower's simulation engine."""
    _ACTIVE.grid = grid
    try:
        yield
    finally:
        _ACTIVE.grid = None


def run_on_flower(
    work: Callable[[FlowerPlan], T],
    build_pool: PoolBuilder,
    *,
    supernodes: int = 4,
    threads: int = 1,
    wait_seconds: float = 300.0,
    cpus: int | None = None,
) -> T:
    """Run ``work(plan)`` as a Flower ServerApp: inside the ServerApp that ``flwr run`` started (its grid,
    :func:`serving`), or else on Flower's simulation engine started here with ``supernodes`` SuperNodes,
    all of them in one long-lived ClientApp process (:func:`client_app_for` ``build_pool``) with ``cpus``
    CPUs (default: all), so that client state persists."""
    if _ACTIVE.grid is not None:
        return work(FlowerPlan(_ACTIVE.grid, wait_seconds=wait_seconds, threads=threads))
    if isinstance(supernodes, bool) or not isinstance(supernodes, int) or supernodes < 1:
        raise ConfigError(f"supernodes {supernodes!r} must be an integer >= 1")
    from flwr.simulation import run_simulation

    cpus = cpus or os.cpu_count() or 1
    results: list[T] = []
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        results.append(work(FlowerPlan(grid, wait_seconds=wait_seconds, threads=threads)))

    with _quiet_flower():
        run_simulation(
            app,
            client_app_for(build_pool),
            num_supernodes=supernodes,
            backend_config={
                "client_resources": {"num_cpus": cpus, "num_gpus": 0.0},
                "init_args": {"num_cpus": cpus, "include_dashboard": False, "log_to_driver": False},
            },
        )
    if not results:
        raise ConfigError("Flower's simulation ended without running the fedveil ServerApp")
    return results[0]


@contextlib.contextmanager
def _quiet_flower() -> Any:
    """Only Flower's errors while its simulation runs (it logs ``run_simulation`` as deprecated in favour
    of ``flwr run``, and every round at INFO); both ways are supported here."""
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    flwr_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        flwr_log.setLevel(level)


# --------------------------------------------------------------------------------------------- client


_POOLS: dict[tuple[int, tuple[str, ...]], Any] = {}
_POOLS_LOCK = threading.Lock()


def _pool_for(
    run_id: int, command: Sequence[str], build_pool: PoolBuilder, *, drop: bool = False, at_hello: bool = True
) -> Any:
    """The client pool (every client of the population) that the device-agent ``command`` describes for
    Flower run ``run_id`` (``build_pool(command)``), built once per process and run (the nodes a process
    serves share it: each touches only its own clients); ``drop`` forgets it. Past the ``hello``
    (``at_hello=False``), a pool this process must build anew is refused unless its clients keep nothing
    but their generators between messages."""
    key = (run_id, tuple(command))
    with _POOLS_LOCK:
        if drop:
            return _POOLS.pop(key, None)
        if key not in _POOLS:
            pool = build_pool(list(command))
            if not at_hello and not _carried_whole(pool):
                raise ConfigError(
                    f"this ClientApp process did not serve the node's earlier messages, and "
                    f"{type(pool).__name__} devices keep state between messages (FDML: the activations "
                    "between its embed and gradient phases and the attested session; FedUV: the secret "
                    "codeword and the deployed model) that only a long-lived process holds. Run it on "
                    "Flower's simulation engine (fedveil run --runtime flower) or fedveil's own network "
                    "runtime; FedAvg runs on per-message ClientApp processes"
                )
            _POOLS[key] = pool
        return _POOLS[key]


def _carried_whole(pool: Any) -> bool:
    """Whether the node's Context.state carries all of ``pool``'s per-client state (its generators)."""
    from fedveil.protocols.fedavg import FedAvgClients

    return type(pool) is FedAvgClients


def _shard(context: Context) -> tuple[int, int]:
    """This node's share ``(I, N)`` from its node config."""
    part, parts = context.node_config.get("partition-id"), context.node_config.get("num-partitions")
    if not (isinstance(part, int) and isinstance(parts, int) and 0 <= part < parts):
        raise ConfigError(
            "this SuperNode's node config has no valid partition-id and num-partitions: start it with "
            '--node-config "partition-id=I num-partitions=N"'
        )
    return part, parts


def handle(content: RecordDict, context: Context, build_pool: PoolBuilder) -> RecordDict:
    """One fedveil message to this node: ``hello`` (build the clients its device-agent command describes
    with ``build_pool``, answer their ids), ``bye``, or a phase's messages for the node's clients (answer
    each one's reply bytes or error)."""
    try:
        if RECORD not in content.config_records:
            raise ValidationError("the message has no fedveil record")
        record = content.config_records[RECORD]
        phase = _field(record, "phase", str)
        saved = context.state.config_records.get(RECORD)
        if phase == HELLO:
            command = [str(c) for c in _field(record, "command", list)]
            pool = _pool_for(context.run_id, command, build_pool)
            part, parts = _shard(context)
            mine = list(pool.client_ids())[part::parts]
            context.state[RECORD] = ConfigRecord({"command": command, "clients": mine, "rngs": "{}"})
            return RecordDict({RECORD: ConfigRecord({"clients": mine})})
        if saved is None:
            raise ConfigError("this node has not been sent a hello: its clients are not built")
        if phase == BYE:
            _pool_for(context.run_id, list(saved["command"]), build_pool, drop=True)  # type: ignore[arg-type]
            del context.state[RECORD]
            return RecordDict({RECORD: ConfigRecord({"clients": []})})
        return RecordDict({RECORD: _phase(record, saved, context.run_id, build_pool)})
    except Exception as exc:  # every failure is the node's reply: the server records it as dropouts
        log.warning("fedveil ClientApp: %s: %s", type(exc).__name__, exc)
        return RecordDict({RECORD: ConfigRecord({"error": f"{type(exc).__name__}: {exc}"[:2000]})})


def _phase(record: ConfigRecord, saved: ConfigRecord, run_id: int, build_pool: PoolBuilder) -> ConfigRecord:
    """Run one phase for the node's addressed clients, their generators restored from and saved to the
    node's state."""
    from fedveil.protocols.common import pool_rng_states, restore_pool_rngs

    pool = _pool_for(run_id, list(saved["command"]), build_pool, at_hello=False)  # type: ignore[arg-type]
    mine = set(saved["clients"])  # type: ignore[arg-type]
    clients = [str(c) for c in _field(record, "clients", list)]
    blobs = _field(record, "blobs", list)
    index = _field(record, "index", list)
    if len(index) != len(clients) or any(not isinstance(i, int) or not 0 <= i < len(blobs) for i in index):
        raise ValidationError("the request's index does not match its clients and blobs")
    strangers = [c for c in clients if c not in mine]
    if strangers:
        raise ValidationError(f"clients {strangers[:3]} are not hosted by this node")
    restore_pool_rngs(pool, json.loads(str(saved["rngs"])))
    decoded = [codec.decode(bytes(b)) for b in blobs]
    results = pool.handle_batch({cid: decoded[i] for cid, i in zip(clients, index, strict=True)})
    errors: list[str] = []
    payloads: list[bytes] = []
    for cid in clients:
        reply = results.get(cid)
        if isinstance(reply, Exception) or reply is None:
            errors.append(f"{type(reply).__name__}: {reply}" if reply is not None else "no reply")
            payloads.append(b"")
        else:
            errors.append("")
            payloads.append(bytes(reply) if isinstance(reply, (bytes, bytearray)) else codec.encode(reply))
    saved["rngs"] = json.dumps(pool_rng_states(pool, sorted(mine)))
    return ConfigRecord({"clients": clients, "errors": errors, "payloads": payloads})


def client_app_for(build_pool: PoolBuilder) -> ClientApp:
    """A Flower ClientApp hosting the clients each ``hello``'s device-agent command describes, built by
    ``build_pool`` (module docstring)."""
    app = ClientApp()

    @app.query("fedveil")
    def _serve_client(message: Message, context: Context) -> Message:
        return Message(handle(message.content, context, build_pool), reply_to=message)

    return app
