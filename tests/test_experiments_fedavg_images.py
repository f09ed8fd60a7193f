"""Image FedAvg experiments: both FedAvg entry points (the experiments' :func:`train_fedavg` on a
:class:`FedAvgRun`, the public :func:`fedveil.train_fedavg` on a user's model) run their rounds in the one
loop, :func:`run_fedavg`, and agree on the same task; an in-memory checkpoint resumes as the uninterrupted
run goes on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedveil
from fedveil.experiments import fedavg_images
from fedveil.experiments.checkpoint import Checkpoint
from fedveil.experiments.fedavg_images import FedAvgRun, ImageSplit, split_images, train_fedavg
from fedveil.models.zoo import build_model
from fedveil.protocols.fedavg import ImageFedAvgConfig
from fedveil.protocols.local import LocalOptimizer

# four clients of 12 stand-in images, all of them in every round, three rounds; 20 test images
RUN = FedAvgRun(
    data="synthetic-fashion-mnist:120",
    model="lenet",
    clients=4,
    samples_per_client=12,
    test_samples=20,
    rounds=3,
    fedavg=ImageFedAvgConfig(clients_per_round=4, batch_size=6, optimizer=LocalOptimizer(lr=0.05)),
    seed=5,
    device="cpu",
)


@pytest.fixture(scope="module")
def split() -> ImageSplit:
    """RUN's data, split once for the module."""
    return split_images(RUN)


def test_both_entry_points_run_their_rounds_in_the_one_loop(
    split: ImageSplit, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = fedavg_images.run_fedavg

    def spy(*args: object, **kwargs: object) -> fedavg_images.FedAvgTraining:
        calls.append(kwargs["rounds"])  # type: ignore[arg-type]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fedavg_images, "run_fedavg", spy)
    train_fedavg(FedAvgRun(**{**RUN.__dict__, "rounds": 1}), progress=False, split=split)
    model = build_model("lenet", num_classes=10, in_channels=1, image_size=28, seed=0)
    fedveil.train_fedavg(model, split.data, rounds=2, clients_per_round=2, lr=0.05, batch_size=6)
    assert calls == [1, 2]


def test_the_experiments_and_the_public_entry_point_agree_on_the_same_task(split: ImageSplit) -> None:
    """With every client in every round and no noise, the two differ only in the generators of selection
    and the simulated network, which then decide nothing: same weights, same losses, same accuracy."""
    ours = train_fedavg(RUN, progress=False, split=split)
    torch.manual_seed(RUN.seed)
    model = build_model(
        RUN.model,
        num_classes=split.members.num_classes,
        in_channels=split.members.image_shape[0],
        image_size=split.members.image_shape[1],
        seed=RUN.seed,
    )
    public = fedveil.train_fedavg(
        model,
        split.data,
        rounds=RUN.rounds,
        clients_per_round=RUN.clients,
        lr=0.05,
        batch_size=6,
        test=(split.test.x, split.test.y),
        seed=RUN.seed,
    )
    ours_state = ours.model().state_dict()
    assert ours_state.keys() == public.state_dict.keys()
    for name, value in ours_state.items():
        assert torch.equal(value, public.state_dict[name]), name
    keys = ("round", "participants", "loss", "test_accuracy", "test_loss", "bytes_up", "bytes_down")
    assert [{k: line[k] for k in keys} for line in ours.history] == [
        {k: line[k] for k in keys} for line in public.history
    ]


def test_a_run_resumed_from_its_checkpoint_goes_on_as_the_uninterrupted_run(split: ImageSplit) -> None:
    saved: list[Checkpoint] = []
    whole = train_fedavg(RUN, progress=False, split=split, on_round=saved.append)
    assert [c.round for c in saved] == [1, 2, 3]
    assert [len(c.meta["history"]) for c in saved] == [1, 2, 3], "each checkpoint holds its own rounds"
    resumed = train_fedavg(RUN, progress=False, split=split, resume=saved[0])
    assert resumed.history == whole.history
    assert np.array_equal(resumed.server.full_weights(), whole.server.full_weights())
