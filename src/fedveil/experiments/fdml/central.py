"""Central (non-federated) training of the TouchAuth net: the reference a federated run is compared with.

It trains FDML's TouchAuth embedding network (:class:`fedveil.models.touchauth.TouchAuthNet`) on the
pooled training users with the batch-all triplet loss (Euclidean distance, margin ``m``; the loss FDML
Alg. 1 evaluates in the enclave) and Adam, batches drawn like FDML's rounds (Sec. VII-B: a phone model
with equal probability, then ``batch_users`` of its users, each with ``samples_per_user``
random-start samples), and reports the Sec. VII-C accuracy of the test users' embeddings. It also reports
two references on the same test split: the untrained net, and a template of raw features (each sample's
mean touch-event vector), which any useful model must beat.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from fedveil.data.touchauth import TouchAuthPopulation
from fedveil.errors import ConfigError
from fedveil.eval.verification import authentication_accuracy
from fedveil.models.device import module_device
from fedveil.models.touchauth import TouchAuthNet

__all__ = [
    "batch_all_triplet_loss",
    "embed_samples",
    "mean_feature_embeddings",
    "train_central_touchauth",
    "train_triplet_steps",
]


def batch_all_triplet_loss(
    embeddings: torch.Tensor, labels: torch.Tensor, margin: float
) -> tuple[torch.Tensor, int]:
    """Batch-all triplet loss over ``embeddings`` ``(B, d)`` with integer ``labels`` ``(B,)``.

    Over every valid triplet (anchor ``a``, positive ``p != a`` with the same label, negative ``n`` with
    another label) the term is ``max(0, ||e_a - e_p|| - ||e_a - e_n|| + margin)`` with Euclidean
    distances; the loss is the mean over the active (positive) terms, 0 when none is active. Memory is
    O(B^2): one row of negatives per (anchor, positive) pair. Returns ``(loss, active_triplets)``.
    """
    squared = (embeddings * embeddings).sum(dim=1)
    gram = embeddings @ embeddings.T
    distances = torch.sqrt((squared[:, None] + squared[None, :] - 2.0 * gram).clamp_min(1e-12))
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(labels.shape[0], dtype=torch.bool, device=labels.device)
    anchors, positives = torch.nonzero(same & ~eye, as_tuple=True)
    terms = distances[anchors, positives][:, None] - distances[anchors] + margin
    terms = torch.relu(terms) * (~same[anchors]).to(terms.dtype)
    active = int((terms > 0).sum())
    return terms.sum() / max(active, 1), active


@torch.no_grad()
def embed_samples(net: torch.nn.Module, samples: np.ndarray, batch: int = 1024) -> np.ndarray:
    """Embeddings ``(..., d)`` of touch samples ``(..., 30, 10)``, in host memory: evaluated where
    ``net`` is (:func:`~fedveil.models.device.module_device`), the samples moved there ``batch`` at a
    time and each batch's embeddings copied back as they are computed (on the CPU nothing is copied)."""
    where = module_device(net)
    flat = torch.tensor(np.asarray(samples, dtype=np.float32)).reshape(-1, 1, *samples.shape[-2:])
    outputs = [net(flat[i : i + batch].to(where)).cpu() for i in range(0, flat.shape[0], batch)]
    embedded = torch.cat(outputs).numpy()
    return embedded.reshape(*samples.shape[:-2], embedded.shape[-1])


def mean_feature_embeddings(samples: np.ndarray) -> np.ndarray:
    """The trivial baseline: each sample ``(..., 30, 10)`` represented by its mean event ``(..., 10)``."""
    return np.asarray(samples, dtype=np.float64).mean(axis=-2)


def _check_positive(name: str, value: object, *, integer: bool) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0 or not math.isfinite(value):
        raise ConfigError(f"{name} must be a positive {'integer' if integer else 'number'}, got {value!r}")


