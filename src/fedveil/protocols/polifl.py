"""PoliFL on the FedAvg engine: the trusted library, policy-enforcing devices, per-group DP rounds and the
compliance strategies ([PoliFL], Sec. 2.4, 3.3, 6; Alg. 1-5).

**The trusted library** (Policile's functions; every one goes through
:func:`fedveil.privacy.pairs.apply`, which checks the command against each input pair's policy and the
side it runs on, and gives the result the intersection of the advanced policies):

- device side: :func:`get_data`, :func:`filter_sensors` (the policy command ``filter``: the named
  sensors' features are replaced by zeros before anything else sees the data, so they carry no
  information and the model's input shape stays the same for every group), :func:`in_geofence_cond`
  (keeps the examples recorded inside a box), :func:`train_local` (Alg. 2) and :func:`train_local_dp`
  (Alg. 3: the update is clipped to ``S`` and noised on the device);
- server side: :func:`accumulate` (Alg. 4), :func:`average` (Alg. 5 / Eq. 1), :func:`run_fl` (the
  ``runFL`` scope: a whole federated training, executed on both sides), :func:`enforce_budget`
  (``enforce_dp_budget`` / ``enforce_privacy_budget`` / ``check_privacy_budget``: refuses when any
  group whose data reached the model has spent more epsilon than the call's bound, which the policy's
  matching rule keeps at most the group's budget) and :func:`release` (``return``).

**Rounds inside ``runFL``** (Table 3's policies, ``get_data . runFL . ... . return``). A job sends each
device its device-side commands (:class:`JobStart`: ``get_data(data_type=...)``, ``filter(...)``); the
device runs them through the library on its own data pair and accepts the job only if the advanced
policy then allows ``runFL`` (:class:`JobReady` says why not). Each round of the stage is then FedAvg on
the engine (:class:`~fedveil.protocols.fedavg.ModelServer`, :class:`~fedveil.protocols.fedavg.ModelClients`)
in the ``runFL`` scope: the device trains on its pair's value only while its pair admits ``runFL``, and
uploads ``Clip(L - G, S)`` (plus its noise share in local mode); the server's aggregation
(:class:`DPAggregate`) sums the clipped updates, adds ``N(0, sigma^2)`` in central mode, and divides by
the number of updates (Eq. 1, with the engine's ``server_lr`` as ``eta``). When the stage ends the
server advances the model's pair by ``runFL`` together with the stage groups' policies
(:func:`run_fl`), so the model carries ``P_1 & P_2 & ...`` (Sec. 3.3).

**Strategies** (Sec. 6) are global programs (:data:`fedveil.experiments.polifl.runner.STRATEGY_PROGRAMS`) that
call the server's functions: ``single`` (one group, its noise), ``combined`` (all groups in one stage at
the strictest group's noise, :func:`stage_of`) and ``cascaded`` (one stage per group, most restrictive
first, each at its own noise; each stage's model is released under its policies before the next stage
fine-tunes it: DP's post-processing, so a group's epsilon counts its own stage only). Per-group
accounting is :class:`~fedveil.privacy.groups.GroupLedger`.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedveil.core.communicator import ClientId, Communicator
from fedveil.core.messages import message
from fedveil.data.federated import FederatedDataset, UserData
from fedveil.enclave.secure_noise import SecureNoise
from fedveil.errors import ConfigError, ValidationError
from fedveil.models.device import resolve_device
from fedveil.models.flat import FlatModel
from fedveil.privacy.groups import GroupLedger, noise_multiplier
from fedveil.privacy.pairs import DataPolicyPair, PolicyViolation, Side, apply, next_commands
from fedveil.privacy.pairs import release as release_pair
from fedveil.privacy.policy import (
    ANY,
    BUDGET_KEYWORDS,
    ZERO,
    Call,
    Policy,
    budget_of,
    derivative,
    nullable,
    parse,
    show,
)
from fedveil.privacy.sandbox import Program, SandboxError, compile_program, preload, run_program
from fedveil.protocols.common import RoundReport
from fedveil.protocols.fedavg import ClipAndNoise, FitResult, ModelClients, ModelServer, fedavg_aggregate
from fedveil.protocols.local import LocalOptimizer

__all__ = [
    "DEVICE_COMMANDS",
    "DEVICE_LIBRARY",
    "DPAggregate",
    "JobReady",
    "JobStart",
    "PolicyDevices",
    "PolicyGroup",
    "Stage",
    "StageResult",
    "StageResume",
    "accumulate",
    "average",
    "enforce_budget",
    "filter_sensors",
    "get_data",
    "in_geofence_cond",
    "prepare_pair",
    "release",
    "release_model",
    "run_fl",
    "run_stage",
    "stage_of",
    "start_pair",
    "train_local",
    "train_local_dp",
]

log = logging.getLogger(__name__)

DP_MODES = ("central", "local")
ModelBuilder = Callable[[str], tuple[FlatModel, Any, "bool | None"]]
"""Makes a job's flat model, loss and batching from its JSON model spec (refusing what it does not
allow with a :class:`~fedveil.errors.ConfigError`)."""
DEVICE_COMMANDS = ("get_data", "filter", "in_geofence_cond")
"""The commands a job may ask a device to run before ``runFL`` (:class:`JobStart`)."""


# --- messages ----------------------------------------------------------------------------------------


@message("polifl.job_start")
@dataclass(frozen=True)
class JobStart:
    """A stage starts: the device-side ``commands`` in policy syntax, or a third-party ``program``
    (RestrictedPython source defining ``prepare(data)``, run in the sandbox on the device; ``""``: none),
    the clip norm ``S``, the standard deviation of the device's noise share (0 in central mode) and the
    job's ``model`` (a JSON model spec a networked device builds its model from with its allow-listed
    builder; ``""``: the device's own model)."""

    job: str
    commands: tuple[str, ...]
    program: str
    clip_norm: float
    local_noise_std: float
    model: str = ""


