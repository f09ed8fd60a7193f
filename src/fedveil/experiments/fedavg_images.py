"""Image FedAvg experiments on the engine: data set, partition, model zoo, rounds with evaluation.

:func:`train_fedavg` is what the attack experiments train their target on (an undefended FedAvg model on
Fashion-MNIST, overfit enough to leak), and what later systems (PPFL, AIoT, PoliFL) start from. Its
rounds, like those of the public :func:`fedveil.train_fedavg`, run in :func:`run_fedavg`, the one round
loop (progress, evaluation, checkpoints) over the engine. Every message goes through the simulation
runtime and the codec, so an observer's tap sees the real bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from fedveil.data.federated import FederatedDataset
from fedveil.data.images import ImageData, load_image_dataset
from fedveil.data.partition import partition, to_federated
from fedveil.errors import ConfigError
from fedveil.experiments.checkpoint import Checkpoint
from fedveil.models.device import check_device_spec
from fedveil.models.flat import FlatModel
from fedveil.models.zoo import INITS, build_model
from fedveil.protocols.common import pool_rng_states, restore_pool_rngs
from fedveil.protocols.fedavg import (
    Aggregate,
    ImageFedAvgConfig,
    ModelClients,
    ModelServer,
    ParameterPlan,
    UpdateTransform,
    fedavg_aggregate,
)
from fedveil.runtime.simulation import SimulationRuntime

__all__ = [
    "FedAvgRun",
    "FedAvgTraining",
    "ImageSplit",
    "TrainedFedAvg",
    "run_fedavg",
    "split_images",
    "train_fedavg",
]


@dataclass(frozen=True)
class FedAvgRun:
    """One image FedAvg experiment: ``data`` (a :func:`load_image_dataset` name), ``model`` (a zoo name),
    ``clients`` holding ``samples_per_client`` training examples each (drawn without replacement from the
    training split, then split by ``scheme``: ``iid``, ``classes:K``, ``dirichlet:ALPHA``), ``test_samples``
    test examples, ``rounds`` of ``fedavg`` and a ``seed`` for everything random; ``model_init``: how the
    model's initial values are drawn (:data:`fedveil.models.zoo.INITS`); ``device``: where the clients train
    (:func:`~fedveil.models.device.resolve_device`)."""

    data: str = "fashion-mnist"
    model: str = "lenet"
    clients: int = 10
    samples_per_client: int = 100
    scheme: str = "iid"
    test_samples: int = 1000
    rounds: int = 20
    fedavg: ImageFedAvgConfig = field(default_factory=ImageFedAvgConfig)
    seed: int = 0
    batched: bool | None = None
    model_init: str = "torch"
    device: str = "auto"

    def __post_init__(self) -> None:
        check_device_spec(self.device)
        for name in ("clients", "samples_per_client", "test_samples", "rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} {value!r} must be an integer >= 1")
        if self.model_init not in INITS:
            raise ConfigError(f"model_init {self.model_init!r} is not one of {', '.join(INITS)}")


@dataclass
class TrainedFedAvg:
    """The outcome: the server (global model), the members' data, the unused training examples
    (non-members from the same distribution), the test split and one history line per evaluation."""

    run: FedAvgRun
    server: ModelServer
    flat: FlatModel
    members: ImageData
    non_members: ImageData
    test: ImageData
    history: list[dict[str, Any]]
    candidate_index: np.ndarray

    def train_accuracy(self) -> float:
        """Accuracy of the global model on the members' data (how far it fits its training set)."""
        return self.server.evaluate(self.members.x, self.members.y)["accuracy"]

    def model(self) -> torch.nn.Module:
        """The global model, loaded into the module (eval mode)."""
        module = self.flat.load_into_module(self.server.full_weights())
        return module.eval()


