"""Face data in its published on-disk layouts ([AIoT]; FDML's CameraAuth).

- **VGGFace2** (:func:`load_face_folder`): an aligned-image folder per identity, ``root/n000001/0001_01.jpg``,
  with the optional ``identity_meta.csv`` beside it (``Class_ID, Name, Sample_Num, Flag, Gender``) for the
  identities' names.
- **insightface's MS1M RecordIO** (:class:`RecordIO`, :func:`load_recordio_faces`): ``train.rec`` and its
  index ``train.idx``, read without MXNet. A record is the magic ``0xced7230a`` (little-endian uint32), a
  uint32 whose low 29 bits are the payload length (the top 3 bits a continuation flag, which insightface's
  files do not use: refused), the payload, and zero padding to a multiple of 4 bytes. A payload is
  MXNet's ``IRHeader`` (``<IfQQ``: ``flag``, ``label``, ``id``, ``id2``), then ``flag`` float32 labels
  when ``flag > 0``, then the image (JPEG). Record 0 is insightface's header record: ``flag > 0`` and its
  first label one past the last image record's key. ``train.idx`` has a ``key<TAB>offset`` line per record.
- **Verification pairs** (:func:`read_pairs`): LFW's ``pairs.txt``: a first line ``folds  n`` (or a
  lone ``n``, as ``pairsDevTrain.txt``): each fold has ``n`` same-identity pairs and ``n`` others; then
  ``name  i  j`` (the same identity) or ``name1  i  name2  j`` (two identities), images numbered from 1
  as ``name/name_%04d.jpg``.

Every failure names the file, the record or line and what was expected. :func:`write_recordio` writes
the same format (tiny fixtures, synthetic stand-ins).

:func:`face_devices` spreads a population's identities over devices (the AIoT paper's private photos on
the devices): each device holds all photos of its own identities, labelled locally ``0 .. k-1``.
"""

from __future__ import annotations

import csv
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedveil.data.federated import FederatedDataset, UserData
from fedveil.data.images import decode_image
from fedveil.errors import ConfigError, ValidationError

__all__ = [
    "FaceImages",
    "FacePair",
    "RecordIO",
    "face_devices",
    "load_face_folder",
    "load_recordio_faces",
    "read_pairs",
    "sample_grid",
    "synthetic_faces",
    "write_recordio",
]

RECORD_MAGIC = 0xCED7230A
_IRHEADER = struct.Struct("<IfQQ")
_LENGTH_MASK = (1 << 29) - 1
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


@dataclass(frozen=True)
class FaceImages:
    """Face photos: ``x`` float32 ``(n, 3, S, S)`` in [0, 1], ``identity`` int64 ``(n,)`` indices into
    ``names``, the ``source`` read and whether the photos are ``synthetic``."""

    x: np.ndarray
    identity: np.ndarray
    names: tuple[str, ...]
    source: str
    synthetic: bool = False

    def __post_init__(self) -> None:
        if self.x.dtype != np.float32 or self.x.ndim != 4 or self.x.shape[1] != 3:
            raise ValidationError(
                f"{self.source}: faces must be float32 (n, 3, S, S), got {self.x.dtype} {self.x.shape}"
            )
        if self.identity.shape != (len(self.x),) or self.identity.dtype != np.int64:
            raise ValidationError(f"{self.source}: identities must be int64 ({len(self.x)},)")
        if len(self.identity) and not 0 <= int(self.identity.min()) <= int(self.identity.max()) < len(
            self.names
        ):
            raise ValidationError(f"{self.source}: identity indices must lie in [0, {len(self.names)})")

    def __len__(self) -> int:
        return len(self.identity)