@message("polifl.job_ready")
@dataclass(frozen=True)
class JobReady:
    """The device ran the commands (``accepted``, with its data pair's advanced ``policy``) or refused
    the job, with the policy's ``reason``."""

    job: str
    accepted: bool
    reason: str
    policy: str
    num_samples: int


# --- the trusted library ---------------------------------------------------------------------------------


def _same(value: Any) -> Any:
    return value


def get_data(pair: DataPolicyPair, **args: Any) -> DataPolicyPair:
    """``get_data(data_type=...)`` (device): the device's data, now usable by the next commands."""
    return apply("get_data", [pair], _same, side=Side.DEVICE, args=args)


def _zero_sensors(value: Any, sensors: Sequence[str]) -> dict[str, Any]:
    if not isinstance(value, Mapping) or "sensor_columns" not in value:
        raise ValidationError("filter(sensors=...) needs data that names its sensors (sensor_columns)")
    columns = list(value["sensor_columns"])
    unknown = sorted(set(sensors) - set(columns))
    if unknown:
        raise ValidationError(f"filter names sensors the data does not have: {unknown} (it has {columns})")
    x = np.array(value["x"], dtype=np.float32, copy=True)
    for i, name in enumerate(columns):
        if name in sensors:
            x[..., i] = 0.0
    return {**value, "x": x}


def filter_sensors(pair: DataPolicyPair, sensors: Sequence[str]) -> DataPolicyPair:
    """``filter(sensors=[...])`` (device): the named sensors' features become zeros (module docstring)."""
    names = [str(s) for s in sensors]
    return apply(
        "filter", [pair], lambda v: _zero_sensors(v, names), side=Side.DEVICE, args={"sensors": names}
    )


