"""FDML's CameraAuth emulation (Sec. VII-B): people as devices, photos as samples.

"We randomly select the photos of 400 people from the VGGFace2 dataset to start the study. We use 300 of
those people as the participants of the FDML training, and the rest 100 are used for testing. Each person
in the training dataset has 70 different pictures of its own, while in the testing dataset, that number is
40." A :class:`CameraAuthPopulation` offers what FDML's clients and evaluation read of a population
(:class:`~fedveil.protocols.common.ClientData` and ``test_samples``): each training person is a device
(attribute ``phone_model = "camera"``: one group, so every round draws from all of them) that samples its
round's photos without replacement from its own; each test person has 40 photos in a fixed order, which
Sec. VII-C splits 20 / 10 / 10 (template, threshold, accuracy).

Sources: :func:`synthetic_cameraauth` (the seeded synthetic face population of
:func:`~fedveil.data.faces.synthetic_faces`, its private domain, labelled synthetic; a person's first
photo is the reference, the rest are in the wild) or :func:`cameraauth_from_folder` (a VGGFace2-layout
folder, the paper's data, when a user has it: people with enough photos are drawn at random, seeded).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedveil.data.faces import IMAGE_SUFFIXES, FaceImages, synthetic_faces
from fedveil.data.federated import FederatedDataset, UserData
from fedveil.data.images import decode_image
from fedveil.errors import ConfigError

__all__ = ["CameraAuthPopulation", "cameraauth_from_folder", "synthetic_cameraauth"]

GROUP = "camera"


def _people(faces: FaceImages, names: list[int], photos: int, prefix: str) -> FederatedDataset:
    users = []
    for k in names:
        rows = np.flatnonzero(faces.identity == k)[:photos]
        users.append(UserData(f"{prefix}{faces.names[k]}", {"phone_model": GROUP}, {"x": faces.x[rows]}))
    return FederatedDataset(users)


class CameraAuthPopulation:
    """Training people (devices) and test people with their photos (module docstring)."""

    def __init__(
        self, train: FederatedDataset, test: FederatedDataset, *, source: str, synthetic: bool
    ) -> None:
        if len(train) < 2 or len(test) < 11:
            raise ConfigError(
                f"CameraAuth needs >= 2 training people and >= 11 test people (Sec. VII-C compares each "
                f"with ten others), got {len(train)} and {len(test)}"
            )
        counts = {len(test.array(u, "x")) for u in test.user_ids}
        if len(counts) != 1 or min(counts) < 4:
            raise ConfigError(
                f"every test person needs the same number (>= 4) of photos, got {sorted(counts)}"
            )
        self.train, self.test = train, test
        self.source, self.synthetic = source, synthetic
        self._test = np.stack([test.array(u, "x") for u in test.user_ids])
        self._test.setflags(write=False)
        first = train.array(train.user_ids[0], "x")
        self.input_shape = tuple(first.shape[1:])

    @property
    def phone_models(self) -> tuple[str, ...]:
        """The one group every device belongs to."""
        return (GROUP,)

    def train_user_ids(self, phone_model: str | None = None) -> list[str]:
        """The training people (all of them are in the one group)."""
        if phone_model not in (None, GROUP):
            return []
        return list(self.train.user_ids)

    def sample_training(self, user_id: str, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` of the person's photos ``(n, 3, S, S)``, distinct when it has ``n`` or more."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ConfigError(f"number of samples must be a positive integer, got {n!r}")
        x = self.train.array(user_id, "x")
        picks = rng.choice(len(x), size=n, replace=n > len(x))
        return x[picks]

    def test_samples(self) -> tuple[list[str], np.ndarray]:
        """Test people and their photos ``(U, photos, 3, S, S)`` (read-only)."""
        return list(self.test.user_ids), self._test


def synthetic_cameraauth(
    *,
    train_people: int = 300,
    test_people: int = 100,
    train_photos: int = 70,
    test_photos: int = 40,
    size: int = 64,
    seed: int = 0,
) -> CameraAuthPopulation:
    """The paper's sizes on the SYNTHETIC face population (private domain), ``size`` x ``size`` photos."""
    if train_photos < 2 or test_photos < 4:
        raise ConfigError(f"need >= 2 photos per training person ({train_photos}), >= 4 per test person")
    train, _ = synthetic_faces(train_people, train_photos - 1, domain="private", size=size, seed=seed)
    test, _ = synthetic_faces(
        test_people, test_photos - 1, domain="private", size=size, seed=seed, first_identity=train_people
    )
    return CameraAuthPopulation(
        _people(train, list(range(train_people)), train_photos, "train-"),
        _people(test, list(range(test_people)), test_photos, "test-"),
        source=f"SYNTHETIC CameraAuth stand-in ({train.source}; {test_people} test people)",
        synthetic=True,
    )


def cameraauth_from_folder(
    root: str | Path,
    *,
    train_people: int = 300,
    test_people: int = 100,
    train_photos: int = 70,
    test_photos: int = 40,
    size: int = 64,
    seed: int = 0,
) -> CameraAuthPopulation:
    """The paper's selection from a VGGFace2-layout folder (``root/n000001/0001_01.jpg``):
    ``train_people + test_people`` people with at least ``train_photos`` photos drawn at random (seeded);
    only their first photos (in name order) are decoded, resized to ``size`` x ``size``."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"face folder {root} does not exist")
    photos = {
        d.name: sorted(f for f in d.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        for d in sorted(root.iterdir())
        if d.is_dir()
    }
    enough = [name for name, files in photos.items() if len(files) >= max(train_photos, test_photos)]
    wanted = train_people + test_people
    if len(enough) < wanted:
        raise ConfigError(
            f"{root}: {len(enough)} people have >= {max(train_photos, test_photos)} photos; CameraAuth "
            f"needs {wanted} (lower train_people / test_people / train_photos)"
        )
    chosen = [enough[i] for i in np.random.default_rng(seed).choice(len(enough), size=wanted, replace=False)]

    def people(names: list[str], count: int) -> FederatedDataset:
        users = []
        for name in names:
            x = np.stack([decode_image(f, size=(size, size), where=str(f)) for f in photos[name][:count]])
            x = x.astype(np.float32) / np.float32(255)
            users.append(UserData(name, {"phone_model": GROUP}, {"x": x}))
        return FederatedDataset(users)

    return CameraAuthPopulation(
        people(chosen[:train_people], train_photos),
        people(chosen[train_people:], test_photos),
        source=f"face folder {root} ({train_people} training and {test_people} test people)",
        synthetic=False,
    )
