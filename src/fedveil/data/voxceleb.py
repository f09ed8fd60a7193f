"""VoxCeleb speaker verification data, FedUV Sec. 6.1, from the published tree.

Expected layout (VoxCeleb1's ``wav`` release, Nagrani et al., 2017; nothing is downloaded)::

    <root>/wav/<speaker id>/<video id>/<clip>.wav     e.g. wav/id10001/1zcIwhmdeo4/00001.wav

Each clip (an utterance) is a PCM WAV file (8, 16, 24 or 32 bit integer samples, any rate; several
channels are averaged), read with the standard ``wave`` module.

The recipe of the paper: 1,000 speakers with 25 training, 10 validation and 10 test examples each, and a
separate set of 5 examples from each of 200 other speakers; an example is a 2-second clip at 8 kHz, a
vector of 2^14 samples (so exactly 2.048 s). The paper's "obtained from videos recorded in one setting"
is read as: every example is one contiguous excerpt of one utterance (one video, one setting).

How fedveil cuts examples: an utterance is resampled to 8 kHz by polyphase filtering
(``scipy.signal.resample_poly`` with its default Kaiser-window FIR, ``up / down`` the reduced ratio of
the rates) and cut into consecutive non-overlapping windows of 2^14 samples from its start (a remainder
shorter than a window is dropped). A speaker's utterances are shuffled by the seed and given whole to the
test split until it has enough windows, then to validation, then the rest to training; so no utterance
feeds two splits. Each split then takes the number of examples it needs, drawn among its windows. A
speaker whose windows cannot fill all three splits is not eligible. Only the WAV headers are read to plan;
only the chosen utterances are decoded.
"""

from __future__ import annotations

import math
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.signal import resample_poly

from fedveil.data.federated import FederatedDataset, UserData
from fedveil.data.mnist_uv import SPLITS, X_KEY, UvSplits
from fedveil.errors import ConfigError, ValidationError

__all__ = [
    "SOURCE_KEY",
    "VoxClip",
    "VoxcelebRecipe",
    "load_voxceleb",
    "read_wav",
    "resample_to",
    "scan_voxceleb",
    "windows_after_resampling",
]

SOURCE_KEY = "source_index"
_FULL_SCALE = {1: 128.0, 2: 32768.0, 3: 8388608.0, 4: 2147483648.0}


@dataclass(frozen=True)
class VoxcelebRecipe:
    """FedUV Sec. 6.1 sizes: ``speakers`` seen speakers with ``train`` / ``val`` / ``test`` examples each;
    ``unseen_speakers`` others with ``unseen_per_speaker`` examples; examples of ``clip_samples`` samples
    at ``sample_rate`` Hz."""

    seed: int = 0
    speakers: int = 1000
    train: int = 25
    val: int = 10
    test: int = 10
    unseen_speakers: int = 200
    unseen_per_speaker: int = 5
    sample_rate: int = 8000
    clip_samples: int = 2**14

    def __post_init__(self) -> None:
        for name in (
            "seed",
            "speakers",
            "train",
            "val",
            "test",
            "unseen_speakers",
            "unseen_per_speaker",
            "sample_rate",
            "clip_samples",
        ):
            value = getattr(self, name)
            least = 0 if name in ("seed", "unseen_speakers") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")


@dataclass(frozen=True)
class VoxClip:
    """One utterance: its path, ``speaker`` and ``video`` ids, and its header's ``frames`` and ``rate``."""

    path: Path
    speaker: str
    video: str
    frames: int
    rate: int


def _open_wav(path: Path) -> wave.Wave_read:
    try:
        return wave.open(str(path), "rb")
    except FileNotFoundError:
        raise ValidationError(f"{path} does not exist") from None
    except (wave.Error, EOFError, OSError) as exc:
        raise ValidationError(f"{path} is not a PCM WAV file the wave module reads: {exc}") from None