def _inside(value: Any, box: tuple[float, float, float, float]) -> dict[str, Any]:
    if not isinstance(value, Mapping) or "location" not in value:
        raise ValidationError("in_geofence_cond needs data with a location (latitude, longitude) per example")
    lat0, lon0, lat1, lon1 = box
    loc = np.asarray(value["location"], dtype=np.float64)
    keep = (loc[:, 0] >= lat0) & (loc[:, 0] <= lat1) & (loc[:, 1] >= lon0) & (loc[:, 1] <= lon1)
    return {k: (np.asarray(v)[keep] if k in ("x", "y", "location") else v) for k, v in value.items()}


def in_geofence_cond(
    pair: DataPolicyPair, lat0: float, lon0: float, lat1: float, lon1: float
) -> DataPolicyPair:
    """``in_geofence_cond(lat0=.., lon0=.., lat1=.., lon1=..)`` (device): only the examples recorded
    inside the box (a policy may pin the box by naming the four keywords)."""
    box = (float(lat0), float(lon0), float(lat1), float(lon1))
    if not (box[0] <= box[2] and box[1] <= box[3]):
        raise ConfigError(f"a geofence needs lat0 <= lat1 and lon0 <= lon1, not {box}")
    args = dict(zip(("lat0", "lon0", "lat1", "lon1"), box, strict=True))
    return apply("in_geofence_cond", [pair], lambda v: _inside(v, box), side=Side.DEVICE, args=args)


def train_local(
    model: DataPolicyPair, data: DataPolicyPair, trainer: Callable[[Any, Any], Any]
) -> DataPolicyPair:
    """``train_local`` (device, Alg. 2): ``trainer(model, data)`` as a pair of ``P_model & P_data``."""
    return apply("train_local", [model, data], trainer, side=Side.DEVICE)


def train_local_dp(
    model: DataPolicyPair,
    data: DataPolicyPair,
    trainer: Callable[[Any, Any], Any],
    transform: ClipAndNoise,
    rng: np.random.Generator,
) -> DataPolicyPair:
    """``train_local_dp`` (device, Alg. 3): local training, then ``Clip(L - G, S)`` plus the device's noise
    share, as ``G + update``."""

    def dp(g: Any, d: Any) -> np.ndarray:
        start = np.asarray(g, dtype=np.float32)
        trained = np.asarray(trainer(g, d), dtype=np.float32)
        update = transform(torch.from_numpy(trained - start), rng).numpy()
        return start + update

    return apply("train_local_dp", [model, data], dp, side=Side.DEVICE)


def accumulate(update: DataPolicyPair, total: DataPolicyPair) -> DataPolicyPair:
    """``accumulate`` (server, Alg. 4): ``total + update``."""
    return apply("accumulate", [update, total], lambda u, t: np.asarray(t) + np.asarray(u), side=Side.SERVER)


def average(model: DataPolicyPair, total: DataPolicyPair, count: int, eta: float = 1.0) -> DataPolicyPair:
    """``average`` (server, Alg. 5): ``G + eta / n * sum``, ``total`` holding the summed updates."""
    if count < 1:
        raise ValidationError(f"average needs at least one accumulated update, not {count}")
    return apply(
        "average",
        [model, total],
        lambda g, s: np.asarray(g) + eta / count * np.asarray(s),
        side=Side.SERVER,
    )


def run_fl(model: DataPolicyPair, groups: Sequence[DataPolicyPair]) -> DataPolicyPair:
    """``runFL`` (both sides): opens the scope of a whole federated training on ``model``, allowed only
    when the model's policy and every contributing group's policy (pairs holding no value on the server:
    policies are public) admit it. The result holds the model's value and the intersection of the
    advanced policies; the rounds then run in the scope (:func:`run_stage`)."""
    return apply("runFL", [model, *groups], lambda m, *_: m, side=Side.BOTH)


