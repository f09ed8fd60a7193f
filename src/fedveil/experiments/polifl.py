"""``fedveil polifl run CONFIG``: PoliFL's compliance strategies with per-group DP (003_d27972a5478cff69.txt,
Sec. 6, Fig. 6-7, Tables 4-5) in simulation.

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
release outcome) is written to ``OUT/<strategy>/state.json`` + ``weights.npz``, and a rerun continues from
the next stage; finished strategies are not run again. ``results.json`` and ``curves.png`` (the metric
over rounds per strategy: Fig. 6/7's shape) are rewritten after every stage.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from fedveil.core.atomic import atomic_write
from fedveil.errors import ConfigError
from fedveil.experiments.config import build_dataclass, read_yaml_mapping
from fedveil.experiments.plots import plot_series
from fedveil.models.flat import FlatModel
from fedveil.privacy.groups import GroupLedger, noise_multiplier
from fedveil.privacy.pairs import DataPolicyPair, PolicyViolation
from fedveil.privacy.policy import parse
from fedveil.protocols.fedavg import ImageFedAvgConfig, ModelServer
from fedveil.protocols.local import LocalOptimizer
from fedveil.protocols.polifl import (
    PolicyDevices,
    PolicyGroup,
    Stage,
    plan_stages,
    prepare_pair,
    release_model,
    run_stage,
    start_pair,
)
from fedveil.runtime.simulation import SimulationRuntime

__all__ = ["GroupSpec", "PolifLRun", "Task", "build_task", "load_polifl_run", "run_polifl"]

TASKS = ("images", "mpu", "text")


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
    ``rounds x groups``); ``stop_at_budget`` shortens a stage to the rounds every group's budget allows."""

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
    eval_every: int = 5
    seed: int = 0
    threads: int = 2

    def __post_init__(self) -> None:
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
            if kind not in ("single", "combined", "cascaded") or (kind == "single") != bool(group):
                raise ConfigError(f"strategy {s!r}: use cascaded, combined or single:GROUP")
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


def load_polifl_run(path: str | Path, overrides: dict[str, Any] | None = None) -> PolifLRun:
    """A :class:`PolifLRun` from a YAML file (unknown keys refused, named), with ``overrides`` on top."""
    return build_dataclass(PolifLRun, {**read_yaml_mapping(path), **(overrides or {})})


