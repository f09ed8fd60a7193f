"""``fedveil polifl run CONFIG``: PoliFL's compliance strategies with per-group DP ([PoliFL], Sec. 6, Fig.
6-7, Tables 4-5) in simulation.

A config names the task (``images``: a zoo classifier on real Fashion-MNIST when installed, split over
clients by a Dirichlet prior; ``mpu``: the engagement LSTM on the **synthetic** MPU population of
:mod:`fedveil.data.mpu`; ``text``: next-word prediction with a 2-layer LSTM on Debian's license texts,
:mod:`fedveil.data.text`), the groups (their policy as the paper writes it, the device commands the
third-party program runs before ``runFL``, the DP noise ``sigma`` and the share of users), and the
strategies to compare: ``cascaded``, ``combined`` and ``single:GROUP``. Each strategy trains from the same
initial model on the same clients (:mod:`fedveil.protocols.polifl`), evaluates the model on the server
every ``eval_every`` rounds (accuracy, or ROC AUC for ``mpu``, on held-out data; each held-out user's data
as its group's program sees it, so filtered sensors are zero there too), spends each group's epsilon in
a :class:`~fedveil.privacy.groups.GroupLedger`, and tries to release each stage's model under the
stage's policies. A refused release is reported with the policy's reason and ends that strategy (its
model never leaves the server; a cascade cannot fine-tune a model it may not release).

The run resumes: after each stage the strategy's state (model weights as ``.npz``, ledger, history,
release outcome) is written to ``OUT/<strategy>/state.json`` + ``weights.npz``, and a rerun with
``resume`` continues from the next stage, under the same settings only (``OUT/config.json``); finished
strategies are not run again. Without ``resume`` a folder that holds anything is refused, unless
``overwrite`` clears it first. Inside a stage, the state is checkpointed after every round but the
stage's last (``state.json``'s ``partial``: the round, the stage's plan, the DP noise's generator and, in
simulation, the devices'; the model in ``call<i>.round<r>.npz``; the ledger and selection generator with
the rest), so a stage cut off mid-way goes on after its last checkpointed round and ends with the
uninterrupted run's model (over the network the devices' generators stay on the devices). Ctrl-C
stops at the end of the round in progress, after its checkpoint
(:class:`~fedveil.experiments.checkpoint.StopAtRoundEnd`).
``results.json`` and ``curves.png`` (the metric over rounds per strategy: Fig. 6/7's shape, with the
task's chance level and, after each stage, the epsilon its groups had spent over their budgets) are
rewritten after every stage.
"""

from __future__ import annotations

import asyncio
import inspect
import io
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from tqdm import tqdm

from fedveil.core.atomic import atomic_write
from fedveil.core.communicator import Communicator
from fedveil.core.provenance import code_identity
from fedveil.enclave.secure_noise import SecureNoise
from fedveil.errors import ConfigError, RunInterrupted
from fedveil.eval.plots import method_colours, save_png
from fedveil.experiments.checkpoint import (
    StopAtRoundEnd,
    claim_device,
    crash_point,
    differing_settings,
    identity_settings,
    prepare_run_dir,
    saved_settings,
)
from fedveil.experiments.config import load_run_config
from fedveil.experiments.plots import Note, Reference, series_figure
from fedveil.experiments.report import announce_stand_in
from fedveil.models.device import check_device_spec, module_device, resolve_device
from fedveil.models.flat import FlatModel
from fedveil.privacy.groups import GroupLedger, noise_multiplier
from fedveil.privacy.pairs import DataPolicyPair, PolicyViolation
from fedveil.privacy.policy import budget_of, parse, show
from fedveil.privacy.sandbox import (
    DeadlineExceeded,
    SandboxError,
    check_deadline,
    compile_program,
    run_program,
)
from fedveil.protocols.common import pool_rng_states, restore_pool_rngs
from fedveil.protocols.fedavg import ImageFedAvgConfig, ModelServer
from fedveil.protocols.local import LocalOptimizer
from fedveil.protocols.polifl import (
    PolicyDevices,
    PolicyGroup,
    Stage,
    StageResume,
    enforce_budget,
    prepare_pair,
    release_model,
    run_fl,
    run_stage,
    stage_of,
    start_pair,
)
from fedveil.runtime.simulation import SimulationRuntime

__all__ = ["GroupSpec", "PolifLRun", "Task", "build_task", "load_polifl_run", "run_polifl"]

TASKS = ("images", "mpu", "text")

RoundHook = Callable[[dict[str, Any], Callable[[], dict[str, float]]], None]
"""Called after every training round with the round's history line and a function that returns each
stage group's epsilon so far (computed only when called). It may raise to stop the run: a
non-:class:`~fedveil.errors.FedveilError` exception propagates out of :func:`run_strategy`, and a rerun
resumes from the last finished call."""


@dataclass(frozen=True)
class GroupSpec:
    """One group: ``name``, ``policy`` (paper syntax), the ``fraction`` of users in it, the DP ``noise``
    ``sigma`` its policy's budget calls for (none: no DP) and what runs on its devices before ``runFL``:
    the device ``commands``, or a third-party ``program`` (RestrictedPython source defining
    ``prepare(data)``, run in the sandbox; it replaces the commands)."""

    name: str
    policy: str
    fraction: float = 0.5
    noise: float | None = None
    commands: tuple[str, ...] = ("get_data",)
    program: str = ""

    def __post_init__(self) -> None:
        parse(self.policy)
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"group {self.name}: fraction {self.fraction!r} must be in (0, 1]")


