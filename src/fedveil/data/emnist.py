"""MNIST-UV from real handwriting: EMNIST-byclass with writer ids, or LEAF FEMNIST JSON.

FedUV Sec. 6.1 builds MNIST-UV from EMNIST-byclass: every example is the
digits 2, 3, 4 and 5 of one writer stacked into a ``(4, 28, 28)`` array; 1,000 writers get 50 train, 15
validation and 15 test examples, unique within a split, whose sub-images never cross splits; 1,000 other
writers get one example each. :func:`build_mnist_uv` applies that recipe (the same
:func:`~fedveil.data.mnist_uv.compose_examples` as the synthetic generator) to a
:class:`HandwritingSamples` read by one of two loaders. Nothing is downloaded.

**EMNIST-byclass** (:func:`load_emnist_byclass`), the files of the EMNIST distribution (Cohen et al.,
2017), plain or gzipped::

    emnist-byclass-train-images-idx3-ubyte[.gz]   IDX, uint8, (n, 28, 28), ink = 255, stored transposed
    emnist-byclass-train-labels-idx1-ubyte[.gz]   IDX, uint8, (n,), 0-9 digits, 10-35 A-Z, 36-61 a-z
    <writer ids>                                  one writer id per image, in the same order

The EMNIST IDX files do not carry writer ids. The NIST Special Database 19 that EMNIST was converted
from records the writer of every character (its ``hsf_*`` forms, one writer per form), and some
redistributions ship those ids alongside the by_class images; fedveil assumes you have such a list,
aligned row by row with the IDX images, as either a CSV/text file (one id per line, optionally under a
header line; or a CSV whose header has a ``writer_id`` column) or an NPZ file holding an array
``writer_ids``. The images are transposed back to upright (``transpose=True``) and scaled to [0, 1].
Train and test parts can be loaded separately and joined with :meth:`HandwritingSamples.concatenate`.

**LEAF FEMNIST** (:func:`load_leaf_femnist`), the JSON files of Caldas et al. (2018),
``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [[784 floats], ...], "y": [...]}}}``,
where users are NIST writers, ``y`` uses the byclass labels and ``x`` is a row-major 28 x 28 image with
values in [0, 1], white background (1.0) and dark ink; it is inverted (``invert=True``) so that ink is 1
as in EMNIST and the synthetic generator.

Pools (:func:`split_pool_sizes`): a writer's images of each digit are shuffled and cut into the
validation pool, the test pool and the training pool, in that order. The validation and test pools are
minimal ones that hold enough distinct examples, chosen so that the training pool, which takes all the
rest, holds as many distinct examples as possible (for a writer with 10 images of each digit: 2, 2 and
6 per digit). A writer whose images cannot fill all three is not eligible as a seen writer; unseen
writers need one image of each digit. The paper does not say how it split a writer's images.
"""

from __future__ import annotations

import csv
import gzip
import io
import itertools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedveil.data.federated import FederatedDataset, UserData
from fedveil.data.mnist_uv import (
    DIGITS,
    IMAGE_SIZE,
    SPLITS,
    SUB_IMAGE_KEY,
    X_KEY,
    UvSplits,
    compose_examples,
    examples_from_pools,
)
from fedveil.errors import ConfigError, ValidationError

__all__ = [
    "HandwritingSamples",
    "MnistUvRecipe",
    "build_mnist_uv",
    "load_emnist_byclass",
    "load_leaf_femnist",
    "read_idx",
    "read_writer_ids",
    "split_pool_sizes",
]

_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_MAX_IDX_DIMS = 8