def face_devices(
    faces: FaceImages, identities_per_device: int, *, prefix: str = "device"
) -> FederatedDataset:
    """``faces``' identities in consecutive groups of ``identities_per_device``, one group per device.

    Device ``<prefix>-0000`` holds identities ``0 .. k-1``, the next ``k .. 2k-1``, ...; the last device
    holds what remains (possibly fewer). Each device has ``x`` (its photos), ``y`` (local labels
    ``0 .. k-1``, the classes of its own ArcFace projector) and ``identity`` (the population's indices),
    and the attribute ``identities`` (its ``k``)."""
    if isinstance(identities_per_device, bool) or identities_per_device < 1:
        raise ConfigError(f"identities_per_device {identities_per_device!r} must be an integer >= 1")
    users = []
    count = len(faces.names)
    for d, first in enumerate(range(0, count, identities_per_device)):
        ids = np.arange(first, min(first + identities_per_device, count))
        rows = np.flatnonzero(np.isin(faces.identity, ids))
        if rows.size == 0:
            continue
        local = np.searchsorted(ids, faces.identity[rows]).astype(np.int64)
        arrays = {"x": faces.x[rows], "y": local, "identity": faces.identity[rows]}
        users.append(UserData(f"{prefix}-{d:04d}", {"identities": str(len(ids))}, arrays))
    return FederatedDataset(users)


def _faces(pixels: list[np.ndarray], identity: list[int], names: Sequence[str], source: str) -> FaceImages:
    if not pixels:
        raise ValidationError(f"{source} holds no face images")
    x = np.stack(pixels).astype(np.float32) / 255.0
    return FaceImages(x, np.asarray(identity, dtype=np.int64), tuple(names), source)


# --- VGGFace2-style folders ---------------------------------------------------------------------------------


def _identity_names(root: Path, folders: Sequence[str]) -> list[str]:
    """Names from ``identity_meta.csv`` (beside ``root`` or inside it), else the folder names."""
    for meta in (root / "identity_meta.csv", root.parent / "identity_meta.csv"):
        if not meta.is_file():
            continue
        names: dict[str, str] = {}
        with meta.open(encoding="utf-8", newline="") as f:
            rows = csv.reader(f)
            header = [h.strip() for h in next(rows, [])]
            if header[:2] != ["Class_ID", "Name"]:
                raise ValidationError(f"{meta}: the header must start with Class_ID, Name; got {header[:2]}")
            for line, row in enumerate(rows, start=2):
                if len(row) < 2:
                    raise ValidationError(f"{meta}, line {line}: expected Class_ID, Name, ...; got {row}")
                names[row[0].strip()] = row[1].strip().strip('"')
        return [names.get(folder, folder) for folder in folders]
    return list(folders)


def load_face_folder(
    root: str | Path,
    *,
    size: int = 112,
    max_identities: int | None = None,
    max_per_identity: int | None = None,
) -> FaceImages:
    """``root/<identity>/<photo>.jpg`` (VGGFace2's layout) as :class:`FaceImages` resized to ``size`` x
    ``size``; identities in sorted folder order, names from ``identity_meta.csv`` when present."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"face folder {root} does not exist")
    folders = sorted(p.name for p in root.iterdir() if p.is_dir())[:max_identities]
    if not folders:
        raise ValidationError(f"{root} has no identity folders (expected root/n000001/0001_01.jpg)")
    pixels, identity = [], []
    for index, folder in enumerate(folders):
        files = sorted(f for f in (root / folder).iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ValidationError(f"identity folder {root / folder} has no .jpg/.png photos")
        for f in files[:max_per_identity]:
            pixels.append(decode_image(f, size=(size, size), where=str(f)))
            identity.append(index)
    return _faces(pixels, identity, _identity_names(root, folders), f"face folder {root}")


# --- insightface RecordIO ---------------------------------------------------------------------------------


def _pack(label: float | Sequence[float], image: bytes, key: int) -> bytes:
    labels = [float(label)] if isinstance(label, (int, float)) else [float(v) for v in label]
    flag = 0 if isinstance(label, (int, float)) else len(labels)
    head = _IRHEADER.pack(flag, labels[0] if flag == 0 else 0.0, key, 0)
    extra = b"" if flag == 0 else struct.pack(f"<{flag}f", *labels)
    return head + extra + image


def write_recordio(
    rec: str | Path, idx: str | Path, records: Iterable[tuple[int, float | Sequence[float], bytes]]
) -> None:
    """Write ``(key, label, image_bytes)`` records (a sequence label makes a header-style record) and the
    ``key<TAB>offset`` index, in insightface's RecordIO format (module docstring)."""
    lines = []
    with Path(rec).open("wb") as f:
        for key, label, image in records:
            payload = _pack(label, image, key)
            if len(payload) > _LENGTH_MASK:
                raise ValidationError(f"record {key} of {len(payload)} bytes exceeds RecordIO's 2**29 - 1")
            lines.append(f"{key}\t{f.tell()}\n")
            f.write(struct.pack("<II", RECORD_MAGIC, len(payload)) + payload + b"\0" * (-len(payload) % 4))
    Path(idx).write_text("".join(lines), encoding="utf-8")


