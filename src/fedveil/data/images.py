"""Labelled image data sets from their published on-disk formats, offline, and a synthetic stand-in.

Formats read (never the pickled Python versions, never a download):

- **IDX** (MNIST, Fashion-MNIST): ``train-images-idx3-ubyte[.gz]`` / ``train-labels-idx1-ubyte[.gz]``
  and ``t10k-...`` (:func:`load_mnist_layout`; the reader is :func:`fedveil.data.emnist.read_idx`).
- **CIFAR-10 binary version**: ``data_batch_1.bin`` ... ``data_batch_5.bin`` and ``test_batch.bin``,
  each a run of 3,073-byte records (1 label byte, then 1,024 red, 1,024 green and 1,024 blue bytes,
  row-major 32 x 32), class names from ``batches.meta.txt`` (:func:`load_cifar10_binary`).
- **Image folder**: ``root/<class>/<file>.png|jpg|jpeg``, classes sorted by name (:func:`load_image_folder`).

**Fashion-MNIST** is real data available on Debian from the package ``dataset-fashion-mnist``
(``apt-get install dataset-fashion-mnist``), which installs the four gzipped IDX files in
``/usr/share/datasets/fashion-mnist/``. :func:`fashion_mnist` looks there (and in ``$FEDVEIL_DATA_DIR``);
when the files are absent it returns :func:`synthetic_fashion_mnist`, a seeded stand-in whose
:meth:`ImageData.describe` says loudly that it is synthetic, so every experiment says which it used.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedveil.data.emnist import read_idx
from fedveil.errors import ConfigError, ValidationError

__all__ = [
    "CIFAR10_CLASSES",
    "DATASET_NAMES",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_DIRS",
    "ImageData",
    "fashion_mnist",
    "find_real_data",
    "load_cifar10_binary",
    "load_idx_images",
    "load_image_dataset",
    "load_image_folder",
    "load_mnist_layout",
    "synthetic_cifar10",
    "synthetic_fashion_mnist",
]

FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
FASHION_MNIST_DIRS = ("/usr/share/datasets/fashion-mnist",)
"""Where Debian's ``dataset-fashion-mnist`` installs its files."""
INSTALL_HINT = "apt-get install dataset-fashion-mnist"
DATASET_NAMES = (
    "fashion-mnist",
    "synthetic-fashion-mnist",
    "synthetic-fashion-mnist:<train size>",
    "mnist",
    "cifar10",
    "synthetic-cifar10[:<train size>]",
    "folder:<path>",
)
_CIFAR_RECORD = 1 + 3 * 32 * 32
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