def enforce_budget(
    pair: DataPolicyPair, command: str, bound: float, spent: Mapping[str, float]
) -> DataPolicyPair:
    """A budget command (``enforce_dp_budget(eps=bound)`` and the two others of
    :data:`~fedveil.privacy.policy.BUDGET_KEYWORDS`, server): refused when any group in ``spent`` (the
    groups whose data reached the model, with their epsilon) has spent more than ``bound``."""
    key = BUDGET_KEYWORDS.get(command)
    if key is None:
        raise PolicyViolation(f"{command} is not a budget command ({', '.join(BUDGET_KEYWORDS)})")
    over = {g: e for g, e in spent.items() if not e <= bound}
    if over:
        raise PolicyViolation(
            f"{command}({key}={bound:g}) refused: "
            + ", ".join(f"group {g} has spent epsilon {e:.4g}" for g, e in sorted(over.items()))
        )
    return apply(command, [pair], _same, side=Side.SERVER, args={key: bound})


def release(pair: DataPolicyPair) -> Any:
    """``return`` (server): the value, when the policy ends there."""
    return release_pair(pair, "return")


def release_model(pair: DataPolicyPair, spent: Mapping[str, float]) -> tuple[Any, list[str]]:
    """Release a trained model the way a compliant global program does: run, in turn, the budget commands
    the model's policy requires (each at the smallest bound the policy accepts, checked against
    ``spent``) and then ``return``. Returns the value and the commands run; raises
    :class:`PolicyViolation` when a budget is exceeded or the policy allows no release."""
    done: list[str] = []
    for _ in range(16):
        if nullable(pair.policy) or derivative(pair.policy, Call("return")) != ZERO:
            break
        budget_calls = []
        for text in next_commands(pair.policy):
            cmd = parse(text).cmd if not text.startswith("anything") else None
            if cmd is not None and cmd.name in BUDGET_KEYWORDS and derivative(pair.policy, cmd) != ZERO:
                budget_calls.append(cmd)
        if not budget_calls:
            break
        call = min(budget_calls, key=lambda c: float(dict(c.args).get(BUDGET_KEYWORDS[c.name], math.inf)))
        bound = float(dict(call.args)[BUDGET_KEYWORDS[call.name]])
        pair = enforce_budget(pair, call.name, bound, spent)
        done.append(show(Policy("cmd", cmd=call)))
    value = release(pair)
    return value, [*done, "return"]


preload(__name__)

DEVICE_LIBRARY: dict[str, Callable[..., Any]] = {
    "get_data": get_data,
    "filter": filter_sensors,
    "in_geofence_cond": in_geofence_cond,
}
"""What a job's device program sees of the trusted library (its ``prepare(data)`` runs before ``runFL``)."""


def prepare_pair(
    pair: DataPolicyPair,
    commands: Sequence[str],
    program: str = "",
    *,
    name: str = "job",
    programs: dict[str, Program] | None = None,
    time_limit: float = 10.0,
    memory_limit: int = 1 << 30,
) -> DataPolicyPair:
    """A device's preparation for a job: ``program``'s ``prepare(data)`` run in the sandbox with
    :data:`DEVICE_LIBRARY` (when given), else the device ``commands`` in turn; refused
    (:class:`PolicyViolation`) unless the advanced policy then admits ``runFL``. ``programs`` caches
    compiled programs by source."""
    if program:
        cache = programs if programs is not None else {}
        if program not in cache:
            cache[program] = compile_program(program, f"{name}/device")
        try:
            out = run_program(
                cache[program],
                "prepare",
                pair,
                library=DEVICE_LIBRARY,
                time_limit=time_limit,
                memory_limit=memory_limit,
            )
        except SandboxError as exc:
            raise PolicyViolation(f"the job's device program failed: {exc}") from None
        if not isinstance(out, DataPolicyPair):
            raise PolicyViolation("the job's device program must return the data pair prepare() was given")
        pair = out
    for text in () if program else commands:
        cmd = parse(text).cmd
        if cmd is None or cmd.name not in DEVICE_COMMANDS:
            raise PolicyViolation(f"{text!r} is not a device command a job may send")
        args = dict(cmd.args)
        if cmd.name == "get_data":
            pair = get_data(pair, **args)
        elif cmd.name == "filter":
            pair = filter_sensors(pair, sorted(args.get("sensors", frozenset())))
        else:
            pair = in_geofence_cond(pair, **args)
    if derivative(pair.policy, Call("runFL")) == ZERO:
        done = "the job's program" if program else (", ".join(commands) or "no commands")
        raise PolicyViolation(
            f"after {done} the policy {show(pair.policy)!r} does not allow runFL; it would accept: "
            + (", ".join(next_commands(pair.policy)) or "nothing")
        )
    return pair


