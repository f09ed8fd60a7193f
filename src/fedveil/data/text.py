"""Per-user text for PoliFL's next-word prediction use case (Sec. 6.1; the paper:
80,000 Reddit users, which are not available here).

**Real English text** that every Debian system ships: the license texts of ``base-files`` in
``/usr/share/common-licenses`` (GPL, LGPL, GFDL, Apache, MPL, Artistic, BSD, CC0: about 48,000 words).
:func:`license_users` splits them into paragraphs and gives each user a run of consecutive paragraphs of
one license (so users differ in vocabulary and style, as Reddit users do), tokenises them into lowercase
words and punctuation, keeps the ``vocab - 1`` most frequent tokens (the rest become ``<unk>``, id 0), and
cuts each user's token stream into samples of ``seq_len`` inputs and the ``seq_len`` next tokens. Legal
prose repeats itself (the GPL versions share much text), so next-word accuracy here is far higher than on
Reddit; the use case's point is the comparison of strategies on real text, not the absolute figure.

When the folder is missing, :func:`synthetic_users` draws a **synthetic** corpus from a seeded per-user
bigram model (labelled so in every result).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np

from fedveil.errors import ConfigError

__all__ = ["LICENSES", "license_users", "synthetic_users", "text_users", "tokenize"]

LICENSES = Path("/usr/share/common-licenses")
_TOKEN = re.compile(r"[a-z]+(?:'[a-z]+)?|[0-9]+|[^\sa-z0-9]")


def tokenize(text: str) -> list[str]:
    """Lowercase words (with an inner apostrophe), numbers and single punctuation marks."""
    return _TOKEN.findall(text.lower())


def _samples(ids: list[int], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    n = (len(ids) - 1) // seq_len
    arr = np.asarray(ids[: n * seq_len + 1], dtype=np.int64)
    x = np.stack([arr[i * seq_len : (i + 1) * seq_len] for i in range(n)]) if n else np.zeros((0, seq_len))
    y = (
        np.stack([arr[i * seq_len + 1 : (i + 1) * seq_len + 1] for i in range(n)])
        if n
        else np.zeros((0, seq_len))
    )
    return x.astype(np.float32), y.astype(np.int64)


def _split(
    users: dict[str, list[int]], seq_len: int, test_fraction: float
) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for uid, ids in users.items():
        x, y = _samples(ids, seq_len)
        if len(x) < 2:
            continue
        cut = max(1, min(len(x) - 1, round(len(x) * (1 - test_fraction))))
        out[uid] = {"x": x[:cut], "y": y[:cut], "test_x": x[cut:], "test_y": y[cut:]}
    return out


def license_users(
    users: int = 100,
    *,
    vocab: int = 2000,
    seq_len: int = 64,
    test_fraction: float = 0.2,
    root: str | Path = LICENSES,
) -> tuple[dict[str, dict[str, np.ndarray]], list[str]]:
    """Per user ``x`` / ``y`` ``(n, seq_len)`` (inputs as float32 token ids, targets int64), held-out
    ``test_x`` / ``test_y``, and the vocabulary (module docstring). Users with fewer than two samples are
    dropped, so fewer than ``users`` may come back."""
    folder = Path(root)
    files = (
        sorted(p for p in folder.glob("*") if p.is_file() and not p.is_symlink()) if folder.is_dir() else []
    )
    if not files:
        raise ConfigError(
            f"no license texts under {folder}: install Debian's base-files or use synthetic text"
        )
    if users < 1 or vocab < 10 or seq_len < 2:
        raise ConfigError(f"users {users}, vocab {vocab}, seq_len {seq_len} must be >= 1, 10, 2")
    paragraphs: list[list[str]] = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        paragraphs += [tokenize(p) for p in re.split(r"\n\s*\n", text) if tokenize(p)]
    counts = Counter(t for p in paragraphs for t in p)
    words = ["<unk>"] + [w for w, _ in counts.most_common(vocab - 1)]
    index = {w: i for i, w in enumerate(words)}
    total = sum(len(p) for p in paragraphs)
    share = total / users
    streams: dict[str, list[int]] = {}
    current: list[int] = []
    for p in paragraphs:
        current += [index.get(t, 0) for t in p]
        if len(current) >= share and len(streams) < users - 1:
            streams[f"user{len(streams):03d}"] = current
            current = []
    streams[f"user{len(streams):03d}"] = current
    return _split(streams, seq_len, test_fraction), words


def synthetic_users(
    users: int = 100,
    *,
    vocab: int = 2000,
    seq_len: int = 64,
    samples: int = 10,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> tuple[dict[str, dict[str, np.ndarray]], list[str]]:
    """A SYNTHETIC corpus (module docstring): a shared Zipf-weighted bigram model, each user's rows mixed
    with a user-specific preference, ``samples`` samples per user."""
    rng = np.random.default_rng(seed)
    base = rng.dirichlet(np.full(vocab, 0.05), size=vocab)
    streams = {}
    for u in range(users):
        taste = rng.dirichlet(np.full(vocab, 0.05))
        ids = [int(rng.integers(vocab))]
        for _ in range(samples * seq_len):
            p = 0.8 * base[ids[-1]] + 0.2 * taste
            ids.append(int(rng.choice(vocab, p=p / p.sum())))
        streams[f"user{u:03d}"] = ids
    return _split(streams, seq_len, test_fraction), [f"w{i}" for i in range(vocab)]


def text_users(
    users: int = 100, *, vocab: int = 2000, seq_len: int = 64, seed: int = 0
) -> tuple[dict[str, dict[str, np.ndarray]], list[str], str]:
    """The Debian license corpus when present, else the synthetic one; the third item names which."""
    try:
        data, words = license_users(users, vocab=vocab, seq_len=seq_len)
        return data, words, f"Debian license texts ({LICENSES}), real English"
    except ConfigError:
        data, words = synthetic_users(users, vocab=vocab, seq_len=seq_len, seed=seed)
        return data, words, "SYNTHETIC bigram text (no /usr/share/common-licenses)"