@dataclass(frozen=True, eq=False)
class ImageData:
    """Labelled images: ``x`` float32 ``(n, C, H, W)`` in [0, 1], ``y`` int64 ``(n,)`` class indices,
    the data set's ``name``, its ``source`` (the files read, or why a stand-in was used) and ``synthetic``."""

    x: np.ndarray
    y: np.ndarray
    classes: tuple[str, ...]
    name: str
    source: str
    synthetic: bool = False

    def __post_init__(self) -> None:
        if self.x.dtype != np.float32 or self.x.ndim != 4:
            raise ValidationError(
                f"{self.name}: images must be float32 (n, C, H, W), got {self.x.dtype} {self.x.shape}"
            )
        if self.y.dtype != np.int64 or self.y.shape != (self.x.shape[0],):
            raise ValidationError(
                f"{self.name}: labels must be int64 ({self.x.shape[0]},), got {self.y.dtype} {self.y.shape}"
            )
        if self.x.size and (float(self.x.min()) < 0.0 or float(self.x.max()) > 1.0):
            raise ValidationError(f"{self.name}: pixel values must lie in [0, 1]")
        if self.y.size and (int(self.y.min()) < 0 or int(self.y.max()) >= len(self.classes)):
            raise ValidationError(
                f"{self.name}: labels must lie in [0, {len(self.classes)}), got up to {int(self.y.max())}"
            )

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def num_classes(self) -> int:
        """The number of classes."""
        return len(self.classes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)``."""
        c, h, w = self.x.shape[1:]
        return int(c), int(h), int(w)

    def subset(self, indices: Sequence[int] | np.ndarray) -> ImageData:
        """The images at ``indices`` (in that order)."""
        idx = np.asarray(indices, dtype=np.int64)
        return ImageData(self.x[idx], self.y[idx], self.classes, self.name, self.source, self.synthetic)

    def describe(self) -> str:
        """One line for a run log; it says SYNTHETIC STAND-IN when the data is not real."""
        c, h, w = self.image_shape
        head = f"{self.name}: {len(self)} images {c}x{h}x{w}, {self.num_classes} classes"
        if self.synthetic:
            return f"{head} -- SYNTHETIC STAND-IN, not real data ({self.source})"
        return f"{head}, from {self.source}"


def _as_image_data(pixels: np.ndarray, labels: np.ndarray, **kw: Any) -> ImageData:
    x = pixels.astype(np.float32) / 255.0
    return ImageData(np.ascontiguousarray(x), labels.astype(np.int64), **kw)


def load_idx_images(
    images: str | Path, labels: str | Path, *, name: str, classes: Sequence[str] | None = None
) -> ImageData:
    """An IDX image file ``(n, H, W)`` uint8 and its IDX label file ``(n,)`` as :class:`ImageData` (C = 1)."""
    pixels, y = read_idx(images), read_idx(labels)
    if pixels.ndim != 3 or pixels.dtype != np.uint8:
        raise ValidationError(f"{images}: expected uint8 images (n, H, W), got {pixels.dtype} {pixels.shape}")
    if y.ndim != 1 or y.dtype != np.uint8:
        raise ValidationError(f"{labels}: expected uint8 labels (n,), got {y.dtype} {y.shape}")
    if len(y) != len(pixels):
        raise ValidationError(f"{images} has {len(pixels)} images but {labels} has {len(y)} labels")
    names = tuple(classes) if classes is not None else tuple(str(i) for i in range(int(y.max(initial=0)) + 1))
    return _as_image_data(pixels[:, None], y, classes=names, name=name, source=f"{images}, {labels}")


def _find(root: Path, stem: str) -> Path:
    for candidate in (root / stem, root / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{root} has neither {stem} nor {stem}.gz")


def load_mnist_layout(
    root: str | Path, split: str, *, name: str = "mnist", classes: Sequence[str] | None = None
) -> ImageData:
    """The ``train`` or ``test`` split of an MNIST-layout directory (MNIST, Fashion-MNIST)."""
    prefix = {"train": "train", "test": "t10k"}.get(split)
    if prefix is None:
        raise ConfigError(f"split {split!r} is not one of train, test")
    root = Path(root)
    images = _find(root, f"{prefix}-images-idx3-ubyte")
    labels = _find(root, f"{prefix}-labels-idx1-ubyte")
    return load_idx_images(images, labels, name=name, classes=classes)


def _read_cifar_file(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValidationError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not raw or len(raw) % _CIFAR_RECORD:
        raise ValidationError(
            f"{path} has {len(raw)} bytes, not a positive multiple of the CIFAR-10 binary record size "
            f"{_CIFAR_RECORD} (1 label byte + 3072 pixel bytes)"
        )
    records = np.frombuffer(raw, dtype=np.uint8).reshape(-1, _CIFAR_RECORD)
    labels = records[:, 0]
    bad = np.flatnonzero(labels > 9)
    if bad.size:
        raise ValidationError(
            f"{path}: record {int(bad[0])} has label {int(labels[bad[0]])}; CIFAR-10 labels are 0-9"
        )
    return records[:, 1:].reshape(-1, 3, 32, 32), labels


def load_cifar10_binary(root: str | Path, split: str) -> ImageData:
    """CIFAR-10 binary: ``train`` (``data_batch_1..5.bin``) or ``test`` (``test_batch.bin``)."""
    root = Path(root)
    if split == "train":
        files = [root / f"data_batch_{i}.bin" for i in range(1, 6)]
    elif split == "test":
        files = [root / "test_batch.bin"]
    else:
        raise ConfigError(f"split {split!r} is not one of train, test")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"CIFAR-10 binary files missing: {', '.join(missing)}")
    parts = [_read_cifar_file(f) for f in files]
    meta = root / "batches.meta.txt"
    classes = CIFAR10_CLASSES
    if meta.is_file():
        names = tuple(line.strip() for line in meta.read_text().splitlines() if line.strip())
        if len(names) != 10:
            raise ValidationError(f"{meta} lists {len(names)} class names, CIFAR-10 has 10")
        classes = names
    return _as_image_data(
        np.concatenate([p for p, _ in parts]),
        np.concatenate([y for _, y in parts]),
        classes=classes,
        name="cifar10",
        source=", ".join(str(f) for f in files),
    )


def decode_image(
    source: str | Path | bytes,
    *,
    size: tuple[int, int] | None = None,
    grayscale: bool = False,
    where: str = "",
) -> np.ndarray:
    """One PNG / JPEG file or its bytes as ``uint8 (C, H, W)`` (RGB, or one channel with ``grayscale``),
    resized to ``size`` ``(H, W)`` when given; an unreadable image is a :class:`ValidationError` naming
    ``where``."""
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as img:
            img = img.convert("L" if grayscale else "RGB")
            if size is not None:
                img = img.resize((size[1], size[0]))
            arr = np.asarray(img, dtype=np.uint8)
    except OSError as exc:
        raise ValidationError(f"{where or 'image'} is not a readable image: {exc}") from None
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def load_image_folder(
    root: str | Path, *, size: tuple[int, int] | None = None, grayscale: bool = False
) -> ImageData:
    """``root/<class>/<file>.png|jpg|jpeg`` as :class:`ImageData`; ``size`` ``(H, W)`` resizes every image,
    otherwise all must share one size."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"image folder {root} does not exist")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise ValidationError(f"{root} has no class sub-folders (expected root/<class>/<image>.png)")
    pixels, labels, shape = [], [], None
    for label, cls in enumerate(classes):
        files = sorted(f for f in (root / cls).iterdir() if f.suffix.lower() in _IMAGE_SUFFIXES)
        if not files:
            raise ValidationError(f"class folder {root / cls} has no .png/.jpg/.jpeg images")
        for f in files:
            arr = decode_image(f, size=size, grayscale=grayscale, where=str(f))
            if shape is None:
                shape = arr.shape
            elif arr.shape != shape:
                raise ValidationError(
                    f"{f} is {arr.shape[2]}x{arr.shape[1]}, the first image was {shape[2]}x{shape[1]}; "
                    "pass size=(H, W) to resize"
                )
            pixels.append(arr)
            labels.append(label)
    return _as_image_data(
        np.stack(pixels), np.asarray(labels), classes=tuple(classes), name=f"folder:{root}", source=str(root)
    )