@dataclass(frozen=True)
class Record:
    """One RecordIO record: its ``flag``, ``labels`` (one value, or ``flag`` values), ``id`` and payload."""

    flag: int
    labels: tuple[float, ...]
    id: int
    image: bytes


class RecordIO:
    """Random access to ``train.rec`` through ``train.idx`` (module docstring)."""

    def __init__(self, rec: str | Path, idx: str | Path) -> None:
        self.rec, self.idx = Path(rec), Path(idx)
        for path in (self.rec, self.idx):
            if not path.is_file():
                raise ConfigError(f"{path} does not exist: give insightface's train.rec and train.idx")
        self.size = self.rec.stat().st_size
        self.offsets: dict[int, int] = {}
        for number, line in enumerate(self.idx.read_text(encoding="utf-8").splitlines(), start=1):
            parts = line.split("\t")
            try:
                key, offset = int(parts[0]), int(parts[1])
            except (ValueError, IndexError):
                raise ValidationError(
                    f"{self.idx}, line {number}: expected key<TAB>offset, got {line!r}"
                ) from None
            if not 0 <= offset < self.size:
                raise ValidationError(
                    f"{self.idx}, line {number}: offset {offset} outside {self.rec} ({self.size} bytes)"
                )
            self.offsets[key] = offset

    def keys(self) -> list[int]:
        """Record keys in index order."""
        return list(self.offsets)

    def read(self, key: int) -> Record:
        """The record ``key``; a bad magic, a continuation flag or a record running past the file's end is
        a :class:`ValidationError` naming the file, key and offset."""
        if key not in self.offsets:
            raise ValidationError(f"{self.idx} has no record {key}")
        offset = self.offsets[key]
        where = f"{self.rec}, record {key} at offset {offset}"
        with self.rec.open("rb") as f:
            f.seek(offset)
            head = f.read(8)
            if len(head) < 8:
                raise ValidationError(f"{where}: truncated record header")
            magic, word = struct.unpack("<II", head)
            if magic != RECORD_MAGIC:
                raise ValidationError(f"{where}: magic {magic:#010x}, expected {RECORD_MAGIC:#010x}")
            if word >> 29:
                raise ValidationError(
                    f"{where}: continuation flag {word >> 29} (split records are not supported)"
                )
            length = word & _LENGTH_MASK
            payload = f.read(length)
        if len(payload) < length:
            raise ValidationError(f"{where}: truncated, {len(payload)} of {length} payload bytes")
        if length < _IRHEADER.size:
            raise ValidationError(f"{where}: payload of {length} bytes is shorter than its IRHeader")
        flag, label, ident, _ = _IRHEADER.unpack_from(payload)
        start = _IRHEADER.size
        if flag > 0:
            end = start + 4 * flag
            if end > length:
                raise ValidationError(f"{where}: {flag} labels run past the payload")
            labels = struct.unpack_from(f"<{flag}f", payload, start)
            start = end
        else:
            labels = (label,)
        return Record(flag, tuple(float(v) for v in labels), ident, payload[start:])


