"""``fedveil polifl scale``: PoliFL's network and system overheads (Sec. 5.3,
Fig. 4) and its scaling to many simultaneous devices (Sec. 5.4, Fig. 5), measured over the networked
runtime.

**The times** (Sec. 5, Fig. 2), per device and request, as
:class:`~fedveil.runtime.network.server.NetworkRuntime` records them (:class:`DeviceTiming`): TTD, time to
distribute (server send -> device receipt of the request), TTE, time to execute (device receipt -> device
send of its reply: the policy program, here local training), TTR, time to receive (device send -> server
receipt) and TTP, time to process (the server's decoding and validation of the reply). The paper's TTP is
"the time to apply federated averaging to the received models": that is reported beside it, per round, as
``aggregate`` (the FedAvg engine's aggregation and update of the model).

**The setup.** One ``NetworkRuntime`` with mutual TLS (a throw-away PKI in a temporary folder, one
certificate per device) on loopback; the devices run in ``processes`` agent processes, each device on its
own TLS stream and its own :class:`~fedveil.runtime.network.agent.AgentHost` (so each device answers on
its own, as a separate phone would); the PKI, the agent processes and the percentiles are
:mod:`fedveil.experiments.loopback`'s. The rounds are real PoliFL rounds
(:func:`fedveil.protocols.polifl.run_stage`): the job starts on the devices (:class:`JobStart`: the device
runs ``get_data(...)`` through the trusted library on its data pair and accepts only if its policy then
admits ``runFL``), then FedAvg engine rounds of :class:`~fedveil.protocols.fedavg.ModelServer`
(``FitRequest`` broadcast, ``FitReply`` upload, validated and aggregated). The three tasks' models are
those of ``configs/polifl`` (:func:`task_run`): ``text`` the 2-layer LSTM of 200 units over 2,000 words,
``images`` LeNet on Fashion-MNIST (a seeded synthetic stand-in when absent, said so in the description),
``mpu`` EngagementNet with the paper's 500 LSTM units on the synthetic MPU population. Each device holds
one user's data of a population of ``max(devices, 100)`` users.

**Fig. 4** (Sec. 5.3): one device, ``rounds`` rounds per task. The device is a
:class:`~fedveil.protocols.polifl.PolicyDevices` that **trains honestly** (TTE is this CPU's local epoch
on the device's data, one torch thread). Reported per task: the model's bytes on the wire, TTD / TTE /
TTR / TTP / aggregation / round wall time per round, their mean, p50, p90 and max, and TTD and TTR per
MiB (the paper: both proportional to the model size).

**Fig. 5** (Sec. 5.4): one round with ``devices`` simultaneous devices per task. As the paper does,
devices do **not train**: :class:`ReplayDevices` accept the job through their policy as ``PolicyDevices``
do, then answer the ``FitRequest`` with a **pre-computed update** (the broadcast model plus one honest
local update computed once per agent process before the round) after waiting a TTE **replayed** from a
normal distribution with the paper's Raspberry Pi mean and standard deviation (Sec. 5.2: language 69.62
+- 47.78 s, image 341.50 +- 110.69 s, behaviour 197.63 +- 85.36 s) times ``tte_scale``, clipped at 0,
drawn from the run's seeded generator. Reported per device in order of arrival at the server: TTD, TTE,
TTR, TTP and the replayed TTE; per task the round's wall time against the slowest device's TTD + TTE +
TTR (the round is gated by the slowest device), whether the last device to arrive is the one with the
longest replayed TTE, the rank correlation of arrival and replayed TTE, and how much of each measured TTE
is beyond the replayed wait (on one machine: waiting for a core while other devices' transfers run).
Memory: the server holds every reply of a round, so its peak grows with devices x model bytes (about
4 GB for 100 devices of the 12 MB behaviour model).

Caveats, printed with the results: loopback on one machine is not the paper's 1 Gb/s LAN (the server and
every agent share the same cores, so TTD/TTR measure TLS, gRPC and Python copying, not a wire), and
Fig. 5's TTE is replayed and scaled, not trained.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedveil.core.communicator import ClientId, CommStats, DeviceTiming, Fold, Message, Validator
from fedveil.data.federated import FederatedDataset, UserData
from fedveil.errors import ConfigError, ValidationError
from fedveil.experiments.loopback import agent_processes, percentiles, throwaway_pki, wait_connected
from fedveil.experiments.polifl.runner import GroupSpec, PolifLRun, Task, build_task
from fedveil.models.flat import FlatModel
from fedveil.privacy.pairs import DataPolicyPair
from fedveil.privacy.policy import parse
from fedveil.protocols.fedavg import ModelClients, ParameterPlan
from fedveil.protocols.local import LocalOptimizer
from fedveil.protocols.messages import FitReply, FitRequest
from fedveil.protocols.polifl import JobStart, PolicyDevices

__all__ = [
    "PAPER",
    "TASKS",
    "ReplayDevices",
    "draw_tte",
    "measure_scale",
    "summary",
    "task_run",
]

TASKS = ("text", "images", "mpu")
"""The three use cases of Sec. 5, in the paper's order (language, image, behaviour)."""