@dataclass(frozen=True, eq=False)
class HandwritingSamples:
    """Character images with labels and writers.

    ``images (n, 28, 28)`` float32 in [0, 1] with ink = 1, upright; ``labels (n,)`` int64 byclass labels
    (digit ``d`` is label ``d``); ``writer_ids (n,)`` non-empty strings; ``source_index (n,)`` int64, the
    row of each image in the source it came from, which held ``source_rows`` rows before the loader kept
    only some labels (so a built example can be traced back, and equal indices mean the same image).
    """

    images: np.ndarray
    labels: np.ndarray
    writer_ids: np.ndarray
    source_index: np.ndarray
    source_rows: int

    def __post_init__(self) -> None:
        n = self.images.shape[0] if self.images.ndim == 3 else -1
        if self.images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE) or self.images.dtype != np.float32:
            raise ValidationError(
                f"images must be float32 (n, {IMAGE_SIZE}, {IMAGE_SIZE}), got {self.images.dtype} "
                f"{self.images.shape}"
            )
        for name in ("labels", "writer_ids", "source_index"):
            if getattr(self, name).shape != (n,):
                raise ValidationError(f"{name} must have shape ({n},), got {getattr(self, name).shape}")
        if n and (self.source_index.min() < 0 or self.source_index.max() >= self.source_rows):
            raise ValidationError(f"source_index must lie in [0, {self.source_rows}), the rows of the source")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @staticmethod
    def concatenate(parts: Sequence[HandwritingSamples]) -> HandwritingSamples:
        """All ``parts`` in order, as if their sources were laid end to end.

        The ``source_index`` of part ``k`` is shifted by the ``source_rows`` of the parts before it, e.g.
        EMNIST's train part followed by its test part.
        """
        if not parts:
            raise ValidationError("concatenate needs at least one part")
        shifts = np.cumsum([0] + [p.source_rows for p in parts])
        return HandwritingSamples(
            images=np.concatenate([p.images for p in parts]),
            labels=np.concatenate([p.labels for p in parts]),
            writer_ids=np.concatenate([p.writer_ids for p in parts]),
            source_index=np.concatenate(
                [p.source_index + shift for p, shift in zip(parts, shifts, strict=False)]
            ),
            source_rows=int(shifts[-1]),
        )