# --- Fashion-MNIST and its synthetic stand-in ------------------------------------------------------------


def _fashion_dirs(root: str | Path | None) -> list[Path]:
    dirs = [] if root is None else [Path(root)]
    env = os.environ.get("FEDVEIL_DATA_DIR")
    if env:
        dirs.append(Path(env) / "fashion-mnist")
    dirs.extend(Path(d) for d in FASHION_MNIST_DIRS)
    return dirs


def _has_mnist_layout(path: Path) -> bool:
    return all(
        any((path / f"{stem}{ext}").is_file() for ext in ("", ".gz"))
        for stem in (
            "train-images-idx3-ubyte",
            "train-labels-idx1-ubyte",
            "t10k-images-idx3-ubyte",
            "t10k-labels-idx1-ubyte",
        )
    )


# Each class's silhouette as a mask of the jittered coordinates (u across, v down, w the width factor):
# only the drawn class's is computed.
_SHAPES: dict[int, Callable[[np.ndarray, np.ndarray, float], np.ndarray]] = {
    0: lambda u, v, w: (
        ((np.abs(u) < 6 * w) & (v > -9) & (v < 10)) | ((np.abs(u) < 12 * w) & (v > -9) & (v < -3))
    ),
    1: lambda u, v, w: (
        ((np.abs(u + 3.5 * w) < 2.5 * w) | (np.abs(u - 3.5 * w) < 2.5 * w)) & (v > -12) & (v < 12)
        | ((np.abs(u) < 6 * w) & (v > -12) & (v < -7))
    ),
    2: lambda u, v, w: (
        ((np.abs(u) < 7 * w) & (v > -10) & (v < 11))
        | ((np.abs(u) < 12 * w) & (v > -10) & (v < 9) & (np.abs(u) > 8 * w))
    ),
    3: lambda u, v, w: (np.abs(u) < (3 + 0.45 * (v + 11)) * w) & (v > -11) & (v < 12),
    4: lambda u, v, w: (
        ((np.abs(u) < 8 * w) & (v > -11) & (v < 12))
        | ((np.abs(u) < 12 * w) & (v > -11) & (v < 10)) & ~((np.abs(u) < 1) & (v > -11))
    ),
    5: lambda u, v, w: (
        ((np.abs(v - 3) < 2.5) & (np.abs(u) < 12 * w))
        | ((np.abs(v + 2 - 0.6 * u) < 1.5) & (np.abs(u) < 10 * w))
    ),
    6: lambda u, v, w: (
        ((np.abs(u) < 7 * w) & (v > -10) & (v < 11))
        | ((np.abs(u) < 12 * w) & (v > -10) & (v < 11) & (np.abs(u) > 9 * w))
        & ~((np.abs(u) < 0.8) & (v > -4))
    ),
    7: lambda u, v, w: (
        ((v > 0) & (v < 7) & (np.abs(u) < 12 * w)) | ((v > -4) & (v < 7) & (u > 0) & (u < 12 * w))
    ),
    8: lambda u, v, w: (
        ((np.abs(u) < 11 * w) & (v > -4) & (v < 11))
        | ((np.hypot(u, v + 5) < 6) & (np.hypot(u, v + 5) > 4) & (v < -4))
    ),
    9: lambda u, v, w: (
        ((u > -8 * w) & (u < 2 * w) & (v > -12) & (v < 9)) | ((u > -8 * w) & (u < 11 * w) & (v > 3) & (v < 9))
    ),
}
_GRID = np.mgrid[0:28, 0:28].astype(np.float32)


