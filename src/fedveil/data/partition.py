"""Partitioners: how a labelled data set is split among simulated clients, each seeded.

- :func:`iid`: a uniformly random split into equal parts (sizes differ by at most one).
- :func:`classes_per_client`: McMahan et al. 2017's pathological non-IID split, as PPFL Sec. 5.2 uses it
  ("a client has samples only from two random classes", ``k = 2``): ``clients * k`` shards, each of one
  class, ``k`` per client; every client holds at most ``k`` classes (tested).
- :func:`dirichlet`: for each class, the shares of the clients are drawn from ``Dir(alpha)`` (Hsu et al.
  2019; PoliFL Sec. 6.2): small ``alpha`` gives skewed clients, large ``alpha`` nearly IID ones.

Each returns one sorted index array per client; the arrays are disjoint and cover every sample.
:func:`to_federated` turns a split into a :class:`~fedveil.data.federated.FederatedDataset`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedveil.data.federated import FederatedDataset, UserData
from fedveil.data.images import ImageData
from fedveil.errors import ConfigError

__all__ = ["SCHEMES", "classes_per_client", "dirichlet", "iid", "partition", "to_federated"]

SCHEMES = ("iid", "classes:K", "dirichlet:ALPHA")
_MAX_DIRICHLET_TRIES = 1000


def _check(labels: np.ndarray, num_clients: int) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1 or y.size == 0:
        raise ConfigError(f"labels must be a non-empty 1-D array, got shape {y.shape}")
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ConfigError(f"num_clients {num_clients!r} must be an integer >= 1")
    if num_clients > y.size:
        raise ConfigError(f"{num_clients} clients for {y.size} samples: every client needs at least one")
    return y


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A random split into ``num_clients`` parts whose sizes differ by at most one."""
    y = _check(labels, num_clients)
    return [np.sort(part) for part in np.array_split(rng.permutation(y.size), num_clients)]


def _shard_counts(sizes: np.ndarray, shards: int) -> np.ndarray:
    """Shards per class: at least one each, the rest proportional to class size (largest remainder),
    never more than a class has samples."""
    counts = np.ones(sizes.size, dtype=np.int64)
    spare = shards - sizes.size
    want = sizes / sizes.sum() * shards - 1
    while spare > 0:
        room = counts < sizes
        gap = np.where(room, want - (counts - 1), -np.inf)
        take = int(np.argmax(gap))
        counts[take] += 1
        spare -= 1
    return counts


def classes_per_client(
    labels: np.ndarray, num_clients: int, k: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """McMahan et al.'s shards, ``k`` per client, each of one class: every client holds <= ``k`` classes.

    The ``num_clients * k`` shards are cut class by class (at least one per class, the rest in proportion
    to class sizes, so equal-size shards on balanced labels as in McMahan et al.), then dealt at random,
    preferring for each shard a client that does not hold its class yet.
    """
    y = _check(labels, num_clients)
    classes, sizes = np.unique(y, return_counts=True)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"classes per client {k!r} must be an integer >= 1")
    if k > classes.size:
        raise ConfigError(
            f"{k} classes per client asked for, but the labels have only {classes.size} classes"
        )
    shards = num_clients * k
    if shards > y.size:
        raise ConfigError(f"{num_clients} clients x {k} shards = {shards} shards for only {y.size} samples")
    if shards < classes.size:
        raise ConfigError(
            f"{num_clients} clients x {k} classes = {shards} shards cannot hold the {classes.size} classes; "
            "use more clients or more classes per client"
        )
    pieces, piece_class = [], []
    for cls, count in zip(classes, _shard_counts(sizes, shards), strict=True):
        idx = rng.permutation(np.flatnonzero(y == cls))
        for piece in np.array_split(idx, int(count)):
            pieces.append(piece)
            piece_class.append(int(cls))
    hands: list[list[int]] = [[] for _ in range(num_clients)]
    for s in rng.permutation(len(pieces)):
        open_hands = [c for c in range(num_clients) if len(hands[c]) < k]
        fresh = [c for c in open_hands if all(piece_class[t] != piece_class[s] for t in hands[c])]
        pool = fresh or open_hands
        hands[pool[int(rng.integers(len(pool)))]].append(int(s))
    return [np.sort(np.concatenate([pieces[s] for s in hand])) for hand in hands]


def dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator, *, min_size: int = 1
) -> list[np.ndarray]:
    """Per-class client shares from ``Dir(alpha)``, redrawn until every client has ``min_size`` samples."""
    y = _check(labels, num_clients)
    if not (np.isfinite(alpha) and alpha > 0):
        raise ConfigError(f"Dirichlet alpha {alpha!r} must be a finite number > 0")
    if min_size * num_clients > y.size:
        raise ConfigError(f"min_size {min_size} x {num_clients} clients exceeds the {y.size} samples")
    for _ in range(_MAX_DIRICHLET_TRIES):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for cls in np.unique(y):
            idx = rng.permutation(np.flatnonzero(y == cls))
            shares = rng.dirichlet(np.full(num_clients, float(alpha)))
            cuts = (np.cumsum(shares)[:-1] * idx.size).astype(int)
            for c, piece in enumerate(np.split(idx, cuts)):
                parts[c].append(piece)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(p.size for p in out) >= min_size:
            return out
    raise ConfigError(
        f"Dirichlet(alpha={alpha}) left a client with fewer than {min_size} samples in "
        f"{_MAX_DIRICHLET_TRIES} draws: use a larger alpha, fewer clients or a smaller min_size"
    )


def partition(
    labels: np.ndarray, scheme: str, num_clients: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Split by ``scheme``: ``iid``, ``classes:K`` (``classes:2``), ``dirichlet:A`` (``dirichlet:0.5``)."""
    name, _, arg = scheme.partition(":")
    try:
        if name == "iid" and not arg:
            return iid(labels, num_clients, rng)
        if name == "classes" and arg:
            return classes_per_client(labels, num_clients, int(arg), rng)
        if name == "dirichlet" and arg:
            return dirichlet(labels, num_clients, float(arg), rng)
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"partition scheme {scheme!r}: {arg!r} is not a number") from None
    raise ConfigError(f"partition scheme {scheme!r} is not one of {', '.join(SCHEMES)}")


def to_federated(data: ImageData, parts: Sequence[np.ndarray], *, prefix: str = "client") -> FederatedDataset:
    """Users ``f"{prefix}{i:04d}"`` holding arrays ``x`` and ``y`` of their part (attribute ``partition``)."""
    return FederatedDataset(
        UserData(f"{prefix}{i:04d}", {"partition": str(i)}, {"x": data.x[idx], "y": data.y[idx]})
        for i, idx in enumerate(parts)
    )
