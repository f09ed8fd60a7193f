"""CelebA face verification data, FedUV Sec. 6.1, from the published files.

Expected layout (the "Align&Cropped" release of Liu et al., 2015; nothing is downloaded)::

    <root>/identity_CelebA.txt          one line per image: "<image name> <identity>", e.g. "000001.jpg 2880"
    <root>/img_align_celeba/<image name>  the aligned JPEGs (178 x 218 in the release)

The recipe of the paper: 1,000 identities drawn from those with at least 30 images, each with 20
training, 5 validation and 5 test images (disjoint); and a separate set of 1,000 images of individuals
not selected, one image per person. Every image is resized, whole, to 64 x 64 (the paper says only
"resized to 64 x 64"; no crop is applied) with Pillow's bilinear filter with antialiasing, and scaled
to [0, 1]. Identities, images and the unseen people are drawn by ``seed``; only the chosen images are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from fedveil.data.federated import FederatedDataset, UserData
from fedveil.data.mnist_uv import SPLITS, X_KEY, UvSplits
from fedveil.errors import ConfigError, ValidationError

__all__ = [
    "IDENTITY_FILE",
    "IMAGE_DIR",
    "SOURCE_KEY",
    "CelebaRecipe",
    "load_celeba",
    "load_face_image",
    "read_identity_file",
]

IDENTITY_FILE = "identity_CelebA.txt"
IMAGE_DIR = "img_align_celeba"
SOURCE_KEY = "source_index"


@dataclass(frozen=True)
class CelebaRecipe:
    """FedUV Sec. 6.1 sizes: ``identities`` seen people with at least ``min_images`` images, ``train`` /
    ``val`` / ``test`` images each; ``unseen`` other people with one image each; ``image_size`` pixels."""

    seed: int = 0
    identities: int = 1000
    min_images: int = 30
    train: int = 20
    val: int = 5
    test: int = 5
    unseen: int = 1000
    image_size: int = 64

    def __post_init__(self) -> None:
        for name in ("seed", "identities", "min_images", "train", "val", "test", "unseen", "image_size"):
            value = getattr(self, name)
            least = 0 if name in ("seed", "unseen") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")
        if self.train + self.val + self.test > self.min_images:
            raise ConfigError(
                f"train + val + test = {self.train + self.val + self.test} images per identity exceed "
                f"min_images={self.min_images}; raise min_images to at least that"
            )


def read_identity_file(path: str | Path) -> list[tuple[str, str]]:
    """``(image name, identity)`` per line of ``identity_CelebA.txt``, in file order.

    Blank lines are skipped; any other line must have exactly two white-space separated fields, and an
    image name may appear only once (a :class:`ValidationError` names the line).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValidationError(f"cannot read {path} as UTF-8 text: {exc}") from None
    rows: list[tuple[str, str]] = []
    names: set[str] = set()
    for line_no, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2:
            raise ValidationError(
                f"{path} line {line_no}: expected '<image name> <identity>', got {line.strip()!r}"
            )
        name, identity = fields
        if name in names:
            raise ValidationError(f"{path} line {line_no}: image {name!r} is listed twice")
        if "/" in name or "\\" in name or name in (".", ".."):
            raise ValidationError(f"{path} line {line_no}: image name {name!r} must be a plain file name")
        names.add(name)
        rows.append((name, identity))
    if not rows:
        raise ValidationError(f"{path} lists no images")
    return rows


def load_face_image(path: str | Path, size: int) -> np.ndarray:
    """One image as ``(3, size, size)`` float32 RGB in [0, 1] (bilinear resize of the whole image)."""
    path = Path(path)
    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
    except FileNotFoundError:
        raise ValidationError(f"image {path} does not exist") from None
    except (OSError, UnidentifiedImageError) as exc:
        raise ValidationError(f"cannot decode image {path}: {exc}") from None
    return (np.asarray(rgb, dtype=np.float32) / np.float32(255.0)).transpose(2, 0, 1)


def _user(
    root: Path, rows: list[tuple[str, str]], identity: str, picks: Sequence[int], size: int
) -> UserData:
    x = np.stack([load_face_image(root / IMAGE_DIR / rows[i][0], size) for i in picks])
    return UserData(identity, {}, {X_KEY: x, SOURCE_KEY: np.asarray(picks, dtype=np.int64)})


def load_celeba(root: str | Path, recipe: CelebaRecipe) -> UvSplits:
    """CelebA split as in FedUV Sec. 6.1 (see the module docstring), users = identities.

    ``train`` / ``val`` / ``test`` hold the seen identities with arrays ``x`` ``(n, 3, s, s)`` float32 RGB
    in [0, 1] (``s = recipe.image_size``) and ``source_index`` ``(n,)`` int64 (the image's line among the
    image lines of ``identity_CelebA.txt``, 0-based); ``unseen`` holds one image of each unseen identity.
    Too few identities is a :class:`ValidationError`; so is a listed image that is missing or unreadable.
    """
    root = Path(root)
    rows = read_identity_file(root / IDENTITY_FILE)
    if not (root / IMAGE_DIR).is_dir():
        raise ValidationError(f"image directory {root / IMAGE_DIR} does not exist")
    by_identity: dict[str, list[int]] = {}
    for i, (_, identity) in enumerate(rows):
        by_identity.setdefault(identity, []).append(i)
    identities = sorted(by_identity)
    eligible = [p for p in identities if len(by_identity[p]) >= recipe.min_images]
    if len(eligible) < recipe.identities:
        raise ValidationError(
            f"only {len(eligible)} of {len(identities)} identities have at least {recipe.min_images} images; "
            f"ask for at most {len(eligible)} identities"
        )
    rng = np.random.default_rng([recipe.seed, 0])
    seen = [eligible[i] for i in sorted(rng.choice(len(eligible), recipe.identities, replace=False).tolist())]
    chosen = set(seen)
    others = [p for p in identities if p not in chosen]
    if len(others) < recipe.unseen:
        raise ValidationError(
            f"only {len(others)} identities are left after the {recipe.identities} seen ones; ask for at "
            f"most {len(others)} unseen people"
        )
    unseen = [others[i] for i in sorted(rng.choice(len(others), recipe.unseen, replace=False).tolist())]
    counts = (recipe.train, recipe.val, recipe.test)
    bounds = np.cumsum((0, *counts))
    splits: list[list[UserData]] = [[] for _ in SPLITS]
    for k, identity in enumerate(seen):
        images = np.random.default_rng([recipe.seed, 1, k]).permutation(by_identity[identity])
        for s in range(len(SPLITS)):
            picks = images[bounds[s] : bounds[s + 1]].tolist()
            splits[s].append(_user(root, rows, identity, picks, recipe.image_size))
    unseen_users = []
    for k, identity in enumerate(unseen):
        options = by_identity[identity]
        pick = options[int(np.random.default_rng([recipe.seed, 2, k]).integers(len(options)))]
        unseen_users.append(_user(root, rows, identity, [pick], recipe.image_size))
    return UvSplits(
        train=FederatedDataset(splits[0]),
        val=FederatedDataset(splits[1]),
        test=FederatedDataset(splits[2]),
        unseen=FederatedDataset(unseen_users),
    )