PAPER: dict[str, dict[str, Any]] = {
    "text": {"label": "language", "model_mb": 79, "tte_mean": 69.62, "tte_std": 47.78},
    "images": {"label": "image", "model_mb": 43, "tte_mean": 341.50, "tte_std": 110.69},
    "mpu": {"label": "behaviour", "model_mb": 12, "tte_mean": 197.63, "tte_std": 85.36},
}
"""Sec. 5.2-5.3: each task's model size (MB) and its TTE on the Raspberry Pi 4 (mean, std, seconds)."""

PAPER_TTP_MS = {"mean": 0.33, "max": 2.2}
"""Sec. 5.3: the server's TTP (federated averaging) over all rounds of all tasks, milliseconds."""

POINTS = (("p50", 50.0), ("p90", 90.0), ("max", 100.0))
TIMES = ("ttd", "tte", "ttr", "ttp")
DATA_TYPE = {"text": "reddit", "images": "fashion", "mpu": "MPU"}
POPULATION = 100
"""Users per task's population (at least): Fig. 4's device holds user 0's data, Fig. 5's device i user i."""

FIG4_DEVICES = "PolicyDevices, honest local training (TTE measured on this CPU, one torch thread)"
FIG5_DEVICES = (
    "ReplayDevices (Sec. 5.4): job accepted through the policy, pre-computed update returned after a "
    "replayed TTE"
)
CAVEATS = (
    "loopback on one machine, not a LAN: the server and all agents share the same CPU cores",
    "Fig. 5's TTE is replayed from the paper's Raspberry Pi distribution times tte_scale, not trained",
    "the models are fedveil's task models (configs/polifl), not the paper's 79/43/12 MB ones",
)


# --- the tasks -------------------------------------------------------------------------------------------


def task_run(task: str, clients: int, seed: int) -> PolifLRun:
    """The :class:`~fedveil.experiments.polifl.runner.PolifLRun` of a task as this measurement builds it: one
    group of every user with the policy ``get_data(data_type=...).runFL.return`` (Sec. 5's Alg. 1 in
    Table 3's syntax), no DP, and the model and local training of ``configs/polifl``."""
    if task not in TASKS:
        raise ConfigError(f"task {task!r} is not one of {', '.join(TASKS)}")
    kind = DATA_TYPE[task]
    group = GroupSpec(
        "all", f'get_data(data_type="{kind}").runFL.return', 1.0, None, (f"get_data(data_type='{kind}')",)
    )
    common: dict[str, Any] = {
        "name": f"polifl_scale_{task}",
        "task": task,
        "clients": max(2, clients),
        "groups": (group,),
        "clients_per_round": 1,
        "local_epochs": 1,
        "seed": seed,
    }
    if task == "images":
        extra = {
            "model": "lenet",
            "samples_per_client": 100,
            "test_samples": 100,
            "batch_size": 32,
            "lr": 0.1,
        }
    elif task == "mpu":
        extra = {"hidden": 500, "batch_size": 32, "lr": 0.5}
    else:
        extra = {"hidden": 200, "vocab": 2000, "batch_size": 20, "lr": 20.0}
    return PolifLRun(**common, **extra)


