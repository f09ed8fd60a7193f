"""Tests of fedveil.experiments.fdml.central: the batch-all triplet loss and central TouchAuth training."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from fedveil.data.touchauth import TouchAuthConfig, TouchAuthPopulation, generate_touchauth
from fedveil.errors import ConfigError
from fedveil.experiments.fdml.central import (
    batch_all_triplet_loss,
    embed_samples,
    mean_feature_embeddings,
    train_central_touchauth,
)
from fedveil.models.touchauth import TouchAuthNet


def _brute_force_loss(embeddings: torch.Tensor, labels: list[int], margin: float) -> tuple[torch.Tensor, int]:
    """Enumerate every (anchor, positive, negative) triplet explicitly."""
    terms = []
    for a, p, n in itertools.product(range(len(labels)), repeat=3):
        if a != p and labels[a] == labels[p] and labels[n] != labels[a]:
            d_ap = torch.linalg.vector_norm(embeddings[a] - embeddings[p])
            d_an = torch.linalg.vector_norm(embeddings[a] - embeddings[n])
            terms.append(torch.relu(d_ap - d_an + margin))
    stacked = torch.stack(terms)
    active = int((stacked > 0).sum())
    return stacked.sum() / max(active, 1), active


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_match_enumerated_triplets(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    labels = [0, 0, 0, 1, 1, 2, 2, 2, 3]  # class 3 has a single sample: an anchor with no positive
    base = torch.randn(len(labels), 5, generator=generator, dtype=torch.float64)
    fast_in = base.clone().requires_grad_(True)
    slow_in = base.clone().requires_grad_(True)
    fast, fast_active = batch_all_triplet_loss(fast_in, torch.tensor(labels), margin=1.0)
    slow, slow_active = _brute_force_loss(slow_in, labels, margin=1.0)
    assert fast_active == slow_active > 0
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-12)
    fast.backward()
    slow.backward()
    torch.testing.assert_close(fast_in.grad, slow_in.grad, rtol=1e-8, atol=1e-10)


def test_no_active_triplet_gives_zero_loss() -> None:
    embeddings = torch.tensor([[0.0, 0.0], [0.1, 0.0], [10.0, 0.0], [10.1, 0.0]], requires_grad=True)
    loss, active = batch_all_triplet_loss(embeddings, torch.tensor([0, 0, 1, 1]), margin=1.0)
    assert active == 0 and loss.item() == 0.0
    loss.backward()
    assert torch.all(embeddings.grad == 0)


def test_duplicated_embeddings_give_finite_gradients() -> None:
    embeddings = torch.ones(6, 4, requires_grad=True)
    loss, active = batch_all_triplet_loss(embeddings, torch.tensor([0, 0, 1, 1, 2, 2]), margin=0.5)
    assert active == 6 * 1 * 4
    assert loss.item() == pytest.approx(0.5, abs=1e-5)
    loss.backward()
    assert torch.isfinite(embeddings.grad).all()


@pytest.fixture(scope="module")
def tiny() -> TouchAuthPopulation:
    """A small, easy population (24 test users: enough for Sec. VII-C's 1 + 2 x 10 users)."""
    return generate_touchauth(
        TouchAuthConfig(
            seed=3,
            train_users_per_model=(12, 12, 12, 12),
            test_users_per_model=(6, 6, 6, 6),
            user_spread=1.0,
        )
    )


def test_embedding_helpers_keep_leading_shape(tiny: TouchAuthPopulation) -> None:
    _, samples = tiny.test_samples()
    torch.manual_seed(0)
    embedded = embed_samples(TouchAuthNet().eval(), samples[:3], batch=7)
    assert embedded.shape == (3, 40, 64) and embedded.dtype == np.float32
    assert mean_feature_embeddings(samples).shape == (24, 40, 10)
    np.testing.assert_allclose(mean_feature_embeddings(samples)[1, 2], samples[1, 2].mean(axis=0), rtol=1e-6)


def test_central_training_runs_and_beats_the_untrained_net(tiny: TouchAuthPopulation) -> None:
    threads = torch.get_num_threads()
    report = train_central_touchauth(
        tiny, steps=40, batch_users=8, samples_per_user=6, lr=3e-3, margin=1.0, seed=0, num_threads=1
    )
    assert torch.get_num_threads() == threads
    assert report["steps"] == 40 and report["test_users"] == 24
    assert report["distance"] == "euclidean" and report["triplets"] == "batch-all"
    assert 0.0 < report["active_fraction_last"] <= 1.0 and 0.0 < report["active_fraction_first"] <= 1.0
    for key in ("accuracy_percent", "untrained_accuracy_percent", "mean_feature_accuracy_percent"):
        assert 0.0 <= report[key] <= 100.0
    assert report["accuracy_percent"] > report["untrained_accuracy_percent"] + 5.0
    again = train_central_touchauth(
        tiny, steps=40, batch_users=8, samples_per_user=6, lr=3e-3, margin=1.0, seed=0, num_threads=1
    )
    assert again["accuracy_percent"] == report["accuracy_percent"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 0}, "steps must be a positive integer"),
        ({"batch_users": 1.5}, "batch_users must be a positive integer"),
        ({"samples_per_user": True}, "samples_per_user"),
        ({"lr": -1e-3}, "lr must be a positive number"),
        ({"margin": float("inf")}, "margin must be a positive number"),
        ({"num_threads": 0}, "num_threads"),
    ],
)
def test_bad_settings_are_rejected(tiny: TouchAuthPopulation, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        train_central_touchauth(tiny, **kwargs)