def _check_header(path: Path, reader: wave.Wave_read) -> None:
    if reader.getsampwidth() not in _FULL_SCALE:
        raise ValidationError(
            f"{path}: {8 * reader.getsampwidth()}-bit samples are not supported; use 8, 16, 24 or 32-bit PCM"
        )
    if reader.getframerate() <= 0 or reader.getnchannels() <= 0:
        raise ValidationError(
            f"{path}: invalid header (rate {reader.getframerate()}, {reader.getnchannels()} channels)"
        )


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """``(samples, rate)``: a PCM WAV file as mono float64 in [-1, 1) (channels averaged), rate in Hz."""
    path = Path(path)
    with _open_wav(path) as reader:
        _check_header(path, reader)
        width, channels, rate = reader.getsampwidth(), reader.getnchannels(), reader.getframerate()
        frames = reader.getnframes()
        raw = reader.readframes(frames)
    if len(raw) != frames * width * channels:
        raise ValidationError(
            f"{path}: header announces {frames} frames but the data chunk holds "
            f"{len(raw) // (width * channels)}"
        )
    if width == 1:
        values = np.frombuffer(raw, dtype=np.uint8).astype(np.float64) - 128.0
    elif width == 3:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        values = ((b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) ^ 0x800000) - 0x800000
    else:
        values = np.frombuffer(raw, dtype=f"<i{width}")
    mono = np.asarray(values, dtype=np.float64).reshape(-1, channels).mean(axis=1)
    return mono / _FULL_SCALE[width], rate