def _open_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValidationError(f"cannot read {path}: {exc.strerror or exc}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise ValidationError(f"{path} looks gzipped but does not decompress: {exc}") from None
    return raw


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (the MNIST/EMNIST format), plain or gzipped, as a native-endian numpy array.

    Layout: two zero bytes, a type byte (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32, 0x0D float32,
    0x0E float64), a byte with the number of dimensions, one big-endian uint32 per dimension, then the
    values in row-major order, big-endian. Any other header, or a body of the wrong length, is a
    :class:`ValidationError` naming the file.
    """
    path = Path(path)
    raw = _open_bytes(path)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValidationError(
            f"{path} is not an IDX file: it must start with two zero bytes, got {raw[:2]!r}"
        )
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise ValidationError(
            f"{path}: unknown IDX type byte 0x{code:02x}; allowed are "
            + ", ".join(f"0x{c:02x}" for c in _IDX_DTYPES)
        )
    if not 1 <= ndim <= _MAX_IDX_DIMS:
        raise ValidationError(f"{path}: IDX number of dimensions must be 1 to {_MAX_IDX_DIMS}, got {ndim}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValidationError(f"{path}: IDX header needs {header} bytes, the file has {len(raw)}")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[code])
    expected = header + math.prod(shape) * dtype.itemsize
    if len(raw) != expected:
        raise ValidationError(
            f"{path}: IDX shape {shape} of {dtype.name} needs {expected} bytes, the file has {len(raw)}"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _check_ids(path: Path, ids: Iterable[str], first_line: int) -> np.ndarray:
    out = []
    for line, value in enumerate(ids, start=first_line):
        if not value:
            raise ValidationError(f"{path} line {line}: empty writer id")
        out.append(value)
    return np.asarray(out, dtype=str)


def read_writer_ids(path: str | Path) -> np.ndarray:
    """Writer ids, one per image: an NPZ with array ``writer_ids``, or a CSV/text file.

    CSV/text: one id per line; an optional first line ``writer_id`` (or ``writer``) is a header; a CSV
    with several columns needs a header naming a ``writer_id`` column. Ids are stripped of surrounding
    white space and must not be empty. NPZ files are read with ``allow_pickle=False``.
    """
    path = Path(path)
    if path.suffix.lower() == ".npz":
        try:
            with np.load(path, allow_pickle=False) as npz:
                if "writer_ids" not in npz.files:
                    raise ValidationError(f"{path} has no array 'writer_ids'; it has {sorted(npz.files)}")
                ids = npz["writer_ids"]
        except (OSError, ValueError) as exc:
            if isinstance(exc, ValidationError):
                raise
            raise ValidationError(f"cannot read {path} as NPZ without pickle: {exc}") from None
        if ids.ndim != 1 or ids.dtype.kind not in "iuU":
            raise ValidationError(
                f"{path}: writer_ids must be a 1-D array of integers or strings, got {ids.dtype} {ids.shape}"
            )
        return _check_ids(path, (str(v).strip() for v in ids.tolist()), 1)
    try:
        text = _open_bytes(path).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValidationError(f"{path} is not UTF-8 text: {exc}") from None
    rows = [row for row in csv.reader(io.StringIO(text))]
    if not rows:
        raise ValidationError(f"{path} holds no writer ids")
    header = [cell.strip().lower() for cell in rows[0]]
    column, first = 0, 0
    if "writer_id" in header:
        column, first = header.index("writer_id"), 1
    elif header == ["writer"]:
        first = 1
    elif len(header) != 1:
        raise ValidationError(
            f"{path} line 1 has {len(header)} columns but no 'writer_id' column; give one id per line "
            "or a header with a writer_id column"
        )
    ids = []
    for line, row in enumerate(rows[first:], start=first + 1):
        if len(row) != len(rows[0]):
            raise ValidationError(f"{path} line {line}: expected {len(rows[0])} columns, got {len(row)}")
        ids.append(row[column].strip())
    return _check_ids(path, ids, first + 1)


def _digit_mask(labels: np.ndarray, digits: Sequence[int]) -> np.ndarray:
    return np.isin(labels, np.asarray(digits, dtype=np.int64))


def load_emnist_byclass(
    images: str | Path,
    labels: str | Path,
    writer_ids: str | Path,
    *,
    transpose: bool = True,
    digits: Sequence[int] = DIGITS,
) -> HandwritingSamples:
    """EMNIST-byclass IDX images and labels with an aligned writer-id file (module docstring).

    Only images whose label is in ``digits`` are kept (``source_index`` is their row in the IDX files).
    The images are ``uint8`` with ink = 255; EMNIST stores them transposed, so ``transpose=True`` turns
    them upright.
    """
    images, labels, writer_ids = Path(images), Path(labels), Path(writer_ids)
    pixels = read_idx(images)
    if pixels.ndim != 3 or pixels.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE) or pixels.dtype != np.uint8:
        raise ValidationError(
            f"{images}: expected uint8 images of shape (n, {IMAGE_SIZE}, {IMAGE_SIZE}), got {pixels.dtype} "
            f"{pixels.shape}"
        )
    y = read_idx(labels)
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise ValidationError(f"{labels}: expected a 1-D integer label array, got {y.dtype} {y.shape}")
    writers = read_writer_ids(writer_ids)
    if not pixels.shape[0] == y.shape[0] == writers.shape[0]:
        raise ValidationError(
            f"{images} has {pixels.shape[0]} images, {labels} {y.shape[0]} labels and {writer_ids} "
            f"{writers.shape[0]} writer ids; the three must align row by row"
        )
    bad = np.flatnonzero((y < 0) | (y > 61))
    if bad.size:
        raise ValidationError(f"{labels} row {bad[0]}: label {y[bad[0]]} is not a byclass label (0-61)")
    keep = np.flatnonzero(_digit_mask(y, digits))
    kept = pixels[keep]
    if transpose:
        kept = kept.transpose(0, 2, 1)
    return HandwritingSamples(
        images=(kept.astype(np.float32) / np.float32(255.0)),
        labels=y[keep].astype(np.int64),
        writer_ids=writers[keep],
        source_index=keep.astype(np.int64),
        source_rows=int(y.shape[0]),
    )


def _json_files(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    items = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    files: list[Path] = []
    for item in items:
        if item.is_dir():
            found = sorted(item.glob("*.json"))
            if not found:
                raise ValidationError(f"directory {item} holds no *.json files")
            files.extend(found)
        else:
            files.append(item)
    if not files:
        raise ValidationError("no LEAF JSON files given")
    return files


def _leaf_user(path: Path, user: str, record: object, declared: int) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(record, dict) or "x" not in record or "y" not in record:
        raise ValidationError(f"{path}: user_data[{user!r}] must be an object with 'x' and 'y'")
    try:
        x = np.asarray(record["x"], dtype=np.float32)
        y = np.asarray(record["y"], dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"{path}: user {user!r} has a malformed x or y ({exc})") from None
    n = y.shape[0] if y.ndim == 1 else -1
    if y.ndim != 1 or n != declared:
        raise ValidationError(f"{path}: user {user!r} declares {declared} samples but y has shape {y.shape}")
    if x.shape != (n, IMAGE_SIZE * IMAGE_SIZE) and not (n == 0 and x.size == 0):
        raise ValidationError(
            f"{path}: user {user!r} x must hold {n} rows of {IMAGE_SIZE * IMAGE_SIZE} values, got {x.shape}"
        )
    if not np.all(np.isfinite(x)) or np.any((x < 0) | (x > 1)):
        raise ValidationError(f"{path}: user {user!r} has pixel values outside [0, 1]")
    if np.any((y != np.round(y)) | (y < 0) | (y > 61)):
        raise ValidationError(f"{path}: user {user!r} has labels that are not byclass labels (integers 0-61)")
    return x.reshape(-1, IMAGE_SIZE, IMAGE_SIZE), y.astype(np.int64)


def load_leaf_femnist(
    paths: str | Path | Sequence[str | Path], *, invert: bool = True, digits: Sequence[int] = DIGITS
) -> HandwritingSamples:
    """LEAF FEMNIST JSON files (a file, a directory of ``*.json``, or a list of either; module docstring).

    Users are writers. Only samples whose label is in ``digits`` are kept; ``source_index`` counts all
    samples in file order (sorted within a directory), user order and sample order. ``invert=True`` maps
    LEAF's white background (1.0) to 0 so that ink is 1. A user listed twice is a :class:`ValidationError`.
    """
    images, labels, writers, index = [], [], [], []
    seen: set[str] = set()
    offset = 0
    for path in _json_files(paths):
        try:
            doc = json.loads(_open_bytes(path).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValidationError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(doc, dict) or not all(k in doc for k in ("users", "num_samples", "user_data")):
            raise ValidationError(
                f"{path}: a LEAF file is an object with 'users', 'num_samples' and 'user_data'"
            )
        users, counts, data = doc["users"], doc["num_samples"], doc["user_data"]
        if not isinstance(users, list) or not isinstance(counts, list) or len(users) != len(counts):
            raise ValidationError(f"{path}: 'users' and 'num_samples' must be lists of the same length")
        if not isinstance(data, dict):
            raise ValidationError(f"{path}: 'user_data' must be an object keyed by user")
        for user, declared in zip(users, counts, strict=True):
            if not isinstance(user, str) or not user:
                raise ValidationError(f"{path}: user ids must be non-empty strings, got {user!r}")
            if isinstance(declared, bool) or not isinstance(declared, int) or declared < 0:
                raise ValidationError(
                    f"{path}: num_samples of {user!r} must be a non-negative integer, got {declared!r}"
                )
            if user in seen:
                raise ValidationError(f"{path}: user {user!r} appears more than once")
            if user not in data:
                raise ValidationError(f"{path}: user {user!r} is listed but has no user_data")
            seen.add(user)
            x, y = _leaf_user(path, user, data[user], declared)
            keep = np.flatnonzero(_digit_mask(y, digits))
            images.append(1.0 - x[keep] if invert else x[keep])
            labels.append(y[keep])
            writers.append(np.full(keep.shape[0], user))
            index.append(offset + keep)
            offset += declared
    return HandwritingSamples(
        images=np.concatenate(images).astype(np.float32).reshape(-1, IMAGE_SIZE, IMAGE_SIZE),
        labels=np.concatenate(labels).astype(np.int64),
        writer_ids=np.concatenate(writers).astype(str),
        source_index=np.concatenate(index).astype(np.int64),
        source_rows=offset,
    )


@dataclass(frozen=True)
class MnistUvRecipe:
    """FedUV Sec. 6.1 sizes: ``writers`` seen writers with ``train`` / ``val`` / ``test`` examples each,
    ``unseen_writers`` other writers with one example each; ``seed`` picks writers, pools and examples."""

    seed: int = 0
    writers: int = 1000
    train: int = 50
    val: int = 15
    test: int = 15
    unseen_writers: int = 1000

    def __post_init__(self) -> None:
        for name in ("seed", "writers", "train", "val", "test", "unseen_writers"):
            value = getattr(self, name)
            least = 1 if name in ("writers", "train", "val", "test") else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")


def _minimal_pools(upper: np.ndarray, need: int) -> np.ndarray:
    """Every pool-size vector ``v`` with ``1 <= v <= upper``, ``prod(v) >= need`` and no entry that could be
    lowered by one without ``prod(v) < need``; ``(m, k)`` int64, in lexicographic order."""
    k = upper.shape[0]
    if k == 1:
        return np.array([[need]], dtype=np.int64) if need <= upper[0] else np.zeros((0, 1), dtype=np.int64)
    # An entry above ``need`` can always be lowered, so the first k - 1 entries range over 1..min(upper, need)
    # and the last is the smallest that reaches ``need``.
    head = np.indices(np.minimum(upper[:-1], need)).reshape(k - 1, -1).T.astype(np.int64) + 1
    last = np.maximum(-(-need // head.prod(axis=1)), 1)
    keep = last <= upper[-1]
    v = np.column_stack([head[keep], last[keep]])
    product = v.prod(axis=1, keepdims=True)
    minimal = np.all((v == 1) | (product // v * (v - 1) < need), axis=1)
    return v[minimal]


def split_pool_sizes(per_digit: Sequence[int], counts: Sequence[int]) -> np.ndarray | None:
    """Pool sizes ``(3, k)`` (rows: train, val, test) for a writer with ``per_digit[j]`` images of digit j.

    ``counts = (train, val, test)`` distinct examples are needed, and a pool of sizes ``v`` holds
    ``prod(v)``. The validation and test pools are minimal (no pool could give up an image and still hold
    enough examples); among all such pairs, the one that leaves the training pool (all remaining images)
    the most distinct examples is taken, the first in lexicographic order on ties. None when no split
    into three pools of at least one image per digit holds enough examples.
    """
    available = np.asarray(per_digit, dtype=np.int64)
    if available.ndim != 1 or available.shape[0] == 0 or np.any(available < len(SPLITS)):
        return None
    upper = available - (len(SPLITS) - 1)
    val, test = _minimal_pools(upper, int(counts[1])), _minimal_pools(upper, int(counts[2]))
    train = available - val[:, None, :] - test[None, :, :]
    product = np.where(np.all(train >= 1, axis=2), np.maximum(train, 1).prod(axis=2), 0)
    if product.size == 0 or product.max() < counts[0]:
        return None
    i, j = np.unravel_index(np.argmax(product), product.shape)
    return np.stack([train[i, j], val[i], test[j]])


def build_mnist_uv(samples: HandwritingSamples, recipe: MnistUvRecipe) -> UvSplits:
    """FedUV Sec. 6.1: MNIST-UV from real handwriting (module docstring for the recipe).

    Writers (sorted by id) that :func:`split_pool_sizes` can serve are eligible; ``recipe.writers`` of
    them are drawn by the seed as seen writers, and ``recipe.unseen_writers`` of the remaining writers
    with at least one image of each digit as unseen writers. Every array ``sub_image_ids`` holds the
    ``source_index`` of the image in each channel. Too few eligible writers is a :class:`ValidationError`.
    """
    rng = np.random.default_rng([recipe.seed, 0])
    counts = (recipe.train, recipe.val, recipe.test)
    by_writer: dict[str, list[np.ndarray]] = {}
    order = np.argsort(samples.writer_ids, kind="stable")
    sorted_ids = samples.writer_ids[order]
    bounds = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1], True])
    for lo, hi in itertools.pairwise(bounds):
        rows = order[lo:hi]
        by_writer[str(sorted_ids[lo])] = [rows[samples.labels[rows] == d] for d in DIGITS]
    names = list(by_writer)
    plans = {w: split_pool_sizes([len(r) for r in by_writer[w]], counts) for w in names}
    eligible = [w for w in names if plans[w] is not None]
    if len(eligible) < recipe.writers:
        raise ValidationError(
            f"only {len(eligible)} of {len(names)} writers have enough images of each digit for "
            f"{counts[0]}/{counts[1]}/{counts[2]} distinct examples; ask for at most {len(eligible)} writers"
        )
    seen = [eligible[i] for i in sorted(rng.choice(len(eligible), recipe.writers, replace=False).tolist())]
    chosen = set(seen)
    spare = [w for w in names if w not in chosen and all(len(r) > 0 for r in by_writer[w])]
    if len(spare) < recipe.unseen_writers:
        raise ValidationError(
            f"only {len(spare)} writers outside the {recipe.writers} seen ones have every digit; ask for "
            f"at most {len(spare)} unseen writers"
        )
    unseen = [spare[i] for i in sorted(rng.choice(len(spare), recipe.unseen_writers, replace=False).tolist())]

    split_users: list[list[UserData]] = [[] for _ in SPLITS]
    for k, writer in enumerate(seen):
        writer_rng = np.random.default_rng([recipe.seed, 1, k])
        rows = [writer_rng.permutation(r) for r in by_writer[writer]]
        sizes = plans[writer]
        starts = np.stack([sizes[1] + sizes[2], np.zeros_like(sizes[1]), sizes[1]])  # val, test, then train
        for s in range(len(SPLITS)):
            pools = [rows[j][starts[s, j] : starts[s, j] + sizes[s, j]] for j in range(len(DIGITS))]
            picks = compose_examples(sizes[s].tolist(), counts[s], writer_rng)
            chosen_rows = np.stack([pools[j][picks[:, j]] for j in range(len(DIGITS))], axis=1)
            x = examples_from_pools([samples.images[p] for p in pools], picks)
            split_users[s].append(
                UserData(writer, {}, {X_KEY: x, SUB_IMAGE_KEY: samples.source_index[chosen_rows]})
            )
    unseen_users = []
    for k, writer in enumerate(unseen):
        writer_rng = np.random.default_rng([recipe.seed, 2, k])
        picked = np.array([[r[writer_rng.integers(len(r))] for r in by_writer[writer]]])
        unseen_users.append(
            UserData(
                writer,
                {},
                {
                    X_KEY: samples.images[picked].astype(np.float32),
                    SUB_IMAGE_KEY: samples.source_index[picked],
                },
            )
        )
    return UvSplits(
        train=FederatedDataset(split_users[0]),
        val=FederatedDataset(split_users[1]),
        test=FederatedDataset(split_users[2]),
        unseen=FederatedDataset(unseen_users),
    )
