"""Image FedAvg's clients (``ModelClients``): each trains one copy of the weights it was sent, tensor by
tensor in place, and uploads that vector itself when every parameter is uploaded untransformed; with
private, frozen or transformed parameters the upload is taken apart as before."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedveil.data.federated import FederatedDataset, UserData
from fedveil.models.flat import FlatModel
from fedveil.protocols import fedavg
from fedveil.protocols.fedavg import ClipAndNoise, ModelClients, ParameterPlan
from fedveil.protocols.local import LocalOptimizer, local_train
from fedveil.protocols.messages import FitReply, FitRequest


def _flat() -> FlatModel:
    torch.manual_seed(5)
    return FlatModel(nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3)))


def _data(clients: int = 3) -> FederatedDataset:
    rng = np.random.default_rng(1)
    users = [
        UserData(
            f"c{i}",
            {},
            {
                "x": rng.normal(size=(11, 1, 4, 4)).astype(np.float32),
                "y": rng.integers(0, 3, 11).astype(np.int64),
            },
        )
        for i in range(clients)
    ]
    return FederatedDataset(users)


def _cross_entropy(flat: FlatModel):
    return lambda p, x, y: nn.functional.cross_entropy(flat(p, x), y)


def test_an_untransformed_full_upload_is_the_trained_vector_itself(monkeypatch) -> None:
    """No copy between training and the reply: the reply's array is the memory the client trained, holding
    exactly what the flat vector's training gives on the same batches; the request, shared by the cohort,
    is left as it was sent."""
    flat = _flat()
    opt = LocalOptimizer("sgd", lr=0.1, momentum=0.9)
    pool = ModelClients(flat, _data(), optimizer=opt, seed=3, batched=False)
    calls: list[tuple[torch.Tensor, list, torch.Tensor]] = []

    def spy(loss, p, batches, *args, **kwargs):
        start = p.clone()
        trained, mean_loss = local_train(loss, p, batches, *args, **kwargs)
        calls.append((start, batches, trained))
        return trained, mean_loss

    monkeypatch.setattr(fedavg, "local_train", spy)
    sent = flat.initial()
    request = FitRequest(1, 0.1, 2, 4, sent.copy())
    replies = pool.handle_batch({c: request for c in pool.client_ids()})
    assert np.array_equal(request.weights, sent)
    assert len(calls) == 3
    for (start, batches, trained), reply in zip(calls, replies.values(), strict=True):
        assert isinstance(reply, FitReply) and reply.weights.dtype == np.float32
        assert np.shares_memory(reply.weights, trained.numpy())
        assert torch.equal(start, torch.from_numpy(sent))
        reference, _ = local_train(_cross_entropy(flat), start, batches, opt, 0.1)
        assert np.array_equal(reply.weights, reference.numpy())


def test_private_frozen_and_transformed_uploads_are_taken_from_the_right_entries() -> None:
    """With a private head and a frozen first layer the upload is the second layer's trained values; the
    clip bounds its distance from the values sent (taken from the request at the uploaded entries), and
    the private head is kept on the device, trained."""
    flat = _flat()
    plan = ParameterPlan(flat, private=["3"], frozen=["1.weight"])
    initial = flat.initial()
    pool = ModelClients(
        flat,
        _data(),
        optimizer=LocalOptimizer("sgd", lr=0.5),
        seed=3,
        plan=plan,
        initial=initial,
        transform=ClipAndNoise(clip_norm=1e-3, noise_std=0.0),
        batched=False,
    )
    sent = initial[plan.shared_index]
    replies = pool.handle_batch({c: FitRequest(1, 0.5, 1, 4, sent) for c in pool.client_ids()})
    for cid, reply in replies.items():
        assert isinstance(reply, FitReply) and reply.weights.shape == plan.upload_index.shape
        delta = reply.weights - sent[plan.upload_in_shared]
        assert 1e-4 < np.linalg.norm(delta) <= 1e-3 * (1 + 1e-5)
        assert not np.array_equal(pool.private_weights(cid), initial[plan.private_index])
