"""Alg. 1's exact path scatters each close pair's terms without sorting the pairs by row
(``_Computation._scatter_pairs``). Against the sort-and-``reduceat`` scatter it replaced (kept here as the
reference): the same counts and loss, and derivatives that differ only by the order of each chunk's
per-row float64 sums on the ``j`` side (one after another instead of ``reduceat``'s blocks), so by at
most :data:`FLOAT64_TOLERANCE` of the largest in float64 and :data:`FLOAT32_TOLERANCE` in float32 (a float64
sum that rounds to the other float32 neighbour). Against the brute-force autograd reference: Alg. 1's
tolerance, on random and on clustered, trained-like embeddings."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, reject, settings
from hypothesis import strategies as st

from fedveil.enclave import triplet
from fedveil.enclave.triplet import STRATEGIES, loss_and_derivatives
from fedveil.errors import ConfigError
from fedveil.experiments.fdml.triplet_reference import reference_loss_and_derivatives


def sorted_scatter_pairs(self: Any, i: np.ndarray, j: np.ndarray, scale: np.ndarray, sign: float) -> None:
    """The former scatter: per chunk and side, a stable argsort of the rows and ``np.add.reduceat``."""
    for s in range(0, i.size, triplet.REFINE_CHUNK):
        a, b = i[s : s + triplet.REFINE_CHUNK], j[s : s + triplet.REFINE_CHUNK]
        term = (self.x[a] - self.x[b]).astype(np.float64)
        term *= sign * scale[s : s + triplet.REFINE_CHUNK, None]
        for index, value in ((a, term), (b, -term)):
            order = np.argsort(index, kind="stable")
            index = index[order]
            first = np.flatnonzero(np.r_[True, index[1:] != index[:-1]])
            self.grad[index[first]] += np.add.reduceat(value[order], first, axis=0)


def both(x: np.ndarray, y: np.ndarray, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> tuple[Any, Any]:
    """Alg. 1 with the current scatter, then with the former one."""
    new = loss_and_derivatives(x, y, **kw)
    with monkeypatch.context() as m:
        m.setattr(triplet._Computation, "_scatter_pairs", sorted_scatter_pairs)
        old = loss_and_derivatives(x, y, **kw)
    return new, old


def clustered(rng: np.random.Generator, n: int, d: int, groups: int, noise: float, dtype: type) -> tuple:
    """Unit vectors around per-label centres, as a trained embedding network's outputs are: most pairs
    are close against their norms, so most of the work takes the exact path."""
    y = rng.integers(0, groups, n)
    x = rng.normal(0, 1, (groups, d))[y] + noise * rng.normal(0, 1, (n, d))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(dtype), y


FLOAT64_TOLERANCE = 1e-14
"""``max |new - old| / max |old|`` allowed for float64 derivatives."""

FLOAT32_TOLERANCE = 2.0**-22
"""The same for float32 derivatives: two units in the last place of the largest."""


def assert_same_up_to_order(new: Any, old: Any) -> None:
    assert (new.loss, new.num_active, new.num_valid) == (old.loss, old.num_active, old.num_valid)
    assert new.derivatives.dtype == old.derivatives.dtype
    tolerance = FLOAT64_TOLERANCE if old.derivatives.dtype == np.float64 else FLOAT32_TOLERANCE
    scale = float(np.max(np.abs(old.derivatives), initial=0.0))
    assert np.max(np.abs(new.derivatives - old.derivatives), initial=0.0) <= tolerance * scale


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(3, 90),
    d=st.integers(1, 9),
    groups=st.integers(2, 12),
    noise=st.sampled_from([0.01, 0.1, 0.5, 2.0]),
    dtype=st.sampled_from([np.float32, np.float64]),
    strategy=st.sampled_from(tuple(STRATEGIES)),
    margin=st.floats(0.05, 2.0),
    limit=st.sampled_from([None, 60_000]),
)
def test_the_scatter_equals_the_former_scatter_up_to_summation_order(
    seed: int,
    n: int,
    d: int,
    groups: int,
    noise: float,
    dtype: type,
    strategy: str,
    margin: float,
    limit: Any,
) -> None:
    rng = np.random.default_rng(seed)
    x, y = clustered(rng, n, d, groups, noise, dtype)
    if seed % 3 == 0:  # copies: distance-0 pairs take the exact path too
        x[: n // 3] = x[n - n // 3 :]
    with pytest.MonkeyPatch.context() as mp:
        try:
            new, old = both(x, y, mp, margin=margin, strategy=strategy, memory_limit_bytes=limit)
        except ConfigError:  # the tight limit is below one embedding per block for this batch
            reject()
    assert_same_up_to_order(new, old)


@pytest.mark.parametrize("strategy", tuple(STRATEGIES))
def test_clustered_embeddings_match_the_reference_and_the_former_scatter(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(11)
    x, y = clustered(rng, 96, 16, 12, 0.1, np.float64)
    calls: list[int] = []
    scatter = triplet._Computation._scatter_pairs

    def counted(self: Any, i: np.ndarray, *args: Any, **kw: Any) -> None:
        calls.append(i.size)
        scatter(self, i, *args, **kw)

    monkeypatch.setattr(triplet._Computation, "_scatter_pairs", counted)
    new = loss_and_derivatives(x, y, margin=1.0, strategy=strategy)
    assert sum(calls) > 300  # the positives and some negatives are close: the exact path
    monkeypatch.undo()
    new_again, old = both(x, y, monkeypatch, margin=1.0, strategy=strategy)
    assert_same_up_to_order(new, old)
    assert_same_up_to_order(new_again, old)
    loss, grad = reference_loss_and_derivatives(x, y, margin=1.0, strategy=strategy)
    assert np.max(np.abs(new.derivatives - grad)) <= 1e-12 * np.max(np.abs(grad))
    assert new.loss == pytest.approx(loss, rel=1e-12)