def load_recordio_faces(
    root: str | Path, *, size: int = 112, limit: int | None = None, names: str = "train"
) -> FaceImages:
    """``root/train.rec`` + ``root/train.idx`` (insightface's MS1M layout) as :class:`FaceImages`, the
    first ``limit`` image records (after insightface's header record, when present)."""
    root = Path(root)
    reader = RecordIO(root / f"{names}.rec", root / f"{names}.idx")
    keys = reader.keys()
    if keys and keys[0] == 0:
        first = reader.read(0)
        if first.flag > 0:
            last = int(first.labels[0])
            keys = [k for k in keys if 1 <= k < last]
    pixels, labels = [], []
    for key in keys[:limit]:
        record = reader.read(key)
        label = record.labels[0]
        if not (label >= 0 and float(label).is_integer()):
            raise ValidationError(f"{reader.rec}, record {key}: label {label} is not an identity index")
        pixels.append(decode_image(record.image, size=(size, size), where=f"{reader.rec}, record {key}"))
        labels.append(int(label))
    classes = sorted(set(labels))
    remap = {c: i for i, c in enumerate(classes)}
    return _faces(pixels, [remap[c] for c in labels], [str(c) for c in classes], f"recordio {root}")


# --- verification pairs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FacePair:
    """Two photos (``name_a`` number ``index_a``, ``name_b`` number ``index_b``, numbered from 1) and
    whether they show the same identity."""

    name_a: str
    index_a: int
    name_b: str
    index_b: int

    @property
    def same(self) -> bool:
        """The same identity."""
        return self.name_a == self.name_b

    def paths(self, root: str | Path) -> tuple[Path, Path]:
        """LFW's file names: ``root/name/name_%04d.jpg``."""
        r = Path(root)
        return (
            r / self.name_a / f"{self.name_a}_{self.index_a:04d}.jpg",
            r / self.name_b / f"{self.name_b}_{self.index_b:04d}.jpg",
        )


def read_pairs(path: str | Path, *, known: Iterable[str] | None = None) -> list[FacePair]:
    """Parse an LFW-style ``pairs.txt`` (module docstring); ``known`` identities, when given, must include
    every name the file uses (else a :class:`ValidationError` naming the line and the identity)."""
    source = Path(path)
    if not source.is_file():
        raise ConfigError(f"pairs file {source} does not exist")
    lines = source.read_text(encoding="utf-8").splitlines()
    if not lines:
        raise ValidationError(f"{source} is empty: expected a header line and pairs")
    try:
        counts = [int(v) for v in lines[0].split()]
    except ValueError:
        raise ValidationError(
            f"{source}, line 1: expected 'folds pairs_per_fold' or a count, got {lines[0]!r}"
        ) from None
    names = None if known is None else set(known)
    pairs = []
    for number, line in enumerate(lines[1:], start=2):
        fields = line.split()
        if not fields:
            continue
        try:
            if len(fields) == 3:
                pair = FacePair(fields[0], int(fields[1]), fields[0], int(fields[2]))
            elif len(fields) == 4:
                pair = FacePair(fields[0], int(fields[1]), fields[2], int(fields[3]))
            else:
                raise ValueError
        except ValueError:
            raise ValidationError(
                f"{source}, line {number}: expected 'name i j' or 'name1 i name2 j', got {line!r}"
            ) from None
        if pair.index_a < 1 or pair.index_b < 1:
            raise ValidationError(f"{source}, line {number}: photo numbers start at 1, got {line!r}")
        for name in (pair.name_a, pair.name_b):
            if names is not None and name not in names:
                raise ValidationError(f"{source}, line {number}: unknown identity {name!r}")
        pairs.append(pair)
    expected = 2 * int(np.prod(counts))  # each fold: that many same-identity and as many other pairs
    if len(pairs) != expected:
        raise ValidationError(
            f"{source}: header {lines[0]!r} announces {expected} pairs, the file has {len(pairs)}"
        )
    return pairs


# --- the synthetic face population (a labelled stand-in for the papers' private photos) ------------------

DOMAINS = ("public", "private")