# --- groups, stages, DP aggregation ---------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyGroup:
    """A group of users with one policy (Table 3): its ``name``, ``policy``, the device ``commands`` a
    compliant program runs before ``runFL`` (or a device ``program``, RestrictedPython source defining
    ``prepare(data)``, which replaces them), the ``noise_std`` ``sigma`` its policy's DP needs (``None``:
    no DP) and its ``members``."""

    name: str
    policy: Policy
    commands: tuple[str, ...]
    noise_std: float | None
    members: tuple[ClientId, ...]
    program: str = ""

    def __post_init__(self) -> None:
        if not self.members:
            raise ConfigError(f"group {self.name} has no members")
        if self.noise_std is not None and not (math.isfinite(self.noise_std) and self.noise_std > 0):
            raise ConfigError(f"group {self.name}: noise {self.noise_std!r} must be a number > 0 (or none)")
        for text in self.commands:
            cmd = parse(text)
            if cmd.kind != "cmd" or cmd.cmd is None or cmd.cmd.name not in DEVICE_COMMANDS:
                raise ConfigError(
                    f"group {self.name}: {text!r} is not a device command before runFL "
                    f"({', '.join(DEVICE_COMMANDS)})"
                )

    @property
    def budget(self) -> float | None:
        """The epsilon the group's policy allows (:func:`~fedveil.privacy.policy.budget_of`)."""
        return budget_of(self.policy)


@dataclass(frozen=True)
class Stage:
    """One ``runFL``: the ``groups`` trained together for ``rounds`` at noise ``noise_std`` (``None``: no
    DP)."""

    groups: tuple[PolicyGroup, ...]
    rounds: int
    noise_std: float | None

    @property
    def name(self) -> str:
        """``g1+g2``."""
        return "+".join(g.name for g in self.groups)

    @property
    def members(self) -> list[ClientId]:
        """Every member of the stage's groups."""
        return [c for g in self.groups for c in g.members]


def stage_of(groups: Sequence[PolicyGroup], rounds: int) -> Stage:
    """One ``runFL`` stage of ``groups`` for ``rounds``, at the strictest noise among them (the largest
    ``sigma``: every group's policy must hold for the combined model; Table 4's combined row), refused
    when some groups use DP and others do not."""
    if not groups:
        raise ConfigError("a stage needs at least one group")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ConfigError(f"rounds {rounds!r} must be an integer >= 1")
    noises = {g.noise_std is None for g in groups}
    if len(noises) > 1:
        raise ConfigError("groups trained together need DP noise for every group or for none")
    noise = None if True in noises else max(g.noise_std or 0.0 for g in groups)
    return Stage(tuple(groups), rounds, noise)


