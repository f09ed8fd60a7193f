"""TouchAuth data: FDML's touch-event encoding, 30-minute samples, and a synthetic user population.

FDML Sec. VII-B and the Appendix: every touch event is the 10-dim vector
``<xs, ys, xe, ye, xd, yd, dur, p, s, t>`` (:data:`FEATURES`):

* ``xs, ys, xe, ye`` -- start and end coordinates divided by the screen width / height (in [0, 1]);
* ``xd = 1 if xe - xs > 0 else 0`` and ``yd = 1 if ye - ys > 0 else 0`` (screen y grows downwards);
* ``dur`` -- the duration clipped at 1,600 ms and divided by 1,600;
* ``p, s`` -- pressure and contact size, already in [0, 1];
* ``t`` -- 0 for a swipe, 1 for a tap.

A sample is 30 consecutive events of one user that occur within 30 minutes, i.e. a window starting at
event ``i`` is valid when ``timestamp[i + 29] - timestamp[i] <= 30 min``. Training samples use
random-start augmentation (any valid start, so a user's samples overlap differently every round); each
test user has 40 fixed samples.

:func:`generate_touchauth` stands in for the Alipay logs the paper used (which cannot be obtained): 1,397
training users on four phone models (507 / 333 / 287 / 270) and 120 disjoint test users (30 per model).
Each user is simulated in device units (pixels, milliseconds, raw sensor readings) and encoded with
:func:`encode_touch_events`, the same function the CSV loader (:mod:`fedveil.data.touch_csv`) uses.

The generative model, per user:

* temporal habits -- usage sessions (lognormal length around a personal mean), lognormal gaps between
  touches around a personal median, occasional pauses of 2-45 minutes inside a session, and hours
  between sessions; these decide which windows satisfy the 30-minute rule;
* where they touch -- a personal preference over the buttons of a shared app layout (defined in units of
  screen width, so its normalised position depends on the phone's aspect ratio), a hand-dependent offset
  and spread of taps, and a personal slip of the finger during a tap;
* swipes -- start region, mix of upward / downward / sideways swipes, length, thumb-arc tilt and speed
  (a swipe's duration is its length over the speed);
* taps -- tap/swipe mix, tap duration and a long-press rate (long presses exceed the 1,600 ms clip);
* pressure and contact size -- personal level, swipe/tap difference and size-pressure coupling.

Each phone model has its screen resolution and its own pressure / size calibration (gain, offset and
quantisation, :data:`PHONE_MODELS`). Every session draws a drift of the user's parameters (posture,
hand, mood: the per-sample noise that makes two samples of one user differ), and every event has its own
noise. ``user_spread`` scales all between-user differences, ``session_noise`` the session drifts and
``event_noise`` the per-event noise; the defaults are calibrated so that a centrally trained TouchAuth
net reaches an accuracy inside the paper's range (:class:`TouchAuthConfig` gives the numbers).

Each user's data depend only on ``(seed, split, phone model, index)``: changing the number of users
changes no other user.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedveil.data.federated import FederatedDataset, UserData
from fedveil.errors import ConfigError, ValidationError

__all__ = [
    "DURATION_CLIP_MS",
    "EVENT_DIM",
    "FEATURES",
    "PHONE_MODELS",
    "PhoneModel",
    "RawTouchEvents",
    "TouchAuthConfig",
    "TouchAuthPopulation",
    "disjoint_window_starts",
    "encode_touch_events",
    "fixed_test_starts",
    "generate_touchauth",
    "simulate_user",
    "valid_window_starts",
]

FEATURES: tuple[str, ...] = ("xs", "ys", "xe", "ye", "xd", "yd", "dur", "p", "s", "t")
EVENT_DIM = len(FEATURES)
DURATION_CLIP_MS = 1600.0
_MS_PER_MINUTE = 60_000.0
_EPOCH_MS = 1_600_000_000_000


@dataclass(frozen=True, eq=False)
class RawTouchEvents:
    """One user's touch log in device units; every field is ``(n,)``, events in time order.

    ``timestamp_ms`` int64 (any epoch); coordinates and screen sizes in pixels; ``duration_ms`` >= 0;
    ``pressure`` and ``size`` in [0, 1]; ``is_tap`` bool (False = swipe).
    """

    timestamp_ms: np.ndarray
    x_start_px: np.ndarray
    y_start_px: np.ndarray
    x_end_px: np.ndarray
    y_end_px: np.ndarray
    screen_width_px: np.ndarray
    screen_height_px: np.ndarray
    duration_ms: np.ndarray
    pressure: np.ndarray
    size: np.ndarray
    is_tap: np.ndarray

    def __len__(self) -> int:
        return int(self.timestamp_ms.shape[0])


def encode_touch_events(raw: RawTouchEvents) -> np.ndarray:
    """FDML Appendix: raw events -> ``(n, 10)`` float32 vectors ``<xs, ys, xe, ye, xd, yd, dur, p, s, t>``.

    Coordinates are divided by the screen width (x) or height (y); ``xd = 1`` iff ``x_end > x_start``
    (likewise ``yd``); ``dur = min(duration_ms, 1600) / 1600``; ``p`` and ``s`` are copied; ``t = 1`` for
    a tap and 0 for a swipe.
    """
    width = np.asarray(raw.screen_width_px, dtype=np.float64)
    height = np.asarray(raw.screen_height_px, dtype=np.float64)
    xs, xe = raw.x_start_px / width, raw.x_end_px / width
    ys, ye = raw.y_start_px / height, raw.y_end_px / height
    columns = (
        xs,
        ys,
        xe,
        ye,
        raw.x_end_px > raw.x_start_px,
        raw.y_end_px > raw.y_start_px,
        np.minimum(raw.duration_ms, DURATION_CLIP_MS) / DURATION_CLIP_MS,
        raw.pressure,
        raw.size,
        raw.is_tap,
    )
    return np.stack([np.asarray(c, dtype=np.float32) for c in columns], axis=1)


def valid_window_starts(timestamps_ms: np.ndarray, events_per_sample: int, window_ms: float) -> np.ndarray:
    """Indices ``i`` (int64, ascending) where events ``i .. i + L - 1`` span at most ``window_ms``.

    ``timestamps_ms`` ``(n,)`` must be non-decreasing; ``L = events_per_sample``. FDML Sec. VII-B: a
    sample is ``L`` consecutive events that occur within 30 minutes.
    """
    ts = np.asarray(timestamps_ms, dtype=np.int64)
    n, length = ts.shape[0], events_per_sample
    if n < length:
        return np.zeros(0, dtype=np.int64)
    span = ts[length - 1 :] - ts[: n - length + 1]
    return np.flatnonzero(span <= window_ms).astype(np.int64)


def disjoint_window_starts(valid_starts: np.ndarray, events_per_sample: int) -> np.ndarray:
    """A largest set of non-overlapping windows: greedy earliest valid start, then skip ``L`` events.

    For equal-length windows the earliest-start greedy choice is optimal (interval scheduling), so the
    result's length is the number of non-overlapping samples a stream holds.
    """
    valid = np.asarray(valid_starts, dtype=np.int64)
    following = np.searchsorted(valid, valid + events_per_sample).tolist()  # next start after each window
    chosen: list[int] = []
    k = 0
    while k < valid.shape[0]:
        chosen.append(k)
        k = following[k]
    return valid[chosen]


def fixed_test_starts(
    timestamps_ms: np.ndarray, events_per_sample: int, window_ms: float, count: int
) -> np.ndarray | None:
    """``count`` fixed, non-overlapping, time-ordered window starts, or None when the stream has fewer.

    Deterministic: of the greedy disjoint windows (:func:`disjoint_window_starts`), ``count`` evenly
    spaced ones (all of them when there are exactly ``count``).
    """
    disjoint = disjoint_window_starts(
        valid_window_starts(timestamps_ms, events_per_sample, window_ms), events_per_sample
    )
    if disjoint.shape[0] < count:
        return None
    return disjoint[np.round(np.linspace(0, disjoint.shape[0] - 1, count)).astype(np.int64)]


@dataclass(frozen=True)
class PhoneModel:
    """A phone model's screen (pixels) and sensor calibration.

    Reported pressure is ``clip(pressure_gain * raw + pressure_offset, 0, 1)`` and reported size
    ``clip(size_gain * raw, 0, 1)``; a ``*_levels`` of ``L > 0`` quantises the value to multiples of
    ``1 / L`` (0 = continuous).
    """

    name: str
    width_px: int
    height_px: int
    pressure_gain: float
    pressure_offset: float
    pressure_levels: int
    size_gain: float
    size_levels: int


PHONE_MODELS: tuple[PhoneModel, ...] = (
    PhoneModel("A", 1080, 2340, 1.00, 0.00, 0, 1.00, 0),
    PhoneModel("B", 1080, 1920, 0.85, 0.08, 0, 0.85, 0),
    PhoneModel("C", 720, 1600, 1.00, 0.04, 20, 1.10, 32),
    PhoneModel("D", 1440, 3200, 0.80, 0.12, 0, 0.95, 0),
)

# Buttons of the shared app layout: (x as a fraction of the width, distance from the anchor edge in
# units of the screen width, anchored at the bottom?). Their normalised y depends on the aspect ratio.
_APP_TARGETS = np.array(
    [
        (0.08, 0.10, 0),  # back
        (0.90, 0.10, 0),  # scan
        (0.14, 0.36, 0),  # four shortcut icons
        (0.38, 0.36, 0),
        (0.62, 0.36, 0),
        (0.86, 0.36, 0),
        (0.14, 0.62, 0),  # four service icons
        (0.38, 0.62, 0),
        (0.62, 0.62, 0),
        (0.86, 0.62, 0),
        (0.50, 0.95, 0),  # banner
        (0.50, 0.40, 1),  # pay / confirm button
        (0.10, 0.08, 1),  # five tabs of the bottom bar
        (0.30, 0.08, 1),
        (0.50, 0.08, 1),
        (0.70, 0.08, 1),
        (0.90, 0.08, 1),
    ]
)
_TARGET_LOG_WEIGHTS = np.log([4, 2, 3, 3, 2, 2, 1.5, 1.5, 1, 1, 1, 5, 4, 2, 2, 1.5, 2])


@dataclass(frozen=True)
class TouchAuthConfig:
    """Size and difficulty of the synthetic TouchAuth population (FDML Sec. VII-B defaults).

    ``train_users_per_model`` / ``test_users_per_model`` give the users of the first ``k`` phone models
    of :data:`PHONE_MODELS` (``1 <= k <= 4``). Every training user's stream holds at least
    ``min_train_samples`` non-overlapping samples; every test user's exactly ``test_samples``.
    ``user_spread``, ``session_noise`` and ``event_noise`` (>= 0) scale the between-user differences, the
    per-session drift and the per-event noise of the generator (``user_spread = 0`` makes all users
    alike). Calibration of the defaults (seed 0, Sec. VII-C accuracy on the 120 test users): the TouchAuth
    net trained centrally by :func:`fedveil.experiments.fdml.central.train_central_touchauth` (2,000 steps)
    reaches 86.3%, the untrained net 56.6% and a template of raw mean event vectors 70.5%.
    """

    seed: int = 0
    train_users_per_model: tuple[int, ...] = (507, 333, 287, 270)
    test_users_per_model: tuple[int, ...] = (30, 30, 30, 30)
    events_per_sample: int = 30
    window_minutes: float = 30.0
    min_train_samples: int = 25
    test_samples: int = 40
    user_spread: float = 0.45
    session_noise: float = 1.0
    event_noise: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed!r}")
        counts = {"train_users_per_model": self.train_users_per_model}
        counts["test_users_per_model"] = self.test_users_per_model
        for name, value in counts.items():
            if not isinstance(value, tuple) or not 1 <= len(value) <= len(PHONE_MODELS):
                raise ConfigError(
                    f"{name} must be a tuple of 1 to {len(PHONE_MODELS)} user counts "
                    f"(one per phone model), got {value!r}"
                )
            if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in value):
                raise ConfigError(f"{name} must hold non-negative integers, got {value!r}")
        if len(self.train_users_per_model) != len(self.test_users_per_model):
            raise ConfigError(
                f"train_users_per_model {self.train_users_per_model} and test_users_per_model "
                f"{self.test_users_per_model} must name the same number of phone models"
            )
        if any(c < 1 for c in self.train_users_per_model):
            raise ConfigError(
                f"every phone model needs at least one training user, got {self.train_users_per_model}"
            )
        for name in ("events_per_sample", "min_train_samples", "test_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("window_minutes", "user_spread", "session_noise", "event_noise"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
            if value < 0 or (name == "window_minutes" and value == 0):
                bound = "> 0" if name == "window_minutes" else ">= 0"
                raise ConfigError(f"{name} must be {bound}, got {value}")

    @property
    def phone_models(self) -> tuple[PhoneModel, ...]:
        """The phone models this population uses."""
        return PHONE_MODELS[: len(self.train_users_per_model)]


class TouchAuthPopulation:
    """Training and test users of a TouchAuth data set, with FDML's sampling (Sec. VII-B).

    ``train`` and ``test`` hold one record per user with attribute ``phone_model`` and arrays
    ``events`` ``(n, 10)`` float32 (:func:`encode_touch_events`) and ``timestamps_ms`` ``(n,)`` int64
    (non-decreasing). Every training user needs ``min_train_samples`` non-overlapping valid windows and
    every test user ``test_samples`` of them; the test users' fixed samples are :func:`fixed_test_starts`.
    """

    def __init__(
        self,
        train: FederatedDataset,
        test: FederatedDataset,
        *,
        events_per_sample: int = 30,
        window_minutes: float = 30.0,
        min_train_samples: int = 1,
        test_samples: int = 40,
    ) -> None:
        for name, value in (
            ("events_per_sample", events_per_sample),
            ("min_train_samples", min_train_samples),
            ("test_samples", test_samples),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not (isinstance(window_minutes, (int, float)) and 0 < window_minutes < math.inf):
            raise ConfigError(f"window_minutes must be a positive number of minutes, got {window_minutes!r}")
        shared = set(train.user_ids) & set(test.user_ids)
        if shared:
            raise ValidationError(f"train and test users must be disjoint; both contain {sorted(shared)[:5]}")
        if len(train) == 0:
            raise ValidationError("a TouchAuth population needs at least one training user")
        self.train = train
        self.test = test
        self.events_per_sample = events_per_sample
        self.window_ms = window_minutes * _MS_PER_MINUTE
        self._offsets = np.arange(events_per_sample, dtype=np.int64)
        self._events: dict[str, np.ndarray] = {}
        self._starts: dict[str, np.ndarray] = {}
        self._disjoint: dict[str, int] = {}
        for user in train:
            events, timestamps = self._checked_stream(user)
            starts = valid_window_starts(timestamps, events_per_sample, self.window_ms)
            disjoint = disjoint_window_starts(starts, events_per_sample).shape[0]
            if disjoint < min_train_samples:
                raise ValidationError(
                    f"training user {user.user_id!r} has {disjoint} non-overlapping samples of "
                    f"{events_per_sample} events within {window_minutes} minutes; at least "
                    f"{min_train_samples} are required (drop the user or lower min_train_samples)"
                )
            self._events[user.user_id] = events
            self._starts[user.user_id] = starts
            self._disjoint[user.user_id] = disjoint
        self.phone_models: tuple[str, ...] = train.attribute_values("phone_model")
        self._by_model = {m: train.users_where(phone_model=m) for m in self.phone_models}
        test_windows = []
        for user in test:
            events, timestamps = self._checked_stream(user)
            starts = fixed_test_starts(timestamps, events_per_sample, self.window_ms, test_samples)
            if starts is None:
                raise ValidationError(
                    f"test user {user.user_id!r} has fewer than {test_samples} non-overlapping samples of "
                    f"{events_per_sample} events within {window_minutes} minutes; pick another test user"
                )
            test_windows.append(events[starts[:, None] + self._offsets])
        shape = (0, test_samples, events_per_sample, EVENT_DIM)
        self._test = np.stack(test_windows) if test_windows else np.zeros(shape, np.float32)
        self._test.setflags(write=False)

    def _checked_stream(self, user: UserData) -> tuple[np.ndarray, np.ndarray]:
        if "phone_model" not in user.attributes:
            raise ValidationError(f"user {user.user_id!r} has no 'phone_model' attribute")
        missing = {"events", "timestamps_ms"} - set(user.arrays)
        if missing:
            raise ValidationError(f"user {user.user_id!r} lacks arrays {sorted(missing)}")
        events, timestamps = user.arrays["events"], user.arrays["timestamps_ms"]
        if events.dtype != np.float32 or events.ndim != 2 or events.shape[1] != EVENT_DIM:
            raise ValidationError(
                f"user {user.user_id!r}: events must be float32 (n, {EVENT_DIM}), "
                f"got {events.dtype} {events.shape}"
            )
        if timestamps.dtype != np.int64 or timestamps.shape != (events.shape[0],):
            raise ValidationError(
                f"user {user.user_id!r}: timestamps_ms must be int64 ({events.shape[0]},), "
                f"got {timestamps.dtype} {timestamps.shape}"
            )
        if np.any(np.diff(timestamps) < 0):
            raise ValidationError(f"user {user.user_id!r}: timestamps_ms must be non-decreasing")
        return events, timestamps

    def train_user_ids(self, phone_model: str | None = None) -> list[str]:
        """Training user ids, all of them or those of one phone model."""
        if phone_model is None:
            return list(self.train.user_ids)
        if phone_model not in self._by_model:
            raise ConfigError(f"unknown phone model {phone_model!r}; this population has {self.phone_models}")
        return list(self._by_model[phone_model])

    def num_disjoint_samples(self, user_id: str) -> int:
        """How many non-overlapping valid samples the training user's stream holds."""
        self._train_events(user_id)
        return self._disjoint[user_id]

    def _train_events(self, user_id: str) -> np.ndarray:
        try:
            return self._events[user_id]
        except KeyError:
            raise ValidationError(f"{user_id!r} is not a training user of this population") from None

    def sample_training(self, user_id: str, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` training samples ``(n, 30, 10)`` float32 with random-start augmentation (Sec. VII-B).

        Each sample starts at a valid start drawn uniformly by ``rng``; the ``n`` starts are distinct
        when the user has at least ``n`` valid starts, otherwise every start is used and the rest repeat.
        """
        events = self._train_events(user_id)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ConfigError(f"number of samples must be a positive integer, got {n!r}")
        starts = self._starts[user_id]
        if n <= starts.shape[0]:
            picks = starts[rng.choice(starts.shape[0], size=n, replace=False)]
        else:
            extra = rng.integers(0, starts.shape[0], size=n - starts.shape[0])
            picks = np.concatenate([rng.permutation(starts), starts[extra]])
        return events[picks[:, None] + self._offsets]

    def test_samples(self) -> tuple[list[str], np.ndarray]:
        """Test user ids and their fixed samples ``(U, test_samples, 30, 10)`` float32 (read-only).

        A user's samples are in time order, so Sec. VII-C's A / B / C parts are consecutive periods.
        """
        return list(self.test.user_ids), self._test


# Standard normals drawn per user: the named behavioural parameters, then one per app target.
_PARAMETER_NORMALS = 24
_USER_NORMALS = _PARAMETER_NORMALS + len(_APP_TARGETS)
_SPLITS = {"train": 0, "test": 1}
_CHUNK_USERS = 128


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _user_parameters(z: np.ndarray, hand: np.ndarray, spread: float) -> dict[str, np.ndarray]:
    """Behavioural parameters ``(U,)`` (``(U, targets)`` for the layout) from per-user normals ``z``.

    ``hand`` is +1 (right thumb) or -1 (left). Units: positions in normalised screen units, offsets of
    taps in screen widths, swipe lengths in screen heights, speeds in screen heights per second.
    """
    return {
        "tap_bias_x": spread * (0.012 * hand + 0.025 * z[:, 0]),
        "tap_bias_y": spread * 0.025 * z[:, 1],
        "tap_jitter": 0.022 * np.exp(spread * 0.3 * z[:, 2]),
        "tap_slip_x": spread * 0.002 * z[:, 3],  # mean finger slip during a tap
        "tap_slip_y": spread * 0.002 * z[:, 4],
        "tap_logit": _logit(0.55) + spread * 0.8 * z[:, 5],
        "swipe_x": 0.5 + spread * (0.07 * hand + 0.06 * z[:, 6]),
        "swipe_y": 0.62 + spread * 0.07 * z[:, 7],
        "swipe_start_sd": 0.05 * np.exp(spread * 0.3 * z[:, 8]),
        "up_logit": _logit(0.7) + spread * 0.8 * z[:, 9],
        "sideways_logit": _logit(0.1) + spread * 0.7 * z[:, 10],
        "left_logit": spread * 1.0 * z[:, 11],
        "log_swipe_length": math.log(0.28) + spread * 0.5 * z[:, 12],
        "tilt": spread * (0.1 * hand + 0.08 * z[:, 13]),  # sideways drift per unit of vertical travel
        "log_speed": math.log(1.6) + spread * 0.5 * z[:, 14],
        "log_tap_ms": math.log(95.0) + spread * 0.45 * z[:, 15],
        "long_press_logit": _logit(0.02) + spread * 0.8 * z[:, 16],
        "pressure": 0.45 + spread * 0.07 * z[:, 17],
        "swipe_pressure": spread * 0.05 * z[:, 18],  # added to the pressure of swipes
        "size": 0.30 + spread * 0.04 * z[:, 19],
        "size_per_pressure": 0.5 + spread * 0.3 * z[:, 20],
        "target_log_weights": _TARGET_LOG_WEIGHTS + spread * 1.2 * z[:, _PARAMETER_NORMALS:],
    }


@dataclass(frozen=True)
class _Draws:
    """The random numbers of one simulated user: parameters, timeline and per-session/event noise."""

    z: np.ndarray  # (_USER_NORMALS,)
    hand: float
    timestamps: np.ndarray  # (n,) int64 ms
    session_ids: np.ndarray  # (n,) 0-based within the user
    drift: np.ndarray  # (sessions, 10) standard normals
    noise: np.ndarray  # (n, 12) standard normals
    uniform: np.ndarray  # (n, 7) uniforms in [0, 1)


def _session_timestamps(
    rng: np.random.Generator, habits: tuple[float, float, float], sessions: int, start_ms: int
) -> tuple[np.ndarray, np.ndarray]:
    """Timestamps (ms) and session ids of ``sessions`` usage sessions starting after ``start_ms``.

    ``habits`` = (log mean events per session, log median seconds between touches, log mean hours
    between sessions). 1% of the gaps inside a session are pauses of 2-45 minutes.
    """
    log_events, log_gap_s, log_session_gap_h = habits
    sizes = np.maximum(3, np.round(np.exp(log_events + 0.5 * rng.standard_normal(sessions)))).astype(np.int64)
    session_ids = np.repeat(np.arange(sessions), sizes)
    gaps_s = np.exp(log_gap_s + 0.7 * rng.standard_normal(session_ids.shape[0]))
    pauses = rng.random(session_ids.shape[0]) < 0.01
    gaps_s[pauses] = rng.uniform(120.0, 2700.0, size=int(pauses.sum()))
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    gaps_s[first] = 3600.0 * rng.exponential(math.exp(log_session_gap_h), size=sessions) + 60.0
    timestamps = start_ms + np.cumsum(np.round(gaps_s * 1000.0)).astype(np.int64)
    return timestamps, session_ids


def _user_draws(cfg: TouchAuthConfig, split: str, model_index: int, index: int) -> _Draws:
    """All randomness of one user, from its own generator seeded by ``(seed, split, model, index)``."""
    rng = np.random.default_rng([cfg.seed, _SPLITS[split], model_index, index])
    z = rng.standard_normal(_USER_NORMALS)
    hand = 1.0 if rng.random() < 0.8 else -1.0
    windows = cfg.min_train_samples + int(rng.poisson(4.0)) if split == "train" else cfg.test_samples
    habits = (math.log(60.0) + 0.4 * z[21], math.log(3.0) + 0.4 * z[22], math.log(6.0) + 0.5 * z[23])
    length, window_ms = cfg.events_per_sample, cfg.window_minutes * _MS_PER_MINUTE
    timestamps = np.zeros(0, dtype=np.int64)
    session_ids = np.zeros(0, dtype=np.int64)
    start_ms = _EPOCH_MS + int(rng.integers(0, 86_400_000))
    while True:  # add sessions until the stream holds `windows` non-overlapping samples, then cut it
        sessions = max(2, math.ceil(1.5 * windows * length / math.exp(habits[0])))
        more_ts, more_ids = _session_timestamps(rng, habits, sessions, start_ms)
        offset = int(session_ids[-1]) + 1 if session_ids.size else 0
        timestamps = np.concatenate([timestamps, more_ts])
        session_ids = np.concatenate([session_ids, more_ids + offset])
        start_ms = int(timestamps[-1])
        disjoint = disjoint_window_starts(valid_window_starts(timestamps, length, window_ms), length)
        if disjoint.shape[0] >= windows:
            end = int(disjoint[windows - 1]) + length
            timestamps, session_ids = timestamps[:end], session_ids[:end]
            break
    n = timestamps.shape[0]
    return _Draws(
        z=z,
        hand=hand,
        timestamps=timestamps,
        session_ids=session_ids,
        drift=rng.standard_normal((int(session_ids[-1]) + 1, 10)),
        noise=rng.standard_normal((n, 12)),
        uniform=rng.random((n, 7)),
    )


def _quantise(values: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Round to multiples of ``1 / levels`` where ``levels > 0``; keep the value where it is 0."""
    safe = np.maximum(levels, 1)
    return np.where(levels > 0, np.round(values * safe) / safe, values)


def _simulate(cfg: TouchAuthConfig, draws: Sequence[_Draws], models: Sequence[int]) -> RawTouchEvents:
    """The raw events of several users, concatenated in order (vectorised over all their events)."""
    counts = np.array([d.timestamps.shape[0] for d in draws])
    owner = np.repeat(np.arange(len(draws)), counts)
    sessions = np.array([d.drift.shape[0] for d in draws])
    session_offset = np.concatenate([[0], np.cumsum(sessions)[:-1]])
    drift_rows = np.concatenate([d.session_ids for d in draws]) + np.repeat(session_offset, counts)
    drift = cfg.session_noise * np.concatenate([d.drift for d in draws])[drift_rows]
    noise = cfg.event_noise * np.concatenate([d.noise for d in draws])
    u = np.concatenate([d.uniform for d in draws])
    users = _user_parameters(
        np.stack([d.z for d in draws]), np.array([d.hand for d in draws]), cfg.user_spread
    )
    for name in ("up", "sideways", "left", "long_press"):
        users[f"{name}_probability"] = _sigmoid(users.pop(f"{name}_logit"))
    p = {name: values[owner] for name, values in users.items() if values.ndim == 1}
    phones = [cfg.phone_models[m] for m in models]

    def phone(attribute: str) -> np.ndarray:
        return np.array([getattr(ph, attribute) for ph in phones], dtype=np.float64)[owner]

    width, height = phone("width_px"), phone("height_px")
    aspect = width / height  # one screen width in units of the screen height
    is_tap = u[:, 0] < _sigmoid(p["tap_logit"] + 0.5 * drift[:, 0])

    # Taps: a preferred button of the shared app layout, shifted by the user's thumb offset.
    weights = np.exp(users["target_log_weights"])
    cumulative = np.cumsum(weights, axis=1) / weights.sum(axis=1, keepdims=True)
    cumulative[:, -1] = 1.0
    flat = (cumulative + np.arange(len(draws))[:, None]).ravel()  # blocks (k, k + 1], ascending
    target = np.searchsorted(flat, u[:, 1] + owner, side="right") - owner * len(_APP_TARGETS)
    tx, ty_w, bottom = _APP_TARGETS[target].T
    ty = np.where(bottom == 1, 1.0 - ty_w * aspect, ty_w * aspect)
    tap_xs = tx + p["tap_bias_x"] + 0.015 * drift[:, 1] + p["tap_jitter"] * noise[:, 0]
    tap_ys = ty + (p["tap_bias_y"] + 0.015 * drift[:, 2] + p["tap_jitter"] * noise[:, 1]) * aspect
    tap_xe = tap_xs + p["tap_slip_x"] + 0.003 * noise[:, 2]
    tap_ye = tap_ys + (p["tap_slip_y"] + 0.003 * noise[:, 3]) * aspect

    # Swipes: mostly vertical scrolling along a thumb arc, sometimes sideways (banners, tabs).
    sw_xs = p["swipe_x"] + 0.04 * drift[:, 3] + p["swipe_start_sd"] * noise[:, 4]
    sw_ys = p["swipe_y"] + 0.04 * drift[:, 4] + p["swipe_start_sd"] * noise[:, 5]
    length = np.exp(p["log_swipe_length"] + 0.15 * drift[:, 5] + 0.3 * noise[:, 6])
    sideways = u[:, 3] < p["sideways_probability"]
    dy = np.where(u[:, 2] < p["up_probability"], -length, length)
    dx = np.where(
        sideways,
        np.where(u[:, 4] < p["left_probability"], -1.6, 1.6) * length,
        (p["tilt"] + 0.1 * noise[:, 7]) * length / aspect,
    )
    dy = np.where(sideways, 0.1 * dy, dy)
    travel = np.hypot(dx * aspect, dy)  # in screen heights
    speed = np.exp(p["log_speed"] + 0.15 * drift[:, 6] + 0.2 * noise[:, 8])

    xs, ys = np.where(is_tap, tap_xs, sw_xs), np.where(is_tap, tap_ys, sw_ys)
    xe, ye = np.where(is_tap, tap_xe, sw_xs + dx), np.where(is_tap, tap_ye, sw_ys + dy)

    tap_ms = np.exp(p["log_tap_ms"] + 0.1 * drift[:, 7] + 0.3 * noise[:, 9])
    long_press = u[:, 5] < p["long_press_probability"]
    tap_ms = np.where(long_press, 600.0 + 2000.0 * u[:, 6], tap_ms)
    duration = np.maximum(1.0, np.round(np.where(is_tap, tap_ms, 30.0 + 1000.0 * travel / speed)))

    swipe_pressure = np.where(is_tap, 0.0, p["swipe_pressure"])
    raw_pressure = p["pressure"] + 0.04 * drift[:, 8] + swipe_pressure + 0.05 * noise[:, 10]
    raw_size = p["size"] + 0.02 * drift[:, 9] + p["size_per_pressure"] * (raw_pressure - p["pressure"])
    raw_size = raw_size + 0.02 * noise[:, 11]
    pressure = np.clip(phone("pressure_gain") * raw_pressure + phone("pressure_offset"), 0.0, 1.0)
    size = np.clip(phone("size_gain") * raw_size, 0.0, 1.0)
    return RawTouchEvents(
        timestamp_ms=np.concatenate([d.timestamps for d in draws]),
        x_start_px=np.round(np.clip(xs, 0.0, 1.0) * width, 1),
        y_start_px=np.round(np.clip(ys, 0.0, 1.0) * height, 1),
        x_end_px=np.round(np.clip(xe, 0.0, 1.0) * width, 1),
        y_end_px=np.round(np.clip(ye, 0.0, 1.0) * height, 1),
        screen_width_px=width,
        screen_height_px=height,
        duration_ms=duration,
        pressure=np.round(_quantise(pressure, phone("pressure_levels")), 4),
        size=np.round(_quantise(size, phone("size_levels")), 4),
        is_tap=is_tap,
    )


def simulate_user(cfg: TouchAuthConfig, split: str, model_index: int, index: int) -> RawTouchEvents:
    """The raw touch log of one simulated user, a function of ``(cfg.seed, split, model_index, index)``.

    Training users' streams end right after their ``cfg.min_train_samples``-th non-overlapping sample
    plus a personal number of extra samples (Poisson, mean 4); test users' after ``cfg.test_samples``.
    """
    if split not in _SPLITS:
        raise ConfigError(f"split must be one of {sorted(_SPLITS)}, got {split!r}")
    if not 0 <= model_index < len(cfg.phone_models):
        raise ConfigError(f"model_index must be in [0, {len(cfg.phone_models) - 1}], got {model_index}")
    return _simulate(cfg, [_user_draws(cfg, split, model_index, index)], [model_index])


def _split_dataset(cfg: TouchAuthConfig, split: str, counts: Sequence[int]) -> FederatedDataset:
    specs = [(m, i) for m, count in enumerate(counts) for i in range(count)]
    users = []
    for first in range(0, len(specs), _CHUNK_USERS):
        chunk = specs[first : first + _CHUNK_USERS]
        draws = [_user_draws(cfg, split, m, i) for m, i in chunk]
        raw = _simulate(cfg, draws, [m for m, _ in chunk])
        events = encode_touch_events(raw)
        end = 0
        for (m, i), d in zip(chunk, draws, strict=True):
            start, end = end, end + d.timestamps.shape[0]
            name = cfg.phone_models[m].name
            users.append(
                UserData(
                    user_id=f"{split}-{name}-{i:04d}",
                    attributes={"phone_model": name},
                    arrays={"events": events[start:end], "timestamps_ms": raw.timestamp_ms[start:end]},
                )
            )
    return FederatedDataset(users)


def generate_touchauth(cfg: TouchAuthConfig) -> TouchAuthPopulation:
    """The synthetic TouchAuth population of FDML Sec. VII-B (see the module docstring).

    User ids are ``"train-<model>-<index:04d>"`` and ``"test-<model>-<index:04d>"``; deterministic for
    ``cfg``.
    """
    return TouchAuthPopulation(
        _split_dataset(cfg, "train", cfg.train_users_per_model),
        _split_dataset(cfg, "test", cfg.test_users_per_model),
        events_per_sample=cfg.events_per_sample,
        window_minutes=cfg.window_minutes,
        min_train_samples=cfg.min_train_samples,
        test_samples=cfg.test_samples,
    )