@dataclass
class ImageSplit:
    """The data of an image FedAvg experiment: the ``train`` and ``test`` sets as loaded, the ``members``
    (the clients' examples, split into ``data`` by the run's scheme), unused training examples
    (``non_members``) and the test subset, with the training-split indices of members and non-members."""

    train: ImageData
    members: ImageData
    non_members: ImageData
    test: ImageData
    data: FederatedDataset
    member_index: np.ndarray
    non_member_index: np.ndarray


def split_images(run: FedAvgRun, *, avoid: np.ndarray | None = None) -> ImageSplit:
    """Load ``run.data`` and draw the clients' examples, the non-members and the test subset (seeded by
    ``run.seed``; ``avoid``: training indices to leave out). Every image experiment splits this way, so
    two systems trained with the same settings see the same clients."""
    rng = np.random.default_rng(run.seed)
    train = load_image_dataset(run.data, "train", seed=run.seed)
    test = load_image_dataset(run.data, "test", seed=run.seed)
    needed = run.clients * run.samples_per_client
    order = rng.permutation(len(train))
    if avoid is not None:
        order = order[~np.isin(order, avoid)]
    if needed > len(order):
        raise ConfigError(
            f"{run.clients} clients x {run.samples_per_client} samples = {needed} examples; "
            f"{train.name} has {len(order)} usable training examples"
        )
    member_index = np.sort(order[:needed])
    non_member_index = np.sort(order[needed : needed + min(len(order) - needed, run.test_samples)])
    members = train.subset(member_index)
    non_members = train.subset(non_member_index)
    test = test.subset(np.sort(rng.permutation(len(test))[: min(len(test), run.test_samples)]))
    parts = partition(members.y, run.scheme, run.clients, rng)
    data = to_federated(members, parts)
    return ImageSplit(train, members, non_members, test, data, member_index, non_member_index)


@dataclass
class FedAvgTraining:
    """What :func:`run_fedavg` trained: the ``server`` (global model), the client ``pool``, the simulated
    ``runtime`` and one ``history`` line per round (the engine's ``RoundReport.as_dict()``, plus
    ``test_accuracy`` and ``test_loss`` where the round was evaluated)."""

    server: ModelServer
    pool: ModelClients
    runtime: SimulationRuntime
    history: list[dict[str, Any]]