def _silhouette(cls: int, rng: np.random.Generator) -> np.ndarray:
    """One 28 x 28 clothing-like silhouette of class ``cls`` with seeded jitter (shape, place, texture)."""
    s = rng.uniform(0.85, 1.15)
    dy, dx = rng.uniform(-1.5, 1.5, size=2)
    yy, xx = _GRID
    v, u = (yy - 14 - dy) / s, (xx - 14 - dx) / s
    w = rng.uniform(0.9, 1.1)
    mask = _SHAPES[cls](u, v, w).astype(np.float32)
    texture = rng.uniform(0.55, 1.0) + 0.12 * rng.standard_normal((28, 28)).astype(np.float32)
    img = mask * texture + 0.05 * rng.standard_normal((28, 28)).astype(np.float32)
    return np.clip(img, 0.0, 1.0)


def synthetic_fashion_mnist(n: int, *, seed: int = 0, split: str = "train", reason: str = "") -> ImageData:
    """A seeded synthetic stand-in for Fashion-MNIST: ``n`` images 1 x 28 x 28 of 10 clothing-like classes.

    Each class is a fixed silhouette (t-shirt, trouser, pullover, dress, coat, sandal, shirt, sneaker, bag,
    ankle boot), each image jittered in scale, position, width, intensity and texture noise, so a small CNN
    learns it but not trivially (shirt/pullover/coat overlap as in the real data). ``train`` and ``test``
    draw from different seeds. It is marked ``synthetic`` and its ``source`` says why it was used.
    """
    if n < 1:
        raise ConfigError(f"n {n!r} must be >= 1")
    if split not in ("train", "test"):
        raise ConfigError(f"split {split!r} is not one of train, test")
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    y = rng.integers(0, 10, n)
    x = np.stack([_silhouette(int(c), rng) for c in y])[:, None].astype(np.float32)
    why = reason or "requested explicitly"
    return ImageData(
        x,
        y.astype(np.int64),
        FASHION_MNIST_CLASSES,
        "synthetic-fashion-mnist",
        f"synthetic stand-in: {why}",
        True,
    )