def train_central_touchauth(
    population: TouchAuthPopulation,
    *,
    steps: int = 2000,
    batch_users: int = 32,
    samples_per_user: int = 8,
    lr: float = 3e-3,
    margin: float = 1.0,
    seed: int = 0,
    num_threads: int | None = None,
) -> dict[str, float | int | str]:
    """Train the TouchAuth net centrally and report Sec. VII-C accuracies (FDML).

    ``steps`` Adam steps at learning rate ``lr`` on :func:`batch_all_triplet_loss` with ``margin``; each
    step draws a phone model uniformly, ``batch_users`` of its training users (all when it has fewer) and
    ``samples_per_user`` random-start samples each. ``seed`` fixes the net's initialisation, the batches
    and the evaluation's draw of other users (the same draw for all three numbers). ``num_threads``
    limits torch's intra-op threads during the call (restored afterwards).

    Returns a JSON-ready dict: ``accuracy_percent``, ``eer`` and ``auc`` of the trained net,
    ``untrained_accuracy_percent``, ``mean_feature_accuracy_percent`` (raw mean-event template),
    ``loss_first`` / ``loss_last`` (mean loss of the first / last 50 steps; the loss is a mean over active
    triplets, so it stays near the margin while training works), ``active_fraction_first`` /
    ``active_fraction_last`` (the share of valid triplets that are active, which falls as the net
    learns), ``seconds`` and the settings. Embeddings are not normalised.
    """
    _check_positive("steps", steps, integer=True)
    _check_positive("batch_users", batch_users, integer=True)
    _check_positive("samples_per_user", samples_per_user, integer=True)
    _check_positive("lr", lr, integer=False)
    _check_positive("margin", margin, integer=False)
    previous_threads = torch.get_num_threads()
    if num_threads is not None:
        _check_positive("num_threads", num_threads, integer=True)
        torch.set_num_threads(num_threads)
    try:
        return _train(population, steps, batch_users, samples_per_user, lr, margin, seed)
    finally:
        torch.set_num_threads(previous_threads)


def train_triplet_steps(
    net: torch.nn.Module,
    population: TouchAuthPopulation,
    *,
    steps: int,
    batch_users: int,
    samples_per_user: int,
    lr: float,
    margin: float,
    rng: np.random.Generator,
) -> tuple[list[float], list[float]]:
    """Train ``net`` in place on ``population``'s training users: ``steps`` Adam steps at ``lr`` on
    :func:`batch_all_triplet_loss` with ``margin``, each on a batch drawn by ``rng`` like an FDML round
    (a phone model uniformly, ``batch_users`` of its users, all when it has fewer, ``samples_per_user``
    random-start samples each). The step runs where ``net``'s parameters are: each drawn batch moves there
    as it is drawn. Returns the loss and the active share of valid triplets of every step."""
    by_model = {m: population.train_user_ids(m) for m in population.phone_models}
    device = module_device(net)
    labels = torch.arange(batch_users).repeat_interleave(samples_per_user).to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    net.train()
    losses, active_fractions = [], []
    for _ in range(steps):
        users = by_model[population.phone_models[int(rng.integers(len(population.phone_models)))]]
        chosen = rng.choice(len(users), size=min(batch_users, len(users)), replace=False)
        batch = np.concatenate([population.sample_training(users[i], samples_per_user, rng) for i in chosen])
        batch_labels = labels[: batch.shape[0]]
        x = torch.from_numpy(batch)[:, None].to(device)
        loss, active = batch_all_triplet_loss(net(x), batch_labels, margin)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        active_fractions.append(active / _valid_triplets(batch_labels))
    return losses, active_fractions


def _valid_triplets(labels: torch.Tensor) -> int:
    """The number of (anchor, positive, negative) triplets among ``labels``."""
    counts = torch.bincount(labels).to(torch.int64)
    return int((counts * (counts - 1) * (labels.shape[0] - counts)).sum())


def _accuracy(embeddings: np.ndarray, seed: int) -> dict[str, float]:
    return authentication_accuracy(embeddings, np.random.default_rng(seed)).summary()


def _train(
    population: TouchAuthPopulation,
    steps: int,
    batch_users: int,
    samples_per_user: int,
    lr: float,
    margin: float,
    seed: int,
) -> dict[str, float | int | str]:
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        net = TouchAuthNet()
    _, test = population.test_samples()
    untrained = _accuracy(embed_samples(net.eval(), test), seed)
    baseline = _accuracy(mean_feature_embeddings(test), seed)

    losses, active_fractions = train_triplet_steps(
        net,
        population,
        steps=steps,
        batch_users=batch_users,
        samples_per_user=samples_per_user,
        lr=lr,
        margin=margin,
        rng=rng,
    )
    trained = _accuracy(embed_samples(net.eval(), test), seed)
    window = min(50, steps)
    return {
        "accuracy_percent": trained["accuracy_percent"],
        "eer": trained["eer"],
        "auc": trained["auc"],
        "untrained_accuracy_percent": untrained["accuracy_percent"],
        "mean_feature_accuracy_percent": baseline["accuracy_percent"],
        "loss_first": float(np.mean(losses[:window])),
        "loss_last": float(np.mean(losses[-window:])),
        "active_fraction_first": float(np.mean(active_fractions[:window])),
        "active_fraction_last": float(np.mean(active_fractions[-window:])),
        "steps": steps,
        "batch_users": batch_users,
        "samples_per_user": samples_per_user,
        "lr": lr,
        "margin": margin,
        "distance": "euclidean",
        "triplets": "batch-all",
        "seed": seed,
        "test_users": int(test.shape[0]),
        "seconds": time.perf_counter() - started,
    }
