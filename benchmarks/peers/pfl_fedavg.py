"""FedAvg of the ``fedveil bench peers`` task in pfl-research's simulation (``pfl``, PyTorch).

Run with the pfl virtual environment's python (``fedveil bench peers --setup`` makes it)::

    .venv-peers/pfl/bin/python benchmarks/peers/pfl_fedavg.py --task runs/bench-peers/task --cohort 100

pfl's :class:`~pfl.algorithm.federated_averaging.FederatedAveraging` on its
:class:`~pfl.aggregate.simulate.SimulatedBackend`, in this one process: each round samples ``--cohort``
users uniformly without replacement, trains each one in turn with pfl's PyTorch SGD bridge (plain
``torch.optim.SGD``), weights the model differences by data points (:class:`WeightByDatapoints`) and
applies their average with a central SGD step of learning rate 1 (the new model is the average). Each
user's data set reshuffles at every epoch with that user's own generator, as fedveil's clients do.

Start-up is reading the task and building pfl's data set, model, backend and algorithm; the round times
come from a callback at the end of every central iteration. pfl evaluates the cohort's local data before
and after training in iteration 0 (``evaluation_frequency`` cannot skip it), which only the warm-up round
pays. Prints one JSON row (``peer_task.row``); peak RSS covers the whole run.
"""

from __future__ import annotations

import importlib.metadata
import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from peer_task import LeNet, evaluate, parse_args, row, tree_cpu_seconds
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByDatapoints
from pfl.algorithm.base import NNAlgorithmParams
from pfl.algorithm.federated_averaging import FederatedAveraging
from pfl.callback.base import TrainingProcessCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.hyperparam.base import NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import Metrics, Weighted
from pfl.model.pytorch import PyTorchModel
from torch import nn


class PflLeNet(LeNet):
    """The task's LeNet with the ``loss`` and ``metrics`` that pfl's PyTorch model calls."""

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of a batch (pfl hands labels over as float32)."""
        self.train()
        return nn.functional.cross_entropy(self(x), y.long())

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        """Summed cross-entropy over the examples (pfl's local evaluation in iteration 0)."""
        self.eval()
        loss = float(nn.functional.cross_entropy(self(x), y.long(), reduction="sum"))
        return {"loss": Weighted(loss, len(y))}


class ShuffledUser(Dataset):
    """A user's data set whose every pass (pfl calls ``iter`` once per epoch) is a fresh permutation
    drawn from the user's own generator."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, user_id: int, rng: np.random.Generator) -> None:
        super().__init__((x, y), user_id=str(user_id))
        self._rng = rng

    def iter(self, batch_size: int | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches of ``batch_size`` (all at once for ``None``) in a fresh random order."""
        x, y = self.raw_data
        order = torch.from_numpy(self._rng.permutation(len(x)))
        step = batch_size or len(x)
        for start in range(0, len(x), step):
            idx = order[start : start + step]
            yield x[idx], y[idx]


class CohortSampler:
    """pfl draws one user per call; this hands out a fresh uniform sample without replacement of
    ``cohort`` users every ``cohort`` calls, i.e. one cohort per round."""

    def __init__(self, clients: int, cohort: int, rng: np.random.Generator) -> None:
        self.clients, self.cohort, self.rng = clients, cohort, rng
        self.pending: list[int] = []

    def __call__(self) -> int:
        """The next user of this round's cohort."""
        if not self.pending:
            self.pending = [int(i) for i in self.rng.choice(self.clients, self.cohort, replace=False)]
        return self.pending.pop()


class Clock(TrainingProcessCallback):
    """Wall and CPU time stamps at the start of training and at the end of every central iteration."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.cpu_stamps: list[float] = []

    def stamp(self) -> None:
        """Record the wall clock and the CPU seconds used so far."""
        self.stamps.append(time.perf_counter())
        self.cpu_stamps.append(tree_cpu_seconds())

    def on_train_begin(self, *, model: Any) -> Metrics:
        """Stamp the start of round 1."""
        self.stamp()
        return Metrics()

    def after_central_iteration(
        self, aggregate_metrics: Metrics, model: Any, *, central_iteration: int
    ) -> tuple[bool, Metrics]:
        """Stamp the end of a round; never stop early."""
        self.stamp()
        return False, Metrics()


def main() -> None:
    """Train the task with pfl and print the row."""
    args, task = parse_args("FedAvg of the fedveil bench peers task in pfl-research's simulation")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    task.preload()
    rngs = [np.random.default_rng([task.seed, i]) for i in range(task.clients)]
    users = FederatedDataset(
        lambda uid: ShuffledUser(*task.client(uid), uid, rngs[uid]),
        CohortSampler(task.clients, args.cohort, np.random.default_rng(task.seed + 1)),
    )
    module = PflLeNet()
    module.load_state_dict(task.initial_model().state_dict())
    model = PyTorchModel(
        model=module,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0),
    )
    backend = SimulatedBackend(training_data=users, val_data=users, postprocessors=[WeightByDatapoints()])
    params = NNAlgorithmParams(
        central_num_iterations=task.rounds + 1,
        evaluation_frequency=task.rounds + 1,
        train_cohort_size=args.cohort,
        val_cohort_size=None,
    )
    train = NNTrainHyperParams(
        local_num_epochs=task.local_epochs, local_learning_rate=task.lr, local_batch_size=task.batch_size
    )
    clock = Clock()
    algorithm = FederatedAveraging()
    startup = time.perf_counter() - started
    algorithm.run(
        params,
        backend,
        model,
        train,
        NNEvalHyperParams(local_batch_size=None),
        callbacks=[clock],
        send_metrics_to_platform=False,
    )
    accuracy = evaluate(module, *task.test())
    result = row(
        framework="pfl",
        version=importlib.metadata.version("pfl"),
        engine="pfl SimulatedBackend, users trained one by one in this process",
        task=task,
        cohort=args.cohort,
        threads=args.threads,
        startup=startup,
        round_seconds=[float(s) for s in np.diff(clock.stamps)],
        round_cpu_seconds=[float(s) for s in np.diff(clock.cpu_stamps)],
        accuracy=accuracy,
        rss_covers="the whole run",
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
