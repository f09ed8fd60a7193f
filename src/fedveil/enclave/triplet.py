"""Closed-form triplet loss and per-embedding derivatives: Alg. 1 of FDML.

Definitions (Euclidean, not squared, distances ``d(x, y) = ||x - y||_2``):

- a *valid* triplet ``(a, p, n)`` has ``label[a] == label[p]``, ``a != p`` and ``label[n] != label[a]``;
- its hinge is ``h = (d(a, p) + margin) - d(a, n)``; it is *active* when ``h > 0`` and the strategy
  selects it: ``"batch-all"`` selects every valid triplet, ``"semi-hard"`` (FaceNet; pytorch-metric-
  learning's ``semihard``) only those with ``d(a, p) < d(a, n)``;
- the loss is the mean hinge over the active triplets, and each active triplet adds ``u_ap - u_an`` to
  ``dL/dA``, ``-u_ap`` to ``dL/dP`` and ``u_an`` to ``dL/dN`` (Alg. 1 lines 5-7), where
  ``u_xy = (x - y) / ||x - y||``, all divided by the number of active triplets (line 10). A zero distance
  (duplicated embeddings) has ``u = 0``, a subgradient. With no active triplet the loss and the
  derivatives are 0.

Alg. 1 walks the ``O(N^3)`` triplets one at a time. This module computes the same numbers in
``O(N^2 d)`` time: for each (anchor, positive) pair it counts the negatives that make the triplet active
(``c_ap``) and for each (anchor, negative) pair the positives that do (``w_an``), so the derivatives are
weighted sums of difference vectors, ``sum_j S_aj (x_a - x_j)`` with ``S = C / D``, taken as matrix
products. The distance matrix is never held whole: the embeddings, grouped by label, are cut into
blocks, and each tile (block pair ``I <= J``) serves both of its blocks as anchors (Alg. 1 line 1 keeps
only the upper triangle too), within ``memory_limit_bytes``.

Accuracy: distances come from the Gram form ``|x|^2 + |y|^2 - 2 x.y`` (after a coarse centring), except
for pairs close against their norms, the positives and duplicated embeddings, which take their
difference vectors; those pairs also scatter their derivative terms from the exact differences. Exact
ties (grids, copies) thus stay ties. In float64 the result matches a brute-force autograd reference to
about 1e-12; in float32, triplets whose hinge is within float32 rounding of 0 may be decided otherwise
than in float64.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from fedveil.errors import ConfigError, ValidationError

__all__ = [
    "DEFAULT_MEMORY_LIMIT_BYTES",
    "STRATEGIES",
    "TripletResult",
    "loss_and_derivatives",
    "magnitude_limit",
    "unusable_rows",
]

DEFAULT_MEMORY_LIMIT_BYTES = 96 * 2**20
"""Working memory allowed by default: 96 MiB, about the usable enclave page cache of SGX1."""

MAX_TILE = 512
"""Largest block (embeddings per tile side); larger tiles gain little and leave the CPU caches."""

DENSE_MAX_POSITIVES = 96
"""Anchors with up to this many positives are counted by comparison planes, larger groups by search."""

REFINE_RATIO = 1.0 / 16.0
"""A squared distance below this fraction of the squared norms is recomputed from the difference."""

FINISH_ROWS = 64
"""Anchors whose positive terms are scattered at once (at least four label groups' worth)."""

REFINE_CHUNK = 1024
"""Pairs whose distance is recomputed at once (bounds the scratch memory)."""


@dataclass(frozen=True)
class TripletResult:
    """What Alg. 1 returns for one batch of ``N`` embeddings of dimension ``d``.

    ``loss`` is the mean hinge over the active triplets (0.0 when none is active); ``derivatives`` is
    ``dloss/dembeddings``, shape ``(N, d)``, in the embeddings' dtype; ``num_active`` counts the active
    (selected, positive-hinge) triplets and ``num_valid`` all valid triplets; ``tile_size`` is the block
    size the memory plan chose and ``workspace_bytes`` that plan's bound on the working memory.
    """

    loss: float
    derivatives: np.ndarray
    num_active: int
    num_valid: int
    tile_size: int
    workspace_bytes: int

    @property
    def active_fraction(self) -> float:
        """The share of valid triplets that are active, ``num_active / num_valid`` in [0, 1] (0.0 when no
        triplet is valid). It falls as the embeddings learn to separate the labels by the margin, while
        ``loss`` (a mean over the active triplets only) can stay near the margin throughout."""
        return self.num_active / self.num_valid if self.num_valid else 0.0

    @property
    def valid_loss(self) -> float:
        """The sum of the active hinges over the number of *valid* triplets, ``loss * active_fraction``
        (0.0 when no triplet is valid): with ``batch-all`` the mean of ``max(0, h)`` over every valid
        triplet, the objective whose fall shows learning."""
        return self.loss * self.active_fraction


@dataclass(frozen=True)
class _Window:
    """The distances ``d(a, n)`` a strategy counts for an (anchor, positive) pair.

    Always ``d(a, n) < d(a, p) + margin`` (a positive hinge); with ``floor``, also ``d(a, n) > d(a, p)``.
    """

    floor: bool


STRATEGIES: dict[str, _Window] = {"batch-all": _Window(floor=False), "semi-hard": _Window(floor=True)}
"""Triplet selection strategies by name."""


@dataclass
class _Block:
    """A run ``[start, stop)`` of embeddings (in label-grouped order) and their positives.

    ``pos_idx`` / ``pos_d`` ``(b, kmax)``: each anchor's positives (grouped index) and their distances,
    ascending, padded with the anchor itself at distance ``+inf``. ``upper`` / ``lower`` ``(kmax, b)``
    (slot-major: a slot's thresholds are one contiguous row): the window ``lower < d(a, n) < upper`` of
    each pair, ``-inf`` on padding (``lower`` is ``None`` without a floor). ``counts`` ``(kmax, b)``: the
    negatives each pair's window has taken so far (``c_ap``).
    """

    start: int
    stop: int
    k: np.ndarray
    kmax: int
    pos_idx: np.ndarray
    pos_d: np.ndarray
    upper: np.ndarray
    lower: np.ndarray | None
    counts: np.ndarray


def _validate(
    embeddings: object, labels: object, margin: object, strategy: object, memory_limit_bytes: object
) -> tuple[np.ndarray, np.ndarray, float, _Window]:
    if not isinstance(embeddings, np.ndarray):
        raise ValidationError(f"embeddings must be a numpy array, got {type(embeddings).__name__}")
    if embeddings.dtype not in (np.float32, np.float64):
        raise ValidationError(f"embeddings have dtype {embeddings.dtype}; cast them to float32 or float64")
    if embeddings.ndim != 2 or embeddings.shape[1] == 0:
        raise ValidationError(f"embeddings must have shape (N, d) with d >= 1, got {embeddings.shape}")
    bad = np.flatnonzero(~np.isfinite(embeddings).all(axis=1))
    if bad.size:
        raise ValidationError(f"embeddings rows {bad[:5].tolist()} hold NaN or inf ({bad.size} rows in all)")
    labels = np.asarray(labels)
    if labels.shape != embeddings.shape[:1]:
        raise ValidationError(
            f"labels must have shape ({embeddings.shape[0]},) to match the embeddings, got {labels.shape}"
        )
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise ValidationError(f"labels have dtype {labels.dtype}; they must be integers")
    info = np.finfo(embeddings.dtype)
    if isinstance(margin, bool) or not isinstance(margin, (int, float, np.integer, np.floating)):
        raise ConfigError(f"margin must be a number, got {margin!r}")
    if not 0 < margin <= np.sqrt(info.max):
        raise ConfigError(f"margin {margin!r} must be > 0 and at most {np.sqrt(info.max):.3g}")
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ConfigError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if memory_limit_bytes is not None and (
        isinstance(memory_limit_bytes, bool)
        or not isinstance(memory_limit_bytes, (int, np.integer))
        or memory_limit_bytes <= 0
    ):
        raise ConfigError(f"memory_limit_bytes {memory_limit_bytes!r} must be a positive int or None")
    if embeddings.size:
        largest = max(-float(embeddings.min()), float(embeddings.max()))
        if largest >= magnitude_limit(embeddings.dtype, embeddings.shape[1]):
            raise ValidationError(
                f"embeddings reach magnitude {largest:.3g}, too large for {embeddings.dtype} squared "
                "distances; rescale them"
            )
    return embeddings, labels, float(margin), STRATEGIES[strategy]


def magnitude_limit(dtype: np.dtype | type, dim: int) -> np.floating:
    """The magnitude every coordinate of ``dim``-dimensional embeddings of float ``dtype`` must stay
    strictly below for Alg. 1: squared distances reach ``4 d x^2``, and they, their sums and the margin
    must stay finite, so ``16 d x^2`` below the dtype's largest value (about 5.8e17 for float32 at
    ``d = 64``). In ``dtype``, so that comparisons against it are exact."""
    info = np.finfo(dtype)
    return np.sqrt(info.max / info.dtype.type(16 * dim))


def unusable_rows(embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of float ``(N, d)`` ``embeddings`` that :func:`loss_and_derivatives` refuses, as two
    boolean ``(N,)`` masks: ``non_finite`` (a NaN or infinity) and ``too_large`` (finite, but a
    coordinate at or above :func:`magnitude_limit`). Whoever drops unusable inputs before Alg. 1 (the
    enclave per client, the host per device reply) uses this, so that what they keep Alg. 1 accepts."""
    non_finite = ~np.isfinite(embeddings).all(axis=1)
    with np.errstate(invalid="ignore"):
        largest = np.abs(embeddings).max(axis=1, initial=0)
    too_large = ~non_finite & (largest >= magnitude_limit(embeddings.dtype, embeddings.shape[1]))
    return non_finite, too_large


class _Plan:
    """Block size and mode chosen so the estimated working memory stays within the limit.

    ``symmetric``: every tile (block pair ``I <= J``) serves both blocks as anchors, which halves the
    distance and gradient products but keeps every block's positives until the end; otherwise each row
    of tiles is finished, and its positives dropped, before the next.
    """

    def __init__(self, n: int, d: int, k: np.ndarray, itemsize: int, floor: bool, limit: int | None) -> None:
        self.n, self.d, self.k, self.item = n, d, k, itemsize
        self.slot = 16 + itemsize * (2 + floor)
        # grouped copy, its Gram factors, float64 gradient, output, and the duplicate search's copies
        self.fixed = n * (2 * (d + 2) * itemsize + d * (3 * itemsize + 9) + 160)
        cap = max(1, min(MAX_TILE, n))
        best: dict[bool, tuple[int, int]] = {}
        for symmetric in (True, False):
            for size in self._sizes(cap):
                need = self.bytes_needed(size, symmetric)
                if limit is None or need <= limit:
                    best[symmetric] = (size, need)
                    break
        if not best:
            raise ConfigError(
                f"memory_limit_bytes={limit} is too small for {n} embeddings of dimension {d} (largest "
                f"label group {int(k.max()) + 1}): even one embedding per block needs "
                f"{self.bytes_needed(1, False)} bytes; raise the limit or send fewer embeddings"
            )
        # a symmetric tile does the work of two; prefer it unless it must be much smaller
        self.symmetric = True in best and (False not in best or 2 * best[True][0] >= best[False][0])
        self.size, self.bytes = best[self.symmetric]

    @staticmethod
    def _sizes(cap: int) -> list[int]:
        sizes = [cap]
        while sizes[-1] > 1:
            sizes.append(max(1, sizes[-1] * 3 // 4))
        return sizes

    def bytes_needed(self, size: int, symmetric: bool) -> int:
        """Estimated peak working memory with blocks of ``size`` embeddings."""
        kmax = np.maximum.reduceat(self.k, np.arange(0, self.n, size))
        widest = int(kmax.max())
        dense = widest <= DENSE_MAX_POSITIVES
        # per tile: distances, refinement thresholds, comparison planes, masks, weights, scale
        tile = size * size * (3 * self.item + 8 + (2 * widest if dense else 24))
        scatter = 2 * size * (2 * self.d + 1) * self.item
        pairs = min(max(REFINE_CHUNK, size + 2 * widest), size * (size + 2 * widest))
        refine = pairs * 48 + min(pairs, REFINE_CHUNK) * self.d * (3 * self.item + 24)
        refine += min(self.n, size + 2 * widest) * self.d * 8  # a scatter's per-row sums
        near = size * widest * 64 + (0 if dense else size * (size + 2 * widest) * (self.item + 3))
        kept = int(np.sum(kmax)) * size * self.slot if symmetric else 2 * size * widest * self.slot
        return self.fixed + tile + scatter + refine + near + kept


def loss_and_derivatives(
    embeddings: np.ndarray,
    labels: np.ndarray,
    *,
    margin: float,
    strategy: str = "batch-all",
    memory_limit_bytes: int | None = DEFAULT_MEMORY_LIMIT_BYTES,
) -> TripletResult:
    """Alg. 1 of FDML: triplet loss and ``dloss/demb_i`` in closed form.

    ``embeddings`` ``(N, d)`` float32 or float64 (the computation runs in that precision, accumulating
    the derivatives in float64), ``labels`` ``(N,)`` integers (e.g. the participant that uploaded each
    embedding), ``margin`` > 0 in distance units, ``strategy`` a key of :data:`STRATEGIES`. Time
    ``O(N^2 d)``; the working memory beyond the inputs stays within ``memory_limit_bytes`` (``None``: no
    limit), or :class:`~fedveil.errors.ConfigError` names the sizes. See the module docstring for the
    exact definitions.
    """
    x, labels, margin, window = _validate(embeddings, labels, margin, strategy, memory_limit_bytes)
    n, d = x.shape
    if n == 0:
        return TripletResult(0.0, np.zeros((0, d), x.dtype), 0, 0, 0, 0)
    _, group, sizes = np.unique(labels, return_inverse=True, return_counts=True)
    # group the embeddings by label, smaller groups first, so a block's anchors have similar positives
    order = np.lexsort((group, sizes[group]))
    k = sizes[group[order]] - 1
    grouped = group[order]
    group = np.concatenate(([0], np.cumsum(grouped[1:] != grouped[:-1])))  # renumbered, non-decreasing
    del grouped
    num_valid = int(np.sum(k * (n - 1 - k)))
    derivatives = np.zeros((n, d), x.dtype)
    if num_valid == 0:
        return TripletResult(0.0, derivatives, 0, 0, 0, 0)
    plan = _Plan(n, d, k, x.dtype.itemsize, window.floor, memory_limit_bytes)
    hinge_sum, grad, active = _Computation(x[order], group, k, margin, window, plan).run()
    if not active:
        return TripletResult(0.0, derivatives, 0, num_valid, plan.size, plan.bytes)
    grad /= active
    derivatives[order] = grad
    return TripletResult(hinge_sum / active, derivatives, active, num_valid, plan.size, plan.bytes)


def _coarse_centre(x: np.ndarray) -> np.ndarray:
    """The mean rounded to a multiple of a power of two near the spread, in ``x``'s dtype.

    Distances are translation invariant; moving the mean to the origin shrinks the cancellation in
    ``|x|^2 + |y|^2 - 2 x.y``. The coarse rounding keeps the shift exact for data on a grid (whole
    numbers stay whole, so ties between distances stay exact ties).
    """
    mean = x.mean(axis=0, dtype=np.float64)
    spread = float(np.sqrt(np.mean(np.var(x, axis=0, dtype=np.float64))))
    step = 2.0 ** np.floor(np.log2(spread)) if spread > 0 else 1.0
    return (np.round(mean / step) * step).astype(x.dtype)


class _Computation:
    """One call's state: grouped embeddings, blocks and the float64 accumulators.

    ``left = [-2 x, |x|^2, 1]`` and ``right = [x, 1, |x|^2]`` (``x`` centred, shape ``(N, d + 2)``) make
    one matrix product give squared distances, ``left_i . right_j = |x_i - x_j|^2``, and a product with
    ``right[:, :d + 1]`` give ``S @ x`` together with the row sums of ``S``.
    """

    def __init__(
        self, x: np.ndarray, group: np.ndarray, k: np.ndarray, margin: float, window: _Window, plan: _Plan
    ) -> None:
        self.x = x
        self.dtype = x.dtype
        self.n, self.d = x.shape
        centred = x - _coarse_centre(x)
        self.sq = np.einsum("ij,ij->i", centred, centred)
        ones = np.ones((self.n, 1), self.dtype)
        self.left = np.concatenate([-2 * centred, self.sq[:, None], ones], axis=1)
        self.right = np.concatenate([centred, ones, self.sq[:, None]], axis=1)
        del centred
        # an embedding with an exact copy ties distances exactly (d(a, p) == d(a, n) when x_p == x_n):
        # its distances are all taken from difference vectors, like the positives', so ties stay ties
        rows = np.ascontiguousarray(x + 0).view(np.dtype((np.void, self.d * self.dtype.itemsize)))[:, 0]
        _, copy_of, copies = np.unique(rows, return_inverse=True, return_counts=True)
        self.duplicated = copies[copy_of] > 1
        self.any_duplicated = bool(self.duplicated.any())
        self.group = group
        self.k = k
        self.group_start = np.searchsorted(group, group, side="left")
        self.margin = self.dtype.type(margin)
        self.window = window
        self.plan = plan
        self.far = np.finfo(self.dtype).max
        self.grad = np.zeros(x.shape, np.float64)
        self.hinge_sum = 0.0
        self.active = 0

    def run(self) -> tuple[float, np.ndarray, int]:
        """Every tile, then every positive term; returns (sum of active hinges, gradient sum, count)."""
        size = self.plan.size
        spans = [slice(s, min(s + size, self.n)) for s in range(0, self.n, size)]
        if self.plan.symmetric:
            blocks = [self._block(s) for s in spans]
            for i, rows in enumerate(blocks):
                for cols in blocks[i:]:
                    self._tile(rows, cols, both=rows is not cols)
            for block in blocks:
                self._finish(block)
        else:
            for rows_span in spans:
                rows = self._block(rows_span)
                for cols_span in spans:
                    cols = rows if cols_span == rows_span else self._block(cols_span, negatives_only=True)
                    self._tile(rows, cols, both=False)
                self._finish(rows)
        return self.hinge_sum, self.grad, self.active

    def _tile(self, rows: _Block, cols: _Block, both: bool) -> None:
        """Negatives of tile ``rows x cols``: count them into the blocks, add their derivative terms.

        ``w`` counts, for each entry, the anchors' positives whose window takes the other embedding as
        a negative (the row's when anchors are rows; also the column's when ``both``); the entry then
        becomes ``S = w / D`` and two matrix products scatter it into the derivatives.
        """
        r, c = slice(rows.start, rows.stop), slice(cols.start, cols.stop)
        dist = self.left[r] @ self.right[c].T
        close = self._condition(dist, r, c, mask_same_group=True)
        anchors = [(rows, 0), (cols, 1)] if both else [(rows, 0)]
        weight = self._weights(dist, [(block, axis) for block, axis in anchors if block.kmax])
        if weight is None:
            return
        scale = weight.astype(self.dtype)
        del weight
        self.hinge_sum -= float(np.vdot(scale, dist))
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(scale, dist, out=scale)
        # close pairs use their exact difference vectors (u = 0 at distance 0); the rest, the products
        for i, j in self._pairs(close):
            s = np.where(dist[i, j] > 0, scale[i, j], 0)
            scale[i, j] = 0
            self._scatter_pairs(rows.start + i, cols.start + j, s, sign=-1.0)
        del dist, close
        self._scatter(r, c, scale, sign=-1.0)

    def _condition(self, dist: np.ndarray, rows: slice, cols: slice, mask_same_group: bool) -> np.ndarray:
        """Squared distances ``(len(rows), len(cols))`` from the Gram form to distances, in place.

        Same-label pairs become the dtype's max when masked. Close pairs, whose squared distance is
        small against the squared norms (where the Gram form cancels), and the pairs of duplicated
        embeddings are recomputed from the difference vectors (duplicates come out exactly 0); returns
        the mask of those pairs.
        """
        same = None
        gr, gc = self.group[rows], self.group[cols]
        if mask_same_group and gr[-1] >= gc[0] and gc[-1] >= gr[0]:
            same = gr[:, None] == gc[None, :]
            np.putmask(dist, same, np.inf)
        # each pair against its own squared norms, which bound the Gram form's cancellation (a bound
        # from the block's largest norm would send every pair beside one far embedding to the slow path)
        limit = np.add.outer(self.sq[rows], self.sq[cols])
        limit *= REFINE_RATIO
        close = dist <= limit
        del limit
        if self.any_duplicated:
            close[self.duplicated[rows]] = True
            close[:, self.duplicated[cols]] = True
            if same is not None:
                close &= ~same
        for i, j in self._pairs(close):
            dist[i, j] = self._squared_distances(rows.start + i, cols.start + j)
        np.sqrt(dist, out=dist)
        if same is not None:
            np.putmask(dist, same, self.far)
        return close

    @staticmethod
    def _pairs(mask: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The ``(row, column)`` indices of ``mask``'s true entries in runs of whole rows holding at most
        ``REFINE_CHUNK`` of them (or one row, if it alone holds more)."""
        counts = np.count_nonzero(mask, axis=1)
        rows = np.flatnonzero(counts)
        total = np.cumsum(counts[rows])
        s, done = 0, 0
        while s < rows.size:
            e = max(s + 1, int(np.searchsorted(total, done + REFINE_CHUNK, side="right")))
            local = rows[s:e]
            i, j = np.nonzero(mask[local])
            yield local[i], j
            s, done = e, int(total[e - 1])

    def _squared_distances(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """``|x_i - x_j|^2`` from the (uncentred) difference vectors, ``REFINE_CHUNK`` pairs at a time."""
        out = np.empty(i.shape, self.dtype)
        for s in range(0, i.size, REFINE_CHUNK):
            diff = self.x[i[s : s + REFINE_CHUNK]] - self.x[j[s : s + REFINE_CHUNK]]
            out[s : s + REFINE_CHUNK] = np.einsum("ij,ij->i", diff, diff)
        return out

    def _block(self, span: slice, negatives_only: bool = False) -> _Block:
        """The anchors in ``span`` with their positives sorted by distance and their windows."""
        k = self.k[span]
        kmax = 0 if negatives_only else int(k.max())
        b = span.stop - span.start
        anchors = np.arange(span.start, span.stop)
        slot = np.arange(kmax)
        pos_idx = self.group_start[span, None] + slot
        pos_idx += pos_idx >= anchors[:, None]  # skip the anchor itself
        valid = slot < k[:, None]
        pos_idx = np.where(valid, pos_idx, anchors[:, None])
        if kmax <= DENSE_MAX_POSITIVES:
            pos_d = self._squared_distances(np.repeat(anchors, kmax), pos_idx.ravel()).reshape(b, kmax)
            np.sqrt(pos_d, out=pos_d)
        else:
            lo, hi = int(pos_idx.min()), int(pos_idx.max()) + 1
            near = self.left[span] @ self.right[lo:hi].T
            self._condition(near, span, slice(lo, hi), mask_same_group=False)
            pos_d = np.take_along_axis(near, pos_idx - lo, axis=1)
            del near
        pos_d[~valid] = np.inf
        ranked = np.argsort(pos_d, axis=1, kind="stable")
        pos_d = np.take_along_axis(pos_d, ranked, axis=1)
        pos_idx = np.take_along_axis(pos_idx, ranked, axis=1)
        upper = pos_d + self.margin
        # below d(a, p) + margin, so that counting "upper > d" minus "lower >= d" never goes negative
        lower = np.minimum(pos_d, np.nextafter(upper, -np.inf)) if self.window.floor else None
        for t in (upper, lower):
            if t is not None:
                t[~valid] = -np.inf
        return _Block(
            span.start,
            span.stop,
            k,
            kmax,
            pos_idx,
            pos_d,
            np.ascontiguousarray(upper.T),
            None if lower is None else np.ascontiguousarray(lower.T),
            np.zeros((kmax, b), np.int64),
        )

    def _weights(self, dist: np.ndarray, anchors: list[tuple[_Block, int]]) -> np.ndarray | None:
        """``w`` of each tile entry, summed over the anchor blocks (along ``axis`` of ``dist``).

        Also adds each block's ``c_ap`` counts. Small groups: one boolean plane per positive slot,
        ``plane[s, i, j] = lower < dist[i, j] < upper`` with the slot-``s`` window of the anchor (row
        ``i`` or column ``j``); ``w`` sums the planes and ``c`` each plane along the negatives.
        """
        dense = [(block, axis) for block, axis in anchors if block.kmax <= DENSE_MAX_POSITIVES]
        total = None
        if dense:
            planes = sum(block.kmax for block, _ in dense)
            hits = np.empty((planes, *dist.shape), bool)
            between = np.empty(dist.shape, bool) if self.window.floor else None
            tall = np.uint16 if max(dist.shape) < 2**16 else np.int64
            first = 0
            for block, axis in dense:
                # thresholds broadcast along the negatives: a column for row anchors, a row for columns
                shape = (-1, 1) if axis == 0 else (1, -1)
                for s in range(block.kmax):
                    plane = hits[first + s]
                    np.less(dist, block.upper[s].reshape(shape), out=plane)
                    if block.lower is not None:
                        np.greater(dist, block.lower[s].reshape(shape), out=between)
                        plane &= between
                flags = hits[first : first + block.kmax].view(np.uint8)
                block.counts += flags.sum(axis=2 - axis, dtype=tall)
                first += block.kmax
            total = hits.view(np.uint8).sum(axis=0, dtype=np.uint8 if planes < 256 else np.uint16)
        for block, axis in anchors:
            if block.kmax > DENSE_MAX_POSITIVES:
                part = self._weights_by_search(dist, block, axis)
                total = part if total is None else total + part
        return total

    def _weights_by_search(self, dist: np.ndarray, block: _Block, axis: int) -> np.ndarray:
        """As :meth:`_weights` for large label groups: per anchor, ``searchsorted`` into its window."""
        view = dist if axis == 0 else dist.T
        total = np.zeros(view.shape, np.int64)
        for r in range(view.shape[0]):
            kr = int(block.k[r])
            if kr == 0:
                continue
            line = view[r]
            # thresholds ascending, so "d < upper_s" holds for slots s >= kr - #{upper > d}; the counts
            # of each slot follow from a histogram (likewise "d <= lower_s", subtracted)
            above = kr - np.searchsorted(block.upper[:kr, r], line, side="right")
            total[r] = above
            block.counts[:kr, r] += np.cumsum(np.bincount(above, minlength=kr + 1)[::-1])[:kr]
            if block.lower is not None:
                floor = kr - np.searchsorted(block.lower[:kr, r], line, side="left")
                total[r] -= floor
                block.counts[:kr, r] -= np.cumsum(np.bincount(floor, minlength=kr + 1)[::-1])[:kr]
        return total if axis == 0 else total.T

    def _scatter(self, rows: slice, cols: slice, scale: np.ndarray, sign: float) -> None:
        """Add ``sign * sum_j S_ij (x_i - x_j)`` to row ``i`` and ``-sign * S_ij (x_i - x_j)`` to ``j``."""
        d = self.d
        self._add(rows, scale @ self.right[cols, : d + 1], sign)  # [S @ x_cols, rowsum(S)]
        self._add(cols, scale.T @ self.right[rows, : d + 1], sign)  # [S^T @ x_rows, colsum(S)]

    def _add(self, span: slice, product: np.ndarray, sign: float) -> None:
        """``grad[i] += sign * (sum_j S_ij x_i - sum_j S_ij x_j)`` from ``product = [S @ x, rowsum(S)]``."""
        term = product[:, self.d :] * self.right[span, : self.d]
        term -= product[:, : self.d]
        if sign > 0:
            self.grad[span] += term
        else:
            self.grad[span] -= term

    def _scatter_pairs(self, i: np.ndarray, j: np.ndarray, scale: np.ndarray, sign: float) -> None:
        """As :meth:`_scatter` for a list of pairs ``(i, j)`` with weights ``scale``, from the exact
        (uncentred) difference vectors, ``REFINE_CHUNK`` pairs at a time; ``i`` is non-decreasing, as
        :meth:`_pairs` yields the pairs.

        Each chunk's terms are summed per derivative row, and each row's sum then added to the row,
        with no sort: on the ``i`` side by ``np.add.reduceat`` over the runs of equal ``i``; on the
        ``j`` side one after another in the order of the pairs, by one ``bincount`` over the flattened
        ``(row, coordinate)`` cells (a row the chunk does not touch gets ``+0.0``, which leaves it
        unchanged). Only that ``j``-side order differs from sorting ``j`` and summing with
        ``np.add.reduceat`` (which adds in blocks): the float64 sums agree to a few units in the last
        place, so the derivatives agree to about 1e-15 of the largest in float64, and to their rounding
        in float32.
        """
        d = self.d
        cells = np.arange(d)
        for s in range(0, i.size, REFINE_CHUNK):
            a, b = i[s : s + REFINE_CHUNK], j[s : s + REFINE_CHUNK]
            term = (self.x[a] - self.x[b]).astype(np.float64)
            term *= sign * scale[s : s + REFINE_CHUNK, None]
            first = np.flatnonzero(np.r_[True, a[1:] != a[:-1]])
            self.grad[a[first]] += np.add.reduceat(term, first, axis=0)
            lo, hi = int(b.min()), int(b.max()) + 1
            flat = ((b - lo) * d)[:, None] + cells
            self.grad[lo:hi] -= np.bincount(flat.ravel(), term.ravel(), (hi - lo) * d).reshape(hi - lo, d)

    def _finish(self, block: _Block) -> None:
        """Positive terms of ``block`` once its counts are complete: ``c_ap u_ap``, and their hinges."""
        if block.kmax == 0:
            return
        c = block.counts.T
        self.active += int(c.sum())
        used = c > 0
        self.hinge_sum += float(np.dot(c[used], block.upper.T[used]))
        coef = np.zeros(c.shape, self.dtype)
        np.divide(c, block.pos_d, out=coef, where=used & (block.pos_d > 0))
        # close positives use their exact difference vectors, as in _tile
        anchors = np.arange(block.start, block.stop)[:, None]
        close = (coef > 0) & (block.pos_d**2 <= (self.sq[anchors] + self.sq[block.pos_idx]) * REFINE_RATIO)
        for i, j in self._pairs(close):
            self._scatter_pairs(block.start + i, block.pos_idx[i, j], coef[i, j], sign=1.0)
        coef[close] = 0
        # a few rows at a time: the positives lie within kmax of their anchor, so S stays narrow
        step = max(FINISH_ROWS, 4 * block.kmax)
        for s in range(0, block.stop - block.start, step):
            idx = block.pos_idx[s : s + step]
            start, stop = block.start + s, block.start + s + idx.shape[0]
            lo, hi = min(int(idx.min()), start), max(int(idx.max()) + 1, stop)
            dense = np.zeros((stop - start, hi - lo), self.dtype)
            np.put_along_axis(dense, idx - lo, coef[s : s + step], axis=1)
            self._scatter(slice(start, stop), slice(lo, hi), dense, sign=1.0)
