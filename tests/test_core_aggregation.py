"""FedAvg folded in as uploads arrive (:class:`fedveil.core.aggregation.FedAvgSum`) against the
all-at-once :func:`~fedveil.core.aggregation.weighted_average` and a float64 reference, within the
tolerance its docstring states."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedveil.core.aggregation import FedAvgSum, weighted_average
from fedveil.errors import ValidationError


def _ulp32(*values: np.ndarray) -> np.ndarray:
    """One float32 ulp at the largest magnitude among ``values``, per coordinate."""
    return np.spacing(np.maximum.reduce([np.abs(v.astype(np.float64)) for v in values]).astype(np.float32))


def _folded(vectors: dict[str, np.ndarray], counts: dict[str, int], order: list[str]) -> np.ndarray:
    total = FedAvgSum(next(iter(vectors.values())).shape)
    for cid in order:
        total.add(cid, vectors[cid], counts[cid])
    return total.result()


@settings(max_examples=40, deadline=None)
@given(
    counts=st.lists(st.integers(1, 10_000), min_size=1, max_size=9),
    shape=st.sampled_from([(1,), (7,), (32768,), (40_001,), (3, 5_000)]),
    scale=st.sampled_from([1e-3, 1.0, 3e4]),
    offset=st.sampled_from([0.0, 5.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_running_sum_is_the_float64_mean_and_within_its_stated_tolerance_of_weighted_average(
    counts: list[int], shape: tuple[int, ...], scale: float, offset: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    ids = [f"c{i}" for i in range(len(counts))]
    vectors = {c: (offset + rng.normal(0, scale, shape)).astype(np.float32) for c in ids}
    n = {c: k for c, k in zip(ids, counts, strict=True)}
    got = _folded(vectors, n, ids)
    assert got.dtype == np.float32 and got.shape == shape

    stacked = np.stack([vectors[c].astype(np.float64) for c in ids])
    weights = np.array(counts, np.float64)[(...,) + (None,) * len(shape)]
    reference = (weights * stacked).sum(axis=0) / sum(counts)
    magnitude = (weights * np.abs(stacked)).sum(axis=0) / sum(counts)  # S of the docstring
    k = len(ids)
    assert np.all(np.abs(got - reference) <= 0.5 * _ulp32(got, reference) + 2 * k * 2.0**-52 * magnitude)

    averaged = weighted_average(vectors, n)
    assert np.all(np.abs(got.astype(np.float64) - averaged) <= _ulp32(got, averaged) + 2.0**-23 * magnitude)
    if offset > 4 * scale:  # every upload positive: no cancellation, within two ulps
        assert np.all(np.abs(got.astype(np.float64) - averaged) <= 2 * _ulp32(got, averaged))

    shuffled = list(rng.permutation(ids))
    again = _folded(vectors, n, shuffled)
    assert np.all(np.abs(again.astype(np.float64) - got) <= _ulp32(got, again) + 2 * k * 2.0**-52 * magnitude)


def test_a_refused_upload_changes_nothing() -> None:
    good = np.array([1.0, 2.0, 3.0], np.float32)
    total = FedAvgSum((3,))
    total.add("a", good, 2)
    for cid, vector, count, why in [
        ("b", np.array([1.0, np.nan, 0.0], np.float32), 1, "client b: the upload has NaN or infinite"),
        ("c", np.array([np.inf, 0.0, 0.0], np.float32), 1, "client c: the upload has NaN or infinite"),
        ("d", np.zeros(4, np.float32), 1, r"client d: vector of shape \(4,\), expected \(3,\)"),
        ("e", good, 0, "client e: weight 0 must be a finite positive number"),
        ("f", good, float("nan"), "client f: weight nan must be a finite positive number"),
    ]:
        with pytest.raises(ValidationError, match=why):
            total.add(cid, vector, count)
    assert total.count == 1 and total.total == 2.0
    np.testing.assert_array_equal(total.result(), good)


def test_a_sum_of_no_uploads_has_no_mean() -> None:
    with pytest.raises(ValidationError, match="FedAvgSum of no uploads"):
        FedAvgSum((2,)).result()
