"""FDML Alg. 1 in closed form (fedveil.enclave.triplet) against the torch autograd brute force."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fedveil.enclave import triplet
from fedveil.enclave.triplet import STRATEGIES, loss_and_derivatives
from fedveil.errors import ConfigError, FedveilError, ValidationError
from fedveil.experiments.fdml.triplet_reference import reference_fits, reference_loss_and_derivatives

MODES = tuple(STRATEGIES)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |g - g_ref| / max(max |g_ref|, tiny)."""
    return float(np.max(np.abs(got - want), initial=0.0) / max(np.max(np.abs(want), initial=0.0), 1e-300))


def check(x: np.ndarray, y: np.ndarray, margin: float, strategy: str, **kw: object) -> triplet.TripletResult:
    res = loss_and_derivatives(x, y, margin=margin, strategy=strategy, **kw)
    loss, grad = reference_loss_and_derivatives(x, y, margin=margin, strategy=strategy)
    assert res.derivatives.shape == x.shape and res.derivatives.dtype == x.dtype
    assert np.isfinite(res.derivatives).all()
    assert rel_err(res.derivatives, grad) <= 1e-6
    assert res.loss == pytest.approx(loss, rel=1e-9, abs=1e-12)
    assert (res.num_active == 0) == (loss == 0.0 and not grad.any())
    return res


def test_alg1_by_hand() -> None:
    # one active triplet: anchor x=1, positive x=0 (d=1), negative x=3 (d=2): hinge 1 + 2 - 2 = 1
    res = loss_and_derivatives(np.array([[0.0], [1.0], [3.0]]), np.array([7, 7, 9]), margin=2.0)
    assert (res.loss, res.num_active, res.num_valid) == (1.0, 1, 2)
    np.testing.assert_array_equal(res.derivatives, [[-1.0], [2.0], [-1.0]])  # -u_ap, u_ap - u_an, u_an