def resample_to(samples: np.ndarray, rate: int, target_rate: int) -> np.ndarray:
    """Polyphase resampling from ``rate`` to ``target_rate`` Hz (``scipy.signal.resample_poly``)."""
    if rate == target_rate:
        return np.asarray(samples, dtype=np.float64)
    g = math.gcd(rate, target_rate)
    return resample_poly(samples, target_rate // g, rate // g)


def windows_after_resampling(frames: int, rate: int, target_rate: int, clip_samples: int) -> int:
    """How many whole windows of ``clip_samples`` a clip of ``frames`` at ``rate`` gives at ``target_rate``.

    ``resample_poly`` returns ``ceil(frames * up / down)`` samples.
    """
    g = math.gcd(rate, target_rate)
    return -(-frames * (target_rate // g) // (rate // g)) // clip_samples


def scan_voxceleb(root: str | Path) -> list[VoxClip]:
    """Every ``<root>/wav/<speaker>/<video>/*.wav``, sorted by speaker, video and file name (headers only)."""
    wav_root = Path(root) / "wav"
    if not wav_root.is_dir():
        raise ValidationError(f"{wav_root} does not exist; expected <root>/wav/<speaker>/<video>/<clip>.wav")
    clips = []
    for path in sorted(wav_root.glob("*/*/*.wav")):
        with _open_wav(path) as reader:
            _check_header(path, reader)
            clips.append(
                VoxClip(
                    path,
                    path.parent.parent.name,
                    path.parent.name,
                    reader.getnframes(),
                    reader.getframerate(),
                )
            )
    if not clips:
        raise ValidationError(f"no <speaker>/<video>/<clip>.wav files under {wav_root}")
    return clips


def _assign_utterances(
    windows: np.ndarray, order: np.ndarray, counts: tuple[int, ...]
) -> list[list[int]] | None:
    """Utterances (in ``order``) for test, then validation, then training; None if any split falls short."""
    groups: list[list[int]] = [[] for _ in SPLITS]
    have = [0] * len(SPLITS)
    position = 0
    for s in (2, 1):
        while have[s] < counts[s] and position < len(order):
            groups[s].append(int(order[position]))
            have[s] += int(windows[order[position]])
            position += 1
    groups[0] = [int(u) for u in order[position:]]
    have[0] = int(windows[order[position:]].sum())
    return groups if all(h >= c for h, c in zip(have, counts, strict=True)) else None


def _examples(
    clips: list[VoxClip],
    members: list[int],
    windows: np.ndarray,
    count: int,
    recipe: VoxcelebRecipe,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """``count`` windows drawn among those of utterances ``members``: audio ``(count, 1, L)``, ids."""
    pairs = np.array([(u, w) for u in members for w in range(int(windows[u]))], dtype=np.int64)
    picks = pairs[np.sort(rng.choice(len(pairs), size=count, replace=False))]
    x = np.empty((count, 1, recipe.clip_samples), dtype=np.float32)
    length = recipe.clip_samples
    for u in np.unique(picks[:, 0]):
        audio, rate = read_wav(clips[u].path)
        audio = resample_to(audio, rate, recipe.sample_rate)
        for e in np.flatnonzero(picks[:, 0] == u):
            start = int(picks[e, 1]) * length
            x[e, 0] = audio[start : start + length]
    return x, picks


def load_voxceleb(root: str | Path, recipe: VoxcelebRecipe) -> UvSplits:
    """VoxCeleb split as in FedUV Sec. 6.1 (see the module docstring), users = speakers.

    ``train`` / ``val`` / ``test`` hold the seen speakers with arrays ``x`` ``(n, 1, clip_samples)`` float32
    (the input layout of the paper's conv1d net) and ``source_index`` ``(n, 2)`` int64: the utterance's
    position in :func:`scan_voxceleb` order and the window number within it. ``unseen`` holds
    ``unseen_per_speaker`` examples of each unseen speaker, from any of their utterances. Too few eligible
    speakers is a :class:`ValidationError`.
    """
    clips = scan_voxceleb(root)
    windows = np.array(
        [windows_after_resampling(c.frames, c.rate, recipe.sample_rate, recipe.clip_samples) for c in clips]
    )
    by_speaker: dict[str, list[int]] = {}
    for i, clip in enumerate(clips):
        by_speaker.setdefault(clip.speaker, []).append(i)
    speakers = sorted(by_speaker)
    counts = (recipe.train, recipe.val, recipe.test)
    plans = {}
    for k, speaker in enumerate(speakers):
        order = np.random.default_rng([recipe.seed, 1, k]).permutation(by_speaker[speaker])
        plans[speaker] = _assign_utterances(windows, order, counts)
    eligible = [p for p in speakers if plans[p] is not None]
    if len(eligible) < recipe.speakers:
        raise ValidationError(
            f"only {len(eligible)} of {len(speakers)} speakers have enough "
            f"{recipe.clip_samples}-sample windows for {counts[0]}/{counts[1]}/{counts[2]} examples from "
            f"separate utterances; ask for at most {len(eligible)} speakers"
        )
    rng = np.random.default_rng([recipe.seed, 0])
    seen = [eligible[i] for i in sorted(rng.choice(len(eligible), recipe.speakers, replace=False).tolist())]
    chosen = set(seen)
    others = [
        p for p in speakers if p not in chosen and windows[by_speaker[p]].sum() >= recipe.unseen_per_speaker
    ]
    if len(others) < recipe.unseen_speakers:
        raise ValidationError(
            f"only {len(others)} speakers outside the {recipe.speakers} seen ones have "
            f"{recipe.unseen_per_speaker} windows; ask for at most {len(others)} unseen speakers"
        )
    unseen = [
        others[i] for i in sorted(rng.choice(len(others), recipe.unseen_speakers, replace=False).tolist())
    ]
    position = {p: k for k, p in enumerate(speakers)}
    splits: list[list[UserData]] = [[] for _ in SPLITS]
    for speaker in seen:
        k = position[speaker]
        groups = plans[speaker]
        split_rng = np.random.default_rng([recipe.seed, 2, k])
        for s in range(len(SPLITS)):
            x, picks = _examples(clips, groups[s], windows, counts[s], recipe, split_rng)
            splits[s].append(UserData(speaker, {}, {X_KEY: x, SOURCE_KEY: picks}))
    unseen_users = []
    for speaker in unseen:
        k = position[speaker]
        x, picks = _examples(
            clips,
            by_speaker[speaker],
            windows,
            recipe.unseen_per_speaker,
            recipe,
            np.random.default_rng([recipe.seed, 3, k]),
        )
        unseen_users.append(UserData(speaker, {}, {X_KEY: x, SOURCE_KEY: picks}))
    return UvSplits(
        train=FederatedDataset(splits[0]),
        val=FederatedDataset(splits[1]),
        test=FederatedDataset(splits[2]),
        unseen=FederatedDataset(unseen_users),
    )
