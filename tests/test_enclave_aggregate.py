"""Eq. (2) of FDML (fedveil.enclave.aggregate) against a brute-force loop."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedveil.enclave.aggregate import (
    BLOCK,
    DEFAULT_MAX_UPLOAD_NORM,
    GradientSum,
    aggregate_gradients,
    check_max_upload_norm,
    check_upload,
    upload_norm,
)
from fedveil.errors import ConfigError, ValidationError


def brute(gradients: dict[str, np.ndarray], counts: dict[str, int]) -> np.ndarray:
    """sum_i |d_i| / |D| g_i, one coordinate at a time in exact rational arithmetic."""
    total = sum(counts.values())
    size = next(iter(gradients.values())).shape[0]
    return np.array(
        [
            float(sum(Fraction(counts[c], total) * Fraction(float(g[j])) for c, g in gradients.items()))
            for j in range(size)
        ]
    )


def test_weights_by_sample_counts() -> None:
    got = aggregate_gradients(
        {"a": np.array([1.0, 0.0]), "b": np.array([0.0, 4.0])}, {"a": 3, "b": 1}
    )  # 3/4 * a + 1/4 * b
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.array([0.75, 1.0], np.float32))


def test_one_participant_is_its_own_gradient() -> None:
    g = np.linspace(-1, 1, 7, dtype=np.float32)
    np.testing.assert_array_equal(aggregate_gradients({"only": g}, {"only": 5}), g)


@settings(max_examples=50, deadline=None)
@given(
    counts=st.lists(st.integers(1, 10_000), min_size=1, max_size=6),
    size=st.integers(1, 20),
    seed=st.integers(0, 2**32 - 1),
)
def test_matches_brute_force(counts: list[int], size: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    gradients = {f"c{i}": rng.normal(0, 10, size).astype(np.float32) for i in range(len(counts))}
    num = {f"c{i}": k for i, k in enumerate(counts)}
    got = aggregate_gradients(gradients, num)
    np.testing.assert_allclose(got, brute(gradients, num).astype(np.float32), rtol=1e-6, atol=1e-6)
    # a weighted mean stays inside the participants' range, coordinate by coordinate
    stacked = np.stack(list(gradients.values()))
    assert np.all(got >= stacked.min(axis=0) - 1e-5) and np.all(got <= stacked.max(axis=0) + 1e-5)


@settings(max_examples=30, deadline=None)
@given(
    counts=st.lists(st.integers(1, 10_000), min_size=1, max_size=8),
    size=st.integers(1, 300),
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_equals_the_straightforward_float64_sum_bit_for_bit(
    counts: list[int], size: int, dtype: type, seed: int
) -> None:
    """The product is written into one reused float64 buffer; the numbers are those of the plain
    ``(sum |d_i| * g_i.astype(float64)) / |D|``."""
    rng = np.random.default_rng(seed)
    gradients = {
        f"c{i}": (rng.normal(0, 10, size) * 10.0 ** rng.uniform(-3, 3)).astype(dtype)
        for i in range(len(counts))
    }
    num = {f"c{i}": k for i, k in enumerate(counts)}
    plain = np.zeros(size, np.float64)
    for cid, g in gradients.items():
        plain += num[cid] * g.astype(np.float64)
    np.testing.assert_array_equal(
        aggregate_gradients(gradients, num), (plain / sum(counts)).astype(np.float32)
    )


@settings(max_examples=40, deadline=None)
@given(
    counts=st.lists(st.integers(1, 2**29 - 1), min_size=1, max_size=12),
    size=st.integers(1, 3 * BLOCK // 2),
    cuts=st.lists(st.integers(1, 11), max_size=11),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_sum_fed_in_batches_equals_one_call_bit_for_bit(
    counts: list[int], size: int, cuts: list[int], seed: int
) -> None:
    """However the participants are cut into batches (the enclave's step-9 requests), the same
    participants in the same order give the same bits: every term |d_i| g_i is exact in float64."""
    rng = np.random.default_rng(seed)
    gradients = {
        f"c{i}": (rng.normal(0, 1, size) * 10.0 ** rng.uniform(-30, 30)).astype(np.float32)
        for i in range(len(counts))
    }
    num = {f"c{i}": k for i, k in enumerate(counts)}
    names = list(gradients)
    edges = sorted({c for c in cuts if c < len(names)})
    acc = GradientSum()
    for lo, hi in zip([0, *edges], [*edges, len(names)], strict=True):
        acc.add({c: gradients[c] for c in names[lo:hi]}, {c: num[c] for c in names[lo:hi]})
    assert acc.total == sum(counts) and acc.nbytes == 8 * size
    np.testing.assert_array_equal(acc.mean(), aggregate_gradients(gradients, num))


def test_a_sum_refuses_another_shape_and_use_after_a_non_finite_gradient() -> None:
    acc = GradientSum()
    acc.add({"a": np.ones(3, np.float32)}, {"a": 2})
    with pytest.raises(ValidationError, match=r"shape \(3,\) like the others"):
        acc.add({"b": np.ones(4, np.float32)}, {"b": 1})
    with pytest.raises(ValidationError, match="at most"):
        acc.add({"b": np.ones(3, np.float32)}, {"b": 2**29})
    np.testing.assert_array_equal(acc.mean(), np.ones(3, np.float32))  # refused batches left it unchanged
    with pytest.raises(ValidationError, match="'b' holds NaN"):
        acc.add({"b": np.array([1.0, np.inf, 0.0], np.float32)}, {"b": 1})
    with pytest.raises(ValidationError, match="unusable"):
        acc.add({"c": np.ones(3, np.float32)}, {"c": 1})
    with pytest.raises(ValidationError, match="at least one participant"):
        acc.mean()
    with pytest.raises(ValidationError, match="at least one participant"):
        GradientSum().mean()


def test_float64_gradients_accumulate_in_float64() -> None:
    big, small = np.array([1e8, 1.0]), np.array([-1e8, 1.0])
    got = aggregate_gradients({"a": big, "b": small}, {"a": 1, "b": 1})
    np.testing.assert_array_equal(got, np.array([0.0, 1.0], np.float32))


@pytest.mark.parametrize(
    ("gradients", "counts", "match"),
    [
        ({}, {}, "at least one participant"),
        ({"a": np.zeros(2)}, {"b": 1}, r"no count for \['a'\], no gradient for \['b'\]"),
        ({"a": np.zeros(2)}, {"a": 0}, r"num_samples\['a'\] = 0"),
        ({"a": np.zeros(2)}, {"a": 2.0}, "positive int"),
        ({"a": np.zeros(2)}, {"a": True}, "positive int"),
        ({"a": [0.0, 1.0]}, {"a": 1}, "float numpy array"),
        ({"a": np.zeros(2, np.int64)}, {"a": 1}, "int64"),
        ({"a": np.zeros((2, 2))}, {"a": 1}, r"flat \(P,\) vector"),
        ({"a": np.zeros(2), "b": np.zeros(3)}, {"a": 1, "b": 1}, r"shape \(2,\) like the others"),
        ({"a": np.array([0.0, np.nan])}, {"a": 1}, "NaN or inf"),
    ],
)
def test_bad_input_names_the_participant(gradients: dict, counts: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        aggregate_gradients(gradients, counts)


def test_an_upload_over_the_norm_bound_or_not_finite_is_refused() -> None:
    """:func:`check_upload` (FDML's gradients, inside the enclave and out, and the FedAvg engine's
    updates): the L2 norm, of the upload or of its change to ``reference``, summed in float64 so that
    float32 values near their largest do not overflow it."""
    g = np.full(2 * BLOCK + 3, 3e38, np.float32)
    assert upload_norm(g) == pytest.approx(3e38 * np.sqrt(g.size), rel=1e-6)
    assert upload_norm(np.array([3, 4], np.float32), np.array([0, 8], np.float32)) == 5.0
    check_upload(np.array([3, 4], np.float32), 5.0)
    with pytest.raises(ValidationError, match=r"gradient of L2 norm 5 exceeds max_upload_norm 4\.9"):
        check_upload(np.array([3, 4], np.float32), 4.9)
    with pytest.raises(ValidationError, match="update of L2 norm"):
        check_upload(np.array([3, 4], np.float32), 1.0, reference=np.zeros(2, np.float32), what="update")
    with pytest.raises(ValidationError, match="NaN or infinity"):
        check_upload(np.array([np.inf, 0], np.float32), DEFAULT_MAX_UPLOAD_NORM)
    with pytest.raises(ValidationError, match=r"exceeds max_upload_norm 1e\+06"):
        check_upload(g, DEFAULT_MAX_UPLOAD_NORM)
    assert check_max_upload_norm(10) == 10.0
    for bad in (0, -1.0, float("inf"), float("nan"), True, "1e6"):
        with pytest.raises(ConfigError, match="max_upload_norm"):
            check_max_upload_norm(bad)
