"""MNIST-UV: handwriting user verification, FedUV Sec. 6.1 and Appendix A.

An MNIST-UV example is a ``(4, 28, 28)`` float32 array (channels first) whose four channels are images
of the digits 2, 3, 4 and 5 (:data:`DIGITS`, in that order) written by one writer. The paper builds it
from EMNIST-byclass (:mod:`fedveil.data.emnist` does that from the real files) with this recipe, which
:func:`compose_examples` implements for both builders:

* every writer's images of each digit are split into disjoint *train*, *validation* and *test* pools, so
  a sub-image is never shared between the three splits;
* an example of a split takes one sub-image of each digit from that split's pools; the examples of a
  writer within a split are unique 4-tuples, but one sub-image may appear in several of them;
* 1,000 writers get 50 train, 15 validation and 15 test examples; 1,000 further, *unseen* writers get one
  example each (a separate test set of writers that never take part in training).

:func:`generate_mnist_uv` stands in for the EMNIST data, which cannot be downloaded here. Every digit is
a few cubic Bezier strokes in a canonical frame (x right, y down, height 2), drawn with an anti-aliased
pen of varying width (distance to each polyline segment), then normalised as EMNIST normalises NIST
characters: the bounding box is centred and its longer side scaled to about 20 of the 28 pixels, keeping
the aspect ratio. A writer's persistent style, drawn from a seeded distribution, is

* an allograph per digit (plain or looped 2, round or flat-topped 3, open or closed 4, straight or wavy
  flag on the 5; :data:`ALLOGRAPH_PROBABILITIES`);
* per-digit offsets of every Bezier control point (the stroke shapes) and a closure gap (how far the
  closed 4's diagonal or the 5's flag starts from the stem);
* slant (shear), rotation and aspect ratio (proportions) shared by all digits;
* pen habits: stroke width, a linear pressure profile along each stroke (start and end width),
  ink intensity and edge softness.

``style_spread`` scales the continuous deviations from the canonical glyphs (not the allograph
choice). Each sub-image adds its own variation, scaled by ``sample_jitter``: control-point jitter,
rotation, shear, aspect and scale jitter, a shift of the centre and a stroke-width factor; then
``pixel_noise`` adds Gaussian pixel noise (clipped to [0, 1]). Writer ``i``'s data depend only on the
configuration and ``i`` (a generator seeded by ``(seed, seen or unseen, i)``), not on the number of
writers.

How hard it is: :func:`writer_difficulty_probe` identifies writers by the nearest raw-pixel centroid of
their training examples and scores verification by the cosine similarity to the centroids. With the
defaults (seed 0, 1,000 writers, 15,000 test examples) it finds the right writer for 25.6 % of the test
examples (chance: 0.1 %) at a verification AUC of 0.947; the paper's nets reach AUC 0.99 on real
MNIST-UV (Table 3). Halving ``sample_jitter`` makes raw pixels nearly enough (top-1 0.92, AUC 0.998).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedveil.data.federated import FederatedDataset, UserData
from fedveil.errors import ConfigError, ValidationError
from fedveil.eval.verification import roc_auc

__all__ = [
    "ALLOGRAPH_PROBABILITIES",
    "DIGITS",
    "IMAGE_SIZE",
    "SPLITS",
    "SUB_IMAGE_KEY",
    "X_KEY",
    "MnistUv",
    "MnistUvConfig",
    "UvSplits",
    "WriterProbe",
    "compose_examples",
    "examples_from_pools",
    "generate_mnist_uv",
    "writer_difficulty_probe",
]

DIGITS: tuple[int, ...] = (2, 3, 4, 5)
IMAGE_SIZE = 28
SPLITS: tuple[str, ...] = ("train", "val", "test")
X_KEY = "x"
SUB_IMAGE_KEY = "sub_image_ids"

_Point = tuple[float, float]


def _line(a: _Point, b: _Point) -> list[_Point]:
    """A straight cubic piece from ``a`` to ``b`` (handles at thirds)."""
    return [
        a,
        (a[0] + (b[0] - a[0]) / 3, a[1] + (b[1] - a[1]) / 3),
        (a[0] + 2 * (b[0] - a[0]) / 3, a[1] + 2 * (b[1] - a[1]) / 3),
        b,
    ]


# Glyphs: digit -> allographs; an allograph is (strokes, gap_stroke). A stroke is a list of cubic pieces,
# each four control points; consecutive pieces share their end point. ``gap_stroke`` names the stroke
# whose first point (and handle) the writer's closure gap moves, or -1.
_TOP_ARC_2 = [(-0.42, -0.55), (-0.38, -1.02), (0.48, -1.05), (0.44, -0.45)]
_BOWL_3 = [
    [(-0.12, -0.06), (0.62, -0.06), (0.66, 0.92), (0.02, 0.96)],
    [(0.02, 0.96), (-0.22, 0.98), (-0.40, 0.88), (-0.50, 0.70)],
]
_GLYPHS: dict[int, list[tuple[list[list[list[_Point]]], int]]] = {
    2: [
        (
            [
                [
                    _TOP_ARC_2,
                    [(0.44, -0.45), (0.40, -0.05), (-0.15, 0.45), (-0.52, 0.92)],
                    _line((-0.52, 0.92), (0.55, 0.90)),
                ]
            ],
            -1,
        ),
        (
            [
                [
                    _TOP_ARC_2,
                    [(0.44, -0.45), (0.40, -0.05), (0.05, 0.40), (-0.25, 0.72)],
                    [(-0.25, 0.72), (-0.62, 1.12), (-0.80, 0.50), (-0.35, 0.62)],
                    [(-0.35, 0.62), (-0.10, 0.70), (0.10, 0.95), (0.55, 0.90)],
                ]
            ],
            -1,
        ),
    ],
    3: [
        (
            [
                [
                    [(-0.42, -0.72), (-0.15, -1.12), (0.58, -0.98), (0.32, -0.38)],
                    [(0.32, -0.38), (0.22, -0.12), (0.02, -0.06), (-0.12, -0.06)],
                    *_BOWL_3,
                ]
            ],
            -1,
        ),
        (
            [
                [
                    _line((-0.45, -0.92), (0.42, -0.92)),
                    [(0.42, -0.92), (0.25, -0.60), (0.08, -0.30), (-0.12, -0.06)],
                    *_BOWL_3,
                ]
            ],
            -1,
        ),
    ],
    4: [
        (
            [
                [_line((-0.30, -0.95), (-0.48, 0.30)), _line((-0.48, 0.30), (0.55, 0.30))],
                [_line((0.22, -0.75), (0.20, 1.00))],
            ],
            -1,
        ),
        (
            [
                [_line((0.20, -0.98), (-0.50, 0.32)), _line((-0.50, 0.32), (0.55, 0.32))],
                [_line((0.22, -0.98), (0.20, 1.00))],
            ],
            0,
        ),
    ],
    5: [
        (
            [
                [_line((0.48, -0.92), (-0.28, -0.92))],
                [
                    _line((-0.30, -0.92), (-0.40, -0.12)),
                    [(-0.40, -0.12), (0.05, -0.42), (0.70, -0.10), (0.50, 0.50)],
                    [(0.50, 0.50), (0.30, 1.05), (-0.30, 1.02), (-0.52, 0.72)],
                ],
            ],
            0,
        ),
        (
            [
                [[(-0.28, -0.90), (-0.05, -0.98), (0.25, -0.85), (0.52, -0.98)]],
                [
                    _line((-0.30, -0.90), (-0.42, -0.05)),
                    [(-0.42, -0.05), (0.10, -0.30), (0.72, 0.05), (0.45, 0.62)],
                    [(0.45, 0.62), (0.25, 1.00), (-0.25, 1.05), (-0.55, 0.82)],
                ],
            ],
            0,
        ),
    ],
}

ALLOGRAPH_PROBABILITIES: dict[int, tuple[float, ...]] = {
    2: (0.75, 0.25),
    3: (0.8, 0.2),
    4: (0.5, 0.5),
    5: (0.6, 0.4),
}

_SEGMENTS_PER_PIECE = 6


@dataclass(frozen=True, eq=False)
class _GlyphTable:
    """All allographs of all digits, padded to common sizes, indexed by a global glyph number ``g``.

    ``ctrl (G, P, 2)`` canonical control points; ``sampler (G, Q, P)`` maps control points to polyline
    vertices (Bernstein weights); ``vertex_valid (G, Q)``; ``seg (G, S, 2)`` vertex indices of each
    segment, ``seg_valid (G, S)``; ``along (G, Q)`` the fraction of its stroke at which a vertex lies;
    ``gap_weight (G, P)`` is 1 for the control points that the closure gap moves; ``digit_glyphs[d]`` the
    glyph numbers of the allographs of ``DIGITS[d]``.
    """

    ctrl: np.ndarray
    sampler: np.ndarray
    vertex_valid: np.ndarray
    seg: np.ndarray
    seg_valid: np.ndarray
    along: np.ndarray
    gap_weight: np.ndarray
    digit_glyphs: tuple[tuple[int, ...], ...]


def _build_glyph_table() -> _GlyphTable:
    t = np.linspace(0.0, 1.0, _SEGMENTS_PER_PIECE + 1)
    bernstein = np.stack([(1 - t) ** 3, 3 * t * (1 - t) ** 2, 3 * t**2 * (1 - t), t**3], axis=1)
    glyphs = []
    digit_glyphs = []
    for digit in DIGITS:
        digit_glyphs.append(tuple(range(len(glyphs), len(glyphs) + len(_GLYPHS[digit]))))
        for strokes, gap_stroke in _GLYPHS[digit]:
            points: list[_Point] = []
            rows: list[tuple[int, np.ndarray]] = []
            segs: list[tuple[int, int]] = []
            along: list[float] = []
            gap: list[int] = []
            for s, stroke in enumerate(strokes):
                start = len(points)
                points.append(stroke[0][0])
                for piece in stroke:
                    points.extend(piece[1:])
                if s == gap_stroke:
                    gap.extend([start, start + 1])
                first_vertex = len(rows)
                for k in range(len(stroke)):
                    rows.extend((start + 3 * k, bernstein[j]) for j in range(k > 0, _SEGMENTS_PER_PIECE + 1))
                n_vertices = len(rows) - first_vertex
                segs.extend((first_vertex + i, first_vertex + i + 1) for i in range(n_vertices - 1))
                along.extend(np.linspace(0.0, 1.0, n_vertices).tolist())
            glyphs.append((points, rows, segs, along, gap))
    p_max = max(len(g[0]) for g in glyphs)
    q_max = max(len(g[1]) for g in glyphs)
    s_max = max(len(g[2]) for g in glyphs)
    n = len(glyphs)
    table = _GlyphTable(
        ctrl=np.zeros((n, p_max, 2)),
        sampler=np.zeros((n, q_max, p_max)),
        vertex_valid=np.zeros((n, q_max), dtype=bool),
        seg=np.zeros((n, s_max, 2), dtype=np.int64),
        seg_valid=np.zeros((n, s_max), dtype=bool),
        along=np.zeros((n, q_max)),
        gap_weight=np.zeros((n, p_max)),
        digit_glyphs=tuple(digit_glyphs),
    )
    for g, (points, rows, segs, along, gap) in enumerate(glyphs):
        table.ctrl[g, : len(points)] = points
        for q, (offset, weights) in enumerate(rows):
            table.sampler[g, q, offset : offset + 4] = weights
        table.vertex_valid[g, : len(rows)] = True
        table.seg[g, : len(segs)] = segs
        table.seg_valid[g, : len(segs)] = True
        table.along[g, : len(along)] = along
        table.gap_weight[g, gap] = 1.0
    return table


_TABLE = _build_glyph_table()

# Writer-level (persistent) standard deviations at style_spread = 1, in canonical units (height 2),
# radians, log-factors or pixels; and per-sub-image ones at sample_jitter = 1.
_WRITER_SD = {
    "shape": 0.07,
    "gap": 0.10,
    "slant": 0.20,
    "rotation": 0.06,
    "log_aspect": 0.15,
    "log_width": 0.25,
    "taper": 0.25,
    "ink": 0.07,
    "softness": 0.15,
}
_MEAN_SLANT = 0.10
_MEAN_WIDTH_PX = 2.2
_SAMPLE_SD = {
    "shape": 0.07,
    "rotation": 0.08,
    "shear": 0.10,
    "log_aspect": 0.10,
    "log_scale": 0.08,
    "shift_px": 0.8,
    "log_width": 0.16,
}
_BOX_PX = 20.0
_CENTRE_PX = (IMAGE_SIZE - 1) / 2.0


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class MnistUvConfig:
    """Size and difficulty of the synthetic MNIST-UV data (FedUV Sec. 6.1 defaults).

    ``writers`` seen writers with ``train`` / ``val`` / ``test`` examples each and ``unseen_writers``
    writers with one example each. ``sub_images_per_digit = (n_train, n_val, n_test)``: how many images of
    each digit every seen writer writes for each split's pool (EMNIST holds about 10 per digit and
    writer; the default is 6 / 2 / 2). A split with ``n`` images per digit has ``n ** 4`` distinct
    examples, which must be at least its example count. ``style_spread``, ``sample_jitter`` (>= 0) scale the
    between-writer and per-sub-image variation and ``pixel_noise`` (>= 0) is the standard deviation of
    the pixel noise (the module docstring lists them).
    """

    seed: int = 0
    writers: int = 1000
    train: int = 50
    val: int = 15
    test: int = 15
    unseen_writers: int = 1000
    sub_images_per_digit: tuple[int, int, int] = (6, 2, 2)
    style_spread: float = 1.0
    sample_jitter: float = 1.0
    pixel_noise: float = 0.02

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed!r}")
        for name in ("writers", "train", "val", "test"):
            _positive_int(name, getattr(self, name))
        if (
            isinstance(self.unseen_writers, bool)
            or not isinstance(self.unseen_writers, int)
            or (self.unseen_writers < 0)
        ):
            raise ConfigError(f"unseen_writers must be a non-negative integer, got {self.unseen_writers!r}")
        pools = self.sub_images_per_digit
        if not isinstance(pools, tuple) or len(pools) != len(SPLITS):
            raise ConfigError(f"sub_images_per_digit must be a tuple (n_train, n_val, n_test), got {pools!r}")
        for split, n in zip(SPLITS, pools, strict=True):
            _positive_int(f"sub_images_per_digit for {split}", n)
            count = getattr(self, split)
            if n ** len(DIGITS) < count:
                least = math.ceil(count ** (1 / len(DIGITS)) - 1e-9)
                raise ConfigError(
                    f"sub_images_per_digit for {split} = {n} gives only {n ** len(DIGITS)} distinct "
                    f"examples, fewer than {split}={count}; use at least {least}"
                )
        for name in ("style_spread", "sample_jitter", "pixel_noise"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
            if value < 0:
                raise ConfigError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class UvSplits:
    """The four sets of a FedUV Sec. 6.1 data set (MNIST-UV, CelebA or VoxCeleb); users are identities.

    ``train`` / ``val`` / ``test`` hold the same seen users (those that take part in training), each with
    their own examples, never shared between the three; ``unseen`` holds other users, for the paper's
    "test (unknown)" evaluation. The arrays each module stores are listed in its builder's docstring.
    """

    train: FederatedDataset
    val: FederatedDataset
    test: FederatedDataset
    unseen: FederatedDataset

    def split(self, name: str) -> FederatedDataset:
        """The set called ``name``: one of ``train``, ``val``, ``test``, ``unseen``."""
        if name not in (*SPLITS, "unseen"):
            raise ConfigError(f"split must be one of {[*SPLITS, 'unseen']}, got {name!r}")
        return getattr(self, name)


MnistUv = UvSplits
"""The MNIST-UV name of :class:`UvSplits`."""


def compose_examples(pool_sizes: Sequence[int], count: int, rng: np.random.Generator) -> np.ndarray:
    """FedUV Sec. 6.1: ``count`` distinct examples of one writer and split, as ``(count, k)`` int64 indices.

    ``pool_sizes[j]`` is how many sub-images of the ``j``-th digit the split's pool holds; row ``e`` picks
    sub-image ``out[e, j]`` of digit ``j``. Rows are distinct tuples, drawn uniformly without replacement
    from all ``prod(pool_sizes)`` of them, so a sub-image may appear in several rows. Too small pools are
    a :class:`ValidationError`.
    """
    sizes = [int(n) for n in pool_sizes]
    if not sizes or any(n < 1 for n in sizes):
        raise ValidationError(f"every pool needs at least one sub-image, got pool sizes {sizes}")
    total = math.prod(sizes)
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= total:
        raise ValidationError(
            f"cannot compose {count!r} distinct examples from pools of sizes {sizes}: at most {total}"
        )
    flat = rng.choice(total, size=count, replace=False)
    return np.stack(np.unravel_index(flat, sizes), axis=1).astype(np.int64)


def examples_from_pools(pools: Sequence[np.ndarray], indices: np.ndarray) -> np.ndarray:
    """Stack sub-images into examples: ``out[e, j] = pools[j][indices[e, j]]``, float32 ``(n, k, h, w)``."""
    return np.stack(
        [np.asarray(pool, dtype=np.float32)[indices[:, j]] for j, pool in enumerate(pools)], axis=1
    )


@dataclass(frozen=True, eq=False)
class _SubImageParams:
    """Render parameters of ``m`` sub-images (see :func:`_render`)."""

    glyph: np.ndarray  # (m,) int
    ctrl: np.ndarray  # (m, P, 2) canonical control points after style and jitter
    linear: np.ndarray  # (m, 2, 2) rotation @ shear @ aspect
    box_px: np.ndarray  # (m,) length of the longer side of the bounding box, pixels
    shift_px: np.ndarray  # (m, 2) centre offset, pixels
    half_width: np.ndarray  # (m, 2) pen half-width at stroke start and end, pixels
    ink: np.ndarray  # (m,)
    softness: np.ndarray  # (m,) pixels over which an edge ramps from 0 to the ink level
    noise: np.ndarray  # (m, 28, 28) float32, pixel noise already scaled


def _writer_params(cfg: MnistUvConfig, rng: np.random.Generator, per_digit: int) -> _SubImageParams:
    """One writer's style (persistent) and ``per_digit`` sub-images of each digit, digit-major."""
    spread, jitter = cfg.style_spread, cfg.sample_jitter
    n_digits, p_max = len(DIGITS), _TABLE.ctrl.shape[1]
    w = {name: sd * spread for name, sd in _WRITER_SD.items()}
    j = {name: sd * jitter for name, sd in _SAMPLE_SD.items()}
    glyph = np.array(
        [
            _TABLE.digit_glyphs[d][rng.choice(len(_TABLE.digit_glyphs[d]), p=ALLOGRAPH_PROBABILITIES[digit])]
            for d, digit in enumerate(DIGITS)
        ]
    )
    shape = rng.normal(0.0, w["shape"], (n_digits, p_max, 2))
    gap = rng.normal(0.0, w["gap"], (n_digits, 2))
    slant = _MEAN_SLANT + rng.normal(0.0, w["slant"])
    rotation = rng.normal(0.0, w["rotation"])
    log_aspect = rng.normal(0.0, w["log_aspect"])
    width = np.clip(_MEAN_WIDTH_PX * math.exp(rng.normal(0.0, w["log_width"])), 1.0, 4.5)
    taper = np.clip(rng.normal(0.0, w["taper"], 2), -0.6, 0.6)
    ink = float(np.clip(0.92 + rng.normal(0.0, w["ink"]), 0.6, 1.0))
    softness = float(np.clip(1.0 + rng.normal(0.0, w["softness"]), 0.5, 1.6))

    m = n_digits * per_digit
    glyphs = np.repeat(glyph, per_digit)
    base = _TABLE.ctrl[glyphs] + np.repeat(
        shape + gap[:, None, :] * _TABLE.gap_weight[glyph][:, :, None], per_digit, axis=0
    )
    ctrl = base + rng.normal(0.0, j["shape"], (m, p_max, 2))
    rot = rotation + rng.normal(0.0, j["rotation"], m)
    shear = slant + rng.normal(0.0, j["shear"], m)
    aspect = np.exp(log_aspect + rng.normal(0.0, j["log_aspect"], m))
    cos, sin = np.cos(rot), np.sin(rot)
    rotate = np.stack([np.stack([cos, -sin], -1), np.stack([sin, cos], -1)], -2)
    # x' = aspect * x - shear * y: with y pointing down, a positive shear leans the top to the right.
    shear_aspect = np.zeros((m, 2, 2))
    shear_aspect[:, 0, 0] = aspect
    shear_aspect[:, 0, 1] = -shear
    shear_aspect[:, 1, 1] = 1.0
    box = _BOX_PX * np.exp(rng.normal(0.0, j["log_scale"], m))
    shift = rng.normal(0.0, j["shift_px"], (m, 2))
    half = 0.5 * width * np.exp(rng.normal(0.0, j["log_width"], m))[:, None] * (1.0 + taper)[None, :]
    noise = rng.standard_normal((m, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32) * np.float32(cfg.pixel_noise)
    return _SubImageParams(
        glyph=glyphs,
        ctrl=ctrl,
        linear=rotate @ shear_aspect,
        box_px=box,
        shift_px=shift,
        half_width=half,
        ink=np.full(m, ink),
        softness=np.full(m, softness),
        noise=noise,
    )


def _concat(params: Sequence[_SubImageParams]) -> _SubImageParams:
    return _SubImageParams(
        **{
            name: np.concatenate([getattr(p, name) for p in params])
            for name in _SubImageParams.__annotations__
        }
    )


_PIXELS_X = np.tile(np.arange(IMAGE_SIZE, dtype=np.float32), IMAGE_SIZE)
_PIXELS_Y = np.repeat(np.arange(IMAGE_SIZE, dtype=np.float32), IMAGE_SIZE)
_RENDER_CHUNK = 16


def _render(p: _SubImageParams) -> np.ndarray:
    """Rasterise sub-images: ``(m, 28, 28)`` float32 in [0, 1].

    Bezier control points -> polyline vertices (Bernstein weights) -> affine style -> bounding box
    centred with its longer side ``box_px`` -> for every pixel centre the largest ``half_width(t) -
    distance`` over all segments (``t`` the position of the nearest point on the segment) -> intensity
    ``ink * clip(that / softness + 1/2, 0, 1)`` -> plus noise, clipped to [0, 1].
    """
    g = p.glyph
    vertices = _TABLE.sampler[g] @ p.ctrl @ np.swapaxes(p.linear, 1, 2)
    valid = _TABLE.vertex_valid[g][:, :, None]
    low = np.where(valid, vertices, np.inf).min(axis=1)
    high = np.where(valid, vertices, -np.inf).max(axis=1)
    scale = p.box_px / np.maximum((high - low).max(axis=1), 1e-6)
    centre = (low + high) / 2.0
    pixels = (vertices - centre[:, None, :]) * scale[:, None, None] + _CENTRE_PX + p.shift_px[:, None, :]
    along = _TABLE.along[g]
    half = p.half_width[:, :1] * (1.0 - along) + p.half_width[:, 1:] * along
    seg = _TABLE.seg[g]
    a = np.take_along_axis(pixels, seg[:, :, :1], axis=1).astype(np.float32)
    b = np.take_along_axis(pixels, seg[:, :, 1:], axis=1).astype(np.float32)
    half_a = np.take_along_axis(half, seg[:, :, 0], axis=1).astype(np.float32)
    half_b = np.take_along_axis(half, seg[:, :, 1], axis=1).astype(np.float32)
    half_a[~_TABLE.seg_valid[g]] = -1e6
    half_b[~_TABLE.seg_valid[g]] = -1e6
    out = np.empty((g.shape[0], IMAGE_SIZE * IMAGE_SIZE), dtype=np.float32)
    for lo in range(0, g.shape[0], _RENDER_CHUNK):
        c = slice(lo, lo + _RENDER_CHUNK)
        ax, ay = a[c, :, 0, None], a[c, :, 1, None]
        ux, uy = b[c, :, 0, None] - ax, b[c, :, 1, None] - ay
        inv_len2 = 1.0 / np.maximum(ux * ux + uy * uy, np.float32(1e-12))
        dx = _PIXELS_X - ax
        dy = _PIXELS_Y - ay
        t = dx * ux
        t += dy * uy
        t *= inv_len2
        np.clip(t, 0.0, 1.0, out=t)
        dx -= t * ux
        dy -= t * uy
        dx *= dx
        dy *= dy
        dx += dy
        np.sqrt(dx, out=dx)
        h0 = half_a[c, :, None]
        t *= half_b[c, :, None] - h0
        t += h0
        t -= dx
        out[c] = t.max(axis=1)
    out /= p.softness[:, None].astype(np.float32)
    out += 0.5
    np.clip(out, 0.0, 1.0, out=out)
    out *= p.ink[:, None].astype(np.float32)
    out = out.reshape(-1, IMAGE_SIZE, IMAGE_SIZE) + p.noise
    return np.clip(out, 0.0, 1.0, out=out)


_SEEN, _UNSEEN = 0, 1


def generate_mnist_uv(cfg: MnistUvConfig) -> UvSplits:
    """The synthetic MNIST-UV data of FedUV Sec. 6.1 / Appendix A (see the module docstring).

    ``train`` / ``val`` / ``test`` hold the seen writers ``"writer-0000"``, ... with arrays ``x`` ``(n, 4,
    28, 28)`` float32 in [0, 1] (channels = digits 2, 3, 4, 5; ink = 1) and ``sub_image_ids`` ``(n, 4)``
    int64 (which of the writer's rendered sub-images each channel shows; different splits never share
    one). ``unseen`` holds writers ``"unseen-0000"``, ... with one example each.

    Seen writer ``i`` renders ``sum(cfg.sub_images_per_digit)`` images of each digit, split into the
    three pools in order; :func:`compose_examples` then draws each split's distinct examples from its own
    pools. Unseen writer ``i`` renders one image of each digit, i.e. its single example. Deterministic
    for ``cfg``; the full default set (44,000 sub-images, 1.0 GB of examples) takes about 8 s of CPU on
    one core.
    """
    pools = cfg.sub_images_per_digit
    per_digit = sum(pools)
    offsets = np.cumsum((0, *pools))
    counts = [getattr(cfg, split) for split in SPLITS]
    params, choices = [], []
    for i in range(cfg.writers):
        rng = np.random.default_rng([cfg.seed, _SEEN, i])
        params.append(_writer_params(cfg, rng, per_digit))
        choices.append(
            [
                offsets[s] + compose_examples((pools[s],) * len(DIGITS), counts[s], rng)
                for s in range(len(SPLITS))
            ]
        )
    for i in range(cfg.unseen_writers):
        params.append(_writer_params(cfg, np.random.default_rng([cfg.seed, _UNSEEN, i]), 1))
    images = _render(_concat(params))
    seen = images[: cfg.writers * len(DIGITS) * per_digit].reshape(
        cfg.writers, len(DIGITS), per_digit, IMAGE_SIZE, IMAGE_SIZE
    )
    unseen = images[cfg.writers * len(DIGITS) * per_digit :].reshape(
        cfg.unseen_writers, 1, len(DIGITS), IMAGE_SIZE, IMAGE_SIZE
    )
    splits = []
    for s in range(len(SPLITS)):
        users = []
        for i in range(cfg.writers):
            ids = choices[i][s]
            users.append(
                UserData(
                    f"writer-{i:04d}", {}, {X_KEY: examples_from_pools(seen[i], ids), SUB_IMAGE_KEY: ids}
                )
            )
        splits.append(FederatedDataset(users))
    unseen_users = FederatedDataset(
        UserData(
            f"unseen-{i:04d}", {}, {X_KEY: unseen[i], SUB_IMAGE_KEY: np.zeros((1, len(DIGITS)), np.int64)}
        )
        for i in range(cfg.unseen_writers)
    )
    return UvSplits(train=splits[0], val=splits[1], test=splits[2], unseen=unseen_users)


@dataclass(frozen=True)
class WriterProbe:
    """How hard writer identity is on raw pixels (:func:`writer_difficulty_probe`).

    ``top1``: fraction of probe examples whose nearest centroid (cosine) is their own writer's, among
    ``writers`` writers (chance is ``1 / writers``); ``auc``: ROC AUC of genuine (own centroid) versus
    impostor (every other centroid) cosine scores; ``probes``: number of probe examples.
    """

    top1: float
    auc: float
    writers: int
    probes: int


def _unit_rows(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def writer_difficulty_probe(
    enrol: FederatedDataset, probe: FederatedDataset, *, key: str = X_KEY
) -> WriterProbe:
    """Nearest-centroid writer identification and verification on raw pixels, a baseline with no learning.

    Every example is flattened, centred by the mean enrolment example and scaled to unit length; a
    writer's centroid is the normalised mean of its ``enrol`` examples. Each example of ``probe`` (the
    writers must also be in ``enrol``) is scored against every centroid by cosine similarity. A model
    trained on the data should beat both numbers.
    """
    writers = list(enrol.user_ids)
    missing = [uid for uid in probe.user_ids if uid not in enrol]
    if not writers or missing:
        raise ValidationError(
            f"every probe writer needs enrolment examples; {len(missing)} do not have any"
            + (f", e.g. {missing[0]!r}" if missing else f" (enrol has {len(writers)} writers)")
        )
    enrol_x = [enrol.array(uid, key).reshape(enrol.array(uid, key).shape[0], -1) for uid in writers]
    mean = np.concatenate(enrol_x).mean(axis=0)
    centroids = _unit_rows(np.stack([_unit_rows(x - mean).mean(axis=0) for x in enrol_x]))
    position = {uid: k for k, uid in enumerate(writers)}
    probe_x = np.concatenate(
        [probe.array(uid, key).reshape(len(probe.array(uid, key)), -1) for uid in probe.user_ids]
    )
    labels = np.concatenate([np.full(len(probe.array(uid, key)), position[uid]) for uid in probe.user_ids])
    scores = _unit_rows(probe_x - mean) @ centroids.T
    rows = np.arange(len(labels))
    genuine = scores[rows, labels]
    impostor_mask = np.ones_like(scores, dtype=bool)
    impostor_mask[rows, labels] = False
    return WriterProbe(
        top1=float(np.mean(scores.argmax(axis=1) == labels)),
        auc=roc_auc(genuine, scores[impostor_mask]),
        writers=len(writers),
        probes=len(labels),
    )