_SKIN_LIGHT = np.array([0.96, 0.84, 0.74])
_SKIN_DARK = np.array([0.36, 0.24, 0.17])
_HAIR = np.array(
    [
        [0.06, 0.05, 0.05],  # black
        [0.30, 0.19, 0.10],  # brown
        [0.78, 0.64, 0.38],  # blond
        [0.55, 0.22, 0.10],  # red
        [0.62, 0.62, 0.62],  # grey
    ]
)


@dataclass(frozen=True)
class _Domain:
    """The distributions a population draws identities from (the domain shift lives here): skin tone on
    the line from light to dark skin (mean, spread), the hair colour palette's probabilities, and the
    (mean, spread) of the eyes' half-height, face width and nose length."""

    tone: tuple[float, float]
    hair: tuple[float, float, float, float, float]
    eye_height: tuple[float, float]
    face_width: tuple[float, float]
    nose_length: tuple[float, float]


_DOMAINS = {
    # varied skin tones and hair colours, rounder eyes, narrower faces (a stand-in for MS-Celeb-1M's mix)
    "public": _Domain(
        (0.35, 0.25), (0.3, 0.35, 0.15, 0.08, 0.12), (0.055, 0.012), (0.58, 0.04), (0.20, 0.04)
    ),
    # narrower skin-tone range, mostly black hair, narrower eyes, wider faces, shorter noses (in-domain set)
    "private": _Domain(
        (0.25, 0.08), (0.85, 0.12, 0.0, 0.0, 0.03), (0.032, 0.008), (0.64, 0.03), (0.15, 0.03)
    ),
}


def _identity_params(rng: np.random.Generator, domain: _Domain) -> dict[str, np.ndarray | float]:
    """One identity's persistent appearance (module docstring of :func:`synthetic_faces`)."""
    tone = float(np.clip(rng.normal(*domain.tone), 0.0, 1.0))
    skin = (1 - tone) * _SKIN_LIGHT + tone * _SKIN_DARK + rng.normal(0, 0.02, 3)
    hair = _HAIR[rng.choice(len(_HAIR), p=np.asarray(domain.hair) / sum(domain.hair))] + rng.normal(
        0, 0.04, 3
    )
    return {
        "skin": np.clip(skin, 0.05, 1.0),
        "hair": np.clip(hair, 0.02, 1.0),
        "face_w": rng.normal(*domain.face_width),
        "face_h": rng.normal(0.78, 0.04),
        "jaw": rng.uniform(0.0, 0.25),
        "hairline": rng.uniform(-0.62, -0.38),
        "fringe": rng.uniform(0.0, 1.0),
        "eye_y": rng.normal(-0.12, 0.04),
        "eye_dx": rng.normal(0.24, 0.03),
        "eye_w": rng.normal(0.085, 0.012),
        "eye_h": rng.normal(*domain.eye_height),
        "iris": np.clip(rng.normal((0.25, 0.18, 0.12), 0.1), 0.0, 1.0),
        "brow_y": rng.normal(-0.25, 0.03),
        "brow_t": rng.uniform(0.012, 0.035),
        "brow_tilt": rng.normal(0.0, 0.15),
        "nose_len": rng.normal(*domain.nose_length),
        "nose_w": rng.normal(0.06, 0.015),
        "mouth_y": rng.normal(0.36, 0.04),
        "mouth_w": rng.normal(0.17, 0.03),
        "mouth_h": rng.normal(0.035, 0.01),
        "lips": np.clip(rng.normal((0.7, 0.3, 0.3), 0.08), 0.0, 1.0),
    }