def run_fedavg(
    flat: FlatModel,
    data: FederatedDataset,
    cfg: ImageFedAvgConfig,
    *,
    rounds: int,
    seed: int,
    runtime_rng: np.random.Generator,
    server_rng: np.random.Generator,
    plan: ParameterPlan | None = None,
    transform: UpdateTransform | None = None,
    aggregate: Aggregate = fedavg_aggregate,
    batched: bool | None = None,
    device: str = "auto",
    test: tuple[np.ndarray, np.ndarray] | None = None,
    tap: Callable[[str, bytes], None] | None = None,
    on_round: Callable[[Checkpoint], None] | None = None,
    resume: Checkpoint | None = None,
    progress: bool = True,
    desc: str = "FedAvg",
) -> FedAvgTraining:
    """The one FedAvg round loop: ``rounds`` rounds of the engine on ``flat``'s model over ``data``'s
    clients in the in-process simulation, every message through the codec.

    The clients (:class:`ModelClients`: ``seed`` seeds their shuffling, ``transform`` their update
    before upload, ``batched`` and ``device`` how they train) start from ``flat``'s current values, of
    which ``plan`` says what is shared; the simulated network draws from ``runtime_rng`` and hands every
    message's bytes to ``tap``; the server (:class:`ModelServer`, ``aggregate`` its aggregation hook)
    selects with ``server_rng``. ``test`` ``(x, y)`` is evaluated every ``cfg.eval_every`` rounds and
    after the last (never when ``eval_every`` is 0). ``on_round`` receives the state after each round (the
    server's :meth:`ModelServer.state_dict`, the generators of the devices, the simulated network and
    torch, and the history so far); ``resume``, such a state, goes on after its round as the
    uninterrupted run would. torch's global generator is the caller's to seed.
    """
    chosen = plan if plan is not None else ParameterPlan(flat)
    initial = flat.initial()
    pool = ModelClients(
        flat,
        data,
        optimizer=cfg.optimizer,
        seed=seed,
        plan=chosen,
        initial=initial,
        transform=transform,
        batched=batched,
        device=device,
    )
    runtime = SimulationRuntime(pool, rng=runtime_rng, tap=tap)
    server = ModelServer(cfg, flat, server_rng, plan=chosen, initial=initial, aggregate=aggregate)
    server.setup(runtime)
    history: list[dict[str, Any]] = []
    first = 1
    if resume is not None:
        try:
            server.load_state_dict(resume.arrays, resume.meta["server"])
            restore_pool_rngs(pool, resume.meta["pool"])
            runtime.rng.bit_generator.state = dict(resume.meta["runtime"])
            torch.set_rng_state(torch.tensor(resume.meta["torch"], dtype=torch.uint8))
            history = list(resume.meta["history"])
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise ConfigError(
                f"the FedAvg checkpoint of round {resume.round} does not fit this run: {exc!r}"
            ) from exc
        first = resume.round + 1
    every = cfg.eval_every

    async def go() -> None:
        bar = tqdm(range(first, rounds + 1), desc=desc, disable=not progress)
        for rnd in bar:
            line = (await server.run_round(rnd, runtime)).as_dict()
            if test is not None and every and (rnd % every == 0 or rnd == rounds):
                line.update({f"test_{k}": v for k, v in server.evaluate(*test).items()})
                bar.set_postfix(acc=f"{line['test_accuracy']:.3f}")
            history.append(line)
            if on_round is not None:
                arrays, meta = server.state_dict()
                state = {
                    "server": meta,
                    "pool": pool_rng_states(pool),
                    "runtime": runtime.rng.bit_generator.state,
                    "torch": torch.get_rng_state().tolist(),
                    "history": list(history),
                }
                on_round(Checkpoint(rnd, arrays, state))

    asyncio.run(go())
    return FedAvgTraining(server, pool, runtime, history)


def train_fedavg(
    run: FedAvgRun,
    *,
    tap: Callable[[str, bytes], None] | None = None,
    progress: bool = True,
    plan: Callable[[FlatModel], ParameterPlan] | None = None,
    avoid: np.ndarray | None = None,
    split: ImageSplit | None = None,
    on_round: Callable[[Checkpoint], None] | None = None,
    resume: Checkpoint | None = None,
) -> TrainedFedAvg:
    """Train ``run`` in simulation (:func:`run_fedavg`) and return the model, data splits and evaluation
    history.

    ``avoid`` lists training-split indices that must be neither members nor non-members (a control model
    trained on data disjoint from another run's candidates, :attr:`TrainedFedAvg.candidate_index`);
    ``split`` is the data already split by :func:`split_images` for ``run`` (not loaded again).
    ``on_round`` and ``resume`` checkpoint and continue the run as :func:`run_fedavg` says.
    """
    split = split_images(run, avoid=avoid) if split is None else split
    members, test = split.members, split.test
    torch.manual_seed(run.seed)
    module = build_model(
        run.model,
        num_classes=members.num_classes,
        in_channels=members.image_shape[0],
        image_size=members.image_shape[1],
        seed=run.seed,
        init=run.model_init,
    )
    flat = FlatModel(module)
    trained = run_fedavg(
        flat,
        split.data,
        run.fedavg,
        rounds=run.rounds,
        seed=run.seed,
        runtime_rng=np.random.default_rng(run.seed + 1),
        server_rng=np.random.default_rng(run.seed + 2),
        plan=plan(flat) if plan is not None else None,
        batched=run.batched,
        device=run.device,
        test=(test.x, test.y),
        tap=tap,
        on_round=on_round,
        resume=resume,
        progress=progress,
        desc=f"FedAvg {run.model} on {split.train.name}",
    )
    return TrainedFedAvg(
        run,
        trained.server,
        flat,
        members,
        split.non_members,
        test,
        trained.history,
        np.r_[split.member_index, split.non_member_index],
    )