@dataclass(frozen=True)
class PolifLRun:
    """A run's settings (module docstring). ``clients`` users (``mpu``: the synthetic population's size,
    237 in the paper), ``samples_per_client`` examples each (``images``), ``hidden`` LSTM units
    (``mpu``; the paper: 500), FedAvg with ``clients_per_round``, local SGD, ``server_lr`` (Eq. 1's
    ``eta``), DP with ``clip_norm`` ``S`` in ``dp_mode`` ``central`` or ``local`` (Alg. 3), accounted at
    ``delta`` by ``accounting`` (``pld`` or ``rdp``); ``vocab`` words (``text``; ``hidden`` is then the
    embedding and LSTM width, 200 in the paper); ``rounds`` per group stage (``combined`` trains
    ``rounds x groups``); ``stop_at_budget`` shortens a stage to the rounds every group's budget allows.
    ``device``: where the simulated devices train (:func:`~fedveil.models.device.resolve_device`)."""

    name: str = "polifl"
    task: str = "images"
    data: str = "fashion-mnist"
    clients: int = 100
    samples_per_client: int = 100
    scheme: str = "dirichlet:0.9"
    test_samples: int = 2000
    model: str = "lenet"
    hidden: int = 64
    vocab: int = 2000
    clients_per_round: int = 10
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.1
    server_lr: float = 1.0
    clip_norm: float = 15.0
    dp_mode: str = "central"
    delta: float = 1e-5
    accounting: str = "pld"
    groups: tuple[GroupSpec, ...] = ()
    strategies: tuple[str, ...] = ("cascaded", "combined")
    rounds: int = 20
    stop_at_budget: bool = False
    program: str = ""
    program_time_limit: float = 60.0
    eval_every: int = 5
    seed: int = 0
    threads: int = 2
    device: str = "auto"

    def __post_init__(self) -> None:
        check_device_spec(self.device)
        if self.task not in TASKS:
            raise ConfigError(f"task {self.task!r} is not one of {', '.join(TASKS)}")
        if len(self.groups) < 1:
            raise ConfigError("a PoliFL run needs at least one group (groups: [{name, policy, ...}])")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ConfigError(f"group names {names} must be distinct")
        if sum(g.fraction for g in self.groups) > 1 + 1e-9:
            raise ConfigError(f"group fractions {[g.fraction for g in self.groups]} add up to more than 1")
        for s in self.strategies:
            kind, _, group = s.partition(":")
            if kind not in ("single", "combined", "cascaded", "program") or (kind == "single") != bool(group):
                raise ConfigError(f"strategy {s!r}: use cascaded, combined, single:GROUP or program")
            if kind == "program" and not self.program:
                raise ConfigError("strategy 'program' needs the job's global program as program: <source>")
            if group and group not in names:
                raise ConfigError(f"strategy {s!r} names no group of this run ({', '.join(names)})")
        for name in ("clients", "samples_per_client", "clients_per_round", "rounds", "hidden"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} {getattr(self, name)!r} must be >= 1")
        if self.clients < 2 * len(self.groups):
            raise ConfigError(f"{self.clients} clients cannot fill {len(self.groups)} groups")
        if self.eval_every < 1:
            raise ConfigError(f"eval_every {self.eval_every!r} must be >= 1")
        if not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise ConfigError(f"clip_norm {self.clip_norm!r} must be a number > 0")


def load_polifl_run(path: str | Path, overrides: Mapping[str, Any] | None = None) -> PolifLRun:
    """A :class:`PolifLRun` from a YAML file with ``overrides`` (e.g. ``--set``'s) on top: unknown keys and
    wrong values are refused, named, and so is a global ``program`` no strategy runs
    (:func:`~fedveil.experiments.config.load_run_config`)."""
    return load_run_config(PolifLRun, path, overrides, unused=_unused_settings)


def _unused_settings(run: PolifLRun) -> list[tuple[str, bool, str]]:
    """The settings ``run`` ignores (:func:`~fedveil.experiments.config.keys_without_effect`)."""
    why = f"only the 'program' strategy runs it; strategies are {', '.join(run.strategies)}"
    return [("program", "program" not in run.strategies, why)]