@pytest.mark.parametrize("strategy", MODES)
@pytest.mark.parametrize("seed", range(4))
def test_matches_reference_on_random_clusters(strategy: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, d = int(rng.integers(20, 70)), int(rng.integers(2, 9))
    y = rng.integers(0, int(rng.integers(2, 12)), n)
    x = rng.normal(0, 1, (12, d))[y] + rng.normal(0, 0.8, (n, d)) + 5.0  # clusters away from the origin
    res = check(x, y, float(rng.uniform(0.3, 2.0)), strategy)
    assert 0 < res.num_active <= res.num_valid


@pytest.mark.parametrize("strategy", MODES)
def test_ties_on_an_integer_grid(strategy: str) -> None:
    rng = np.random.default_rng(3)
    x = rng.integers(-2, 3, (60, 3)).astype(np.float64)  # many equal distances, hinges exactly 0
    y = rng.integers(0, 6, 60)
    check(x, y, 1.0, strategy)
    check(x, y, 2.0, strategy)


@pytest.mark.parametrize("strategy", MODES)
def test_classes_with_one_sample_are_only_negatives(strategy: str) -> None:
    rng = np.random.default_rng(4)
    y = np.array([0, 0, 0, 1, 2, 3, 4, 4, 5])
    x = rng.normal(0, 1, (9, 4))
    res = check(x, y, 1.5, strategy)
    k = np.array([2, 2, 2, 0, 0, 0, 1, 1, 0])
    assert res.num_valid == int(np.sum(k * (9 - 1 - k)))


def test_far_apart_clusters_have_no_active_triplet() -> None:
    rng = np.random.default_rng(5)
    y = np.repeat(np.arange(6), 5)
    x = 100.0 * np.eye(6)[y] + rng.normal(0, 0.1, (30, 6))
    for strategy in MODES:
        res = loss_and_derivatives(x, y, margin=1.0, strategy=strategy)
        assert (res.loss, res.num_active, res.num_valid) == (0.0, 0, 30 * 4 * 25)
        assert not res.derivatives.any()


@pytest.mark.parametrize("strategy", MODES)
def test_duplicated_embeddings_give_zero_direction_not_nan(strategy: str) -> None:
    rng = np.random.default_rng(6)
    x = rng.normal(0, 1, (8, 3))
    x = np.concatenate([x, x[:4], x[:2]])  # duplicates inside a class and across classes
    y = np.array([0, 0, 1, 1, 2, 2, 3, 3, 0, 1, 1, 2, 2, 0])
    res = check(x, y, 1.0, strategy)
    assert res.num_active > 0
    same = loss_and_derivatives(np.zeros((4, 2)), np.array([0, 0, 1, 1]), margin=1.0, strategy=strategy)
    assert np.isfinite(same.derivatives).all() and not same.derivatives.any()
    assert (same.loss, same.num_active) == ((1.0, 8) if strategy == "batch-all" else (0.0, 0))


@pytest.mark.parametrize("strategy", MODES)
def test_small_memory_limit_runs_many_tiles_with_the_same_result(strategy: str) -> None:
    rng = np.random.default_rng(7)
    y = rng.integers(0, 30, 300)
    x = rng.normal(0, 1, (30, 8))[y] + rng.normal(0, 0.7, (300, 8))
    whole = loss_and_derivatives(x, y, margin=1.0, strategy=strategy, memory_limit_bytes=None)
    tiled = loss_and_derivatives(x, y, margin=1.0, strategy=strategy, memory_limit_bytes=600_000)
    assert whole.tile_size == 300 and tiled.tile_size < 60
    assert tiled.num_active == whole.num_active and tiled.num_valid == whole.num_valid
    assert tiled.loss == pytest.approx(whole.loss, rel=1e-12)
    assert rel_err(tiled.derivatives, whole.derivatives) <= 1e-12


@pytest.mark.parametrize("strategy", MODES)
def test_row_by_row_plan_equals_symmetric_tiles(strategy: str) -> None:
    rng = np.random.default_rng(8)
    y = rng.integers(0, 9, 120)
    x = rng.normal(0, 1, (120, 5))
    want = loss_and_derivatives(x, y, margin=1.0, strategy=strategy, memory_limit_bytes=None)
    order = np.lexsort((y, np.bincount(y)[y]))
    group = np.concatenate(([0], np.cumsum(y[order][1:] != y[order][:-1])))
    k = np.bincount(y)[y[order]] - 1
    plan = triplet._Plan(120, 5, k, 8, strategy == "semi-hard", None)
    plan.size, plan.symmetric = 17, False
    hinge, grad, active = triplet._Computation(x[order], group, k, 1.0, STRATEGIES[strategy], plan).run()
    got = np.empty_like(grad)
    got[order] = grad / active
    assert active == want.num_active and hinge / active == pytest.approx(want.loss, rel=1e-12)
    assert rel_err(got, want.derivatives) <= 1e-12


def test_large_groups_under_a_tight_limit_go_row_by_row_within_the_limit() -> None:
    rng = np.random.default_rng(12)
    y = np.repeat([0, 1, 2], [300, 300, 1])
    x = rng.normal(0, 1, (601, 4))
    limit = 2 * 2**20
    # every block's positives cannot be kept until the end: 600 anchors x 299 positives
    plan = triplet._Plan(601, 4, np.sort(np.bincount(y)[y] - 1), 8, False, limit)
    assert not plan.symmetric
    want = loss_and_derivatives(x, y, margin=1.0, memory_limit_bytes=None)
    tracemalloc.start()
    try:
        got = loss_and_derivatives(x, y, margin=1.0, memory_limit_bytes=limit)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= got.workspace_bytes <= limit and got.tile_size == plan.size
    assert got.num_active == want.num_active and got.loss == pytest.approx(want.loss, rel=1e-12)
    assert rel_err(got.derivatives, want.derivatives) <= 1e-12


@pytest.mark.parametrize("strategy", MODES)
def test_large_label_groups_are_counted_by_search(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(9)
    y = np.repeat([0, 1, 2, 3], [20, 12, 3, 1])
    x = rng.normal(0, 1, (4, 3))[y] + rng.normal(0, 0.9, (36, 3))
    dense = loss_and_derivatives(x, y, margin=1.0, strategy=strategy)
    monkeypatch.setattr(triplet, "DENSE_MAX_POSITIVES", 4)
    searched = check(x, y, 1.0, strategy)
    assert searched.num_active == dense.num_active
    assert rel_err(searched.derivatives, dense.derivatives) <= 1e-12
    ties = rng.integers(0, 3, (36, 2)).astype(np.float64)
    check(ties, y, 1.0, strategy, memory_limit_bytes=400_000)


def test_float32_input_stays_float32_and_close_to_the_float64_reference() -> None:
    rng = np.random.default_rng(10)
    y = np.repeat(np.arange(10), 6)
    x = (rng.normal(0, 1, (10, 16))[y] + rng.normal(0, 0.5, (60, 16))).astype(np.float32)
    res = loss_and_derivatives(x, y, margin=1.0)
    loss, grad = reference_loss_and_derivatives(x, y, margin=1.0)
    assert res.derivatives.dtype == np.float32
    assert rel_err(res.derivatives.astype(np.float64), grad) <= 1e-4
    assert res.loss == pytest.approx(loss, rel=1e-4)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_far_embedding_does_not_send_its_tile_to_the_exact_path(
    dtype: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trained TouchAuth batch has a few embeddings far out: each pair is refined against its own squared
    norms (which bound the Gram form's cancellation), not the tile's largest, and stays accurate."""
    rng = np.random.default_rng(12)
    y = np.repeat(np.arange(32), 8)
    x = rng.normal(0, 1, (32, 16))[y] + rng.normal(0, 0.3, (256, 16))
    x[5] *= 40.0  # one embedding 40x further out than the rest
    x = x.astype(dtype)
    refined: list[int] = []
    original = triplet._Computation._squared_distances

    def counted(self: triplet._Computation, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        refined.append(i.size)
        return original(self, i, j)

    monkeypatch.setattr(triplet._Computation, "_squared_distances", counted)
    res = loss_and_derivatives(x, y, margin=1.0)
    loss, grad = reference_loss_and_derivatives(x, y, margin=1.0)
    tol = 1e-9 if dtype is np.float64 else 1e-4
    assert rel_err(res.derivatives.astype(np.float64), grad) <= tol
    assert res.loss == pytest.approx(loss, rel=tol)
    # the positives (7 per anchor, always exact) plus few close pairs; not a large share of all 256^2
    positives = 256 * 7
    assert sum(refined) - positives < 0.02 * 256 * 256, sum(refined)


def test_memory_stays_within_the_plan_and_the_limit() -> None:
    rng = np.random.default_rng(11)
    y = np.repeat(np.arange(100), 8)
    x = rng.normal(0, 1, (800, 32)).astype(np.float32)
    limit = 6 * 2**20
    loss_and_derivatives(x, y, margin=1.0, memory_limit_bytes=limit)  # warm caches outside the trace
    tracemalloc.start()
    try:
        res = loss_and_derivatives(x, y, margin=1.0, memory_limit_bytes=limit)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert res.tile_size < 800 and peak <= res.workspace_bytes <= limit


def test_empty_and_triplet_free_batches() -> None:
    empty = loss_and_derivatives(np.zeros((0, 3), np.float32), np.zeros(0, np.int64), margin=1.0)
    assert empty.derivatives.shape == (0, 3) and empty.derivatives.dtype == np.float32
    for y in ([4, 4, 4], [0, 1, 2]):  # one class; only singletons
        res = loss_and_derivatives(np.eye(3), np.array(y), margin=1.0)
        assert (res.loss, res.num_active, res.num_valid) == (0.0, 0, 0) and not res.derivatives.any()


def near_tie(x: np.ndarray, y: np.ndarray, margin: float, strategy: str) -> bool:
    """Whether a valid triplet's selection (hinge > 0; for semi-hard also d_an > d_ap) is within
    1e-9 of its threshold, exact ties included: there the loss's derivative jumps, and which side a
    float computation lands on is rounding. Exact ties of exactly representable points are the integer
    grid's case, which must agree exactly."""
    dist = np.sqrt(((x[:, None, :] - x[None, :, :]) ** 2).sum(-1))
    same = y[:, None] == y[None, :]
    pos = same & ~np.eye(len(y), dtype=bool)
    gaps = [(dist[:, :, None] + margin - dist[:, None, :])[pos[:, :, None] & ~same[:, None, :]]]
    if strategy == "semi-hard":
        gaps.append((dist[:, None, :] - dist[:, :, None])[pos[:, :, None] & ~same[:, None, :]])
    scale = max(1.0, float(np.abs(x).max(initial=0.0)), margin)
    return any(bool((np.abs(g) < 1e-9 * scale).any()) for g in gaps)


def test_near_tie_finds_a_tie_that_rounding_breaks() -> None:
    # hypothesis's find: anchor 2^-52, positive 1, negative 4, margin 3: (1 - 2^-52) + 3 - (4 - 2^-52) = 0
    x, y = np.array([[4.0], [2.0**-52], [1.0]]), np.array([0, 1, 1])
    assert near_tie(x, y, 3.0, "batch-all") and not near_tie(x, y, 2.5, "batch-all")


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    n=st.integers(2, 14),
    d=st.integers(1, 4),
    strategy=st.sampled_from(MODES),
    on_grid=st.booleans(),
)
def test_property_matches_reference_and_is_translation_invariant(
    data: st.DataObject, n: int, d: int, strategy: str, on_grid: bool
) -> None:
    y = data.draw(arrays(np.int64, n, elements=st.integers(0, 3)))
    if on_grid:
        x = data.draw(arrays(np.int64, (n, d), elements=st.integers(-3, 3))).astype(np.float64)
        margin = float(data.draw(st.integers(1, 3)))
    else:
        x = data.draw(arrays(np.float64, (n, d), elements=st.floats(-4, 4, width=32)))
        margin = data.draw(st.floats(0.05, 3.0))
        assume(not near_tie(x, y, margin, strategy))
    res = check(x, y, margin, strategy)
    # the loss is translation invariant, so its derivatives sum to zero over the embeddings
    assert np.abs(res.derivatives.sum(axis=0)).max() <= 1e-9 * max(1.0, np.abs(res.derivatives).max())
    moved = loss_and_derivatives(x + 8.0, y, margin=margin, strategy=strategy)
    assert moved.num_active == res.num_active or not on_grid


@pytest.mark.parametrize(
    ("embeddings", "labels", "kwargs", "error", "match"),
    [
        ([[0.0, 1.0]], [0], {}, ValidationError, "numpy array"),
        (np.zeros((3, 2), np.int32), [0, 0, 1], {}, ValidationError, "dtype int32"),
        (np.zeros((3, 2), np.float16), [0, 0, 1], {}, ValidationError, "float32 or float64"),
        (np.zeros(3), [0, 0, 1], {}, ValidationError, r"shape \(N, d\)"),
        (np.zeros((3, 0)), [0, 0, 1], {}, ValidationError, "d >= 1"),
        (np.array([[0.0], [np.nan], [np.inf]]), [0, 0, 1], {}, ValidationError, r"rows \[1, 2\]"),
        (np.zeros((3, 2)), [0, 1], {}, ValidationError, r"shape \(3,\)"),
        (np.zeros((3, 2)), [0.0, 1.0, 1.0], {}, ValidationError, "integers"),
        (np.full((3, 2), 1e300), [0, 0, 1], {}, ValidationError, "rescale"),
        (np.zeros((3, 2)), [0, 0, 1], {"margin": 0.0}, ConfigError, "margin 0.0"),
        (np.zeros((3, 2)), [0, 0, 1], {"margin": float("nan")}, ConfigError, "margin nan"),
        (np.zeros((3, 2)), [0, 0, 1], {"margin": True}, ConfigError, "number"),
        (np.zeros((3, 2), np.float32), [0, 0, 1], {"margin": 1e30}, ConfigError, "at most"),
        (np.zeros((3, 2)), [0, 0, 1], {"strategy": "hard"}, ConfigError, "'hard' is not one of"),
        (np.zeros((3, 2)), [0, 0, 1], {"memory_limit_bytes": 0}, ConfigError, "positive int"),
        (np.zeros((3, 2)), [0, 0, 1], {"memory_limit_bytes": 2.5}, ConfigError, "positive int"),
    ],
)
def test_bad_input_is_rejected_with_a_named_error(
    embeddings: object, labels: object, kwargs: dict[str, object], error: type[FedveilError], match: str
) -> None:
    kw: dict[str, object] = {"margin": 1.0, **kwargs}
    with pytest.raises(error, match=match):
        loss_and_derivatives(embeddings, np.asarray(labels), **kw)  # type: ignore[arg-type]


def test_a_limit_below_one_embedding_per_block_names_the_sizes() -> None:
    x = np.zeros((5000, 64), np.float32)
    with pytest.raises(ConfigError, match=r"memory_limit_bytes=1000000 is too small for 5000 embeddings"):
        loss_and_derivatives(x, np.arange(5000) // 8, margin=1.0, memory_limit_bytes=1_000_000)


def test_reference_fit_check() -> None:
    assert reference_fits(64, 8) and not reference_fits(4096, 64)
    with pytest.raises(ConfigError, match="does not fit"):
        reference_loss_and_derivatives(np.zeros((700, 2)), np.zeros(700, np.int64), margin=1.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_unusable_rows_are_exactly_those_alg1_refuses(dtype: type) -> None:
    """Whoever filters embeddings before Alg. 1 (the enclave per client, the host per device reply) uses
    :func:`triplet.unusable_rows`: a row just below :func:`triplet.magnitude_limit` is kept and computed,
    a row at the limit is flagged, and Alg. 1 refuses exactly such a batch."""
    d = 64
    limit = triplet.magnitude_limit(dtype, d)
    assert limit.dtype == dtype and 5e17 < float(triplet.magnitude_limit(np.float32, d)) < 6e17
    below = np.nextafter(limit, dtype(0))
    x = np.random.default_rng(0).standard_normal((4, d)).astype(dtype)
    labels = np.array([0, 0, 1, 1])
    x[1, 3] = -below
    non_finite, too_large = triplet.unusable_rows(x)
    assert not non_finite.any() and not too_large.any()
    loss_and_derivatives(x, labels, margin=1.0)
    x[2, 5] = limit
    x[3, 0] = np.nan
    non_finite, too_large = triplet.unusable_rows(x)
    assert non_finite.tolist() == [False, False, False, True]
    assert too_large.tolist() == [False, False, True, False]
    with pytest.raises(ValidationError, match="too large"):
        loss_and_derivatives(x[:3], labels[:3], margin=1.0)
