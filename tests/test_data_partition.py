"""Partitioners: each keeps the property it promises (hypothesis), is seeded, and refuses bad requests."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedveil.data.images import synthetic_fashion_mnist
from fedveil.data.partition import classes_per_client, dirichlet, iid, partition, to_federated
from fedveil.errors import ConfigError

labels_st = st.lists(st.integers(0, 9), min_size=40, max_size=300).map(np.array)


def _disjoint_cover(parts: list[np.ndarray], n: int) -> None:
    joined = np.concatenate(parts)
    assert joined.size == n and np.unique(joined).size == n
    assert all(np.all(np.diff(p) > 0) for p in parts if p.size > 1)


@settings(max_examples=40, deadline=None)
@given(labels=labels_st, clients=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_iid_equal_sizes(labels, clients, seed) -> None:
    parts = iid(labels, clients, np.random.default_rng(seed))
    _disjoint_cover(parts, labels.size)
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= 1
    again = iid(labels, clients, np.random.default_rng(seed))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


@settings(max_examples=40, deadline=None)
@given(labels=labels_st, clients=st.integers(1, 15), k=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_classes_per_client_at_most_k(labels, clients, k, seed) -> None:
    present = np.unique(labels).size
    if k > present or clients * k > labels.size or clients * k < present:
        with pytest.raises(ConfigError):
            classes_per_client(labels, clients, k, np.random.default_rng(seed))
        return
    parts = classes_per_client(labels, clients, k, np.random.default_rng(seed))
    _disjoint_cover(parts, labels.size)
    assert len(parts) == clients
    assert max(np.unique(labels[p]).size for p in parts) <= k


def test_two_classes_per_client_on_balanced_labels() -> None:
    labels = np.repeat(np.arange(10), 100)
    parts = classes_per_client(labels, 50, 2, np.random.default_rng(0))
    _disjoint_cover(parts, labels.size)
    assert max(np.unique(labels[p]).size for p in parts) <= 2
    assert all(p.size == 20 for p in parts)


@settings(max_examples=30, deadline=None)
@given(labels=labels_st, clients=st.integers(1, 6), alpha=st.floats(0.3, 50), seed=st.integers(0, 2**16))
def test_dirichlet_covers_and_respects_min_size(labels, clients, alpha, seed) -> None:
    parts = dirichlet(labels, clients, alpha, np.random.default_rng(seed), min_size=2)
    _disjoint_cover(parts, labels.size)
    assert min(p.size for p in parts) >= 2


def test_smaller_alpha_is_more_skewed() -> None:
    labels = np.repeat(np.arange(10), 200)

    def skew(alpha: float) -> float:
        parts = dirichlet(labels, 10, alpha, np.random.default_rng(1))
        return float(np.mean([np.bincount(labels[p], minlength=10).max() / p.size for p in parts]))

    assert skew(0.1) > skew(1.0) > skew(100.0)
    assert skew(100.0) < 0.2


def test_dispatch_federated_dataset_and_bad_requests() -> None:
    data = synthetic_fashion_mnist(60, seed=0)
    parts = partition(data.y, "classes:2", 5, np.random.default_rng(0))
    fed = to_federated(data, parts)
    assert fed.user_ids[0] == "client0000" and len(fed) == 5
    np.testing.assert_array_equal(fed.array("client0001", "y"), data.y[parts[1]])
    assert len(partition(data.y, "dirichlet:0.5", 3, np.random.default_rng(0))) == 3
    assert len(partition(data.y, "iid", 4, np.random.default_rng(0))) == 4
    with pytest.raises(ConfigError, match="11 classes per client asked for, but the labels have only 10"):
        classes_per_client(data.y, 2, 11, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="not one of iid"):
        partition(data.y, "shards", 3, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="'x' is not a number"):
        partition(data.y, "dirichlet:x", 3, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="100 clients for 60 samples"):
        iid(data.y, 100, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="alpha"):
        dirichlet(data.y, 3, 0.0, np.random.default_rng(0))