class DPAggregate:
    """The server's aggregation of a DP round (Eq. 1 with Alg. 3's clipping): ``G + (sum_i Clip(L_i - G,
    S) + N(0, sigma^2)) / n`` over the ``n`` updates received. The server clips again in central mode
    (the bound must hold whatever a device sends); in local mode the noise is already in each update
    (re-clipping would clip the noise) and ``sigma`` here is 0. Without DP (``clip_norm=None``) it is
    FedAvg's sample-weighted average. ``rng``: a seeded generator (simulation, float Gaussian noise) or,
    for deployments, a :class:`~fedveil.enclave.secure_noise.SecureNoise` (the sum snapped to a
    power-of-two grid plus exact discrete Gaussian noise from the OS's CSPRNG; epsilon by RDP)."""

    def __init__(
        self, *, clip_norm: float | None, noise_std: float, rng: np.random.Generator | SecureNoise
    ) -> None:
        self.clip_norm = clip_norm
        self.noise_std = noise_std
        self.rng = rng

    def __call__(self, rnd: int, results: Mapping[ClientId, FitResult], current: np.ndarray) -> np.ndarray:
        """The new shared parameters."""
        if self.clip_norm is None:
            return fedavg_aggregate(rnd, results, current)
        total = np.zeros(current.shape, dtype=np.float64)
        for r in results.values():
            assert r.weights is not None
            delta = np.asarray(r.weights, dtype=np.float64) - current
            if self.noise_std > 0:
                norm = float(np.linalg.norm(delta))
                delta = delta * min(1.0, self.clip_norm / norm) if norm > 0 else delta
            total += delta
        if self.noise_std > 0 and isinstance(self.rng, SecureNoise):
            total = self.rng.add_normal(total, self.noise_std)
        elif self.noise_std > 0:
            total += self.rng.normal(0.0, self.noise_std, size=total.shape)
        return (current + total / len(results)).astype(np.float32)


# --- the devices ------------------------------------------------------------------------------------------


