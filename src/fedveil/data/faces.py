"""Face data in its published on-disk layouts (AIoT paper 002_a446963dedd95f77.txt; FDML's CameraAuth).

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
"""

from __future__ import annotations

import csv
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedveil.data.images import decode_image
from fedveil.errors import ConfigError, ValidationError

__all__ = [
    "FaceImages",
    "FacePair",
    "RecordIO",
    "load_face_folder",
    "load_recordio_faces",
    "read_pairs",
    "write_recordio",
]

RECORD_MAGIC = 0xCED7230A
_IRHEADER = struct.Struct("<IfQQ")
_LENGTH_MASK = (1 << 29) - 1
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


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
        files = sorted(f for f in (root / folder).iterdir() if f.suffix.lower() in _IMAGE_SUFFIXES)
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