def synthetic_cifar10(n: int, *, seed: int = 0, split: str = "train", reason: str = "") -> ImageData:
    """A seeded synthetic stand-in in CIFAR-10's *format*: ``n`` images 3 x 32 x 32 of 10 classes.

    Each image is a class's silhouette (:func:`synthetic_fashion_mnist`'s ten shapes, placed at a random
    offset in the 32 x 32 frame) painted in a class hue with jittered saturation and brightness on a
    random background colour, plus pixel noise. It has CIFAR-10's shape and class count, not its content
    (no photographs of planes or frogs): results on it say nothing about CIFAR-10's difficulty. It is
    marked ``synthetic`` and its ``source`` says why it was used.
    """
    if n < 1:
        raise ConfigError(f"n {n!r} must be >= 1")
    if split not in ("train", "test"):
        raise ConfigError(f"split {split!r} is not one of train, test")
    rng = np.random.default_rng([seed, 2 if split == "train" else 3])
    y = rng.integers(0, 10, n)
    hues = np.array(
        [
            [0.9, 0.2, 0.2],
            [0.2, 0.8, 0.2],
            [0.2, 0.3, 0.9],
            [0.9, 0.8, 0.2],
            [0.8, 0.3, 0.8],
            [0.2, 0.8, 0.8],
            [0.9, 0.5, 0.1],
            [0.5, 0.5, 0.5],
            [0.6, 0.4, 0.2],
            [0.95, 0.95, 0.95],
        ],
        dtype=np.float32,
    )
    x = np.empty((n, 3, 32, 32), dtype=np.float32)
    for i, c in enumerate(y):
        mask = np.zeros((32, 32), dtype=np.float32)
        oy, ox = rng.integers(0, 5, size=2)
        mask[oy : oy + 28, ox : ox + 28] = _silhouette(int(c), rng)
        colour = np.clip(hues[c] * rng.uniform(0.7, 1.1) + rng.normal(0, 0.08, 3), 0, 1).astype(np.float32)
        background = rng.uniform(0, 0.6, 3).astype(np.float32)
        img = mask[None] * colour[:, None, None] + (1 - mask[None]) * background[:, None, None]
        x[i] = np.clip(img + 0.05 * rng.standard_normal((3, 32, 32)), 0.0, 1.0)
    return ImageData(
        x,
        y.astype(np.int64),
        tuple(f"shape {k}" for k in range(10)),
        "synthetic-cifar10",
        f"synthetic stand-in in CIFAR-10's format: {reason or 'requested explicitly'}",
        True,
    )


def fashion_mnist(
    split: str,
    *,
    root: str | Path | None = None,
    allow_synthetic: bool = True,
    synthetic_size: int | None = None,
    seed: int = 0,
) -> ImageData:
    """Real Fashion-MNIST (``train``: 60,000, ``test``: 10,000) from ``root``,
    ``$FEDVEIL_DATA_DIR/fashion-mnist`` or Debian's ``/usr/share/datasets/fashion-mnist``; else the
    synthetic stand-in (or an error when ``allow_synthetic`` is False)."""
    for path in _fashion_dirs(root):
        if _has_mnist_layout(path):
            return load_mnist_layout(path, split, name="fashion-mnist", classes=FASHION_MNIST_CLASSES)
    looked = ", ".join(str(p) for p in _fashion_dirs(root))
    if not allow_synthetic:
        raise ConfigError(f"Fashion-MNIST not found in {looked}; install it with `{INSTALL_HINT}`")
    n = synthetic_size or (60000 if split == "train" else 10000)
    return synthetic_fashion_mnist(
        n, seed=seed, split=split, reason=f"Fashion-MNIST not found in {looked} ({INSTALL_HINT})"
    )