@dataclass
class Task:
    """A use case built for a run: the model, each client's data (``values``), the groups' members,
    the loss, whether the cohort trains batched, the metric's name and the evaluation of weights (``None``
    where the server holds no test data: networked devices), the model's spec (what networked devices
    build) and ``stand_in``, which synthetic data stands in for real data (``None``: the data is real).
    ``initial`` is the model's initial vector, taken when the task is built: every strategy starts
    from it (evaluating loads other weights into the module)."""

    flat: FlatModel
    values: dict[str, dict[str, Any]]
    members: dict[str, list[str]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batched: bool | None
    metric: str
    evaluate: Callable[[np.ndarray], float] | None
    description: str = ""
    spec: ModelSpec | None = None
    stand_in: str | None = None
    initial: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.initial = self.flat.initial().copy()


@dataclass(frozen=True)
class ModelSpec:
    """What a device needs to build a job's model (it travels in :class:`~fedveil.protocols.polifl.JobStart`
    as JSON; the server's initial weights come with the first round): the ``task``, the zoo ``model`` name
    (``images``), the LSTM width ``hidden`` (``mpu``, ``text``), the ``vocab`` size (``text``) and, for
    images, the classes, channels and image size."""

    task: str
    model: str = "lenet"
    hidden: int = 64
    vocab: int = 2000
    num_classes: int = 10
    in_channels: int = 1
    image_size: int = 28

    def to_json(self) -> str:
        """The spec as it travels."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        """A spec from a job; unknown keys or a task outside :data:`TASKS` are refused."""
        try:
            fields = json.loads(text)
            spec = cls(**fields) if isinstance(fields, dict) else None
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"model spec {text[:80]!r} is not valid: {exc}") from None
        if spec is None or spec.task not in TASKS:
            raise ConfigError(f"model spec {text[:80]!r} names no task of {', '.join(TASKS)}")
        return spec


def task_model(
    spec: ModelSpec, seed: int = 0
) -> tuple[FlatModel, Callable[[torch.Tensor, torch.Tensor], torch.Tensor], bool | None]:
    """The flat model, loss and batching of ``spec`` (every use case builds its model here; devices build
    a job's model from its spec). Only allow-listed architectures: the zoo's image models, EngagementNet
    (LSTM, 15 MPU sensors) and the 2-layer next-word LSTM."""
    from fedveil.models.behaviour import EngagementNet, NextWordLSTM, binary_logit_loss, sequence_loss

    torch.manual_seed(seed)
    if spec.task == "images":
        from fedveil.models.zoo import MODELS, build_model

        if spec.model not in MODELS:
            raise ConfigError(f"model {spec.model!r} is not in the zoo ({', '.join(MODELS)})")
        module = build_model(
            spec.model,
            num_classes=spec.num_classes,
            in_channels=spec.in_channels,
            image_size=spec.image_size,
            seed=seed,
        )
        return FlatModel(module), torch.nn.functional.cross_entropy, None
    for name in ("hidden", "vocab"):
        if not 1 <= getattr(spec, name) <= 100_000:
            raise ConfigError(f"model {name} {getattr(spec, name)} must be between 1 and 100000")
    if spec.task == "mpu":
        from fedveil.data.mpu import SENSORS

        return FlatModel(EngagementNet(len(SENSORS), hidden=spec.hidden)), binary_logit_loss, False
    return (
        FlatModel(NextWordLSTM(spec.vocab, embedding=spec.hidden, hidden=spec.hidden)),
        sequence_loss,
        False,
    )


def _assign(ids: list[str], run: PolifLRun) -> dict[str, list[str]]:
    order = [ids[i] for i in np.random.default_rng(run.seed + 11).permutation(len(ids))]
    members: dict[str, list[str]] = {}
    start = 0
    for g in run.groups:
        take = round(g.fraction * len(ids))
        members[g.name] = sorted(order[start : start + take])
        start += take
        if not members[g.name]:
            raise ConfigError(f"group {g.name} gets no users: raise its fraction or the number of clients")
    return members


def _images(run: PolifLRun, members: dict[str, list[str]] | None) -> Task:
    from fedveil.experiments.fedavg_images import FedAvgRun, split_images
    from fedveil.protocols.fedavg import evaluate_model

    split = split_images(
        FedAvgRun(
            data=run.data,
            model=run.model,
            clients=run.clients,
            samples_per_client=run.samples_per_client,
            scheme=run.scheme,
            test_samples=run.test_samples,
            seed=run.seed,
        )
    )
    ids = list(split.data.user_ids)
    values = {c: {"x": split.data.array(c, "x"), "y": split.data.array(c, "y")} for c in ids}
    spec = ModelSpec(
        "images",
        run.model,
        num_classes=split.members.num_classes,
        in_channels=split.members.image_shape[0],
        image_size=split.members.image_shape[1],
    )
    flat, loss, batched = task_model(spec, run.seed)
    test = split.test

    def evaluate(weights: np.ndarray) -> float:
        return evaluate_model(flat.load_into_module(weights), test.x, test.y)["accuracy"]

    return Task(
        flat,
        values,
        members or _assign(ids, run),
        loss,
        batched,
        "accuracy",
        evaluate,
        f"{run.model} on {split.train.name}, {run.clients} clients x {run.samples_per_client} ({run.scheme})",
        spec,
        f"{split.train.name}, {split.train.source}" if split.train.synthetic else None,
    )


def _mpu(run: PolifLRun, members: dict[str, list[str]] | None) -> Task:
    from fedveil.data.mpu import SENSORS, synthetic_mpu
    from fedveil.eval.verification import roc_auc

    users = synthetic_mpu(run.clients, seed=run.seed)
    ids = list(users)
    members = members or _assign(ids, run)
    values = {c: {"x": u["x"], "y": u["y"], "sensor_columns": tuple(SENSORS)} for c, u in users.items()}
    group_of = {c: g for g, cs in members.items() for c in cs}
    specs = {g.name: g for g in run.groups}
    programs: dict[str, Any] = {}
    xs, ys = [], []
    for c, u in users.items():
        x = u["test_x"]
        if c in group_of:
            g = specs[group_of[c]]
            held_out = {"x": x, "y": u["test_y"], "sensor_columns": tuple(SENSORS)}
            try:
                pair = prepare_pair(
                    DataPolicyPair(held_out, parse(g.policy)), g.commands, g.program, programs=programs
                )
            except PolicyViolation as exc:
                raise PolicyViolation(f"group {g.name}: {exc}") from None
            x = np.asarray(pair._value()["x"])
        xs.append(x)
        ys.append(u["test_y"])
    test_x = torch.from_numpy(np.concatenate(xs))
    test_y = np.concatenate(ys)
    spec = ModelSpec("mpu", hidden=run.hidden)
    flat, loss, batched = task_model(spec, run.seed)

    def evaluate(weights: np.ndarray) -> float:
        model = flat.load_into_module(weights).eval()
        with torch.no_grad():
            scores = model(test_x.to(module_device(model))).cpu().numpy()
        return roc_auc(scores[test_y == 1], scores[test_y == 0])

    return Task(
        flat,
        values,
        members,
        loss,
        batched,
        "auc",
        evaluate,
        f"SYNTHETIC MPU: {run.clients} users, 15 sensors, EngagementNet (LSTM {run.hidden} units)",
        spec,
        f"{run.clients} users of the synthetic MPU population (fedveil.data.mpu), for the paper's phones",
    )


def _text(run: PolifLRun, members: dict[str, list[str]] | None) -> Task:
    from fedveil.data.text import text_users

    users, _, source = text_users(run.clients, vocab=run.vocab, seed=run.seed)
    ids = list(users)
    values = {c: {"x": u["x"], "y": u["y"]} for c, u in users.items()}
    test_x = torch.from_numpy(np.concatenate([u["test_x"] for u in users.values()]))
    test_y = torch.from_numpy(np.concatenate([u["test_y"] for u in users.values()]))
    spec = ModelSpec("text", hidden=run.hidden, vocab=run.vocab)
    flat, loss, batched = task_model(spec, run.seed)

    def evaluate(weights: np.ndarray) -> float:
        model = flat.load_into_module(weights).eval()
        where = module_device(model)
        with torch.no_grad():
            hits = sum(
                int((model(test_x[i : i + 64].to(where)).argmax(-1).cpu() == test_y[i : i + 64]).sum())
                for i in range(0, len(test_x), 64)
            )
        return hits / test_y.numel()

    return Task(
        flat,
        values,
        members or _assign(ids, run),
        loss,
        batched,
        "accuracy",
        evaluate,
        f"next word on {source}: {len(ids)} users, vocabulary {run.vocab}, 2-layer LSTM {run.hidden} units",
        spec,
        source if "SYNTHETIC" in source else None,
    )


def build_task(run: PolifLRun, members: dict[str, list[str]] | None = None) -> Task:
    """The run's use case (module docstring); ``members`` (group name -> user ids) replaces the seeded
    assignment by the groups' fractions (a service knows its devices' groups)."""
    if members is not None:
        names = {g.name for g in run.groups}
        if set(members) != names or not all(members.values()):
            raise ConfigError(f"members must name users for exactly the groups {sorted(names)}")
    task = {"images": _images, "mpu": _mpu, "text": _text}[run.task](run, members)
    unknown = sorted({c for cs in task.members.values() for c in cs} - set(task.values))
    if unknown:
        raise ConfigError(f"members {unknown[:5]} are not users of the {run.task} task")
    return task


# --- one strategy: a global program in the sandbox, the server's functions as its host ------------------

STRATEGY_PROGRAMS = {
    "cascaded": """
def main(model, groups, rounds):
    def strictness(g):
        budget = g["budget"] if g["budget"] is not None else 1e300
        noise = g["noise"] if g["noise"] is not None else 0.0
        return [budget, -noise, g["index"]]

    for g in sorted(groups, key=strictness):
        model = release(run_fl(model, [g["name"]], rounds))
    return model
""",
    "combined": """
def main(model, groups, rounds):
    names = [g["name"] for g in groups]
    return release(run_fl(model, names, rounds * len(names)))
""",
    "single": """
def main(model, groups, rounds):
    return release(run_fl(model, [groups[0]["name"]], rounds))
""",
}
"""The compliance strategies as global programs (Sec. 6): ``cascaded`` trains the most restrictive group
first (smallest budget, then largest noise, then config order) and releases each stage's model before the
next fine-tunes it; ``combined`` trains everyone for ``rounds x groups`` rounds; ``single`` one group."""


@dataclass
class _State:
    calls: list[dict[str, Any]] = field(default_factory=list)
    round: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    stages: list[dict[str, Any]] = field(default_factory=list)
    ledger: dict[str, Any] | None = None
    selection: dict[str, Any] | None = None
    partial: dict[str, Any] | None = None
    stopped: str | None = None
    released: bool = False
    done: bool = False


def _groups(run: PolifLRun, task: Task) -> list[PolicyGroup]:
    return [
        PolicyGroup(
            g.name, parse(g.policy), tuple(g.commands), g.noise, tuple(task.members[g.name]), g.program
        )
        for g in run.groups
    ]


@dataclass(frozen=True)
class Network:
    """Devices reached over the network (:class:`~fedveil.runtime.network.server.NetworkRuntime`): the
    communicator and the event loop it serves on (another thread's); each stage runs there."""

    comm: Communicator
    loop: asyncio.AbstractEventLoop


def network_task(run: PolifLRun, members: dict[str, list[str]]) -> Task:
    """A run's task when its devices are networked agents: the model from the run's spec, the groups'
    ``members`` (device ids), and, instead of the devices' data (which stays on them), a stand-in with
    the structure of one user's data and no rows (built from the task's seeded synthetic or public
    population: the dry run's device-side checks need the structure only). No server-side evaluation."""
    probe = replace(
        run,
        clients=max(4, 2 * len(run.groups)),
        samples_per_client=4,
        test_samples=10,
        vocab=min(run.vocab, 50),
    )
    local = build_task(probe)
    sample = next(iter(local.values.values()))
    standin = {k: (v[:0] if isinstance(v, np.ndarray) else v) for k, v in sample.items()}
    assert local.spec is not None
    spec = replace(local.spec, vocab=run.vocab)
    flat, loss, batched = task_model(spec, run.seed)
    description = (
        f"{run.task} model {spec.to_json()} on networked devices ({sum(map(len, members.values()))})"
    )
    return Task(flat, {"(stand-in)": standin}, dict(members), loss, batched, "none", None, description, spec)


class _Host:
    """The server's side of a job (the functions a global program calls, :func:`run_program`'s ``host``):
    ``run_fl``, ``release``, the three budget commands and ``epsilon``. Every call is logged with its
    outcome in ``state.json`` (``run_fl``'s model in ``call<i>.npz``), so a rerun replays finished calls
    instead of training again and the program, being deterministic, continues where it stopped.

    A call with arguments a function does not take (their number, a keyword, a type: a model that is no
    handle, a group that is not the job's) is a :class:`~fedveil.errors.ConfigError` naming the function
    and the argument, which reaches the program as an exception it may catch. ``deadline``
    (``time.monotonic()``): every call checks it before and after its work and each ``run_fl`` round
    after the round; past it, :class:`~fedveil.privacy.sandbox.DeadlineExceeded` stops the program."""

    def __init__(
        self,
        run: PolifLRun,
        task: Task,
        strategy: str,
        folder: Path,
        progress: bool,
        *,
        dry: bool = False,
        on_round: RoundHook | None = None,
        network: Network | None = None,
        deadline: float | None = None,
        stop: StopAtRoundEnd | None = None,
    ) -> None:
        self.run, self.task, self.strategy, self.folder, self.progress = run, task, strategy, folder, progress
        self.dry, self.on_round, self.network, self.deadline = dry, on_round, network, deadline
        self.stop = stop
        self.state_path = folder / "state.json"
        self.state = (
            _State(**json.loads(self.state_path.read_text())) if self.state_path.exists() else _State()
        )
        self.groups = {g.name: g for g in _groups(run, task)}
        # networked runs add discrete Gaussian noise (the secure sampler): its RDP curve is the continuous
        # Gaussian's, its exact privacy loss distribution is not, so they are accounted by RDP
        method = "rdp" if network is not None else run.accounting
        self.ledger = GroupLedger(list(self.groups), delta=run.delta, method=method)
        if self.state.ledger is not None:
            self.ledger.restore(self.state.ledger)
        self.optimizer = LocalOptimizer("sgd", run.lr)
        self.runtime: Communicator
        self.devices: PolicyDevices | None = None
        if network is not None:
            self.runtime = network.comm
        else:
            group_of = {c: g for g in self.groups.values() for c in g.members}
            pairs = {
                c: DataPolicyPair(v, group_of[c].policy) for c, v in task.values.items() if c in group_of
            }
            devices = PolicyDevices(
                task.flat,
                pairs,
                optimizer=self.optimizer,
                seed=run.seed,
                loss=task.loss,
                batched=task.batched,
                device=run.device,
            )
            self.runtime = SimulationRuntime(devices, rng=np.random.default_rng(run.seed + 1))
            self.devices = devices
        cfg = ImageFedAvgConfig(
            clients_per_round=run.clients_per_round,
            local_epochs=run.local_epochs,
            batch_size=run.batch_size,
            optimizer=self.optimizer,
            server_lr=run.server_lr,
            eval_every=0,
        )
        self.initial = task.initial
        self.server = ModelServer(cfg, task.flat, np.random.default_rng(run.seed + 2), initial=self.initial)
        if self.state.selection is not None:
            self.server.engine.rng.bit_generator.state = self.state.selection
        self.contributors: dict[int, frozenset[str]] = {}
        self.released: set[int] = set()
        self.refusals: list[str] = []
        self.calls = 0
        if not self.state.history and not dry and task.evaluate is not None:
            self.state.history.append({"round": 0, "stage": "", task.metric: task.evaluate(self.initial)})

    def functions(self) -> dict[str, Any]:
        """The host functions by the names programs call them; each policy refusal is also kept in
        :attr:`refusals` (a program may catch it, the run's summary still names it)."""
        functions: dict[str, Callable[..., Any]] = {
            "run_fl": self.run_fl,
            "release": self.release,
            "check_privacy_budget": lambda model, max_eps: self.budget(
                model, "check_privacy_budget", max_eps
            ),
            "enforce_privacy_budget": lambda model, max_eps: self.budget(
                model, "enforce_privacy_budget", max_eps
            ),
            "enforce_dp_budget": lambda model, eps: self.budget(model, "enforce_dp_budget", eps),
            "epsilon": self.epsilon,
        }
        return {name: self._guarded(name, f) for name, f in functions.items()}

    def _guarded(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` as the program calls it: its arguments bound (a mismatch is a ConfigError naming
        the function's parameters), the deadline checked before and after, each refusal noted."""
        signature = inspect.signature(function)
        usage = f"{name}({', '.join(signature.parameters)})"

        def call(*args: Any, **kwargs: Any) -> Any:
            check_deadline(self.deadline, f"job {self.run.name}")
            try:
                signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise ConfigError(f"{usage} called wrongly: {exc}") from None
            try:
                result = function(*args, **kwargs)
            except PolicyViolation as exc:
                self.refusals.append(str(exc))
                raise
            check_deadline(self.deadline, f"job {self.run.name}")
            return result

        return call

    @staticmethod
    def _pair(model: Any, function: str) -> DataPolicyPair:
        """The pair a program's ``model`` argument stands for; a ConfigError if it is none."""
        if not isinstance(model, DataPolicyPair):
            raise ConfigError(
                f"{function}'s model must be the model main() was given or one that run_fl, release or a "
                f"budget command returned, not {type(model).__name__} {str(model)[:50]!r}"
            )
        return model

    def epsilon(self, name: str) -> float:
        """The epsilon group ``name`` has spent so far."""
        if not isinstance(name, str) or name not in self.groups:
            raise ConfigError(
                f"epsilon({str(name)[:50]!r}): name one of this job's groups ({', '.join(self.groups)})"
            )
        return self.ledger.epsilon(name)

    def _save(self) -> None:
        self.state.ledger = self.ledger.state()
        self.state.selection = self.server.engine.rng.bit_generator.state
        atomic_write(self.state_path, json.dumps(asdict(self.state), indent=1, default=_json).encode())

    def _logged(self, kind: str) -> dict[str, Any] | None:
        i = self.calls
        self.calls += 1
        if i < len(self.state.calls):
            entry = self.state.calls[i]
            if entry["kind"] != kind:
                raise ConfigError(
                    f"resumed program called {kind} where the log has {entry['kind']}: rerun afresh"
                )
            return entry
        return None

    def _spent(self, model: DataPolicyPair) -> dict[str, float]:
        return {g: self.ledger.epsilon(g) for g in sorted(self.contributors.get(id(model), frozenset()))}

    def run_fl(self, model: DataPolicyPair, names: list[str], rounds: int) -> DataPolicyPair:
        """Train the named groups together for ``rounds`` from ``model`` (one ``runFL`` stage); at most
        the run's ``rounds`` times its number of groups (what ``combined`` asks for) in one call."""
        model = self._pair(model, "run_fl")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"run_fl's names {str(names)[:50]!r} must be a list of group names")
        unknown = sorted(set(names) - set(self.groups))
        if unknown or not names:
            raise ConfigError(
                f"run_fl names groups {unknown or names} this job does not have ({', '.join(self.groups)})"
            )
        most = self.run.rounds * len(self.run.groups)
        if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= most:
            raise ConfigError(
                f"run_fl rounds {str(rounds)[:50]!r} must be an integer from 1 to {most} (the job's rounds "
                "times its groups)"
            )
        entry = self._logged("run_fl")
        index = self.calls - 1
        weights_path = self.folder / f"call{index}.npz"
        if self.dry:
            entry = self._plan(model, [self.groups[n] for n in names], rounds)
            out = DataPolicyPair(model._value(), parse(entry["policy"]))
            self.contributors[id(out)] = self.contributors.get(id(model), frozenset()) | frozenset(names)
            return out
        if entry is None:
            entry = self._train(model, [self.groups[n] for n in names], rounds)
            atomic_write(weights_path, _npz(self.server.weights))
            self.state.calls.append(entry)
            self._save()
            for stale in self.folder.glob(f"call{index}.round*.npz"):
                stale.unlink()
        with np.load(weights_path, allow_pickle=False) as z:
            out = DataPolicyPair(np.asarray(z["weights"], dtype=np.float32), parse(entry["policy"]))
        self.contributors[id(out)] = self.contributors.get(id(model), frozenset()) | frozenset(names)
        return out

    def _plan(self, model: DataPolicyPair, groups: list[PolicyGroup], rounds: int) -> dict[str, Any]:
        """A dry run's ``run_fl``: the same stage, budget stop, device-side program (on a stand-in of the
        devices' data with no rows: only its structure) and ``runFL`` policy checks as a real stage, and
        the rounds charged to the ledger at the noise and sampling rate they would have, without
        training."""
        run = self.run
        stage, row = self._stage(groups, rounds)
        sample = next(iter(self.task.values.values()))
        standin = {k: (v[:0] if isinstance(v, np.ndarray) else v) for k, v in sample.items()}
        prepared = []
        for g in groups:
            try:
                prepared.append(
                    prepare_pair(DataPolicyPair(standin, g.policy), g.commands, g.program, name=self.strategy)
                )
            except PolicyViolation as exc:
                raise PolicyViolation(f"group {g.name}: {exc}") from None
        scoped = run_fl(model, [DataPolicyPair(None, p.policy) for p in prepared])
        dp = stage.noise_std is not None
        z = noise_multiplier(stage.noise_std, run.clip_norm) if dp and stage.noise_std else None
        q = min(1.0, run.clients_per_round / len(stage.members))
        self.ledger.record([g.name for g in groups], z=z, q=q, rounds=stage.rounds)
        self.state.round += stage.rounds
        row.update({"z": z, "q": q, "epsilon": {g.name: self.ledger.epsilon(g.name) for g in groups}})
        self.state.stages.append(row)
        return {"kind": "run_fl", "policy": show(scoped.policy)}

    def _stage(self, groups: list[PolicyGroup], rounds: int) -> tuple[Stage, dict[str, Any]]:
        """The stage of ``groups`` for ``rounds``, shortened to what the budgets allow when the run stops
        at its budget, and its summary row."""
        run = self.run
        stage = stage_of(groups, rounds)
        row: dict[str, Any] = {"stage": stage.name, "groups": [g.name for g in groups]}
        row.update({"noise_std": stage.noise_std, "rounds_planned": stage.rounds})
        if run.stop_at_budget and stage.noise_std is not None:
            z = noise_multiplier(stage.noise_std, run.clip_norm)
            q = min(1.0, run.clients_per_round / len(stage.members))
            allowed = [
                self.ledger.affordable_rounds(g.name, z=z, q=q, budget=g.budget, limit=stage.rounds)
                for g in groups
                if g.budget is not None
            ]
            if allowed and min(allowed) < stage.rounds:
                if min(allowed) < 1:
                    raise PolicyViolation(f"stage {stage.name}: the groups' budgets allow no further round")
                stage = replace(stage, rounds=min(allowed))
                row["stopped_by_budget"] = True
        row["rounds"] = stage.rounds
        return stage, row

    def _train(self, model: DataPolicyPair, groups: list[PolicyGroup], rounds: int) -> dict[str, Any]:
        """Train one ``runFL`` call (the next one the log does not hold), checkpointed after each of its
        rounds but the last; a checkpoint of this call in ``state.json`` makes it go on from there."""
        run, task = self.run, self.task
        call, partial = len(self.state.calls), self.state.partial
        if partial is not None and partial["call"] != call:
            raise ConfigError(
                f"{self.state_path} holds a stage of run_fl call {partial['call']}, but the program's next "
                f"call to train is number {call}: rerun afresh (--overwrite)"
            )
        if partial is None:
            stage, row = self._stage(groups, rounds)
        else:  # the ledger already holds the stage's rounds so far: its plan is the checkpoint's
            row = dict(partial["row"])
            stage = replace(stage_of(groups, rounds), rounds=int(row["rounds"]))
        # networked devices are a deployment: the server's central noise then comes from the secure sampler
        noise: np.random.Generator | SecureNoise = (
            SecureNoise()
            if self.network is not None
            else np.random.default_rng(run.seed + 100 + len(self.state.stages))
        )
        bar = tqdm(
            total=stage.rounds, desc=f"{self.strategy} {stage.name}", disable=not self.progress, leave=False
        )
        base = self.state.round

        def checkpoint(rnd: int) -> None:
            """After the stage's round ``rnd``: the model (its own file), then the state that names it."""
            atomic_write(self.folder / f"call{call}.round{rnd}.npz", _npz(self.server.weights))
            previous = self.state.partial
            self.state.partial = {
                "call": call,
                "rounds": rnd,
                "row": row,
                "noise": noise.bit_generator.state if isinstance(noise, np.random.Generator) else None,
                "devices": None if self.devices is None else pool_rng_states(self.devices.trainer),
            }
            self._save()
            if previous is not None and previous["rounds"] != rnd:
                (self.folder / f"call{call}.round{previous['rounds']}.npz").unlink(missing_ok=True)
            crash_point("polifl_checkpoint", base + rnd)

        resume = None
        if partial is not None:
            done = int(partial["rounds"])
            with np.load(self.folder / f"call{call}.round{done}.npz", allow_pickle=False) as z:
                weights = np.asarray(z["weights"], dtype=np.float32)

            def rewind() -> None:
                if isinstance(noise, np.random.Generator) and partial["noise"] is not None:
                    noise.bit_generator.state = partial["noise"]
                if self.devices is not None and partial["devices"] is not None:
                    restore_pool_rngs(self.devices.trainer, partial["devices"])

            resume = StageResume(done, weights, rewind)

        def on_round(rnd: int, report: Any) -> None:
            check_deadline(self.deadline, f"job {self.run.name}")
            bar.update(1)
            line: dict[str, Any] = {"round": base + rnd, "stage": stage.name, "loss": report.loss}
            if task.evaluate is not None and (rnd % run.eval_every == 0 or rnd == stage.rounds):
                line[task.metric] = task.evaluate(self.server.weights)
                bar.set_postfix({task.metric: f"{line[task.metric]:.3f}"})
            self.state.history.append(line)
            if self.on_round is not None:
                self.on_round(line, lambda: {g.name: self.ledger.epsilon(g.name) for g in groups})
            if rnd < stage.rounds:  # the stage's last round ends in its saved state
                checkpoint(rnd)
                if self.stop is not None:
                    self.stop.check()

        started = time.perf_counter()
        stage_run = run_stage(
            stage,
            job=f"{run.name}/{self.strategy}/{stage.name}",
            model=model,
            server=self.server,
            comm=self.runtime,
            ledger=self.ledger,
            clip_norm=run.clip_norm,
            dp_mode=run.dp_mode,
            rng=noise,
            on_round=on_round,
            model_spec=task.spec.to_json() if task.spec is not None else "",
            resume=resume,
        )
        if self.network is not None:
            result = asyncio.run_coroutine_threadsafe(stage_run, self.network.loop).result()
        else:
            result = asyncio.run(stage_run)
        bar.close()
        self.state.round += stage.rounds
        self.state.partial = None
        row.update(
            {
                "seconds": time.perf_counter() - started,
                "z": result.z,
                "q": result.q,
                "refused_devices": len(result.refused),
                "refusal_example": next(iter(result.refused.values()), None),
                "epsilon": {g.name: self.ledger.epsilon(g.name) for g in groups},
            }
        )
        self.state.stages.append(row)
        return {"kind": "run_fl", "policy": show(result.model.policy)}

    def release(self, model: DataPolicyPair) -> DataPolicyPair:
        """``return`` after the budget commands the model's policy requires; the released model is the
        application's (a pair with no user policy: DP's post-processing)."""
        model = self._pair(model, "release")
        entry = self._logged("release")
        if entry is None:
            try:
                _, commands = release_model(model, self._spent(model))
                entry = {"kind": "release", "ok": True, "commands": commands}
            except PolicyViolation as exc:
                entry = {"kind": "release", "ok": False, "message": str(exc)}
            if self.state.stages:
                self.state.stages[-1].update(
                    {"released": entry["ok"], "release_commands": entry.get("commands")}
                    if entry["ok"]
                    else {"released": False, "refusal": entry["message"]}
                )
            self.state.calls.append(entry)
            self._save()
        if not entry["ok"]:
            raise PolicyViolation(entry["message"])
        out = start_pair(model._value())
        self.released.add(id(out))
        return out

    def budget(self, model: DataPolicyPair, command: str, bound: float) -> DataPolicyPair:
        """A budget command on ``model`` against its contributing groups' epsilon."""
        model = self._pair(model, command)
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound):
            raise ConfigError(f"{command}'s bound {str(bound)[:50]!r} must be a finite number")
        entry = self._logged(command)
        if entry is None:
            try:
                enforce_budget(model, command, float(bound), self._spent(model))
                entry = {"kind": command, "ok": True}
            except PolicyViolation as exc:
                entry = {"kind": command, "ok": False, "message": str(exc)}
            self.state.calls.append(entry)
            self._save()
        if not entry["ok"]:
            raise PolicyViolation(entry["message"])
        out = enforce_budget(model, command, float(bound), {})
        self.contributors[id(out)] = self.contributors.get(id(model), frozenset())
        return out


def run_strategy(
    run: PolifLRun,
    task: Task,
    strategy: str,
    out: Path,
    *,
    progress: bool = True,
    dry: bool = False,
    on_round: RoundHook | None = None,
    network: Network | None = None,
    deadline: float | None = None,
    stop: StopAtRoundEnd | None = None,
) -> dict[str, Any]:
    """Run (or resume) one strategy's global program in the sandbox; return its summary (module
    docstring). ``dry``: check the program against the groups' policies before anything trains: every
    ``run_fl`` runs the device-side program on a stand-in of the data and the ``runFL`` checks, and charges
    the ledger the epsilon its rounds would cost, so the budget commands and ``return`` meet the same
    refusals as the real run would (a dry run's summary says ``released`` and why not in ``stopped``).
    ``on_round``: :data:`RoundHook`. ``network``: the devices are networked agents (:func:`network_task`)
    instead of the task's simulated ones. ``deadline`` (``time.monotonic()``): everything the program
    causes, its calls into the server included, ends by then, or
    :class:`~fedveil.privacy.sandbox.DeadlineExceeded` is raised (the strategy is then not done).
    ``stop`` ends it at the end of a round after a Ctrl-C (the strategy is then not done either)."""
    folder = out / strategy.replace(":", "_")
    folder.mkdir(parents=True, exist_ok=True)
    host = _Host(
        run,
        task,
        strategy,
        folder,
        progress,
        dry=dry,
        on_round=on_round,
        network=network,
        deadline=deadline,
        stop=stop,
    )
    kind, _, single = strategy.partition(":")
    source = run.program if kind == "program" else STRATEGY_PROGRAMS[kind]
    info = [
        {
            "name": g.name,
            "budget": host.groups[g.name].budget,
            "noise": g.noise,
            "users": len(task.members[g.name]),
            "index": i,
        }
        for i, g in enumerate(run.groups)
        if not single or g.name == single
    ]
    if not host.state.done:
        try:
            final = run_program(
                compile_program(source, f"{run.name}/{strategy}"),
                "main",
                start_pair(host.initial),
                info,
                run.rounds,
                host=host.functions(),
                time_limit=run.program_time_limit,
                deadline=deadline,
            )
            host.state.released = isinstance(final, DataPolicyPair) and id(final) in host.released
            if host.state.released:
                if not dry:
                    atomic_write(folder / "weights.npz", _npz(final._value()))
            else:
                host.state.stopped = "the program returned no released model"
        except DeadlineExceeded:
            raise
        except SandboxError as exc:
            host.state.stopped = str(exc)
        host.state.done = True
        host._save()
    state = host.state
    evaluated = [h for h in state.history if task.metric in h]
    return {
        "strategy": strategy,
        "stages": state.stages,
        "released": state.released,
        "stopped": state.stopped,
        "refusals": host.refusals,
        "rounds": state.round,
        "final": evaluated[-1][task.metric] if evaluated else None,
        "best": max(h[task.metric] for h in evaluated) if evaluated else None,
        "privacy": host.ledger.report(),
        "history": state.history,
    }


def _npz(weights: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, weights=np.asarray(weights, dtype=np.float32))
    return buf.getvalue()


def run_polifl(
    run: PolifLRun,
    out: Path,
    *,
    strategies: tuple[str, ...] | None = None,
    progress: bool = True,
    resume: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Every strategy of ``run`` (or ``strategies``), resumable in ``out`` (``resume``); writes
    ``results.json`` and ``curves.png`` there and returns the results (module docstring)."""
    torch.set_num_threads(run.threads)
    device = resolve_device(run.device)  # a device this machine lacks fails before the run dir is touched
    out = prepare_run_dir(out, resume=resume, overwrite=overwrite)
    _claim_run_dir(out, run, device)
    task = build_task(run)
    if task.stand_in:
        announce_stand_in(task.stand_in, quiet=not progress)
    chosen = strategies or run.strategies
    results: dict[str, Any] = {
        "name": run.name,
        "code": code_identity(),
        "task": run.task,
        "description": task.description,
        "metric": task.metric,
        "config": asdict(run),
        "groups": {g: len(m) for g, m in task.members.items()},
        "strategies": {},
    }
    strategy = ""
    try:
        with StopAtRoundEnd(f"PoliFL run {run.name!r}") as stop:
            for strategy in chosen:
                results["strategies"][strategy] = run_strategy(
                    run, task, strategy, out, progress=progress, stop=stop
                )
                atomic_write(out / "results.json", json.dumps(results, indent=1, default=_json).encode())
                save_png(curves_figure(run, task, results["strategies"]), out / "curves.png")
                stop.check()
    except KeyboardInterrupt:
        raise RunInterrupted(
            f"PoliFL run {run.name!r} interrupted in strategy {strategy}; the stages it finished and the "
            f"checkpoint of the one it was in are kept in {out / strategy.replace(':', '_')}, and that stage "
            "goes on after its last checkpointed round"
        ) from None
    return results


def chance_level(task: Task) -> Reference | None:
    """The score of a model that learned nothing, from the task's classes: accuracy ``1 / classes``
    (``images``: the model's classes; ``text``: a uniform guess over the vocabulary) or ROC AUC 0.5
    (``mpu``); ``None`` where the server evaluates nothing (networked devices)."""
    if task.metric == "auc":
        return Reference("chance (AUC 0.5)", 0.5)
    if task.metric == "accuracy" and task.spec is not None:
        classes = task.spec.num_classes if task.spec.task == "images" else task.spec.vocab
        return Reference(f"chance (1 / {classes} classes)", 1.0 / classes)
    return None


def epsilon_notes(run: PolifLRun, summary: dict[str, Any], metric: str, colour: str | None) -> list[Note]:
    """One note per trained stage of a strategy's ``summary`` (:func:`run_strategy`), at the stage's last
    round on its ``metric`` curve: each stage group's epsilon spent by then (at the run's delta) over
    the budget its policy names (none: no budget; ``inf``: a round without noise)."""
    budgets = {g.name: budget_of(parse(g.policy)) for g in run.groups}
    points = {h["round"]: h[metric] for h in summary["history"] if metric in h}
    notes: list[Note] = []
    end = 0
    for row in summary["stages"]:
        end += row.get("rounds", 0)
        if not row.get("epsilon") or end not in points:
            continue
        spent = [
            f"{g} {'∞' if math.isinf(eps) else f'{eps:.3g}'}"
            + (f"/{budgets[g]:g}" if budgets.get(g) is not None else "")
            for g, eps in row["epsilon"].items()
        ]
        notes.append(Note(end, points[end], "ε " + ", ".join(spent), colour))
    return notes


def curves_figure(run: PolifLRun, task: Task, strategies: dict[str, dict[str, Any]]) -> Figure:
    """``curves.png``: each strategy's metric over rounds (Fig. 6/7's shape) in its colour, the chance
    level (:func:`chance_level`) and, at the end of every stage, the epsilon each of its groups had spent
    over its budget (:func:`epsilon_notes`)."""
    series = {
        s: [(h["round"], h[task.metric]) for h in r["history"] if task.metric in h]
        for s, r in strategies.items()
    }
    colours = method_colours(series)
    chance = chance_level(task)
    return series_figure(
        series,
        title=f"PoliFL {run.task}: {task.metric} over rounds (ε spent / budget after each stage)",
        ylabel=task.metric,
        smooth=1,
        colours=colours,
        references=[chance] if chance is not None else [],
        notes=[n for s, r in strategies.items() for n in epsilon_notes(run, r, task.metric, colours[s])],
        ylim=(0.0, 1.02),
    )


def _claim_run_dir(out: Path, run: PolifLRun, device: torch.device) -> None:
    """Write ``out/config.json`` (the settings that decide the numbers), or refuse to continue a run
    with other settings, or one that does not say which it has; the simulated devices train on ``device``
    only (the resolved device, :func:`~fedveil.experiments.checkpoint.claim_device`)."""
    settings = {k: v for k, v in asdict(run).items() if k not in ("threads", "strategies")}
    mine = json.loads(json.dumps(settings, default=str))
    path = out / "config.json"
    if path.is_file():
        theirs = saved_settings(path)
        differ = differing_settings(identity_settings(mine), identity_settings(theirs))
        if differ:
            raise ConfigError(
                f"run directory {str(out)!r} holds a run with other settings ({', '.join(differ)}): resume "
                "it with its own config, start afresh with --overwrite, or choose another --out"
            )
    elif any(out.glob("*/state.json")):
        raise ConfigError(
            f"run directory {str(out)!r} holds strategy states but no config.json saying which settings "
            "made them: start afresh with --overwrite, or choose another --out"
        )
    claim_device(out, device, artefacts=("*/state.json", "results.json"))
    if not path.is_file():
        atomic_write(path, (json.dumps(mine, indent=1) + "\n").encode())


def _json(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON: {type(value).__name__}")