class PolicyDevices:
    """Devices that hold their own data pairs and enforce their policies (a ``ClientPool``).

    ``pairs`` maps each device to its data pair (a dict with ``x``, ``y`` and, for sensor data,
    ``sensor_columns``; the policy is its group's). A :class:`JobStart` runs the job's device commands
    through the library on the device's pair; a device whose advanced policy does not admit ``runFL``
    refuses the job (:class:`JobReady` carries the reason) and trains nothing. A ``FitRequest`` is served
    only by devices that accepted the current job, by a :class:`~fedveil.protocols.fedavg.ModelClients`
    over the pairs' values with the job's :class:`~fedveil.protocols.fedavg.ClipAndNoise`. With a
    ``builder`` (networked devices, which serve many jobs), each job's model comes from its
    :class:`JobStart`'s spec; a spec the builder refuses is a refused job. ``secure_noise``: the devices'
    noise shares (local DP mode) come from the secure sampler (``ClipAndNoise(secure_noise=True)``), as
    networked devices' do; a simulation keeps each device's seeded generator. ``device``
    (:func:`~fedveil.models.device.resolve_device`) is where the accepted devices train (the model moves
    there; each job's prepared values move there once).
    """

    def __init__(
        self,
        flat: FlatModel | None,
        pairs: Mapping[ClientId, DataPolicyPair],
        *,
        optimizer: LocalOptimizer,
        seed: int,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.nn.functional.cross_entropy,
        batched: bool | None = None,
        time_limit: float = 10.0,
        memory_limit: int = 1 << 30,
        builder: ModelBuilder | None = None,
        secure_noise: bool = False,
        device: str | torch.device = "cpu",
    ) -> None:
        self.device = resolve_device(device)
        if flat is None and builder is None:
            raise ConfigError("devices need a model or a builder that makes each job's model from its spec")
        self.builder = builder
        self._built: dict[str, tuple[FlatModel, Any, bool | None]] = {}
        self.flat = flat
        self.pairs = dict(pairs)
        self.time_limit = time_limit
        self.memory_limit = memory_limit
        self._programs: dict[str, Program] = {}
        self.optimizer = optimizer
        self.seed = seed
        self.loss = loss
        self.batched = batched
        self.secure_noise = secure_noise
        self.prepared: dict[ClientId, DataPolicyPair] = {}
        self.trainer: ModelClients | None = None

    def client_ids(self) -> list[ClientId]:
        """Every device."""
        return list(self.pairs)

    def handle_batch(self, msgs: Mapping[ClientId, object]) -> dict[ClientId, object]:
        """Job starts and local training."""
        out: dict[ClientId, object] = {}
        starts = {c: m for c, m in msgs.items() if isinstance(m, JobStart)}
        if starts:
            out.update(self._start(starts))
        fits = {c: m for c, m in msgs.items() if not isinstance(m, JobStart)}
        if fits:
            out.update(self._fit(fits))
        return out

    def _prepare(self, cid: ClientId, m: JobStart) -> DataPolicyPair:
        return prepare_pair(
            self.pairs[cid],
            m.commands,
            m.program,
            name=m.job,
            programs=self._programs,
            time_limit=self.time_limit,
            memory_limit=self.memory_limit,
        )

    def _admit(self, msgs: Mapping[ClientId, JobStart]) -> dict[ClientId, object]:
        """Each device's preparation for the job through the library and its policy: a :class:`JobReady`
        per device, and :attr:`prepared` holds the pairs of the devices that accepted."""
        out: dict[ClientId, object] = {}
        self.prepared = {}
        for cid, m in msgs.items():
            try:
                pair = self._prepare(cid, m)
            except (PolicyViolation, ValidationError) as exc:
                out[cid] = JobReady(m.job, False, str(exc), "", 0)
                continue
            self.prepared[cid] = pair
            out[cid] = JobReady(m.job, True, "", show(pair.policy), len(pair._value()["y"]))
        return out

    def _start(self, msgs: Mapping[ClientId, JobStart]) -> dict[ClientId, object]:
        self.prepared = {}
        self.trainer = None
        job = next(iter(msgs.values()))
        if self.builder is not None and job.model:
            try:
                if job.model not in self._built:
                    self._built = {job.model: self.builder(job.model)}
                self.flat, self.loss, self.batched = self._built[job.model]
            except (ConfigError, ValidationError) as exc:
                return {c: JobReady(m.job, False, f"model refused: {exc}", "", 0) for c, m in msgs.items()}
        elif self.flat is None:
            return {c: JobReady(m.job, False, "the job names no model", "", 0) for c, m in msgs.items()}
        out = self._admit(msgs)
        users = [
            UserData(cid, {}, {"x": np.asarray(pair._value()["x"]), "y": np.asarray(pair._value()["y"])})
            for cid, pair in self.prepared.items()
        ]
        transform = None
        if job.clip_norm > 0:
            transform = ClipAndNoise(job.clip_norm, job.local_noise_std, 1, secure_noise=self.secure_noise)
        if users:
            assert self.flat is not None
            self.trainer = ModelClients(
                self.flat,
                FederatedDataset(users),
                optimizer=self.optimizer,
                seed=self.seed + zlib.crc32(job.job.encode()),
                loss=self.loss,
                transform=transform,
                batched=self.batched,
                device=self.device,
            )
        return out

    def _permitted(
        self, msgs: Mapping[ClientId, object]
    ) -> tuple[dict[ClientId, object], dict[ClientId, object]]:
        """(refusals, requests to serve): a device trains only for a job it accepted, and only while its
        pair's policy admits ``runFL``."""
        out: dict[ClientId, object] = {}
        allowed: dict[ClientId, object] = {}
        for cid, m in msgs.items():
            pair = self.prepared.get(cid)
            if pair is None:
                out[cid] = PolicyViolation(f"device {cid} has accepted no job; it trains nothing")
            elif derivative(pair.policy, Call("runFL")) == ZERO:
                out[cid] = PolicyViolation(f"device {cid}'s policy no longer allows runFL")
            else:
                allowed[cid] = m
        return out, allowed

    def _fit(self, msgs: Mapping[ClientId, object]) -> dict[ClientId, object]:
        out, allowed = self._permitted(msgs)
        if allowed:
            assert self.trainer is not None
            out.update(self.trainer.handle_batch(allowed))
        return out


# --- one stage --------------------------------------------------------------------------------------------


@dataclass
class StageResult:
    """What a stage produced: the model's pair, the devices that refused the job (with reasons), the
    per-round reports and the noise multiplier and sampling rate accounted."""

    model: DataPolicyPair
    refused: dict[ClientId, str]
    reports: list[RoundReport] = field(default_factory=list)
    z: float | None = None
    q: float = 0.0