def load_image_dataset(
    name: str, split: str, *, root: str | Path | None = None, allow_synthetic: bool = True, seed: int = 0
) -> ImageData:
    """A data set by name: ``fashion-mnist`` (real, or the labelled stand-in), ``synthetic-fashion-mnist``
    (60,000 / 10,000 stand-in images; ``synthetic-fashion-mnist:N`` for N / N // 6, small runs),
    ``mnist`` and ``cifar10`` (from ``root`` or ``$FEDVEIL_DATA_DIR/mnist``, ``.../cifar-10-batches-bin``;
    for ``cifar10`` the labelled :func:`synthetic_cifar10` stand-in when absent and ``allow_synthetic``),
    ``synthetic-cifar10`` (50,000 / 10,000; ``:N`` for N / N // 5), or ``folder:<path>``."""
    env = os.environ.get("FEDVEIL_DATA_DIR")
    if name == "fashion-mnist":
        return fashion_mnist(split, root=root, allow_synthetic=allow_synthetic, seed=seed)
    if name == "synthetic-fashion-mnist":
        return synthetic_fashion_mnist(60000 if split == "train" else 10000, seed=seed, split=split)
    if name.startswith("synthetic-fashion-mnist:"):
        size = name.partition(":")[2]
        if not size.isdigit() or int(size) < 6:
            raise ConfigError(f"data set {name!r}: the training size after ':' must be an integer >= 6")
        n = int(size)
        return synthetic_fashion_mnist(n if split == "train" else max(1, n // 6), seed=seed, split=split)
    if name == "synthetic-cifar10" or name.startswith("synthetic-cifar10:"):
        size = name.partition(":")[2]
        if size and (not size.isdigit() or int(size) < 6):
            raise ConfigError(f"data set {name!r}: the training size after ':' must be an integer >= 6")
        n_train = int(size) if size else 50000
        n = n_train if split == "train" else (max(1, n_train // 5) if size else 10000)
        return synthetic_cifar10(n, seed=seed, split=split)
    if name in ("mnist", "cifar10"):
        sub = "mnist" if name == "mnist" else "cifar-10-batches-bin"
        where = Path(root) if root is not None else (Path(env) / sub if env else None)
        if name == "cifar10" and allow_synthetic and (where is None or not where.is_dir()):
            looked = (
                "no directory given (pass root=... or set FEDVEIL_DATA_DIR)" if where is None else str(where)
            )
            return synthetic_cifar10(
                50000 if split == "train" else 10000,
                seed=seed,
                split=split,
                reason=f"CIFAR-10's binary version not found: {looked}",
            )
        if where is None:
            raise ConfigError(
                f"{name} needs its files: pass root=... or set FEDVEIL_DATA_DIR (with {sub}/ in it)"
            )
        return load_mnist_layout(where, split) if name == "mnist" else load_cifar10_binary(where, split)
    if name.startswith("folder:"):
        return load_image_folder(name[len("folder:") :])
    raise ConfigError(f"data set {name!r} is not one of {', '.join(DATASET_NAMES)}")


def find_real_data() -> list[dict[str, Any]]:
    """The real data sets found on this machine: name, path, split sizes and image shape."""
    found: list[dict[str, Any]] = []
    seen: set[Path] = set()
    for path in _fashion_dirs(None):
        if path in seen or not _has_mnist_layout(path):
            continue
        seen.add(path)
        splits = {
            s: len(read_idx(_find(path, f"{p}-labels-idx1-ubyte")))
            for s, p in (("train", "train"), ("test", "t10k"))
        }
        found.append(
            {"name": "fashion-mnist", "path": str(path), "splits": splits, "image_shape": [1, 28, 28]}
        )
    env = os.environ.get("FEDVEIL_DATA_DIR")
    if env:
        mnist = Path(env) / "mnist"
        if _has_mnist_layout(mnist):
            splits = {
                s: len(read_idx(_find(mnist, f"{p}-labels-idx1-ubyte")))
                for s, p in (("train", "train"), ("test", "t10k"))
            }
            found.append({"name": "mnist", "path": str(mnist), "splits": splits, "image_shape": [1, 28, 28]})
        cifar = Path(env) / "cifar-10-batches-bin"
        if (cifar / "test_batch.bin").is_file():
            sizes = {
                "train": sum(
                    (cifar / f"data_batch_{i}.bin").stat().st_size
                    for i in range(1, 6)
                    if (cifar / f"data_batch_{i}.bin").is_file()
                )
                // _CIFAR_RECORD,
                "test": (cifar / "test_batch.bin").stat().st_size // _CIFAR_RECORD,
            }
            found.append({"name": "cifar10", "path": str(cifar), "splits": sizes, "image_shape": [3, 32, 32]})
    return found