@dataclass
class Task:
    """A use case built for a run: the model, each client's data (``values``), the groups' members,
    the loss, whether the cohort trains batched, the metric's name and the evaluation of weights."""

    flat: FlatModel
    values: dict[str, dict[str, Any]]
    members: dict[str, list[str]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batched: bool | None
    metric: str
    evaluate: Callable[[np.ndarray], float]
    description: str = ""


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


def _images(run: PolifLRun) -> Task:
    from fedveil.experiments.fedavg_images import FedAvgRun, split_images
    from fedveil.models.zoo import build_model
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
    module = build_model(
        run.model,
        num_classes=split.members.num_classes,
        in_channels=split.members.image_shape[0],
        image_size=split.members.image_shape[1],
        seed=run.seed,
    )
    flat = FlatModel(module)
    test = split.test

    def evaluate(weights: np.ndarray) -> float:
        return evaluate_model(flat.load_into_module(weights), test.x, test.y)["accuracy"]

    return Task(
        flat,
        values,
        _assign(ids, run),
        torch.nn.functional.cross_entropy,
        None,
        "accuracy",
        evaluate,
        f"{run.model} on {split.train.name}, {run.clients} clients x {run.samples_per_client} ({run.scheme})",
    )


def _mpu(run: PolifLRun) -> Task:
    from fedveil.data.mpu import SENSORS, synthetic_mpu
    from fedveil.eval.verification import roc_auc
    from fedveil.models.behaviour import EngagementNet, binary_logit_loss

    users = synthetic_mpu(run.clients, seed=run.seed)
    ids = list(users)
    members = _assign(ids, run)
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
            pair = prepare_pair(
                DataPolicyPair(held_out, parse(g.policy)), g.commands, g.program, programs=programs
            )
            x = np.asarray(pair._value()["x"])
        xs.append(x)
        ys.append(u["test_y"])
    test_x = torch.from_numpy(np.concatenate(xs))
    test_y = np.concatenate(ys)
    torch.manual_seed(run.seed)
    module = EngagementNet(len(SENSORS), hidden=run.hidden)
    flat = FlatModel(module)

    def evaluate(weights: np.ndarray) -> float:
        model = flat.load_into_module(weights).eval()
        with torch.no_grad():
            scores = model(test_x).numpy()
        return roc_auc(scores[test_y == 1], scores[test_y == 0])

    return Task(
        flat,
        values,
        members,
        binary_logit_loss,
        False,
        "auc",
        evaluate,
        f"SYNTHETIC MPU: {run.clients} users, 15 sensors, EngagementNet (LSTM {run.hidden} units)",
    )


def _text(run: PolifLRun) -> Task:
    from fedveil.data.text import text_users
    from fedveil.models.behaviour import NextWordLSTM, sequence_loss

    users, _, source = text_users(run.clients, vocab=run.vocab, seed=run.seed)
    ids = list(users)
    values = {c: {"x": u["x"], "y": u["y"]} for c, u in users.items()}
    test_x = torch.from_numpy(np.concatenate([u["test_x"] for u in users.values()]))
    test_y = torch.from_numpy(np.concatenate([u["test_y"] for u in users.values()]))
    torch.manual_seed(run.seed)
    flat = FlatModel(NextWordLSTM(run.vocab, embedding=run.hidden, hidden=run.hidden))

    def evaluate(weights: np.ndarray) -> float:
        model = flat.load_into_module(weights).eval()
        with torch.no_grad():
            hits = sum(
                int((model(test_x[i : i + 64]).argmax(-1) == test_y[i : i + 64]).sum())
                for i in range(0, len(test_x), 64)
            )
        return hits / test_y.numel()

    return Task(
        flat,
        values,
        _assign(ids, run),
        sequence_loss,
        False,
        "accuracy",
        evaluate,
        f"next word on {source}: {len(ids)} users, vocabulary {run.vocab}, 2-layer LSTM {run.hidden} units",
    )


def build_task(run: PolifLRun) -> Task:
    """The run's use case (module docstring)."""
    return {"images": _images, "mpu": _mpu, "text": _text}[run.task](run)


# --- one strategy ---------------------------------------------------------------------------------------


@dataclass
class _State:
    stage: int = 0
    round: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    stages: list[dict[str, Any]] = field(default_factory=list)
    ledger: dict[str, Any] | None = None
    stopped: str | None = None
    done: bool = False
    selection: dict[str, Any] | None = None


def _groups(run: PolifLRun, task: Task) -> list[PolicyGroup]:
    return [
        PolicyGroup(
            g.name, parse(g.policy), tuple(g.commands), g.noise, tuple(task.members[g.name]), g.program
        )
        for g in run.groups
    ]


def _stages(run: PolifLRun, strategy: str, groups: list[PolicyGroup]) -> list[Stage]:
    kind, _, single = strategy.partition(":")
    return plan_stages(groups, kind, run.rounds, single=single or None)


def run_strategy(
    run: PolifLRun, task: Task, strategy: str, out: Path, *, progress: bool = True
) -> dict[str, Any]:
    """Run (or resume) one strategy; return its summary (module docstring)."""
    folder = out / strategy.replace(":", "_")
    folder.mkdir(parents=True, exist_ok=True)
    state_path, weights_path = folder / "state.json", folder / "weights.npz"
    state = _State(**json.loads(state_path.read_text())) if state_path.exists() else _State()
    groups = _groups(run, task)
    stages = _stages(run, strategy, groups)
    ledger = GroupLedger([g.name for g in groups], delta=run.delta, method=run.accounting)
    if state.ledger is not None:
        ledger.restore(state.ledger)
    initial = task.flat.initial()
    weights = initial
    if weights_path.exists():
        with np.load(weights_path, allow_pickle=False) as z:
            weights = np.asarray(z["weights"], dtype=np.float32)
    group_of = {c: g for g in groups for c in g.members}
    pairs = {c: DataPolicyPair(v, group_of[c].policy) for c, v in task.values.items() if c in group_of}
    optimizer = LocalOptimizer("sgd", run.lr)
    devices = PolicyDevices(
        task.flat, pairs, optimizer=optimizer, seed=run.seed, loss=task.loss, batched=task.batched
    )
    runtime = SimulationRuntime(devices, rng=np.random.default_rng(run.seed + 1))
    cfg = ImageFedAvgConfig(
        clients_per_round=run.clients_per_round,
        local_epochs=run.local_epochs,
        batch_size=run.batch_size,
        optimizer=optimizer,
        server_lr=run.server_lr,
        eval_every=0,
    )
    server = ModelServer(cfg, task.flat, np.random.default_rng(run.seed + 2), initial=initial)
    if state.selection is not None:
        server.engine.rng.bit_generator.state = state.selection
    if not state.history:
        state.history.append({"round": 0, "stage": "", task.metric: task.evaluate(initial)})
    while not state.done and state.stage < len(stages):
        stage = stages[state.stage]
        row: dict[str, Any] = {"stage": stage.name, "groups": [g.name for g in stage.groups]}
        row.update({"noise_std": stage.noise_std, "rounds_planned": stage.rounds})
        if run.stop_at_budget and stage.noise_std is not None:
            members = sum(len(g.members) for g in stage.groups)
            z = noise_multiplier(stage.noise_std, run.clip_norm)
            q = min(1.0, run.clients_per_round / members)
            allowed = [
                ledger.affordable_rounds(g.name, z=z, q=q, budget=g.budget, limit=stage.rounds)
                for g in stage.groups
                if g.budget is not None
            ]
            if allowed and min(allowed) < stage.rounds:
                stage = replace(stage, rounds=min(allowed))
                row["stopped_by_budget"] = True
        row["rounds"] = stage.rounds
        if stage.rounds < 1:
            state.stopped = f"stage {stage.name}: the budget allows no round"
            row["released"] = False
            state.stages.append(row)
            break
        bar = tqdm(total=stage.rounds, desc=f"{strategy} {stage.name}", disable=not progress, leave=False)
        base = state.round

        def on_round(rnd: int, report: Any, base: int = base, stage: Stage = stage, bar: Any = bar) -> None:
            bar.update(1)
            line: dict[str, Any] = {"round": base + rnd, "stage": stage.name, "loss": report.loss}
            if rnd % run.eval_every == 0 or rnd == stage.rounds:
                line[task.metric] = task.evaluate(server.weights)
                bar.set_postfix({task.metric: f"{line[task.metric]:.3f}"})
            state.history.append(line)

        started = time.perf_counter()
        result = asyncio.run(
            run_stage(
                stage,
                job=f"{run.name}/{strategy}/{stage.name}",
                model=start_pair(weights),
                server=server,
                comm=runtime,
                ledger=ledger,
                clip_norm=run.clip_norm,
                dp_mode=run.dp_mode,
                rng=np.random.default_rng(run.seed + 100 + state.stage),
                on_round=on_round,
            )
        )
        bar.close()
        row.update(
            {
                "seconds": time.perf_counter() - started,
                "z": result.z,
                "q": result.q,
                "refused_devices": len(result.refused),
                "refusal_example": next(iter(result.refused.values()), None),
            }
        )
        state.round += stage.rounds
        spent = {g.name: ledger.epsilon(g.name) for g in stage.groups}
        row["epsilon"] = spent
        try:
            released, commands = release_model(result.model, spent)
            row.update({"released": True, "release_commands": commands})
            weights = np.asarray(released, dtype=np.float32)
        except PolicyViolation as exc:
            row.update({"released": False, "refusal": str(exc)})
            state.stopped = str(exc)
            state.done = True
            weights = server.weights
        state.stages.append(row)
        state.stage += 1
        state.ledger = ledger.state()
        state.selection = server.engine.rng.bit_generator.state
        buf = _npz(weights)
        atomic_write(weights_path, buf)
        atomic_write(state_path, json.dumps(asdict(state), indent=1).encode())
    state.done = True
    atomic_write(state_path, json.dumps(asdict(state), indent=1).encode())
    evaluated = [h for h in state.history if task.metric in h]
    return {
        "strategy": strategy,
        "stages": state.stages,
        "released": bool(state.stages) and all(s.get("released") for s in state.stages),
        "stopped": state.stopped,
        "rounds": state.round,
        "final": evaluated[-1][task.metric] if evaluated else None,
        "best": max(h[task.metric] for h in evaluated) if evaluated else None,
        "privacy": ledger.report(),
        "history": state.history,
    }


def _npz(weights: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.savez(buf, weights=np.asarray(weights, dtype=np.float32))
    return buf.getvalue()


def run_polifl(
    run: PolifLRun, out: Path, *, strategies: tuple[str, ...] | None = None, progress: bool = True
) -> dict[str, Any]:
    """Every strategy of ``run`` (or ``strategies``), resumable in ``out``; writes ``results.json`` and
    ``curves.png`` there and returns the results."""
    torch.set_num_threads(run.threads)
    out.mkdir(parents=True, exist_ok=True)
    task = build_task(run)
    chosen = strategies or run.strategies
    results: dict[str, Any] = {
        "name": run.name,
        "task": run.task,
        "description": task.description,
        "metric": task.metric,
        "config": asdict(run),
        "groups": {g: len(m) for g, m in task.members.items()},
        "strategies": {},
    }
    for strategy in chosen:
        results["strategies"][strategy] = run_strategy(run, task, strategy, out, progress=progress)
        atomic_write(out / "results.json", json.dumps(results, indent=1, default=_json).encode())
        series = {
            s: [(h["round"], h[task.metric]) for h in r["history"] if task.metric in h]
            for s, r in results["strategies"].items()
        }
        plot_series(
            series,
            out / "curves.png",
            title=f"PoliFL {run.task}: {task.metric} over rounds",
            ylabel=task.metric,
            smooth=1,
        )
    return results


def _json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON: {type(value).__name__}")