def draw_tte(task: str, n: int, scale: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` replayed TTEs (seconds) for ``task``: ``N(mean, std)`` of the paper's Raspberry Pi
    measurements (Sec. 5.2) times ``scale``, clipped at 0."""
    p = PAPER[task]
    return np.clip(rng.normal(p["tte_mean"] * scale, p["tte_std"] * scale, n), 0.0, None)


# --- the devices -----------------------------------------------------------------------------------------


class ReplayDevices(PolicyDevices):
    """PoliFL Sec. 5.4's simulated devices: they hold a data pair each and accept a job through its policy
    exactly as :class:`~fedveil.protocols.polifl.PolicyDevices` do, but do not train: a ``FitRequest`` is
    answered, while the device's pair admits ``runFL``, with the broadcast model plus the pre-computed
    ``update`` after sleeping the device's replayed ``tte`` seconds (on the agent's worker thread, so the
    agent keeps serving heartbeats). A pool's replies leave together: one device per pool gives every
    device its own wait."""

    def __init__(
        self,
        flat: FlatModel,
        pairs: Mapping[ClientId, DataPolicyPair],
        *,
        update: np.ndarray,
        update_loss: float,
        tte: Mapping[ClientId, float],
        sleep: Callable[[float], None] = time.sleep,
        **kwargs: Any,
    ) -> None:
        super().__init__(flat, pairs, **kwargs)
        self.update = np.asarray(update, dtype=np.float32)
        self.update_loss = float(update_loss)
        self.tte = {c: float(v) for c, v in tte.items()}
        self._sleep = sleep

    def _start(self, msgs: Mapping[ClientId, JobStart]) -> dict[ClientId, object]:
        # PolicyDevices' job start (the same device commands through the same library and policy check)
        # without building a local trainer: replay devices never train.
        return self._admit(msgs)

    def _fit(self, msgs: Mapping[ClientId, object]) -> dict[ClientId, object]:
        out, allowed = self._permitted(msgs)
        for cid, m in allowed.items():
            if not isinstance(m, FitRequest) or m.weights.shape != self.update.shape:
                out[cid] = ValidationError(f"device {cid} replays updates of shape {self.update.shape} only")
            else:
                self._sleep(self.tte.get(cid, 0.0))
                n = len(self.prepared[cid]._value()["y"])
                out[cid] = FitReply(m.round, n, self.update_loss, np.asarray(m.weights) + self.update)
        return out


def _precompute(run: PolifLRun, task: Task, plan: ParameterPlan) -> tuple[np.ndarray, float]:
    """The pre-computed update replay devices send back (Sec. 5.4): one honest local epoch of the
    population's first user from the task's initial model (trained minus initial), and its loss."""
    user = next(iter(task.values))
    value = task.values[user]
    trainer = ModelClients(
        task.flat,
        FederatedDataset([UserData(user, {}, {"x": np.asarray(value["x"]), "y": np.asarray(value["y"])})]),
        optimizer=LocalOptimizer("sgd", run.lr),
        seed=run.seed,
        plan=plan,
        loss=task.loss,
        batched=task.batched,
    )
    request = FitRequest(1, run.lr, run.local_epochs, run.batch_size, task.initial)
    fit = trainer.handle_batch({user: request})[user]
    if isinstance(fit, Exception):
        raise fit
    return np.asarray(fit.weights, dtype=np.float32) - task.initial, float(fit.loss)


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _agent_main(argv: list[str]) -> int:
    """An agent process: ``SPEC_JSON I/N``; serves every ``I``-th of the spec's devices (from ``I``), each
    on its own :class:`AgentHost` (module docstring)."""
    from fedveil.runtime.network import certs
    from fedveil.runtime.network.agent import AgentHost

    spec_path, shard = argv
    i, n = (int(x) for x in shard.split("/"))
    spec = json.loads(Path(spec_path).read_text())
    _one_thread()
    mine = spec["devices"][i::n]
    built: dict[str, tuple[PolifLRun, Task]] = {}
    with np.load(spec["updates"], allow_pickle=False) as z:
        updates = {t: np.asarray(z[t], dtype=np.float32) for t in z.files}
    hosts = []
    for k, d in enumerate(mine):
        task_name = d["task"]
        if task_name not in built:
            run = task_run(task_name, spec["population"], spec["seed"])
            built[task_name] = (run, build_task(run))
        run, task = built[task_name]
        users = list(task.values)
        user = users[d["user"] % len(users)]
        pair = {d["name"]: DataPolicyPair(task.values[user], parse(run.groups[0].policy))}
        kwargs: dict[str, Any] = {
            "optimizer": LocalOptimizer("sgd", run.lr),
            "seed": run.seed,
            "loss": task.loss,
            "batched": task.batched,
        }
        if d["replay"] is None:
            pool: Any = PolicyDevices(task.flat, pair, **kwargs)
        else:
            pool = ReplayDevices(
                task.flat,
                pair,
                update=updates[task_name],
                update_loss=spec["update_loss"][task_name],
                tte={d["name"]: d["replay"]},
                **kwargs,
            )
        creds = certs.DeviceCredentials.read(Path(spec["credentials"]) / d["name"])
        hosts.append(
            AgentHost(
                spec["server"],
                {d["name"]: creds},
                pool,
                max_message_bytes=int(spec["max_bytes"]),
                give_up_after=120.0,
                seed=spec["seed"] * 100_003 + i * 1009 + k,
                worker_init=_one_thread,
            )
        )

    async def serve() -> list[dict[str, str]]:
        return list(await asyncio.gather(*(h.run() for h in hosts)))

    endings = asyncio.run(serve())
    return 0 if all(e == "finished" for ending in endings for e in ending.values()) else 1


# --- the server ------------------------------------------------------------------------------------------


@dataclass
class _Request:
    phase: str
    start: float
    end: float
    first: int
    last: int


@dataclass
class _TimedComm:
    """The runtime as the protocol's Communicator, recording per request its phase, start and end
    (``perf_counter``) and which of the runtime's per-device timings it produced."""

    runtime: Any
    requests: list[_Request] = field(default_factory=list)

    def available(self) -> Sequence[ClientId]:
        """The runtime's connected devices."""
        return self.runtime.available()

    def stats(self) -> CommStats:
        """The runtime's counters."""
        return self.runtime.stats()

    async def request(
        self,
        msgs: Mapping[ClientId, Message],
        *,
        phase: str,
        min_replies: int,
        timeout: float,
        expected: type | tuple[type, ...],
        validate: Validator | None = None,
        fold: Fold | None = None,
    ) -> dict[ClientId, Message]:
        """The runtime's request, timed."""
        first, start = len(self.runtime.stats().timings), time.perf_counter()
        try:
            return await self.runtime.request(
                msgs,
                phase=phase,
                min_replies=min_replies,
                timeout=timeout,
                expected=expected,
                validate=validate,
                fold=fold,
            )
        finally:
            self.requests.append(
                _Request(phase, start, time.perf_counter(), first, len(self.runtime.stats().timings))
            )


@dataclass
class _RoundTimes:
    round: int
    wall: float
    aggregate: float
    replies: int
    timings: list[DeviceTiming]


async def _stage(
    runtime: Any,
    run: PolifLRun,
    task: Task,
    plan: ParameterPlan,
    members: list[str],
    *,
    rounds: int,
    timeout: float,
    job: str,
    seed: int,
    on_round: Callable[[int], None] | None = None,
) -> list[_RoundTimes]:
    """One ``runFL`` stage of ``members`` for ``rounds`` over ``runtime`` (:func:`run_stage`), timed.
    ``plan`` is the task's :class:`ParameterPlan` (everything shared), built once per task."""
    from fedveil.privacy.groups import GroupLedger
    from fedveil.protocols.fedavg import ImageFedAvgConfig, ModelServer
    from fedveil.protocols.polifl import PolicyGroup, run_stage, stage_of, start_pair

    g = run.groups[0]
    cfg = ImageFedAvgConfig(
        clients_per_round=len(members),
        local_epochs=run.local_epochs,
        batch_size=run.batch_size,
        optimizer=LocalOptimizer("sgd", run.lr),
        timeout=timeout,
        eval_every=0,
    )
    server = ModelServer(cfg, task.flat, np.random.default_rng(seed), plan=plan, initial=task.initial)
    group = PolicyGroup(g.name, parse(g.policy), tuple(g.commands), None, tuple(members))
    comm = _TimedComm(runtime)
    ends: list[tuple[int, float, int]] = []

    def mark(rnd: int, report: Any) -> None:
        ends.append((rnd, time.perf_counter(), int(report.gradients)))
        if on_round is not None:
            on_round(rnd)

    result = await run_stage(
        stage_of([group], rounds),
        job=job,
        model=start_pair(task.initial),
        server=server,
        comm=comm,
        ledger=GroupLedger([g.name], delta=run.delta, method=run.accounting),
        clip_norm=None,
        dp_mode="central",
        rng=np.random.default_rng(seed + 1),
        on_round=mark,
    )
    if result.refused:
        raise ConfigError(f"{job}: devices refused the job: {dict(list(result.refused.items())[:3])}")
    fits = [r for r in comm.requests if r.phase == server.engine.phase]
    timings = runtime.stats().timings
    return [
        _RoundTimes(
            rnd,
            end - req.start,
            end - req.end,
            replies,
            [t for t in timings[req.first : req.last] if t.phase == req.phase],
        )
        for req, (rnd, end, replies) in zip(fits, ends, strict=True)
    ]


def _stats(values: Sequence[float]) -> dict[str, float]:
    out = percentiles(values, POINTS)
    if out:
        out["mean"] = float(np.mean(values))
    return out


def _fig4_summary(rows: list[dict[str, Any]], params: int) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": len(rows), "params": params, "model_bytes": 4 * params}
    out["bytes_down"] = int(np.median([r["bytes_down"] for r in rows])) if rows else 0
    out["bytes_up"] = int(np.median([r["bytes_up"] for r in rows])) if rows else 0
    for key in (*TIMES, "aggregate", "round_seconds"):
        out[key] = _stats([r[key] for r in rows])
    mib = out["bytes_down"] / 2**20
    if rows and mib > 0:
        out["ttd_p50_seconds_per_mib"] = out["ttd"]["p50"] / mib
        out["ttr_p50_seconds_per_mib"] = out["ttr"]["p50"] / (out["bytes_up"] / 2**20)
    return out


def _rank_correlation(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation (no ties expected), ``None`` when either side is constant."""
    if len(a) < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return None
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def _fig5_summary(rows: list[dict[str, Any]], round_seconds: float, params: int, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {"devices": n, "replies": len(rows), "params": params, "model_bytes": 4 * params}
    out["bytes_down"] = int(np.median([r["bytes_down"] for r in rows])) if rows else 0
    for key in (*TIMES, "tte_replayed"):
        out[key] = _stats([r[key] for r in rows])
    # what the device's TTE holds beyond its replayed wait: handing the request to the pool, adding the
    # update, encoding the reply, and waiting for a core while other devices' transfers run
    out["tte_beyond_replayed"] = _stats([r["tte"] - r["tte_replayed"] for r in rows])
    slowest = max(rows, key=lambda r: r["arrival"]) if rows else None
    out["round_seconds"] = round_seconds
    out["slowest_device_seconds"] = slowest["arrival"] if slowest else None
    out["slowest_device_tte"] = slowest["tte"] if slowest else None
    out["max_tte"] = max(r["tte"] for r in rows) if rows else None
    out["server_overhead_seconds"] = round_seconds - slowest["arrival"] if slowest else None
    out["last_arrival_replayed_the_longest"] = (
        slowest["device"] == max(rows, key=lambda r: r["tte_replayed"])["device"] if slowest else None
    )
    out["arrival_rank_correlation_with_replayed_tte"] = _rank_correlation(
        [r["arrival"] for r in rows], [r["tte_replayed"] for r in rows]
    )
    out["ttd_over_ttr_p50"] = (
        out["ttd"]["p50"] / out["ttr"]["p50"] if rows and out["ttr"]["p50"] > 0 else None
    )
    return out


def _check(devices: int, rounds: int, tasks: Sequence[str], tte_scale: float, processes: int) -> None:
    for name, value in (("devices", devices), ("rounds", rounds), ("processes", processes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} {value!r} must be an integer >= 1")
    if devices > 10_000:
        raise ConfigError(f"devices {devices} is more than this loopback measurement runs (at most 10000)")
    if isinstance(tte_scale, bool) or not isinstance(tte_scale, int | float) or not math.isfinite(tte_scale):
        raise ConfigError(f"tte_scale {tte_scale!r} must be a finite number >= 0")
    if tte_scale < 0:
        raise ConfigError(f"tte_scale {tte_scale!r} must be >= 0 (0: devices answer at once)")
    if not tasks:
        raise ConfigError(f"no tasks given: choose from {', '.join(TASKS)}")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ConfigError(f"task {unknown[0]!r} is not one of {', '.join(TASKS)}")
    if len(set(tasks)) != len(tasks):
        raise ConfigError(f"tasks {list(tasks)} name a task twice")


def measure_scale(
    *,
    devices: int = 100,
    rounds: int = 100,
    tasks: Sequence[str] = TASKS,
    tte_scale: float = 0.01,
    processes: int = 4,
    seed: int = 0,
    out: str | Path | None = None,
    progress: bool = True,
    connect_timeout: float = 300.0,
) -> dict[str, Any]:
    """Measure Fig. 4 (one device, ``rounds`` rounds per task) and Fig. 5 (one round of ``devices``
    simultaneous devices per task, TTE replayed at ``tte_scale``) as the module docstring describes, in
    ``processes`` agent processes; write ``results.json``, ``fig4.png`` and ``fig5.png`` under ``out``
    (when given) and return the results (per-round and per-device rows included; :func:`summary` drops
    them)."""
    _check(devices, rounds, tasks, tte_scale, processes)
    from tqdm import tqdm

    started = time.perf_counter()
    tasks = list(tasks)
    rng = np.random.default_rng(seed)
    replayed = {t: draw_tte(t, devices, tte_scale, rng) for t in tasks}
    population = max(devices, POPULATION)
    runs = {t: task_run(t, population, seed) for t in tasks}
    setup = tqdm(total=len(tasks) + 1, desc="setup: tasks, then agents", disable=not progress)
    built: dict[str, Task] = {}
    plans: dict[str, ParameterPlan] = {}
    precomputed: dict[str, tuple[np.ndarray, float]] = {}
    for t in tasks:
        setup.set_postfix_str(t)
        built[t] = build_task(runs[t])
        plans[t] = ParameterPlan(built[t].flat)
        precomputed[t] = _precompute(runs[t], built[t], plans[t])
        setup.update(1)
    params = {t: int(built[t].flat.num_params) for t in tasks}
    solo = {t: f"{t}-solo" for t in tasks}
    crowd = {t: [f"{t}-{i:05d}" for i in range(devices)] for t in tasks}
    spec_devices = [{"name": solo[t], "task": t, "user": 0, "replay": None} for t in tasks]
    for t in tasks:
        spec_devices += [
            {"name": name, "task": t, "user": i, "replay": float(replayed[t][i])}
            for i, name in enumerate(crowd[t])
        ]
    total = len(spec_devices)
    processes = min(processes, total)
    max_bytes = 2 * 4 * max(params.values()) + 2**16
    fig5_timeout = 120.0 + 2.0 * max(float(replayed[t].max()) for t in tasks)
    fig4_rows: dict[str, list[dict[str, Any]]] = {}
    fig5_rows: dict[str, list[dict[str, Any]]] = {}
    fig5_walls: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="fedveil-polifl-scale-") as tmp:
        root = Path(tmp)
        pki, creds, cert_seconds = throwaway_pki(root, [d["name"] for d in spec_devices])
        np.savez(root / "updates.npz", **{t: u for t, (u, _) in precomputed.items()})

        async def go() -> float:
            from fedveil.runtime.network.server import NetworkRuntime

            runtime = NetworkRuntime("127.0.0.1:0", pki=pki, max_message_bytes=max_bytes)
            port = await runtime.start()
            spec = {
                "server": f"127.0.0.1:{port}",
                "credentials": str(creds),
                "max_bytes": max_bytes,
                "seed": seed,
                "population": population,
                "updates": str(root / "updates.npz"),
                "update_loss": {t: loss for t, (_, loss) in precomputed.items()},
                "devices": spec_devices,
            }
            spec_path = root / "spec.json"
            spec_path.write_text(json.dumps(spec))
            commands = [
                [sys.executable, "-m", "fedveil.experiments.polifl.scale", str(spec_path), f"{i}/{processes}"]
                for i in range(processes)
            ]
            async with agent_processes(runtime, commands, log_dir=root):
                try:
                    setup.set_postfix_str(f"{total} devices connecting")
                    connect = await wait_connected(runtime, total, connect_timeout)
                    setup.update(1)
                    setup.close()
                except ConfigError as exc:
                    logs = "".join(
                        p.read_text(errors="replace")[-600:] for p in sorted(root.glob("agent-*.log"))
                    )
                    raise ConfigError(f"{exc}; agent output: {logs or '(none)'}") from None
                bar = tqdm(total=len(tasks) * rounds, desc="Fig. 4: one device", disable=not progress)
                for t in tasks:
                    bar.set_postfix_str(t)
                    times = await _stage(
                        runtime,
                        runs[t],
                        built[t],
                        plans[t],
                        [solo[t]],
                        rounds=rounds,
                        timeout=600.0,
                        job=f"scale/fig4/{t}",
                        seed=seed + 7,
                        on_round=lambda _: bar.update(1),
                    )
                    fig4_rows[t] = [
                        {
                            "round": r.round,
                            **{k: float(getattr(r.timings[0], k)) for k in TIMES},
                            "aggregate": r.aggregate,
                            "round_seconds": r.wall,
                            "bytes_down": r.timings[0].bytes_down,
                            "bytes_up": r.timings[0].bytes_up,
                        }
                        for r in times
                        if r.timings
                    ]
                bar.close()
                for t in tqdm(tasks, desc=f"Fig. 5: {devices} devices", disable=not progress):
                    (r,) = await _stage(
                        runtime,
                        runs[t],
                        built[t],
                        plans[t],
                        crowd[t],
                        rounds=1,
                        timeout=fig5_timeout,
                        job=f"scale/fig5/{t}",
                        seed=seed + 11,
                    )
                    index = {name: i for i, name in enumerate(crowd[t])}
                    rows = [
                        {
                            "device": x.client,
                            "arrival": float(x.ttd + x.tte + x.ttr),
                            **{k: float(getattr(x, k)) for k in TIMES},
                            "tte_replayed": float(replayed[t][index[x.client]]),
                            "bytes_down": x.bytes_down,
                            "bytes_up": x.bytes_up,
                        }
                        for x in r.timings
                    ]
                    fig5_rows[t] = sorted(rows, key=lambda row: row["arrival"])
                    fig5_walls[t] = r.wall
            return connect

        connect_seconds = asyncio.run(go())
    results: dict[str, Any] = {
        "settings": {
            "devices": devices,
            "rounds": rounds,
            "tasks": tasks,
            "tte_scale": tte_scale,
            "processes": processes,
            "seed": seed,
            "population": population,
            "fig4_devices": FIG4_DEVICES,
            "fig5_devices": FIG5_DEVICES,
            "transport": "gRPC over mutual TLS on loopback (127.0.0.1), throw-away PKI",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "tasks": {t: built[t].description for t in tasks},
        "paper": {
            "model_mb": {t: PAPER[t]["model_mb"] for t in tasks},
            "tte_mean_std_seconds": {t: [PAPER[t]["tte_mean"], PAPER[t]["tte_std"]] for t in tasks},
            "ttp_ms": PAPER_TTP_MS,
        },
        "fig4": {t: _fig4_summary(fig4_rows[t], params[t]) for t in tasks},
        "fig5": {
            t: {
                **_fig5_summary(fig5_rows[t], fig5_walls[t], params[t], devices),
                "tte_replayed_distribution": {
                    "mean": PAPER[t]["tte_mean"] * tte_scale,
                    "std": PAPER[t]["tte_std"] * tte_scale,
                },
            }
            for t in tasks
        },
        "fig4_rounds": fig4_rows,
        "fig5_arrivals": fig5_rows,
        "connect_seconds": connect_seconds,
        "certificate_seconds": cert_seconds,
        "caveats": list(CAVEATS),
    }
    results["wall_seconds"] = time.perf_counter() - started
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        results["plots"] = [
            str(_plot_fig4(results, folder / "fig4.png")),
            str(_plot_fig5(results, folder / "fig5.png")),
        ]
        (folder / "results.json").write_text(json.dumps(results, indent=1))
    return results


def summary(results: Mapping[str, Any]) -> dict[str, Any]:
    """The results without the per-round and per-device rows (what ``--json`` prints)."""
    return {k: v for k, v in results.items() if k not in ("fig4_rounds", "fig5_arrivals")}


# --- plots -----------------------------------------------------------------------------------------------


def _label(results: Mapping[str, Any], t: str) -> str:
    mb = results["fig4"][t]["model_bytes"] / 1e6 if t in results["fig4"] else 0.0
    return f"{PAPER[t]['label']}\n({t}, {mb:.1f} MB)"


def _plot_fig4(results: Mapping[str, Any], path: Path) -> Path:
    """Fig. 4's shape: per task, box plots of TTD, TTR and TTP (ms) over the rounds."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tasks = list(results["fig4_rounds"])
    fig = Figure(figsize=(11, 4), dpi=100)
    FigureCanvasAgg(fig)
    for k, key in enumerate(("ttd", "ttr", "ttp")):
        ax = fig.add_subplot(1, 3, k + 1)
        data = [[1e3 * r[key] for r in results["fig4_rounds"][t]] for t in tasks]
        ax.boxplot(data, showfliers=True)
        ax.set_xticks(range(1, len(tasks) + 1), [_label(results, t) for t in tasks], fontsize=8)
        ax.set_title(key.upper())
        ax.set_ylabel("milliseconds")
        ax.grid(True, axis="y", alpha=0.3)
    rounds = results["settings"]["rounds"]
    fig.suptitle(f"PoliFL Fig. 4 shape: one device, {rounds} rounds, loopback mTLS", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _plot_fig5(results: Mapping[str, Any], path: Path) -> Path:
    """Fig. 5's shape: per task, one stacked bar (TTD, TTE, TTR) per device in order of arrival, and the
    round's wall time."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tasks = list(results["fig5_arrivals"])
    fig = Figure(figsize=(5 * len(tasks), 4), dpi=100)
    FigureCanvasAgg(fig)
    for k, t in enumerate(tasks):
        ax = fig.add_subplot(1, len(tasks), k + 1)
        rows = results["fig5_arrivals"][t]
        x = np.arange(1, len(rows) + 1)
        bottom = np.zeros(len(rows))
        for key, colour in (("ttd", "tab:blue"), ("tte", "tab:orange"), ("ttr", "tab:green")):
            h = np.array([r[key] for r in rows])
            ax.bar(x, h, bottom=bottom, width=1.0, color=colour, label=key.upper())
            bottom += h
        wall = results["fig5"][t]["round_seconds"]
        ax.axhline(wall, color="black", linestyle="--", linewidth=1, label=f"round {wall:.2f} s")
        ax.set_title(_label(results, t).replace("\n", " "), fontsize=9)
        ax.set_xlabel("device, in order of arrival at the server")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7)
    scale = results["settings"]["tte_scale"]
    fig.suptitle(
        f"PoliFL Fig. 5 shape: one round, {results['settings']['devices']} simultaneous devices, "
        f"TTE replayed x {scale:g}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    return path


if __name__ == "__main__":
    sys.exit(_agent_main(sys.argv[1:]))