@dataclass(frozen=True)
class StageResume:
    """Where an interrupted stage goes on: after its round ``rounds``, from the model's ``weights`` then.
    ``rewind`` is called once the job has started on the devices again, before the next round: it sets
    the generators the rounds draw from (the DP noise's, the devices') to their states after that
    round."""

    rounds: int
    weights: np.ndarray
    rewind: Callable[[], None]


async def run_stage(
    stage: Stage,
    *,
    job: str,
    model: DataPolicyPair,
    server: ModelServer,
    comm: Communicator,
    ledger: GroupLedger,
    clip_norm: float | None,
    dp_mode: str,
    rng: np.random.Generator,
    on_round: Callable[[int, RoundReport], None] | None = None,
    model_spec: str = "",
    resume: StageResume | None = None,
) -> StageResult:
    """Run one ``runFL`` stage on the engine (module docstring): start the job on the stage's devices
    (``model_spec``: the model networked devices build, :class:`JobStart`), train ``stage.rounds`` rounds
    from ``model``'s value, record each round in ``ledger`` and return the model's advanced pair.
    ``resume`` goes on with an interrupted stage after its last checkpointed round (the server's
    selection generator and ``ledger`` already as they were then): the job starts again, the rounds
    before are not trained again."""
    if dp_mode not in DP_MODES:
        raise ConfigError(f"dp mode {dp_mode!r} is not one of {', '.join(DP_MODES)}")
    dp = stage.noise_std is not None
    if dp and clip_norm is None:
        raise ConfigError(f"stage {stage.name} adds DP noise but no clip norm S is set")
    m = server.cfg.clients_per_round
    local_std = stage.noise_std / math.sqrt(m) if dp and dp_mode == "local" else 0.0
    starts = {
        c: JobStart(
            job,
            g.commands,
            g.program,
            float(clip_norm or 0.0) if dp else 0.0,
            float(local_std or 0.0),
            model_spec,
        )
        for g in stage.groups
        for c in g.members
    }
    replies = await comm.request(
        starts, phase="job", min_replies=len(starts), timeout=60.0, expected=JobReady
    )
    ready = [c for c, r in replies.items() if r.accepted]
    refused = {c: r.reason for c, r in replies.items() if not r.accepted}
    refused.update({c: "no reply" for c in starts if c not in replies})
    for cid, reason in sorted(refused.items()):
        log.warning("device %s refused job %s: %s", cid, job, reason)
    if not ready:
        raise PolicyViolation(
            f"no device of stage {stage.name} accepted job {job}; first refusal: "
            + next(iter(refused.values()), "none")
        )
    server.members = ready
    q = min(1.0, m / len(ready))
    z = noise_multiplier(stage.noise_std, clip_norm) if dp and stage.noise_std and clip_norm else None
    server.engine.aggregate = DPAggregate(
        clip_norm=clip_norm if dp else None,
        noise_std=float(stage.noise_std) if dp and dp_mode == "central" else 0.0,
        rng=rng,
    )
    reported = sorted({replies[c].policy for c in ready})
    scoped = run_fl(model, [DataPolicyPair(None, parse(text)) for text in reported])
    start = scoped._value() if resume is None else resume.weights
    server.engine.current = np.array(start, dtype=np.float32)
    if resume is not None:
        resume.rewind()
    result = StageResult(scoped, refused, z=z, q=q)
    for rnd in range(1 if resume is None else resume.rounds + 1, stage.rounds + 1):
        report = await server.run_round(rnd, comm)
        ledger.record([g.name for g in stage.groups], z=z, q=q)
        result.reports.append(report)
        if on_round is not None:
            on_round(rnd, report)
    result.model = DataPolicyPair(server.weights, scoped.policy)
    return result


def start_pair(weights: np.ndarray) -> DataPolicyPair:
    """The application's initial model: its own, with no policy of any user (``!0``)."""
    return DataPolicyPair(np.asarray(weights, dtype=np.float32), ANY)