def _blur(img: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian blur of ``(3, S, S)``."""
    if sigma <= 0.05:
        return img
    radius = max(1, int(3 * sigma))
    k = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    k /= k.sum()
    pad = np.pad(img, ((0, 0), (radius, radius), (radius, radius)), mode="edge")
    rows = sum(w * pad[:, i : i + img.shape[1], :] for i, w in enumerate(k))
    return sum(w * rows[:, :, i : i + img.shape[2]] for i, w in enumerate(k))


def _render(p: dict[str, np.ndarray | float], size: int, rng: np.random.Generator, wild: bool) -> np.ndarray:
    """One photo of identity ``p``: frontal and evenly lit when not ``wild``; otherwise a random pose
    (roll, yaw as horizontal compression and shift, scale), illumination gradient and colour cast, blur,
    sensor noise, and now and then a mask over the lower face."""
    lin = (np.arange(size) + 0.5) / size * 2 - 1
    y, x = np.meshgrid(lin, lin, indexing="ij")
    if wild:
        roll, scale = rng.normal(0, 0.12), rng.uniform(0.88, 1.12)
        yaw, shift = rng.uniform(-0.35, 0.35), rng.normal(0, 0.05, 2)
    else:
        roll, scale, yaw, shift = 0.0, 1.0, 0.0, np.zeros(2)
    c, s = np.cos(roll), np.sin(roll)
    u = (c * (x - shift[0]) + s * (y - shift[1])) / scale
    v = (-s * (x - shift[0]) + c * (y - shift[1])) / scale
    u = u / (1 - 0.3 * abs(yaw)) - 0.25 * yaw  # a turned head: features compress and move sideways
    f = {k: float(np.asarray(val).mean()) if np.ndim(val) == 0 else val for k, val in p.items()}
    background = rng.uniform(0.2, 0.9, 3) if wild else np.full(3, 0.85)
    img = np.empty((3, size, size))
    img[:] = background[:, None, None]

    def paint(mask: np.ndarray, colour: np.ndarray) -> None:
        img[:] = np.where(mask[None], np.asarray(colour)[:, None, None], img)

    face_w = float(f["face_w"]) * (1 - float(f["jaw"]) * np.clip(v, 0, None))
    face = (u / face_w) ** 2 + (v / float(f["face_h"])) ** 2 <= 1
    head = (u / (float(f["face_w"]) * 1.12)) ** 2 + ((v + 0.08) / (float(f["face_h"]) * 1.05)) ** 2 <= 1
    paint(head & (v < 0.1), p["hair"])
    paint(face, p["skin"])
    fringe = face & (v < float(f["hairline"]) + 0.12 * float(f["fringe"]) * np.cos(3 * u))
    paint(fringe, p["hair"])
    for side in (-1, 1):
        ex = side * float(f["eye_dx"])
        eye = ((u - ex) / float(f["eye_w"])) ** 2 + ((v - float(f["eye_y"])) / float(f["eye_h"])) ** 2 <= 1
        paint(eye, np.array([0.95, 0.95, 0.95]))
        iris = ((u - ex) ** 2 + (v - float(f["eye_y"])) ** 2) <= (0.8 * float(f["eye_h"])) ** 2
        paint(eye & iris, p["iris"])
        brow_v = float(f["brow_y"]) + side * float(f["brow_tilt"]) * (u - ex)
        brow = (abs(u - ex) <= 1.2 * float(f["eye_w"])) & (abs(v - brow_v) <= float(f["brow_t"]))
        paint(brow, p["hair"] * 0.8)
    nose = (abs(u) <= float(f["nose_w"]) * (v - float(f["eye_y"])) / float(f["nose_len"])) & (
        v > float(f["eye_y"])
    )
    nose &= v <= float(f["eye_y"]) + float(f["nose_len"])
    paint(nose, p["skin"] * 0.82)
    mouth = (u / float(f["mouth_w"])) ** 2 + ((v - float(f["mouth_y"])) / float(f["mouth_h"])) ** 2 <= 1
    paint(mouth, p["lips"])
    if wild and rng.uniform() < 0.25:  # a mask over the lower face
        mask = face & (v > float(f["eye_y"]) + 0.5 * float(f["nose_len"]))
        paint(
            mask,
            rng.choice(
                [np.array([0.75, 0.85, 0.95]), np.array([0.95, 0.95, 0.95]), np.array([0.2, 0.2, 0.25])]
            ),
        )
    if wild:
        direction = rng.normal(0, 1, 2)
        light = 1 + rng.uniform(0, 0.45) * (direction[0] * x + direction[1] * y) / np.linalg.norm(direction)
        img = img * light[None] * rng.uniform(0.6, 1.2) * rng.uniform(0.9, 1.1, 3)[:, None, None]
        img = _blur(img, rng.uniform(0, 1.5) * size / 112)
        img = img + rng.normal(0, rng.uniform(0, 0.04), img.shape)
    return np.clip(img, 0, 1).astype(np.float32)


def synthetic_faces(
    identities: int,
    wild_per_identity: int,
    *,
    domain: str = "private",
    size: int = 112,
    seed: int = 0,
    first_identity: int = 0,
) -> tuple[FaceImages, np.ndarray]:
    """A seeded **synthetic** face population (a labelled stand-in for the papers' private photos).

    Each identity has a persistent appearance drawn from its ``domain``'s distributions (face width and
    jaw, skin tone, hair colour, hairline and fringe, eye position, size and colour, eyebrows, nose,
    mouth), rendered with numpy at ``size`` x ``size`` x 3: one **reference** photo under standard
    conditions (frontal, even light, plain background) and ``wild_per_identity`` photos "in the wild"
    (pose, illumination, colour cast, blur, noise, and a mask over the lower face in a quarter of them).
    The ``"public"`` and ``"private"`` domains differ in skin and hair colour, eye height, face width and
    nose length: the domain shift between a server's public pre-training data and the devices' photos.
    Identity ``first_identity + i`` is drawn from its own seeded generator, so populations are disjoint
    when their identity ranges are. Returns the photos (names ``"<domain>-<k>"``) and a boolean
    ``reference`` mask, reference photo first for each identity."""
    if domain not in _DOMAINS:
        raise ConfigError(f"face domain {domain!r} is not one of {', '.join(DOMAINS)}")
    if identities < 1 or wild_per_identity < 0 or size < 16:
        raise ConfigError(
            f"need identities >= 1 ({identities}), wild photos >= 0 ({wild_per_identity}), "
            f"size >= 16 ({size})"
        )
    pixels, identity, reference, names = [], [], [], []
    for i in range(identities):
        k = first_identity + i
        rng = np.random.default_rng([seed, DOMAINS.index(domain), k])
        params = _identity_params(rng, _DOMAINS[domain])
        names.append(f"{domain}-{k}")
        for j in range(wild_per_identity + 1):
            pixels.append(_render(params, size, rng, wild=j > 0))
            identity.append(i)
            reference.append(j == 0)
    source = f"SYNTHETIC face population ({domain} domain, {identities} identities, seed {seed})"
    faces = FaceImages(
        np.stack(pixels), np.asarray(identity, dtype=np.int64), tuple(names), source, synthetic=True
    )
    return faces, np.asarray(reference, dtype=bool)


def sample_grid(
    path: str | Path, *, identities: int = 4, wild: int = 5, size: int = 112, seed: int = 0
) -> Path:
    """A PNG of the synthetic population: per domain, ``identities`` rows of the reference photo then
    ``wild`` photos in the wild."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1.2 * (wild + 1), 1.25 * 2 * identities), dpi=100)
    FigureCanvasAgg(fig)
    for d, domain in enumerate(DOMAINS):
        faces, _ = synthetic_faces(identities, wild, domain=domain, size=size, seed=seed)
        for i in range(identities * (wild + 1)):
            ax = fig.add_subplot(2 * identities, wild + 1, d * identities * (wild + 1) + i + 1)
            ax.imshow(faces.x[i].transpose(1, 2, 0))
            ax.set_xticks([])
            ax.set_yticks([])
            if i % (wild + 1) == 0:
                ax.set_ylabel(f"{domain}\n{faces.names[i // (wild + 1)]}", fontsize=7)
            if d == 0 and i < wild + 1:
                ax.set_title("reference" if i == 0 else "wild", fontsize=8)
    fig.suptitle("SYNTHETIC faces: reference photo, then photos in the wild", fontsize=9)
    fig.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target)
    return target
